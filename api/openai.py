"""The OpenAI-compatible surface: /v1/models, /v1/chat/completions, /v1/completions.

Streaming answers are SSE as OpenAI sends them: a first chunk with the role, one chunk per relayed
piece (text; thinking as `reasoning_content`, an extension OpenAI's own API lacks; a model's tool
calls as `tool_calls` deltas: api.tools), a last chunk with
`finish_reason`, a usage chunk when `stream_options.include_usage` asks
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
    Answer,
    check_messages,
    encode,
    finish_reason,
    gateway,
    sse,
    sse_error,
    stream,
    submit,
    task_answer,
    unix_now,
    usage,
)
from api.errors import OPENAI, READS, SUBMITS, BadRequestError, documented, model_not_found, streamed
from api.pipelines import model_entry, pipeline_answer, refuse_unsupported
from api.schemas import ChatCompletionCreate, CompletionCreate
from api.tools import check_tool_choice, check_tools, openai_calls, openai_deltas
from dispatch.response_format import ollama_format
from dispatch.serving import catalog
from pipelines.coordinator import PIPELINE_MODEL
from tasks.payload import Result, TaskMessage, Thought

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


def _think(effort: str | None) -> bool | str | None:
    """OpenAI's `reasoning_effort` as Ollama's `think`: "none" turns thinking off, a level turns it on."""
    if effort is None:
        return None
    return False if effort == "none" else effort


def _single(n: int | None) -> None:
    if n not in (None, 1):
        raise BadRequestError("only n=1 is supported", param="n", hint="send n separate requests")


@router.get("/v1/models", responses=documented(OPENAI, *READS))
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


@router.get("/v1/models/{model:path}", responses=documented(OPENAI, 404, *READS))
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


@router.post(
    "/v1/chat/completions", responses={**streamed("text/event-stream"), **documented(OPENAI, *SUBMITS)}
)
async def chat_completions(body: ChatCompletionCreate, request: Request) -> Response:
    _single(body.n)
    check_messages(request, len(body.messages))
    messages = [m.to_message() for m in body.messages]
    max_tokens = body.max_completion_tokens or body.max_tokens
    tools = check_tools(body.tools)
    tool_choice = check_tool_choice(body.tool_choice, tools)
    if body.model == PIPELINE_MODEL:
        if tools is not None:
            raise BadRequestError(
                f"the {PIPELINE_MODEL} model does not call tools", param="tools", hint="choose another model"
            )
        refuse_unsupported(
            messages,
            response_format=ollama_format(body.response_format),
            reasoning_effort=_think(body.reasoning_effort),
        )
        ans = pipeline_answer(request, messages, max_tokens)
    else:
        req = TaskMessage(
            model=body.model,
            messages=messages,
            domain=body.domain,
            options=_options(body),
            max_tokens=max_tokens,
            format=ollama_format(body.response_format),
            client=request.headers.get("user-agent"),
            stream=bool(body.stream),
            paced=bool(body.stream),
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            response_format=body.response_format,
            think=_think(body.reasoning_effort),
        )
        ans = task_answer(request, await submit(request, req))
    cid, created = f"chatcmpl-{ans.ident}", unix_now()
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        return stream(
            ans,
            _chat_chunks(ans, cid, created, include),
            media_type="text/event-stream",
            error_line=sse_error(OPENAI),
        )
    result = await ans.whole()
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        # As OpenAI answers a call: no content unless the model also wrote some.
        message["content"] = result.text or None
        message["tool_calls"] = openai_calls(result.tool_calls)
    if result.thinking:
        # Not OpenAI's own: the field several OpenAI-compatible servers answer thinking in.
        message["reasoning_content"] = result.thinking
    return JSON(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": ans.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish_reason(result),
                    "logprobs": None,
                }
            ],
            "usage": usage(result),
            "system_fingerprint": None,
        },
        headers=ans.headers(result),
    )


async def _chat_chunks(ans: Answer, cid: str, created: int, include_usage: bool) -> AsyncIterator[bytes]:
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": ans.model}

    def chunk(delta: dict[str, Any], reason: str | None = None) -> bytes:
        return sse(
            encode(
                {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}
            )
        )

    # The role goes out at once: a pipeline's children run for a while before any text exists.
    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    async for item in ans.pieces():
        if isinstance(item, str):
            yield chunk({"content": item})
        elif isinstance(item, Thought):
            yield chunk({"reasoning_content": item.text})
        elif isinstance(item, list):
            for delta in openai_deltas(item, calls):
                yield chunk({"tool_calls": [delta]})
            calls += len(item)
        else:
            yield chunk({}, finish_reason(item))
            if include_usage:
                yield sse(encode({**head, "choices": [], "usage": usage(item)}))
    yield b"data: [DONE]\n\n"


@router.post("/v1/completions", responses={**streamed("text/event-stream"), **documented(OPENAI, *SUBMITS)})
async def completions(body: CompletionCreate, request: Request) -> Response:
    _single(body.n)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise BadRequestError("exactly one prompt is supported", param="prompt")
    req = TaskMessage(
        model=body.model,
        kind="generate",
        prompt=prompts[0],
        domain=body.domain,
        options=_options(body),
        max_tokens=body.max_tokens,
        client=request.headers.get("user-agent"),
        stream=bool(body.stream),
        paced=bool(body.stream),
    )
    ans = task_answer(request, await submit(request, req))
    cid, created = f"cmpl-{ans.ident}", unix_now()
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        return stream(
            ans,
            _completion_chunks(ans, cid, created, include),
            media_type="text/event-stream",
            error_line=sse_error(OPENAI),
        )
    result = await ans.whole()
    return JSON(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": ans.model,
            "choices": [
                {"index": 0, "text": result.text, "finish_reason": finish_reason(result), "logprobs": None}
            ],
            "usage": usage(result),
        },
        headers=ans.headers(result),
    )


async def _completion_chunks(
    ans: Answer, cid: str, created: int, include_usage: bool
) -> AsyncIterator[bytes]:
    head = {"id": cid, "object": "text_completion", "created": created, "model": ans.model}

    def chunk(text: str, reason: str | None = None) -> bytes:
        return sse(
            encode(
                {**head, "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}]}
            )
        )

    async for item in ans.pieces():
        if isinstance(item, str):
            yield chunk(item)
        elif isinstance(item, Result):
            yield chunk("", finish_reason(item))
            if include_usage:
                yield sse(encode({**head, "choices": [], "usage": usage(item)}))
    yield b"data: [DONE]\n\n"
