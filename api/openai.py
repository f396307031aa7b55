"""The OpenAI-compatible surface: /v1/models, /v1/chat/completions, /v1/completions.

Streaming answers are SSE as OpenAI sends them: a first chunk with the role, one chunk per relayed
piece, a last chunk with `finish_reason`, a usage chunk when `stream_options.include_usage` asks
for it, then `data: [DONE]`. A failure after the stream started is one `data: {"error": …}`
line (the openai client raises it as an APIError) and no [DONE].
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from api.common import (
    JSON,
    check_messages,
    encode,
    finish_reason,
    gateway,
    mark,
    sse,
    sse_error,
    stream,
    task_headers,
    unix_now,
    usage,
)
from api.errors import OPENAI, BadRequestError, GenerationError
from api.gateway import Gateway, model_not_found
from api.pipelines import PIPELINE_MODEL, model_entry, openai_chat
from api.schemas import ChatCompletionCreate, CompletionCreate
from dispatch.payload import Result
from dispatch.serving import catalog
from dispatch.submit import Submitted, TaskRequest

router = APIRouter(tags=["openai"])


def _options(body: ChatCompletionCreate | CompletionCreate) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for name in ("temperature", "top_p", "seed"):
        value = getattr(body, name)
        if value is not None:
            opts[name] = value
    if body.stop is not None:
        opts["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    return opts


def _single(n: int | None) -> None:
    if n not in (None, 1):
        raise BadRequestError("only n=1 is supported", param="n", hint="send n separate requests")


def _failed(result: Result) -> None:
    if result.status != "completed":
        raise GenerationError(f"task {result.task_id} {result.status}: {result.error or 'no answer'}")


@router.get("/v1/models")
async def list_models(request: Request) -> JSON:
    """Every model name and alias the live fleet serves, plus `auto` (the router picks)."""
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    models = catalog(leases)
    data = [
        _model(m.name, {"digest": m.entry.digest, "holders": m.holders, "slots": m.slots}) for m in models
    ]
    if models:
        data.append(
            _model("auto", {"description": "routeledger picks the model by quality and expected latency"})
        )
        data.append(_model(PIPELINE_MODEL, model_entry()))
    return JSON({"object": "list", "data": data})


@router.get("/v1/models/{model:path}")
async def read_model(model: str, request: Request) -> JSON:
    """One model, as OpenAI's models.retrieve reads it."""
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    for m in catalog(leases):
        if m.name == model:
            return JSON(_model(m.name, {"digest": m.entry.digest, "holders": m.holders, "slots": m.slots}))
    if model == "auto" and catalog(leases):
        return JSON(_model("auto", {}))
    if model == PIPELINE_MODEL and catalog(leases):
        return JSON(_model(PIPELINE_MODEL, model_entry()))
    raise model_not_found(model, leases)


def _model(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "routeledger", **extra}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionCreate, request: Request) -> Response:
    _single(body.n)
    check_messages(request, len(body.messages))
    if body.model == PIPELINE_MODEL:
        return await openai_chat(body, request)
    gw = gateway(request)
    fmt = body.response_format or {}
    sub = await gw.submit(
        TaskRequest(
            model=body.model,
            messages=[m.to_message() for m in body.messages],
            domain=body.domain,
            options=_options(body),
            max_tokens=body.max_completion_tokens or body.max_tokens,
            format="json" if fmt.get("type") == "json_object" else None,
            client=request.headers.get("user-agent"),
            stream=bool(body.stream),
        )
    )
    mark(request, sub)
    cid, created = f"chatcmpl-{sub.task_id}", unix_now()
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        return stream(
            request,
            sub,
            _chat_chunks(gw, sub, cid, created, include),
            media_type="text/event-stream",
            error_line=sse_error(OPENAI),
        )
    result = await gw.wait(sub.task_id)
    _failed(result)
    return JSON(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": sub.task.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "finish_reason": finish_reason(result),
                    "logprobs": None,
                }
            ],
            "usage": usage(result),
            "system_fingerprint": None,
        },
        headers=task_headers(sub, result),
    )


async def _chat_chunks(
    gw: Gateway, sub: Submitted, cid: str, created: int, include_usage: bool
) -> AsyncIterator[bytes]:
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": sub.task.model}

    def chunk(delta: dict[str, Any], reason: str | None = None) -> bytes:
        return sse(
            encode(
                {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}
            )
        )

    yield chunk({"role": "assistant", "content": ""})
    async for item in gw.relay(sub.task_id):
        if isinstance(item, str):
            yield chunk({"content": item})
        else:
            yield chunk({}, finish_reason(item))
            if include_usage:
                yield sse(encode({**head, "choices": [], "usage": usage(item)}))
    yield b"data: [DONE]\n\n"


@router.post("/v1/completions")
async def completions(body: CompletionCreate, request: Request) -> Response:
    _single(body.n)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise BadRequestError("exactly one prompt is supported", param="prompt")
    gw = gateway(request)
    sub = await gw.submit(
        TaskRequest(
            model=body.model,
            kind="generate",
            prompt=prompts[0],
            domain=body.domain,
            options=_options(body),
            max_tokens=body.max_tokens,
            client=request.headers.get("user-agent"),
            stream=bool(body.stream),
        )
    )
    mark(request, sub)
    cid, created = f"cmpl-{sub.task_id}", unix_now()
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        return stream(
            request,
            sub,
            _completion_chunks(gw, sub, cid, created, include),
            media_type="text/event-stream",
            error_line=sse_error(OPENAI),
        )
    result = await gw.wait(sub.task_id)
    _failed(result)
    return JSON(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": sub.task.model,
            "choices": [
                {"index": 0, "text": result.text, "finish_reason": finish_reason(result), "logprobs": None}
            ],
            "usage": usage(result),
        },
        headers=task_headers(sub, result),
    )


async def _completion_chunks(
    gw: Gateway, sub: Submitted, cid: str, created: int, include_usage: bool
) -> AsyncIterator[bytes]:
    head = {"id": cid, "object": "text_completion", "created": created, "model": sub.task.model}
    async for item in gw.relay(sub.task_id):
        if isinstance(item, str):
            yield sse(
                encode(
                    {**head, "choices": [{"index": 0, "text": item, "finish_reason": None, "logprobs": None}]}
                )
            )
        else:
            yield sse(
                encode(
                    {
                        **head,
                        "choices": [
                            {"index": 0, "text": "", "finish_reason": finish_reason(item), "logprobs": None}
                        ],
                    }
                )
            )
            if include_usage:
                yield sse(encode({**head, "choices": [], "usage": usage(item)}))
    yield b"data: [DONE]\n\n"
