"""The ASGI guard in front of every route: API keys, body size, metrics and the access log.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which costs a task and a queue per
request). It refuses early what it can refuse without reading the body, counts the body as it
is read for what it cannot, and records every request's route, model, status and time. It
never logs a body: prompts and outputs stay out of the logs.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Sequence
from typing import Any, Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError, PayloadTooLargeError, UnauthorizedError, render, surface_of
from api.metrics import Metrics
from dispatch.quota import ApiKey

access = logging.getLogger("routeledger.api.access")

# Probes must work without a key: a load balancer or an orchestrator asks them.
OPEN_PATHS: Final = frozenset({"/healthz", "/readyz"})
# Where a handler records the resolved model (for metrics) and the task id (for the access log).
MODEL_KEY: Final = "routeledger.model"
TASK_KEY: Final = "routeledger.task"
# Where the guard records the API key a request came with (an ApiKey; absent when none are configured).
API_KEY: Final = "routeledger.api_key"


def key_matches(presented: bytes, keys: Sequence[bytes]) -> bool:
    """Constant-time comparison against every configured key (no early exit on a match either)."""
    return matching(presented, keys) is not None


def matching(presented: bytes, keys: Sequence[bytes]) -> int | None:
    """The index of the configured key `presented` is, compared with every one in constant time."""
    found: int | None = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(presented, key):
            found = i
    return found


def bearer(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def send_error(send: Send, path: str, exc: ApiError) -> None:
    body = render(exc, surface_of(path))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """Keys, limits, metrics and access log for every HTTP request."""

    def __init__(
        self, app: ASGIApp, *, api_keys: Sequence[ApiKey], max_body_bytes: int, metrics: Metrics
    ) -> None:
        self.app = app
        self.named = list(api_keys)
        self.keys = [k.key.encode() for k in self.named]
        self.max_body = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path: str = scope["path"]
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                status = refusal.status
                await send_error(send, path, refusal)
                return
            await self.app(scope, self._limited(receive), sending)
        finally:
            self._record(scope, path, status, time.perf_counter() - start)

    def _refusal(self, scope: Scope, path: str) -> ApiError | None:
        if self.keys and path not in OPEN_PATHS:
            presented = bearer(scope)
            found = None if presented is None else matching(presented, self.keys)
            if found is not None:
                scope[API_KEY] = self.named[found]
            else:
                return UnauthorizedError(
                    "missing or wrong API key",
                    hint="send the header 'Authorization: Bearer <key>' with one of the configured keys",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = content_length(scope)
        if length is not None and length > self.max_body:
            return too_large(self.max_body)
        return None

    def _limited(self, receive: Receive) -> Receive:
        seen = 0
        limit = self.max_body

        async def receiving() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise too_large(limit)
            return message

        return receiving

    def _record(self, scope: Scope, path: str, status: int, seconds: float) -> None:
        route: Any = scope.get("route")
        template = getattr(route, "path", None) or "unmatched"
        model = scope.get(MODEL_KEY) or ""
        self.metrics.observe(template, model, status, seconds)
        if access.isEnabledFor(logging.INFO):
            access.info(
                "request",
                extra={
                    "method": scope.get("method"),
                    "route": template,
                    "status": status,
                    "ms": round(seconds * 1000, 2),
                    "model": model or None,
                    "task": scope.get(TASK_KEY),
                },
            )


def too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"request body is over the limit of {limit} bytes", hint="raise max_body_bytes, or send less"
    )
