"""The Ollama-compatible surface, so that Open WebUI's Ollama connection and the `ollama` CLI work.

Like Ollama, /api/chat and /api/generate stream NDJSON unless `"stream": false`: one object per
piece with `"done": false`, then a final one with `"done": true`, `done_reason` and the backend's
own counts and durations (nanoseconds). A model's tool calls come as `message.tool_calls` (api.tools)
in a chunk of their own when streamed; its thinking as `message.thinking` (`thinking` on generate).
A failure mid-stream is one `{"error": "..."}` line.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any, Final

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response

from api.common import JSON, Answer, check_messages, encode, gateway, stream, submit, task_answer
from api.errors import (
    OLLAMA,
    READS,
    SUBMITS,
    ApiError,
    BadRequestError,
    documented,
    model_not_found,
    render,
    streamed,
)
from api.pipelines import pipeline_answer, refuse_unsupported
from api.schemas import OllamaChat, OllamaGenerate, OllamaShow
from api.tools import check_tools, ollama_calls
from dispatch.modelcard import details, facts, read_card
from dispatch.ollama import OLLAMA_VERSION, final_fields, rfc3339
from dispatch.serving import ModelInfo, catalog
from events.event import ModelEntry
from pipelines.coordinator import PIPELINE_MODEL
from router.choose import AUTO_MODEL
from tasks.lease import LeaseInfo, LoadedModel
from tasks.payload import Result, TaskMessage, Thought

router = APIRouter(tags=["ollama"])

NDJSON: Final = "application/x-ndjson"


def _facts(m: ModelInfo, leases: dict[str, LeaseInfo]) -> ModelEntry:
    """What the holders of `m` report of it, each fact from the first holder that reports it."""
    return facts(m.entry.digest, leases) or m.entry


@router.get("/", include_in_schema=False)
async def root() -> PlainTextResponse:
    # The ollama CLI and some UIs probe the root for this exact text. Browsers (Accept: text/html)
    # never get here: dashboard.Shell sends them to the dashboard first.
    return PlainTextResponse("Ollama is running")


@router.get("/api/version")
async def version() -> JSON:
    return JSON({"version": OLLAMA_VERSION})


@router.get("/api/tags", responses=documented(OLLAMA, *READS))
async def tags(request: Request) -> JSON:
    """Every model the live fleet serves, in Ollama's full shape (`name`, `model`, `modified_at`,
    `size`, `digest`, `details`: clients index them), and `capabilities` (an extension: Ollama's
    own list leaves them to /api/show); then the models only routeledger serves, `auto` and
    `pipeline`, in the same shape."""
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    return JSON({"models": _listing(leases)})


def _listing(leases: dict[str, LeaseInfo]) -> list[dict[str, Any]]:
    """Every /api/tags entry: the served models, then the virtual ones (none while nothing is served)."""
    models = [_listed(m, leases) for m in catalog(leases)]
    if models:
        # Open WebUI's Ollama connection lists models from here: what /api/chat takes must be here.
        newest = max(m["modified_at"] for m in models)
        models += [_virtual(name, newest, leases) for name in VIRTUAL_MODELS]
    return models


def _listed(m: ModelInfo, leases: dict[str, LeaseInfo]) -> dict[str, Any]:
    f = _facts(m, leases)
    entry: dict[str, Any] = {
        "name": m.name,
        "model": m.name,
        # A backend that reports no time (an OpenAI-compatible server): when the fleet began serving it.
        "modified_at": f.modified_at or rfc3339(min(leases[w].since for w in m.holders) / 1000),
        # The key is always there, as clients index it; null where no holder reports the size:
        # unknown is not 0 bytes.
        "size": f.size,
        "digest": f.digest,
        "details": details(f),
    }
    if f.capabilities is not None:
        entry["capabilities"] = f.capabilities
    return entry


# The models only routeledger serves: the router's pick, and a request split across the fleet.
VIRTUAL_MODELS: Final = (AUTO_MODEL, PIPELINE_MODEL)


def _virtual(name: str, modified_at: str, leases: dict[str, LeaseInfo]) -> dict[str, Any]:
    """`auto` or `pipeline` as Ollama lists a model: a digest of its own (clients group names by
    digest), no size (it holds no weights), and what it can do."""
    return {
        "name": name,
        "model": name,
        "modified_at": modified_at,
        "size": 0,
        "digest": hashlib.sha256(f"routeledger/{name}".encode()).hexdigest(),
        "details": {"family": f"routeledger-{name}", "families": [f"routeledger-{name}"]},
        "capabilities": _virtual_capabilities(name, leases),
    }


def _virtual_capabilities(name: str, leases: dict[str, LeaseInfo]) -> list[str]:
    if name == PIPELINE_MODEL:
        # It answers prose from text (api.pipelines refuses tools, images, a format and thinking).
        return ["completion"]
    # `auto` picks among the served models that can do what a request asks: any of them may.
    found: dict[str, None] = {}
    for m in catalog(leases):
        for capability in _facts(m, leases).capabilities or ["completion"]:
            found[capability] = None
    return list(found)


@router.get("/api/ps", responses=documented(OLLAMA, *READS))
async def ps(request: Request) -> JSON:
    """Each model loaded somewhere in the live fleet, once, as its backends' /api/ps report it
    (sizes, expiry) at their last heartbeat: `expires_at` the latest of them, and `workers` (an
    extension of Ollama's shape) each machine that holds it loaded with its own figures."""
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    by_digest: dict[str, dict[str, Any]] = {}
    for info in sorted(leases.values(), key=lambda i: i.worker):
        names = {e.digest: e.name for e in info.inventory}
        reported = {lm.digest: lm for lm in info.loaded_models}
        for digest in info.loaded:
            lm = reported.get(digest) or LoadedModel(name=names.get(digest, digest[:12]), digest=digest)
            machine: dict[str, Any] = {"name": info.worker}
            for field in ("size", "size_vram", "expires_at", "context_length"):
                value = getattr(lm, field)
                if value is not None:
                    machine[field] = value
            entry = by_digest.get(digest)
            if entry is None:
                f = facts(digest, leases) or next((e for e in info.inventory if e.digest == digest), None)
                entry = by_digest[digest] = {
                    "name": lm.name,
                    "model": lm.name,
                    **{k: v for k, v in machine.items() if k != "name"},
                    "digest": digest,
                    "details": details(f) if f is not None else {},
                    "workers": [],
                }
            else:
                # Loaded until the last machine's keep-alive runs out; a figure the first left out.
                for field, value in machine.items():
                    if field == "expires_at" and entry.get(field, "") < value:
                        entry[field] = value
                    elif field != "name":
                        entry.setdefault(field, value)
            entry["workers"].append(machine)
    return JSON({"models": list(by_digest.values())})


@router.post("/api/show", responses=documented(OLLAMA, 400, 404, 422, *READS))
async def show(body: OllamaShow, request: Request) -> JSON:
    """What the holders' backends say of the model (their own /api/show, cached per digest by each
    worker): capabilities, template, parameters, details and model_info; what none says is absent."""
    name = body.model or body.name
    if not name:
        raise BadRequestError("model is required", param="model")
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    models = catalog(leases)
    listed = (
        next((e for e in _listing(leases) if e["name"] == name), None) if name in VIRTUAL_MODELS else None
    )
    if listed is not None:
        what = "picks a model for each request" if name == AUTO_MODEL else "splits a request across the fleet"
        return JSON(
            {
                "modelfile": f"# routeledger's own model {name!r}: it {what}\n",
                "details": listed["details"],
                "model_info": {"routeledger.holders": sorted(leases)},
                "capabilities": listed["capabilities"],
                "modified_at": listed["modified_at"],
            }
        )
    m = next((m for m in models if name in (m.name, m.name.removesuffix(":latest"))), None)
    if m is None:
        raise model_not_found(name, leases)
    digest, holders = m.entry.digest, m.holders
    f = _facts(m, leases)
    card = await gw.retrying(lambda: read_card(gw.redis, gw.keys, digest, holders))
    shown: dict[str, Any] = {
        "modelfile": f"# served by routeledger from {', '.join(holders)}\nFROM {m.name}\n",
    }
    if card.parameters is not None:
        shown["parameters"] = card.parameters
    if card.template is not None:
        shown["template"] = card.template
    shown["details"] = details(f)
    # The ollama client requires `model_info` (empty will do): the holders' own, and who they are.
    shown["model_info"] = {**(card.model_info or {}), "routeledger.holders": holders}
    if f.capabilities is not None:
        # What a UI offers tools or images by.
        shown["capabilities"] = f.capabilities
    if f.modified_at:
        shown["modified_at"] = f.modified_at
    return JSON(shown)


def _max_tokens(options: dict[str, Any] | None) -> int | None:
    value = (options or {}).get("num_predict")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _final(ans: Answer, result: Result, key: str) -> dict[str, Any]:
    empty: Any = {"role": "assistant", "content": ""} if key == "message" else ""
    return {
        "model": ans.model,
        "created_at": rfc3339(),
        key: empty,
        **final_fields(result.done_reason, result.timings),
    }


async def _lines(ans: Answer, key: str) -> AsyncIterator[bytes]:
    async for item in ans.pieces():
        if isinstance(item, Result):
            yield encode(_final(ans, item, key)) + b"\n"
            continue
        piece: Any
        line: dict[str, Any] = {"model": ans.model, "created_at": rfc3339()}
        if isinstance(item, Thought):
            # Ollama's own spelling: the message's `thinking`; a completion's top-level `thinking`.
            if key == "message":
                piece = {"role": "assistant", "content": "", "thinking": item.text}
            else:
                piece, line["thinking"] = "", item.text
        elif isinstance(item, list):
            piece = {"role": "assistant", "content": "", "tool_calls": ollama_calls(item)}
        else:
            piece = {"role": "assistant", "content": item} if key == "message" else item
        yield encode({**line, key: piece, "done": False}) + b"\n"


def _error_line(exc: ApiError) -> bytes:
    return render(exc, OLLAMA) + b"\n"


async def _respond(ans: Answer, streaming: bool, key: str) -> Response:
    if streaming:
        return stream(ans, _lines(ans, key), media_type=NDJSON, error_line=_error_line)
    result = await ans.whole()
    body = _final(ans, result, key)
    if key == "message":
        body[key] = {"role": "assistant", "content": result.text}
        if result.thinking:
            body[key]["thinking"] = result.thinking
        if result.tool_calls:
            body[key]["tool_calls"] = ollama_calls(result.tool_calls)
    else:
        body[key] = result.text
        if result.thinking:
            body["thinking"] = result.thinking
    return JSON(body, headers=ans.headers(result))


async def _loaded(request: Request, model: str, key: str) -> JSON:
    """What Ollama answers when there is nothing to say: it loads the model and is done."""
    if model != PIPELINE_MODEL:
        gw = gateway(request)
        await gw.retrying(lambda: gw.resolve(model))
    empty: Any = {"role": "assistant", "content": ""} if key == "message" else ""
    return JSON({"model": model, "created_at": rfc3339(), key: empty, "done": True, "done_reason": "load"})


@router.post("/api/chat", responses={**streamed(NDJSON), **documented(OLLAMA, *SUBMITS)})
async def chat(body: OllamaChat, request: Request) -> Response:
    messages = [m.to_message() for m in body.messages or []]
    check_messages(request, len(messages))
    if not messages:
        return await _loaded(request, body.model, "message")
    tools = check_tools(body.tools)
    if body.model == PIPELINE_MODEL:
        if tools is not None:
            raise BadRequestError(f'"{PIPELINE_MODEL}" does not support tools', param="tools")
        refuse_unsupported(messages, format=body.format, think=body.think)
        ans = pipeline_answer(request, messages, _max_tokens(body.options))
    else:
        req = TaskMessage(
            model=body.model,
            messages=messages,
            options=body.options or {},
            max_tokens=_max_tokens(body.options),
            format=body.format,
            client=request.headers.get("user-agent"),
            stream=body.stream is not False,
            paced=body.stream is not False,
            tools=tools,
            think=body.think,
        )
        ans = task_answer(request, await submit(request, req))
    return await _respond(ans, body.stream is not False, "message")


@router.post("/api/generate", responses={**streamed(NDJSON), **documented(OLLAMA, *SUBMITS)})
async def generate(body: OllamaGenerate, request: Request) -> Response:
    if not body.prompt:
        return await _loaded(request, body.model, "response")
    req = TaskMessage(
        model=body.model,
        kind="generate",
        prompt=body.prompt,
        system=body.system,
        options=body.options or {},
        max_tokens=_max_tokens(body.options),
        format=body.format,
        client=request.headers.get("user-agent"),
        stream=body.stream is not False,
        paced=body.stream is not False,
        images=body.images or None,
        think=body.think,
    )
    return await _respond(
        task_answer(request, await submit(request, req)), body.stream is not False, "response"
    )
