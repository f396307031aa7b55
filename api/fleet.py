"""The fleet and routing surface: who is there, what it can serve, the statistics, the preview."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Query, Request

from api.common import JSON, gateway, options_policy
from api.errors import NATIVE, READS, BadRequestError, answer, documented, model_not_found
from api.schemas import MAX_TOKENS, BenchCreate
from dispatch.benchmark import on_demand, request_benchmark
from dispatch.errors import ModelNotServedError
from dispatch.overview import clock_fields
from dispatch.serving import catalog, embedding_only, holdings, served
from dispatch.submit import preview_request
from dispatch.view import LiveView
from projections.benchset import BenchPrompt, SpeedPrompt, domains, pick_speed
from projections.snapshot import Stamped, Stat
from router.choose import RouteQuery
from router.errors import RouterError
from tasks.errors import TaskError
from tasks.lease import resources_of

router = APIRouter(tags=["fleet"])


def _stamped(s: Stamped, now: int) -> dict[str, Any]:
    return {"value": s.value, "at": s.at, "age_s": None if s.at is None else max(0.0, (now - s.at) / 1000)}


@router.get("/v1/fleet", responses=documented(NATIVE, *READS))
async def read_fleet(request: Request) -> JSON:
    """Every known worker (live leases and the fleet table), and live slots per model.

    Times and ages are on the ledger's clock (a lease's are read through the offset its worker
    measured). `clock_skew_s`: the worker's clock minus the ledger's, the median of its recent
    claims and completions; `clock_skewed`: past 5 s (null: no such event seen yet)."""
    gw = gateway(request)
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    evidence = await gw.retrying(lambda: gw.fleet.evidence(fresh=True))
    rows = evidence.snapshot.fleet
    # Ages on the ledger's clock; a lease's times (the worker's clock) are read on it too.
    now = await gw.fleet.clock.now_ms()
    workers: list[dict[str, Any]] = []
    for name in sorted(set(leases) | set(rows)):
        info = leases.get(name)
        row = rows.get(name)
        # A live worker's machine figures and last sign of life are its lease's; the ledger's
        # (the projected row) only speak for a worker that is gone.
        resources: dict[str, Any] | None
        if info is not None:
            status = "draining" if info.draining else "online"
            since: int | None = info.on_ledger(info.since)
            renewed = info.on_ledger(info.renewed_at)
            resources = {
                "value": resources_of(info),
                "at": renewed,
                "age_s": max(0.0, (now - renewed) / 1000),
            }
            seen: int | None = renewed
        else:
            status = row.status if row is not None and row.status != "online" else "offline"
            since = row.status_since if row is not None else None
            resources = _stamped(row.resources, now) if row is not None else None
            seen = row.last_heartbeat if row is not None else None
        workers.append(
            {
                "id": name,
                "status": status,
                "since": since,
                "lease_age_s": None if seen is None or info is None else max(0.0, (now - seen) / 1000),
                "slots": info.slots if info is not None else (row.slots.value if row is not None else None),
                "in_flight": info.in_flight
                if info is not None
                else (len(row.in_flight) if row is not None else None),
                "models": [m.name for m in served(info)] if info is not None else [],
                "held": [m.name for m in info.inventory] if info is not None else [],
                "loaded": list(info.loaded) if info is not None else [],
                "resources": resources,
                "last_heartbeat": seen,
                "seen_from": "lease" if info is not None else "ledger" if row is not None else None,
                **clock_fields(row),
            }
        )
    capacity = {m.name: m.slots for m in catalog(leases)}
    return JSON({"workers": workers, "capacity": capacity, "projection": evidence.error or "ok"})


def _stat(s: Stat, now: int) -> dict[str, Any]:
    return {"n": s.n, "mean": s.mean, "decayed_mean": s.decayed_mean, "age_s": s.age_s(now)}


@router.get("/v1/stats", responses=documented(NATIVE, *READS))
async def stats(request: Request) -> JSON:
    """The projection tables with sample counts and ages (what the router's estimates start from),
    and each API key's use against its limits."""
    gw = gateway(request)
    evidence = await gw.retrying(lambda: gw.fleet.evidence(fresh=True))
    usage = await gw.retrying(lambda: gw.quotas.usage(request.app.state.api_keys))
    snap = evidence.snapshot
    now = await gw.fleet.clock.now_ms()
    return JSON(
        {
            "checkpoint": snap.checkpoint,
            # Each API key's use (by name, never the key): requests, tokens, open tasks, refusals.
            "keys": [u.to_dict() for u in usage],
            "half_life_s": snap.half_life_s,
            "speed": [
                {
                    "worker": r.worker,
                    "digest": r.digest,
                    **{
                        f: _stat(getattr(r, f), now)
                        for f in ("decode_tps", "prompt_tps", "load_s", "ttft_s", "embed_tps")
                    },
                    "decode_counted_from_stream": r.counted_n,
                }
                for r in snap.speed.values()
            ],
            "length": [
                {"digest": r.digest, "domain": r.domain, "output_tokens": _stat(r.output_tokens, now)}
                for r in snap.length.values()
            ],
            "quality": [
                {"digest": r.digest, "domain": r.domain, "score": _stat(r.score, now)}
                for r in snap.quality.values()
            ],
            "demand": [
                {"digest": r.digest, "arrivals": _stat(r.arrivals, now)} for r in snap.demand.values()
            ],
            "projection": evidence.error or "ok",
        }
    )


@router.get("/v1/route/preview", responses=documented(NATIVE, 400, 404, 422, *READS))
async def route_preview(
    request: Request,
    model: str = Query(description="a model name, alias, digest prefix, or 'auto'"),
    domain: str = Query("general"),
    tokens: int | None = Query(None, ge=1, le=MAX_TOKENS, description="the request's max tokens"),
) -> JSON:
    """What the router would do with such a request now: candidates with every term, and the plan.

    The same function as `routeledger route preview --json` (dispatch.submit.preview_request).
    """
    try:
        options_policy(request).check_domain(domain)
    except TaskError as exc:
        raise answer(exc) from None
    gw = gateway(request)
    view = LiveView(gw.redis, gw.keys)
    query = RouteQuery(model=model, domain=domain, max_tokens=tokens)
    try:
        out = await gw.retrying(lambda: preview_request(view, query))
    except (ModelNotServedError, RouterError):
        leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
        raise model_not_found(model, leases) from None
    return JSON(msgspec.to_builtins(out))


@router.post("/v1/bench", status_code=202, responses=documented(NATIVE, 400, 404, 422, *READS))
async def bench(request: Request, body: BenchCreate) -> JSON:
    """Benchmark every live holder of the model (every served model when none is named): `count`
    speed prompts and `count` of the domain's graded prompts go to each holder's background
    stream, never only to the current winner (an embedding model: `count` batches to embed)."""
    gw = gateway(request)
    domain = body.domain or "general"
    if domain not in domains():
        raise BadRequestError(
            f"no shipped benchmark prompts for domain {domain!r}",
            param="domain",
            hint=f"use one of {domains()}",
        )
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
    targets = [t for t in holdings(leases, body.model) if body.worker is None or t[0] == body.worker]
    if not targets:
        raise model_not_found(body.model or "any model", leases)
    count = body.count or 3
    evidence = await gw.retrying(lambda: gw.fleet.evidence(fresh=True))
    # An embedding model is benchmarked with embeddings (a sample of its embedding rate).
    embedders = embedding_only(leases)
    sent = []
    for worker, local, digest in targets:
        embed = digest in embedders
        # Speed prompts (answers long enough to measure), then the graded prompts the model has not
        # been graded on first: each answer is then a new grade too.
        prompts: list[BenchPrompt | SpeedPrompt] | None = (
            None if embed else [*pick_speed(count), *on_demand(evidence.snapshot, digest, domain, count)]
        )

        async def send(
            w: str = worker,
            n: str = local,
            d: str = digest,
            ps: list[BenchPrompt | SpeedPrompt] | None = prompts,
            e: bool = embed,
        ) -> str:
            return await request_benchmark(
                gw.queues, worker=w, model=n, digest=d, domain=domain, count=count, prompts=ps, embed=e
            )

        bench_id = await gw.retrying(send)
        sent.append(
            {
                "bench_id": bench_id,
                "worker": worker,
                "model": local,
                "digest": digest,
                "prompts": count if embed else 2 * count,
            }
        )
    return JSON({"domain": domain, "benchmarks": sent}, status_code=202)
