"""Models onto machines: Ollama's /api/pull and /api/delete, over the fleet.

The story's fix was to copy the model onto the fast machine. `ollama pull M` pointed at routeledger
pulls M onto every live Ollama worker that lacks it (or, with `"worker": NAME` in the body, an
extension, onto that machine alone): each worker asks its own server (dispatch.control), and the
answer streams Ollama's progress lines as they come, each with `worker` naming its machine, then
`{"status": "success"}` once every machine has it. A machine that failed says why in a line of its
own, and the stream ends with one `{"error": …}` naming them. `ollama rm M` deletes it from every
live Ollama worker that holds it (or from the one named). An OpenAI-compatible server cannot pull:
its worker answers so, in its own words. What each machine then holds reaches the router with its
worker's next lease (at once), and the ledger as WorkerChanged.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any, Final, Literal

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from api.auth import API_KEY
from api.common import JSON, encode, gateway
from api.errors import (
    OLLAMA,
    ApiError,
    BadRequestError,
    ForbiddenError,
    GenerationError,
    NotFoundError,
    WaitTimeoutError,
    documented,
    streamed,
)
from api.relay import RelayResponse
from api.schemas import OllamaDelete, OllamaPull
from dispatch.control import ControlRequest, ControlTimeoutError, Failure, Op, Progress, follow, new_id, send
from dispatch.gateway import Gateway
from dispatch.serving import names_model
from events.cancellation import cancel_and_wait
from tasks.lease import LeaseInfo
from tasks.quota import ApiKey

router = APIRouter(tags=["ollama"])

NDJSON: Final = "application/x-ndjson"
# The kind of backend whose server can pull and delete (workers.backend.Pulling).
PULLING_KIND: Final = "ollama"
# What the routes answer besides 200, as the OpenAPI document lists it.
_ANSWERS: Final = (400, 404, 422, 502, 503, 504)


class Outcome(msgspec.Struct, frozen=True):
    """How one machine's part ended: no error when it succeeded, else its error and failure kind."""

    worker: str
    error: str | None = None
    failure: Failure | Literal["timeout"] | None = None


def _may_manage(request: Request) -> None:
    """Pulling and deleting change every user's fleet: a key of the operator's only (a plain
    `api_keys` key, or a `[[keys]]` table with `manage_models = true`); anyone where no key is
    configured (loopback, the default)."""
    key: ApiKey | None = request.scope.get(API_KEY)
    if key is not None and not key.manage_models:
        raise ForbiddenError(
            f"API key {key.name!r} may not pull or delete models: they change the fleet for everyone",
            hint="use an operator's key (a plain api_keys one), or set manage_models = true in its "
            "[[keys]] table",
        )


@router.post("/api/pull", responses={**streamed(NDJSON), **documented(OLLAMA, *_ANSWERS)})
async def pull(body: OllamaPull, request: Request) -> Response:
    """Pull a model onto the machines that lack it (or the one named), streaming Ollama's progress."""
    _may_manage(request)
    model = _model(body.model or body.name)
    if body.insecure:
        # Every machine would fetch over plain HTTP from whatever host the name names (its LAN too).
        raise BadRequestError(
            "insecure pulls are refused here: each machine would fetch the model over plain HTTP",
            param="insecure",
            hint="pull it on that machine itself (ollama pull --insecure), or from a registry with TLS",
        )
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    named = body.worker
    targets = [_live(named, leases).worker] if named is not None else pull_targets(leases, model)
    started = await _start(gw, "pull", model, targets, insecure=body.insecure)
    if body.stream is False:
        outcomes = [o async for o in _outcomes(gw, started)]
        _raise_failed(model, "pull", outcomes)
        return JSON({"status": "success"})
    return RelayResponse(_pull_lines(gw, model, started), media_type=NDJSON)


@router.delete(
    "/api/delete",
    response_class=Response,
    responses={200: {"description": "deleted: no body, as Ollama answers"}, **documented(OLLAMA, *_ANSWERS)},
)
async def delete(body: OllamaDelete, request: Request) -> Response:
    """Delete a model from the machines that hold it (or the one named); 404 when none does."""
    _may_manage(request)
    model = _model(body.model or body.name)
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    if body.worker is not None:
        targets = [_live(body.worker, leases).worker]
    else:
        targets = [w for w in _pulling(leases, "delete") if _holds(leases[w], model)]
        if not targets:
            raise NotFoundError(
                f"model {model!r} not found on any live Ollama worker",
                hint="see /api/tags for the models the fleet holds",
                param="model",
            )
    started = await _start(gw, "delete", model, targets)
    outcomes = [o async for o in _outcomes(gw, started)]
    _raise_failed(model, "delete", outcomes)
    return Response(status_code=200)


def _model(name: str | None) -> str:
    if not name or not name.strip():
        raise BadRequestError("model is required", param="model", hint='send {"model": "NAME"}')
    return name.strip()


def _live(worker: str, leases: dict[str, LeaseInfo]) -> LeaseInfo:
    info = leases.get(worker)
    if info is None:
        raise NotFoundError(
            f"no live worker is named {worker!r}; live: {', '.join(sorted(leases)) or 'none'}",
            param="worker",
            hint="name a machine the fleet lists (routeledger status), or leave worker out",
        )
    return info


def _pulling(leases: dict[str, LeaseInfo], op: Op) -> list[str]:
    """The live workers whose server can pull and delete, by name; 400 when there is none."""
    found = sorted(w for w, info in leases.items() if info.backend_kind == PULLING_KIND)
    if not found:
        kinds = ", ".join(
            f"{w} ({i.backend_kind or 'no kind reported: an older worker?'})"
            for w, i in sorted(leases.items())
        )
        raise BadRequestError(
            f"no live worker's server can {op} models: "
            + (f"the live ones run {kinds}" if leases else "no worker is live"),
            hint="put the model where each server loads models from and restart it",
            param="model",
        )
    return found


def pull_targets(leases: dict[str, LeaseInfo], model: str) -> list[str]:
    """The live Ollama workers a pull naming no worker goes to: those that lack the model and would
    serve it once they hold it. A worker that drains, or serves a list of models without this one
    (a retired server serves none), would hold it for nothing."""
    return [
        w
        for w in _pulling(leases, "pull")
        if not _holds(leases[w], model) and not leases[w].draining and _would_serve(leases[w], model)
    ]


def _would_serve(info: LeaseInfo, model: str) -> bool:
    if info.serves_named is None:
        return True
    bare = model.removesuffix(":latest")
    return any(name.removesuffix(":latest") == bare for name in info.serves_named)


def _holds(info: LeaseInfo, model: str) -> bool:
    return any(names_model(entry, model) for entry in info.inventory)


async def _start(
    gw: Gateway, op: Op, model: str, targets: list[str], *, insecure: bool = False
) -> dict[str, str]:
    """Ask each target; worker -> the request's id."""
    started: dict[str, str] = {}
    for worker in targets:
        request = ControlRequest(op=op, id=new_id(), model=model, insecure=insecure)
        await gw.retrying(functools.partial(send, gw.redis, gw.keys, worker, request))
        started[worker] = request.id
    return started


async def _merged(gw: Gateway, started: dict[str, str]) -> AsyncIterator[tuple[str, Progress | Outcome]]:
    """Every machine's progress as it comes, and then its Outcome, in one stream."""
    queue: asyncio.Queue[tuple[str, Progress | Outcome]] = asyncio.Queue()

    async def one(worker: str, request_id: str) -> None:
        try:
            async for progress in follow(gw.redis, gw.keys, worker, request_id):
                if progress.end:
                    await queue.put((worker, Outcome(worker, progress.error, progress.failure)))
                    return
                await queue.put((worker, progress))
            await queue.put((worker, Outcome(worker, "its progress ended without an end", "backend")))
        except ControlTimeoutError as exc:
            await queue.put((worker, Outcome(worker, exc.message, "timeout")))
        except Exception as exc:
            await queue.put((worker, Outcome(worker, f"{type(exc).__name__}: {exc}", "backend")))

    tasks = [asyncio.create_task(one(w, i)) for w, i in started.items()]
    try:
        for _ in range(len(tasks)):
            while True:
                worker, item = await queue.get()
                yield worker, item
                if isinstance(item, Outcome):
                    break
    finally:
        await cancel_and_wait(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)


async def _outcomes(gw: Gateway, started: dict[str, str]) -> AsyncIterator[Outcome]:
    async for _, item in _merged(gw, started):
        if isinstance(item, Outcome):
            yield item


async def _pull_lines(gw: Gateway, model: str, started: dict[str, str]) -> AsyncIterator[bytes]:
    if not started:
        yield encode({"status": f"every live Ollama worker holds {model}"}) + b"\n"
    outcomes: list[Outcome] = []
    async for worker, item in _merged(gw, started):
        if isinstance(item, Progress):
            if item.line is not None:
                yield encode({**item.line, "worker": worker}) + b"\n"
            continue
        outcomes.append(item)
        if item.error is not None:
            yield encode({"status": f"failed on {worker}: {item.error}", "worker": worker}) + b"\n"
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        yield encode({"error": _failure_text(model, "pull", failed)}) + b"\n"
    else:
        yield encode({"status": "success"}) + b"\n"


def _failure_text(model: str, op: Op, failed: list[Outcome]) -> str:
    return f"could not {op} {model} on " + "; ".join(f"{o.worker}: {o.error}" for o in failed)


# The error a machine's failure answers with when the request waited for the whole outcome.
_FAILURES: Final[dict[str | None, type[ApiError]]] = {
    "unsupported": BadRequestError,
    "refused": BadRequestError,
    "not_found": NotFoundError,
    "timeout": WaitTimeoutError,
    "expired": WaitTimeoutError,
}


def _raise_failed(model: str, op: Op, outcomes: list[Outcome]) -> None:
    failed = [o for o in outcomes if o.error is not None]
    if not failed:
        return
    kind = _FAILURES.get(failed[0].failure, GenerationError)
    extra: dict[str, Any] = {"failed": {o.worker: o.error for o in failed}}
    raise kind(_failure_text(model, op, failed), param="model", extra=extra)
