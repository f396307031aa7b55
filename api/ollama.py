"""The Ollama-compatible surface, so that Open WebUI's Ollama connection and the `ollama` CLI work.

Like Ollama, /api/chat and /api/generate stream NDJSON unless `"stream": false`: one object per
piece with `"done": false`, then a final one with `"done": true`, `done_reason` and the backend's
own counts and durations (nanoseconds). A failure mid-stream is one `{"error": "..."}` line.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Final

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response

from api.common import JSON, check_messages, encode, gateway, mark, stream, task_headers
from api.errors import OLLAMA, ApiError, BadRequestError, GenerationError, render
from api.gateway import Gateway, model_not_found
from api.pipelines import PIPELINE_MODEL, ollama_chat
from api.schemas import OllamaChat, OllamaGenerate, OllamaShow
from dispatch.lease import LeaseInfo
from dispatch.payload import Result
from dispatch.serving import ModelInfo, catalog
from dispatch.submit import Submitted, TaskRequest

router = APIRouter(tags=["ollama"])

# The Ollama API version this surface follows (clients check it is recent enough).
VERSION: Final = "0.12.3"
NDJSON: Final = "application/x-ndjson"


def rfc3339(epoch_s: float | None = None) -> str:
    t = time.time() if epoch_s is None else epoch_s
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f"{t % 1:.6f}"[1:] + "Z"


def _details(m: ModelInfo) -> dict[str, Any]:
    e = m.entry
    return {
        "parent_model": "",
        "format": "gguf",
        "family": e.family or "",
        "families": [e.family] if e.family else None,
        "parameter_size": e.parameter_size or "",
        "quantization_level": e.quantization or "",
    }


def _since(leases: dict[str, LeaseInfo], m: ModelInfo) -> float:
    return min((leases[w].since for w in m.holders if w in leases), default=0) / 1000


@router.get("/", include_in_schema=False)
async def root() -> PlainTextResponse:
    # The ollama CLI and some UIs probe the root for this exact text. Browsers (Accept: text/html)
    # never get here: dashboard.Shell sends them to the dashboard first.
    return PlainTextResponse("Ollama is running")


@router.get("/api/version")
async def version() -> JSON:
    return JSON({"version": VERSION})


@router.get("/api/tags")
async def tags(request: Request) -> JSON:
    """Every model the live fleet serves, as Ollama lists what it holds."""
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    models = [
        {
            "name": m.name,
            "model": m.name,
            "modified_at": rfc3339(_since(leases, m)),
            "size": m.entry.size or 0,
            "digest": m.entry.digest,
            "details": _details(m),
        }
        for m in catalog(leases)
    ]
    if models:
        # Open WebUI's Ollama connection lists models from here, so the pipeline must be among them.
        models.append(
            {
                "name": PIPELINE_MODEL,
                "model": PIPELINE_MODEL,
                "modified_at": rfc3339(),
                "size": 0,
                "digest": "",
                "details": {"parent_model": "", "format": "", "family": "routeledger-pipeline"},
            }
        )
    return JSON({"models": models})


@router.get("/api/ps")
async def ps(request: Request) -> JSON:
    """Models loaded on at least one live worker."""
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    models = [
        {
            "name": m.name,
            "model": m.name,
            "size": m.entry.size or 0,
            "digest": m.entry.digest,
            "details": _details(m),
            "expires_at": rfc3339(time.time() + 300),
            "size_vram": 0,
            "workers": m.loaded_on,
        }
        for m in catalog(leases)
        if m.loaded_on
    ]
    return JSON({"models": models})


@router.post("/api/show")
async def show(body: OllamaShow, request: Request) -> JSON:
    name = body.model or body.name
    if not name:
        raise BadRequestError("model is required", param="model")
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    for m in catalog(leases):
        if name in (m.name, m.name.removesuffix(":latest")):
            return JSON(
                {
                    "modelfile": f"# served by routeledger from {', '.join(m.holders)}\nFROM {m.name}\n",
                    "parameters": "",
                    "template": "{{ .Prompt }}",
                    "details": _details(m),
                    "model_info": {
                        "general.architecture": m.entry.family or "",
                        "routeledger.holders": m.holders,
                    },
                    "capabilities": ["completion"],
                    "modified_at": rfc3339(_since(leases, m)),
                }
            )
    raise model_not_found(name, leases)


def _max_tokens(options: dict[str, Any] | None) -> int | None:
    value = (options or {}).get("num_predict")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _final(sub: Submitted, result: Result, key: str) -> dict[str, Any]:
    t = result.timings
    out: dict[str, Any] = {"model": sub.task.model, "created_at": rfc3339()}
    out[key] = {"role": "assistant", "content": ""} if key == "message" else ""
    out.update(
        {
            "done": True,
            "done_reason": result.done_reason or "stop",
            "total_duration": t.total_duration,
            "load_duration": t.load_duration,
            "prompt_eval_count": t.prompt_eval_count,
            "prompt_eval_duration": t.prompt_eval_duration,
            "eval_count": t.eval_count,
            "eval_duration": t.eval_duration,
        }
    )
    return {k: v for k, v in out.items() if v is not None}


def _failed(result: Result) -> None:
    if result.status != "completed":
        raise GenerationError(f"task {result.task_id} {result.status}: {result.error or 'no answer'}")


async def _lines(gw: Gateway, sub: Submitted, key: str) -> AsyncIterator[bytes]:
    model = sub.task.model
    async for item in gw.relay(sub.task_id):
        if isinstance(item, str):
            piece: Any = {"role": "assistant", "content": item} if key == "message" else item
            yield encode({"model": model, "created_at": rfc3339(), key: piece, "done": False}) + b"\n"
        else:
            yield encode(_final(sub, item, key)) + b"\n"


def _error_line(exc: ApiError) -> bytes:
    return render(exc, OLLAMA) + b"\n"


async def _answer(request: Request, sub: Submitted, streaming: bool, key: str) -> Response:
    gw = gateway(request)
    if streaming:
        return stream(request, sub, _lines(gw, sub, key), media_type=NDJSON, error_line=_error_line)
    result = await gw.wait(sub.task_id)
    _failed(result)
    body = _final(sub, result, key)
    body[key] = {"role": "assistant", "content": result.text} if key == "message" else result.text
    return JSON(body, headers=task_headers(sub, result))


@router.post("/api/chat")
async def chat(body: OllamaChat, request: Request) -> Response:
    messages = body.messages or []
    check_messages(request, len(messages))
    if body.model == PIPELINE_MODEL:
        return await ollama_chat(body, request)
    gw = gateway(request)
    if not messages:
        # Ollama loads the model and answers at once when there is nothing to say.
        await gw.retrying(lambda: gw.resolve(body.model))
        return JSON(
            {
                "model": body.model,
                "created_at": rfc3339(),
                "message": {"role": "assistant", "content": ""},
                "done": True,
                "done_reason": "load",
            }
        )
    sub = await gw.submit(
        TaskRequest(
            model=body.model,
            messages=[m.to_message() for m in messages],
            options=body.options or {},
            max_tokens=_max_tokens(body.options),
            format=body.format,
            client=request.headers.get("user-agent"),
            stream=body.stream is not False,
        )
    )
    mark(request, sub)
    return await _answer(request, sub, body.stream is not False, "message")


@router.post("/api/generate")
async def generate(body: OllamaGenerate, request: Request) -> Response:
    gw = gateway(request)
    if not body.prompt:
        await gw.retrying(lambda: gw.resolve(body.model))
        return JSON(
            {
                "model": body.model,
                "created_at": rfc3339(),
                "response": "",
                "done": True,
                "done_reason": "load",
            }
        )
    sub = await gw.submit(
        TaskRequest(
            model=body.model,
            kind="generate",
            prompt=body.prompt,
            system=body.system,
            options=body.options or {},
            max_tokens=_max_tokens(body.options),
            format=body.format,
            client=request.headers.get("user-agent"),
            stream=body.stream is not False,
        )
    )
    mark(request, sub)
    return await _answer(request, sub, body.stream is not False, "response")
