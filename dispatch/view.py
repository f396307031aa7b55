"""The router's inputs, read from Redis: the projection snapshot plus the live facts it lacks.

`router/` is pure; this is where its FleetView is filled: live workers from their leases (slots,
what they serve, what is loaded, what each slot runs and since when), each queue's backlog
(entries no worker has read yet), arrival rates and estimates from the snapshot. The gate in every
worker, the preview command and the API all read the fleet through this one module.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

import msgspec
import redis.asyncio as aioredis

from dispatch.serving import embedding_only, resolve_models, served, served_models
from events.clock import LedgerClock
from events.codec import as_str
from events.keys import REQUEUED_CONSUMER, WORKERS_GROUP, Keys, band_order
from events.scripts import ScriptDef, read_lua
from projections.errors import ProjectionError
from projections.reader import snapshot
from projections.snapshot import Snapshot
from router.estimate import Estimator, build_estimator
from router.gate import BACKLOG_DEPTH, SNAPSHOT_EVERY_S
from router.plan import BacklogEntry, FleetView, RunningTask, WorkerView, arrival_rates
from router.prefix import PromptChain
from tasks.lease import LeaseInfo, live_workers
from tasks.payload import F_ID, F_TASK

log = logging.getLogger("routeledger.view")
T = TypeVar("T")

# The Lua this module runs (dispatch/lua/backlog.lua), headed by the KEYS and ARGV it takes: one
# model's waiting entries, head first, across its band queues.
_LUA: Final = Path(__file__).parent / "lua"
_BACKLOG: Final = read_lua(_LUA / "backlog.lua")
_BACKLOG_DEF: Final = ScriptDef("backlog", _BACKLOG, allow_oom=True)


def embedding_models(leases: dict[str, LeaseInfo], snap: Snapshot) -> frozenset[str]:
    """The digests the estimates cost as embedding models: those whose holders say they embed
    and do not complete (dispatch.serving.embedding_only), and those no holder says anything about
    (an OpenAI-compatible server reports no capabilities) that have only ever embedded: some
    worker measured their embedding rate and none a decode speed."""
    said = {
        entry.digest for info in leases.values() for entry in served(info) if entry.capabilities is not None
    }
    embedded: set[str] = set()
    decoded: set[str] = set()
    for row in snap.speed.values():
        if row.embed_tps.n:
            embedded.add(row.digest)
        if row.decode_tps.n:
            decoded.add(row.digest)
    return embedding_only(leases) | frozenset(embedded - decoded - said)


def worker_views(leases: dict[str, LeaseInfo]) -> list[WorkerView]:
    """Live, non-draining workers in the order they came online."""
    return [
        WorkerView(
            name=info.worker,
            slots=info.slots,
            holds={m.digest for m in served(info)},
            loaded=set(info.loaded),
            loaded_known=info.loaded_known,
            max_loaded=info.max_loaded,
            cache=info.cache,
            running=[
                RunningTask(
                    task_id=r.task_id,
                    digest=r.digest,
                    started_at_ms=info.on_ledger(r.started_at),
                    domain=r.domain,
                    prompt_tokens=r.prompt_tokens,
                    max_tokens=r.max_tokens,
                )
                for r in info.running
                if not r.answered and not r.background
            ],
        )
        for info in sorted(leases.values(), key=lambda i: (i.on_ledger(i.since), i.worker))
        if not info.draining
    ]


# `LiveView.resolve` keeps at most this many models' answers per read of the leases.
_RESOLVED_MAX: Final = 256


def with_own(views: list[WorkerView], own: LeaseInfo) -> list[WorkerView] | None:
    """`views` (from `worker_views`) with the worker `own` describes as it is now, in its place,
    and left out while it drains; None when it is not among them (then only `worker_views` knows
    its place)."""
    for i, w in enumerate(views):
        if w.name == own.worker:
            return views[:i] + worker_views({own.worker: own}) + views[i + 1 :]
    return None


def fleet_view(
    leases: dict[str, LeaseInfo],
    backlog: dict[str, list[BacklogEntry]],
    snapshot: Snapshot,
    now_ms: int,
    workers: list[WorkerView] | None = None,
) -> FleetView:
    """The FleetView a decision reads: live workers from their leases (`workers`: their views,
    already built), the given backlogs, and each backlog's arrival rate from the snapshot's demand
    table (the one way production builds it)."""
    return FleetView(
        workers=worker_views(leases) if workers is None else workers,
        backlog=backlog,
        arrival_rate=arrival_rates(snapshot, backlog, now_ms),
    )


class Cached(Generic[T]):
    """A value refreshed at most every `ttl_s`, with one refresh in flight at a time."""

    def __init__(self, load: Callable[[], Awaitable[T]], ttl_s: float) -> None:
        self._load = load
        self._ttl_s = ttl_s
        self._value: T | None = None
        self._at = 0.0
        self._lock = asyncio.Lock()

    def stale(self) -> bool:
        return self._value is None or time.monotonic() - self._at >= self._ttl_s

    async def get(self, fresh: bool = False, max_age_s: float | None = None) -> T:
        """The value, read again when older than `ttl_s` (or `max_age_s`, where given and shorter)."""
        ttl = self._ttl_s if max_age_s is None else min(self._ttl_s, max_age_s)
        if not fresh and self._value is not None and time.monotonic() - self._at < ttl:
            return self._value
        async with self._lock:
            if not fresh and self._value is not None and time.monotonic() - self._at < ttl:
                return self._value
            value = await self._load()
            self._value, self._at = value, time.monotonic()
            return value


class Evidence(msgspec.Struct, kw_only=True):
    """A projection snapshot and the estimator fitted to it; `error` when the tables were unreadable."""

    snapshot: Snapshot
    estimator: Estimator
    error: str | None = None


class LiveView:
    """Builds FleetViews from Redis. The leases and the evidence change on the scale of heartbeats
    and projector batches, not requests, so both are read through short caches; the estimator's
    fit, the costly part, is redone once per snapshot."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        snapshot_every_s: float = SNAPSHOT_EVERY_S,
        leases_every_s: float = 0.0,
    ) -> None:
        # Worker -> its lease's renewed_at when this process last handed it a task
        # (dispatch.submit): the next hand-off waits for a lease written after that one.
        self.handed_off: dict[str, int] = {}
        self.redis = redis
        self.keys = keys
        # Ages (of samples, of queued entries, of running tasks) are read on the ledger's clock.
        self.clock = LedgerClock(redis)
        self._leases = Cached(self._load_leases, leases_every_s)
        self._evidence = Cached(self._load_evidence, snapshot_every_s)
        self._backlog = _BACKLOG_DEF.bind(redis)
        # `worker_views` of the last leases read: the cached leases are one object until the next
        # read, and building 500 workers' views cost a millisecond per decision.
        self._views_of: dict[str, LeaseInfo] | None = None
        self._views: list[WorkerView] = []
        # `resolve_models` of the last leases read, per model asked for (as cheap to keep).
        self._resolved_of: dict[str, LeaseInfo] | None = None
        self._resolved: dict[str, dict[str, str] | None] = {}

    async def _load_leases(self) -> dict[str, LeaseInfo]:
        return await live_workers(self.redis, self.keys)

    def leases_stale(self) -> bool:
        """True when the next `leases()` reads Redis."""
        return self._leases.stale()

    def resolve(self, model: str, leases: dict[str, LeaseInfo]) -> dict[str, str] | None:
        """`resolve_models(model, leases)`, worked out once per model for each read of the leases
        (a pass over every worker's inventory: a millisecond at 500 workers). Callers only read it."""
        if leases is not self._resolved_of:
            self._resolved_of, self._resolved = leases, {}
        if model in self._resolved:
            return self._resolved[model]
        if len(self._resolved) >= _RESOLVED_MAX:
            self._resolved.clear()  # the names come from requests: any string at all
        found = self._resolved[model] = resolve_models(model, leases)
        return found

    async def _load_evidence(self) -> Evidence:
        now = await self.clock.now_ms()
        try:
            snap = await snapshot(self.redis, self.keys, now_ms=now)
            error = None
        except ProjectionError as exc:
            # Route on priors rather than refuse: the projection is evidence, not a precondition.
            log.warning("projection unreadable, routing on priors: %s", exc)
            snap, error = Snapshot(taken_at=now), str(exc)
        # Which models embed is read from the leases with the evidence: a digest's capabilities
        # never change, so only a model new to the fleet waits (one snapshot period) to be costed
        # as an embedding model.
        embedding = embedding_models(await self.leases(), snap)
        return Evidence(snapshot=snap, estimator=build_estimator(snap, now, embedding=embedding), error=error)

    async def leases(self, fresh: bool = False, max_age_s: float | None = None) -> dict[str, LeaseInfo]:
        """Live workers' leases (cached for `leases_every_s`, or `max_age_s` where shorter)."""
        return await self._leases.get(fresh, max_age_s)

    def worker_views(self, leases: dict[str, LeaseInfo]) -> list[WorkerView]:
        """`worker_views(leases)`, built once for each read of the leases. The list and its views
        are shared: the router never changes them."""
        if leases is not self._views_of:
            self._views, self._views_of = worker_views(leases), leases
        return self._views

    async def evidence(self, fresh: bool = False) -> Evidence:
        """The snapshot and its estimator (cached for `snapshot_every_s`)."""
        return await self._evidence.get(fresh)

    async def estimates(self) -> tuple[Snapshot, Estimator]:
        ev = await self.evidence()
        return ev.snapshot, ev.estimator

    async def backlog(self, digest: str) -> list[BacklogEntry]:
        """The entries of the model's queue that no worker has read yet, head first."""
        return (await self.backlogs([digest]))[digest]

    async def backlogs(self, digests: Iterable[str]) -> dict[str, list[BacklogEntry]]:
        """Each model's waiting queue entries, head first (one script per queue, run side by side)."""
        return (await self.backlogs_and_cursors(digests))[0]

    async def backlogs_and_cursors(
        self, digests: Iterable[str], depth: int = BACKLOG_DEPTH
    ) -> tuple[dict[str, list[BacklogEntry]], dict[str, str]]:
        """Each model's waiting queue entries (at most `depth`), head first, and each queue's cursor
        (the id of its last entry: an XREAD from it wakes on the next new one), keyed by queue name."""
        wanted = sorted(set(digests))
        plain = str(band_order(0, 0))
        reads = [
            self._backlog(
                keys=[self.keys.queue(d), self.keys.bands(d)],
                args=[WORKERS_GROUP, depth, REQUEUED_CONSUMER, plain],
            )
            for d in wanted
        ]
        # One model's read is awaited as it is: gather would wrap it in a task of its own, a turn of
        # the event loop later, for nothing to run beside it.
        replies: list[Any] = [await reads[0]] if len(reads) == 1 else await asyncio.gather(*reads)
        backlog: dict[str, list[BacklogEntry]] = {}
        cursors: dict[str, str] = {}
        for digest, (names, marks, found) in zip(wanted, replies, strict=True):
            entries: list[BacklogEntry] = []
            for raw, mark, rows in zip(names, marks, found, strict=True):
                queue = as_str(raw)
                cursors[queue] = as_str(mark)
                entries += _entries(digest, rows, queue)
            backlog[digest] = entries
        return backlog, cursors

    async def fleet(
        self, digests: Iterable[str] | None = None, leases: dict[str, LeaseInfo] | None = None
    ) -> tuple[FleetView, Estimator, int, dict[str, LeaseInfo]]:
        """The FleetView for `digests` (every served model when None), the estimator, now, the leases."""
        snap, est = await self.estimates()
        now = await self.clock.now_ms()
        live = leases if leases is not None else await self.leases()
        wanted = set(digests) if digests is not None else set(served_models(live).values())
        backlog = await self.backlogs(wanted)
        return fleet_view(live, backlog, snap, now, self.worker_views(live)), est, now, live


class _TaskSize(msgspec.Struct, kw_only=True):
    """What the plan reads of a queued task (tasks.payload.TaskMessage, its prompt skipped)."""

    task_id: str
    domain: str = "general"
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    prefix: PromptChain | None = None
    paced: bool = False


# The plan reads up to BACKLOG_DEPTH tasks per decision: decoding only these fields skips building
# every message of every queued prompt.
_size_decoder = msgspec.msgpack.Decoder(_TaskSize)


def _entries(digest: str, rows: list[Any], queue: str) -> list[BacklogEntry]:
    out: list[BacklogEntry] = []
    for raw_id, flat in rows:
        fields = flat if isinstance(flat, dict) else dict(zip(flat[::2], flat[1::2], strict=False))
        entry_id = as_str(raw_id)
        enqueued = int(entry_id.split("-")[0])
        try:
            task = _size_decoder.decode(fields[F_TASK])
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
            # A malformed entry stays in the backlog, as a small task: it is the head a worker must
            # take (and dead-letter), or no worker could ever take what lies behind it.
            ident = as_str(fields.get(F_ID, raw_id))
            out.append(
                BacklogEntry(
                    entry_id=entry_id, task_id=ident, digest=digest, enqueued_at_ms=enqueued, queue=queue
                )
            )
            continue
        out.append(
            BacklogEntry(
                entry_id=entry_id,
                task_id=task.task_id,
                digest=digest,
                enqueued_at_ms=enqueued,
                domain=task.domain,
                prompt_tokens=task.prompt_tokens,
                max_tokens=task.max_tokens,
                queue=queue,
                prefix=task.prefix,
                paced=task.paced,
            )
        )
    return out
