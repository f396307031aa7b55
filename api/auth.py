"""The ASGI guard in front of every route: who may ask (host, origin, key), body type and size,
metrics and the access log.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which costs a task and a queue per
request). It refuses early what it can refuse without reading the body, counts the body as it
is read for what it cannot, and records every request's route, model, status and time. It
never logs a body: prompts and outputs stay out of the logs.

A keyless API on loopback is still reachable from any web page the user opens: a page can send
a "simple" cross-site POST (no preflight: a form, or fetch with text/plain), and a page whose
host name re-resolves to 127.0.0.1 (DNS rebinding) reads the answers as same-origin. Three checks,
all on headers the guard scans anyway, close both: the Host must be a name this API answers to,
an Origin a browser sent must be this API's own (or a configured one), and a body must be sent
as application/json, which a page cannot send cross-site without a preflight nobody answers.
A page of an origin the operator allows (allowed_origins) gets its preflight answered and CORS
headers on its answers, so that a web app served elsewhere can call the API.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import (
    ApiError,
    ForbiddenError,
    PayloadTooLargeError,
    UnauthorizedError,
    UnsupportedMediaTypeError,
    render,
    surface_of,
)
from api.metrics import Metrics
from tasks.quota import ApiKey

access = logging.getLogger("routeledger.api.access")

# Probes must work without a key: a load balancer or an orchestrator asks them.
OPEN_PATHS: Final = frozenset({"/healthz", "/readyz"})
# Where a handler records the resolved model (for metrics) and the task id (for the access log).
MODEL_KEY: Final = "routeledger.model"
TASK_KEY: Final = "routeledger.task"
# Host names a local API always answers to, on any port.
LOOPBACK_HOSTS: Final = ("localhost", "127.0.0.1", "[::1]")
# Addresses that bind every interface: they name no host a client would use.
WILDCARD_BINDS: Final = frozenset({"", "0.0.0.0", "::", "[::]"})
# In allowed_hosts or allowed_origins: any (behind a proxy that checks them itself).
ANY: Final = "*"
# Methods whose body, when they carry one, must be JSON.
BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})
# Ollama's surface, whose bodies are JSON whatever their Content-Type says (as Ollama reads them).
OLLAMA_PATHS: Final = "/api/"

_DEFAULT_PORTS: Final = {b"http": b":80", b"https": b":443"}
# Most Host header values the guard remembers as allowed (a few per way of reaching it).
MAX_SEEN_HOSTS: Final = 64
# Where the guard marks a request from an allowed other origin (its Origin), and a CORS preflight.
CORS_KEY: Final = "routeledger.cors"
PREFLIGHT_KEY: Final = "routeledger.preflight"
# What a page of an allowed other origin may send, and read of the answer besides the body.
_CORS_ALLOW: Final = [
    (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
    (b"access-control-allow-headers", b"authorization, content-type"),
    (b"access-control-max-age", b"600"),
]
_CORS_EXPOSE: Final = (
    b"x-routeledger-task, x-routeledger-model, x-routeledger-worker, x-routeledger-expected-worker, "
    b"x-routeledger-pipeline, retry-after"
)


def wants_html(scope: Scope) -> bool:
    """A browser navigating (Accept names text/html); Ollama clients send JSON or */* and get the text."""
    for name, value in scope.get("headers", ()):
        if name == b"accept":
            return b"text/html" in value
    return False


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


def bearer_token(value: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header value."""
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def host_name(host: bytes) -> bytes:
    """The name in a Host header, lower-case and without its port (`[::1]:8600` → `[::1]`)."""
    if host.startswith(b"["):
        end = host.find(b"]")
        return (host[: end + 1] if end > 0 else host).lower()
    return host.partition(b":")[0].lower()


def _authority(scheme: bytes, authority: bytes) -> bytes:
    # `http://localhost` and `Host: localhost:80` are the same origin.
    authority = authority.lower()
    default = _DEFAULT_PORTS.get(scheme)
    if default is not None and authority.endswith(default):
        return authority[: -len(default)]
    return authority


def normal_origin(origin: bytes) -> bytes:
    """An origin as browsers send it, lower-case, without a default port or a trailing slash."""
    scheme, sep, rest = origin.strip().rstrip(b"/").lower().partition(b"://")
    return scheme + sep + _authority(scheme, rest) if sep else origin.strip().lower()


def same_origin(origin: bytes, host: bytes) -> bool:
    """Whether a browser's Origin names the host the request came to (a page of this API)."""
    scheme, sep, rest = origin.lower().partition(b"://")
    return bool(sep) and _authority(scheme, rest) == _authority(scheme, host)


def is_json(content_type: bytes) -> bool:
    """`application/json`, with or without parameters (`; charset=utf-8`)."""
    return content_type.partition(b";")[0].strip().lower() == b"application/json"


def allowed_host_names(configured: Iterable[str], bound: str | None) -> frozenset[bytes] | None:
    """Host names the API answers to: loopback, the configured ones, and the bound address unless
    it binds every interface; None when `*` allows any."""
    names = [*LOOPBACK_HOSTS, *configured]
    if ANY in names:
        return None
    if bound is not None and bound not in WILDCARD_BINDS:
        names.append(f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound)
    return frozenset(host_name(n.strip().encode()) for n in names if n.strip())


async def send_error(send: Send, path: str, exc: ApiError) -> None:
    body = render(exc, surface_of(path))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """Host, origin, keys, body type and size, metrics and access log for every HTTP request.

    It sits outside the dashboard's shell so that the page, too, loads only under a name this API
    answers to; the shell's files (which hold no data) are exempt from the key alone.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: Sequence[ApiKey],
        max_body_bytes: int,
        metrics: Metrics,
        allowed_hosts: Sequence[str] = (),
        allowed_origins: Sequence[str] = (),
        bound_host: str | None = None,
        pages: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.named = list(api_keys)
        self.keys = [k.key.encode() for k in self.named]
        self.max_body = max_body_bytes
        self.metrics = metrics
        self.hosts = allowed_host_names(allowed_hosts, bound_host)
        self.any_origin = ANY in allowed_origins
        self.origins = frozenset(normal_origin(o.encode()) for o in allowed_origins if o.strip())
        # The dashboard's shell: a browser cannot attach a key to a page load, and it holds no data.
        self.pages = pages
        # Host header values already found allowed, as sent (see _host_allowed).
        self.seen_hosts: set[bytes] = set()

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
            cors: bytes | None = scope.get(CORS_KEY)
            if cors is not None:
                status = await self._cross_origin(scope, receive, send, cors)
                return
            await self.app(scope, self._limited(receive), sending)
        finally:
            self._record(scope, path, status, time.perf_counter() - start)

    def _refusal(self, scope: Scope, path: str) -> ApiError | None:
        # One pass over the headers, in C: the checks below only look names up.
        headers: dict[bytes, bytes] = dict(scope.get("headers", ()))
        host = headers.get(b"host")
        origin = headers.get(b"origin")
        content_type = headers.get(b"content-type")
        length = headers.get(b"content-length")
        if host is not None and host not in self.seen_hosts and not self._host_allowed(host):
            return wrong_host(host)
        if origin is not None and not (host is not None and same_origin(origin, host)):
            if not self.any_origin and normal_origin(origin) not in self.origins:
                return wrong_origin(origin)
            # An allowed page of another origin: its answers carry CORS headers, and its preflight
            # (which carries no key) is answered here.
            scope[CORS_KEY] = origin
            if scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers:
                scope[PREFLIGHT_KEY] = True
                return None
        if self.keys and not self._key_exempt(scope, path):
            presented = bearer_token(headers.get(b"authorization"))
            found = None if presented is None else matching(presented, self.keys)
            if found is not None:
                scope[API_KEY] = self.named[found]
            else:
                return UnauthorizedError(
                    "missing or wrong API key",
                    hint="send the header 'Authorization: Bearer <key>' with one of the configured keys",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        size: int | None = None
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                size = None
        if size is not None and size > self.max_body:
            return too_large(self.max_body)
        has_body = b"transfer-encoding" in headers or (size is not None and size > 0)
        if (
            has_body
            and content_type != b"application/json"
            and (content_type is None or not is_json(content_type))
        ):
            if not path.startswith(OLLAMA_PATHS):
                return not_json(content_type) if scope.get("method") in BODY_METHODS else None
            # Ollama reads every body as JSON whatever its type, and its own docs' `curl -d` (and
            # litellm) send none or a form's: the body is read as JSON here too (a body that is not
            # JSON is a 400). No browser gets in by it: a page of another origin sends an Origin,
            # refused above, and a name that re-resolves to this machine is not an allowed Host.
            scope["headers"] = [
                *((name, value) for name, value in scope["headers"] if name != b"content-type"),
                (b"content-type", b"application/json"),
            ]
        return None

    def _host_allowed(self, host: bytes) -> bool:
        if self.hosts is not None and host_name(host) not in self.hosts:
            return False
        # Clients send a handful of Host values: each allowed one is parsed once. Refused ones are
        # not kept, and the set is bounded, so no client can grow it.
        if len(self.seen_hosts) < MAX_SEEN_HOSTS:
            self.seen_hosts.add(host)
        return True

    async def _cross_origin(self, scope: Scope, receive: Receive, send: Send, origin: bytes) -> int:
        """Serve a request from an allowed other origin, with CORS headers; returns the status."""
        allow = [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
        if scope.get(PREFLIGHT_KEY):
            headers = [*allow, *_CORS_ALLOW, (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return 204
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                exposed = [*allow, (b"access-control-expose-headers", _CORS_EXPOSE)]
                message = {**message, "headers": [*message.get("headers", ()), *exposed]}
            await send(message)

        await self.app(scope, self._limited(receive), sending)
        return status

    def _key_exempt(self, scope: Scope, path: str) -> bool:
        if path in OPEN_PATHS:
            return True
        if scope.get("method") not in ("GET", "HEAD") or not self.pages:
            return False
        return path.rstrip("/") in self.pages or (path == "/" and wants_html(scope))

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
        template = getattr(route, "path", None) or ("/dashboard" if path in self.pages else "unmatched")
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


def wrong_host(host: bytes) -> ForbiddenError:
    name = host_name(host).decode(errors="replace")
    return ForbiddenError(
        f"this API does not answer to the host name {name!r} (a page whose name re-resolves to this "
        "machine could read it)",
        hint=f"reach it as localhost or 127.0.0.1, or add {name!r} to allowed_hosts "
        "(ROUTELEDGER_ALLOWED_HOSTS; '*' allows any, behind a proxy that checks the name)",
    )


def wrong_origin(origin: bytes) -> ForbiddenError:
    text = origin.decode(errors="replace")
    return ForbiddenError(
        f"requests from the web page origin {text!r} are refused: only this API's own pages may call it",
        hint=f"add {text!r} to allowed_origins (ROUTELEDGER_ALLOWED_ORIGINS) to let that site call it",
    )


def not_json(content_type: bytes | None) -> UnsupportedMediaTypeError:
    sent = "none" if content_type is None else repr(content_type.decode(errors="replace"))
    return UnsupportedMediaTypeError(
        f"the request body must be JSON sent as Content-Type application/json (got {sent})",
        hint="send the header 'Content-Type: application/json' with a JSON body",
    )
