"""routeledger's own task API: submit, look up, follow, cancel."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from api.common import (
    JSON,
    check_messages,
    encode,
    gateway,
    sse,
    stream,
    submit,
    task_answer,
    task_headers,
    waited,
)
from api.errors import (
    NATIVE,
    READS,
    SUBMITS,
    ApiError,
    BadRequestError,
    NotFoundError,
    documented,
    render,
    streamed,
)
from api.schemas import TaskCreate
from api.tools import check_tools, openai_calls
from dispatch.gateway import Gateway
from dispatch.submit import Submitted
from events.codec import event_fields
from tasks.payload import TaskMessage, Thought

router = APIRouter(tags=["tasks"])


def _request(body: TaskCreate, client: str | None) -> TaskMessage:
    messages = [m.to_message() for m in body.messages or []]
    kind = "generate" if body.prompt is not None and not messages else "chat"
    tools = check_tools(body.tools)
    if tools is not None and kind != "chat":
        raise BadRequestError("tools need messages: a plain prompt cannot call tools", param="tools")
    return TaskMessage(
        model=body.model,
        kind=kind,
        messages=messages,
        prompt=body.prompt,
        system=body.system,
        domain=body.domain,
        options=body.options or {},
        max_tokens=body.max_tokens,
        priority=body.priority,
        client=client,
        paced=bool(body.stream),
        tools=tools,
        images=body.images or None,
        format=body.format,
        think=body.think,
    )


@router.post(
    "/v1/tasks",
    status_code=202,
    responses={**streamed("text/event-stream"), **documented(NATIVE, *SUBMITS)},
)
async def create_task(body: TaskCreate, request: Request) -> Response:
    """Submit a task. `wait` answers with its result; `stream` relays its output (SSE)."""
    check_messages(request, len(body.messages or []))
    gw = gateway(request)
    sub = await submit(
        request,
        _request(body, request.headers.get("user-agent")),
        waits=body.stream or body.wait,
        timeout_s=body.timeout_s,
    )
    if body.stream:
        ans = task_answer(request, sub, body.timeout_s)
        return stream(
            ans, _events(gw, sub, body.timeout_s), media_type="text/event-stream", error_line=_error
        )
    if body.wait:
        result = await waited(request, gw, sub.task_id, body.timeout_s)
        return JSON(await gw.view(sub.task_id), headers=task_headers(sub, result))
    return JSON(_accepted(sub), status_code=202, headers=task_headers(sub))


def _accepted(sub: Submitted) -> dict[str, Any]:
    tid = sub.task_id
    best = sub.decision.ranking.best if sub.decision is not None else None
    return {
        "task_id": tid,
        "status": "queued",
        "model": sub.task.model,
        "digest": sub.task.digest,
        "domain": sub.task.domain,
        "queue": sub.queue,
        "expected_worker": best.worker if best is not None else None,
        "expected_finish_s": best.expected_finish_s if best is not None else None,
        "links": {"self": f"/v1/tasks/{tid}", "events": f"/v1/tasks/{tid}/events"},
    }


async def _events(gw: Gateway, sub: Submitted, timeout_s: float | None) -> AsyncIterator[bytes]:
    yield b"event: accepted\n" + sse(encode(_accepted(sub)))
    async for item in gw.relay(sub.task_id, timeout_s):
        if isinstance(item, str):
            yield b"event: chunk\n" + sse(encode({"text": item}))
        elif isinstance(item, Thought):
            yield b"event: thinking\n" + sse(encode({"thinking": item.text}))
        elif isinstance(item, list):
            yield b"event: tool_calls\n" + sse(encode({"tool_calls": openai_calls(item)}))
        else:
            yield b"event: result\n" + sse(encode(await gw.view(sub.task_id)))


def _error(exc: ApiError) -> bytes:
    return b"event: error\n" + sse(render(exc, NATIVE))


@router.get("/v1/tasks/{task_id}", responses=documented(NATIVE, 404, *READS))
async def read_task(task_id: str, request: Request) -> JSON:
    """Status, result, who ran it, timings, attempts and the routing breakdown."""
    gw = gateway(request)
    return JSON(await gw.retrying(lambda: gw.view(task_id)))


@router.get("/v1/tasks/{task_id}/events", responses=documented(NATIVE, 404, *READS))
async def task_events(task_id: str, request: Request) -> JSON:
    """The task's history from the ledger, in order: the entries its row lists and the unfolded
    tail (O(events of the task), not O(ledger))."""
    gw = gateway(request)
    found = await gw.retrying(lambda: gw.events_of(task_id))
    if not found:
        raise NotFoundError(f"the ledger has no events of task {task_id}")
    events = [{"id": entry_id, **event_fields(event)} for entry_id, event in found]
    return JSON({"task_id": task_id, "events": events})


@router.delete(
    "/v1/tasks/{task_id}",
    responses={
        202: {"description": "the task runs, and is told to stop", "content": {"application/json": {}}},
        **documented(NATIVE, 404, 409, *READS),
    },
)
async def cancel_task(task_id: str, request: Request) -> JSON:
    """Cancel: a queued task is removed at once; a running one is told to stop (202)."""
    gw = gateway(request)
    outcome = await gw.retrying(lambda: gw.cancel(task_id))
    return JSON(outcome, status_code=202 if outcome["was_running"] else 200)
