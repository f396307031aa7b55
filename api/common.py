"""What every surface's handlers share: the gateway, limits, submission, answers, response helpers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import msgspec
from fastapi import Request
from redis.exceptions import RedisError
from starlette.responses import Response

from api.auth import API_KEY, MODEL_KEY, TASK_KEY
from api.errors import (
    ApiError,
    BadRequestError,
    ClientGoneError,
    GenerationError,
    PayloadTooLargeError,
    answer,
    render,
    too_deep,
)
from api.relay import RelayResponse
from api.schemas import MAX_DEPTH
from dispatch.errors import TaskTimeoutError
from dispatch.gateway import TRANSIENT, Gateway, unavailable
from dispatch.options import OptionsPolicy
from dispatch.submit import Submitted
from tasks.errors import TaskError
from tasks.payload import Relayed, Result, TaskMessage

_enc: Final = msgspec.json.Encoder()
_msgpack: Final = msgspec.msgpack.Encoder()


class RequestLimits(msgspec.Struct, kw_only=True, frozen=True):
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


def limits(request: Request) -> RequestLimits:
    lim: RequestLimits = request.app.state.limits
    return lim


def options_policy(request: Request) -> OptionsPolicy:
    policy: OptionsPolicy = request.app.state.options
    return policy


def check_messages(request: Request, count: int) -> None:
    most = limits(request).max_messages
    if count > most:
        raise PayloadTooLargeError(
            f"{count} messages is over the limit of {most}",
            hint="raise max_messages, or send fewer",
            param="messages",
        )


async def submit(
    request: Request, req: TaskMessage, *, waits: bool = True, timeout_s: float | None = None
) -> Submitted:
    """Check what a surface built, then route and queue it (dispatch.gateway); marks the request
    with its model and task for the metrics and the access log. `waits`: the client waits for the
    answer (at most `timeout_s`), which is then the task's deadline (Gateway.submit)."""
    if req.kind == "chat" and not req.messages:
        raise BadRequestError(
            "messages must not be empty", param="messages", hint="send at least one message"
        )
    if req.kind == "generate" and req.prompt is None:
        raise BadRequestError("prompt is required", param="prompt")
    if any(value is None for value in req.options.values()):
        # A null option is one not set, as Ollama reads it (LangChain sends `"num_ctx": null`).
        options = {name: value for name, value in req.options.items() if value is not None}
        req = msgspec.structs.replace(req, options=options)
    policy = options_policy(request)
    try:
        policy.check_domain(req.domain)
        runtime = policy.check_options(req.options)
    except TaskError as exc:
        raise answer(exc) from None
    if runtime:
        req = msgspec.structs.replace(req, runtime_options=True)
    # Options and format travel to the backend as msgpack: refuse what cannot (ints over 64 bits).
    for name, value in (("options", req.options), ("format", req.format), ("tools", req.tools)):
        try:
            _msgpack.encode(value)
        except RecursionError:
            # Bodies are checked for depth as they are read; this is the last line, not the first.
            raise too_deep(MAX_DEPTH) from None
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:
            raise BadRequestError(
                f"{name} holds a value that cannot be sent to a backend: {exc}", param=name
            ) from None
    key = request.scope.get(API_KEY)
    sub = await gateway(request).submit(req, waits=waits, timeout_s=timeout_s, key=key)
    request.scope[MODEL_KEY] = sub.task.model
    request.scope[TASK_KEY] = sub.task_id
    return sub


def task_headers(sub: Submitted, result: Result | None = None) -> dict[str, str]:
    headers = {"X-Routeledger-Task": sub.task_id, "X-Routeledger-Model": sub.task.model}
    if result is not None and result.worker:
        headers["X-Routeledger-Worker"] = result.worker
    elif sub.decision is not None:
        # Streaming answers start before a worker claims the task: this is the router's expectation.
        headers["X-Routeledger-Expected-Worker"] = sub.decision.ranking.best.worker
    return headers


class Answer:
    """One generation a surface answers with, a task's or a pipeline's: its output as it arrives
    (text pieces and tool calls, then its Result), or whole; the headers that name it; what to do
    when the client leaves a stream. Each surface renders both kinds through the same code."""

    def __init__(
        self,
        *,
        ident: str,
        model: str,
        pieces: Callable[[], AsyncIterator[Relayed]],
        whole: Callable[[], Awaitable[Result]],
        headers: Callable[[Result | None], dict[str, str]],
        on_disconnect: Callable[[], Awaitable[None]],
    ) -> None:
        self.ident = ident
        self.model = model
        self.pieces = pieces
        self.whole = whole
        self.headers = headers
        self.on_disconnect = on_disconnect


def task_answer(request: Request, sub: Submitted, timeout_s: float | None = None) -> Answer:
    """The answer of a submitted task: relayed from its output stream, or awaited whole (a task
    that ended without an answer is a 502)."""
    gw = gateway(request)

    async def whole() -> Result:
        result = await waited(request, gw, sub.task_id, timeout_s)
        if result.refused:
            raise BadRequestError(f"the backend refused task {result.task_id}: {result.error}")
        if result.status != "completed":
            raise GenerationError(f"task {result.task_id} {result.status}: {result.error or 'no answer'}")
        return result

    return Answer(
        ident=sub.task_id,
        model=sub.task.model,
        pieces=lambda: gw.relay(sub.task_id, timeout_s),
        whole=whole,
        headers=lambda result: task_headers(sub, result),
        on_disconnect=lambda: gw.cancel_quietly(sub.task_id),
    )


async def waited(request: Request, gw: Gateway, task_id: str, timeout_s: float | None) -> Result:
    """The task's result, waited for while its client waits: a client that disconnects, or a wait
    that times out (504), cancels the task, so that nobody's abandoned request runs later."""
    waiting = asyncio.ensure_future(gw.wait(task_id, timeout_s))
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not waiting.done():
            waiting.cancel()
    if not waiting.cancelled() and waiting.done():
        try:
            return waiting.result()
        except TaskTimeoutError:
            await gw.cancel_quietly(task_id)
            raise
    await gw.cancel_quietly(task_id)
    raise ClientGoneError(f"the client of task {task_id} disconnected before it finished")


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the request's body was read already: the next message
    the server sends the app is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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
    """OpenAI's finish_reason: `tool_calls` when the model called tools (whatever the backend said)."""
    if result.tool_calls:
        return "tool_calls"
    return "length" if result.done_reason == "length" else "stop"


def stream(
    ans: Answer,
    lines: AsyncIterator[bytes],
    *,
    media_type: str,
    error_line: Callable[[ApiError], bytes],
) -> RelayResponse:
    """A streamed answer: `lines`, then an error line in the surface's shape if the relay fails."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for line in lines:
                yield line
        except ApiError as exc:
            yield error_line(exc)
        except TaskTimeoutError as exc:
            # Nobody waits for the task any more: it must not run later.
            await ans.on_disconnect()
            yield error_line(answer(exc))
        except TaskError as exc:
            yield error_line(answer(exc))
        except (RedisError, *TRANSIENT) as exc:
            yield error_line(answer(unavailable(exc)))

    return RelayResponse(
        body(), media_type=media_type, headers=ans.headers(None), on_disconnect=ans.on_disconnect
    )


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def sse_error(surface: str) -> Callable[[ApiError], bytes]:
    return lambda exc: sse(render(exc, surface))


def encode(content: Any) -> bytes:
    return _enc.encode(content)


def unix_now() -> int:
    return int(time.time())
