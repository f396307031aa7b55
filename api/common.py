"""What every surface's handlers share: the gateway, limits, response helpers, usage."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import msgspec
from fastapi import Request
from redis.exceptions import RedisError
from starlette.responses import Response

from api.auth import MODEL_KEY, TASK_KEY
from api.errors import ApiError, PayloadTooLargeError, render
from api.gateway import TRANSIENT, Gateway, unavailable
from api.relay import RelayResponse
from dispatch.payload import Result
from dispatch.submit import Submitted

_enc: Final = msgspec.json.Encoder()


class Limits(msgspec.Struct, kw_only=True, frozen=True):
    """Per-request limits the app enforces."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_messages: int = 256


class JSON(Response):
    """A JSON response encoded by msgspec (several times faster than the standard library)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _enc.encode(content)


def gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def limits(request: Request) -> Limits:
    lim: Limits = request.app.state.limits
    return lim


def check_messages(request: Request, count: int) -> None:
    most = limits(request).max_messages
    if count > most:
        raise PayloadTooLargeError(
            f"{count} messages is over the limit of {most}",
            hint="raise max_messages, or send fewer",
            param="messages",
        )


def mark(request: Request, sub: Submitted) -> None:
    """Tell the guard which model and task this request was for (metrics and the access log)."""
    request.scope[MODEL_KEY] = sub.task.model
    request.scope[TASK_KEY] = sub.task_id


def task_headers(sub: Submitted, result: Result | None = None) -> dict[str, str]:
    headers = {"X-Routeledger-Task": sub.task_id, "X-Routeledger-Model": sub.task.model}
    if result is not None and result.worker:
        headers["X-Routeledger-Worker"] = result.worker
    elif sub.decision is not None:
        # Streaming answers start before a worker claims the task: this is the router's expectation.
        headers["X-Routeledger-Expected-Worker"] = sub.decision.ranking.best.worker
    return headers


def usage(result: Result) -> dict[str, int | None]:
    """OpenAI's usage from the backend's own counts; an unreported count stays None (unknown)."""
    p = result.timings.prompt_eval_count
    c = result.timings.eval_count
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": None if p is None or c is None else p + c,
    }


def finish_reason(result: Result) -> str:
    return "length" if result.done_reason == "length" else "stop"


def stream(
    request: Request,
    sub: Submitted,
    lines: AsyncIterator[bytes],
    *,
    media_type: str,
    error_line: Callable[[ApiError], bytes],
) -> RelayResponse:
    """A streamed answer: `lines`, then an error line in the surface's shape if the relay fails."""
    gw = gateway(request)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for line in lines:
                yield line
        except ApiError as exc:
            yield error_line(exc)
        except (RedisError, *TRANSIENT) as exc:
            yield error_line(unavailable(exc))

    return RelayResponse(
        body(),
        media_type=media_type,
        headers=task_headers(sub),
        on_disconnect=lambda: gw.cancel_quietly(sub.task_id),
    )


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def sse_error(surface: str) -> Callable[[ApiError], bytes]:
    return lambda exc: sse(render(exc, surface))


def encode(content: Any) -> bytes:
    return _enc.encode(content)


def unix_now() -> int:
    return int(time.time())
