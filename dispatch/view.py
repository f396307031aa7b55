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
from typing import Any, Generic, TypeVar

import msgspec
import redis.asyncio as aioredis

from dispatch.lease import LeaseInfo, live_workers
from dispatch.payload import F_TASK, decode_task
from dispatch.serving import served, served_models
from events.codec import as_str
from events.event import now_ms
from events.keys import WORKERS_GROUP, Keys
from projections.errors import ProjectionError
from projections.reader import snapshot
from projections.snapshot import Snapshot
from router.estimate import Estimator, build_estimator
from router.plan import BacklogEntry, FleetView, RunningTask, WorkerView, arrival_rate

log = logging.getLogger("routeledger.view")
T = TypeVar("T")

# The plan looks this far down each queue; tasks behind it cannot change who takes the head.
BACKLOG_DEPTH = 64

# One queue's entries after its group's last-delivered id (the ones no worker has read), at most
# ARGV[2] of them. KEYS[1] the queue (one key: the script runs on a cluster); ARGV[1] the group.
# A missing queue or group reads from the start; a key that is not a stream gives no entries.
_BACKLOG = """
local start = '-'
local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
if type(groups) == 'table' and groups.err == nil then
  for _, g in ipairs(groups) do
    local name, last = nil, nil
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then last = g[j + 1] end
    end
    if name == ARGV[1] and last ~= nil and last ~= '0-0' then start = '(' .. last end
  end
end
local rows = redis.pcall('XRANGE', KEYS[1], start, '+', 'COUNT', ARGV[2])
if type(rows) ~= 'table' or rows.err ~= nil then rows = {} end
return rows
"""


def worker_views(leases: dict[str, LeaseInfo]) -> list[WorkerView]:
    """Live, non-draining workers in the order they came online."""
    return [
        WorkerView(
            name=info.worker,
            slots=info.slots,
            holds={m.digest for m in served(info)},
            loaded=set(info.loaded),
            running=[
                RunningTask(
                    task_id=r.task_id,
                    digest=r.digest,
                    started_at_ms=r.started_at,
                    domain=r.domain,
                    prompt_tokens=r.prompt_tokens,
                    max_tokens=r.max_tokens,
                )
                for r in info.running
            ],
        )
        for info in sorted(leases.values(), key=lambda i: (i.since, i.worker))
        if not info.draining
    ]


def fleet_view(
    leases: dict[str, LeaseInfo],
    backlog: dict[str, list[BacklogEntry]],
    snapshot: Snapshot,
    now_ms: int,
) -> FleetView:
    """The FleetView a decision reads: live workers from their leases, the given backlogs, and each
    backlog's arrival rate from the snapshot's demand table (the one way production builds it)."""
    rates = {d: arrival_rate(snapshot, d, now_ms, snapshot.demand_half_life_s) for d in backlog}
    return FleetView(workers=worker_views(leases), backlog=backlog, arrival_rate=rates)


class Cached(Generic[T]):
    """A value refreshed at most every `ttl_s`, with one refresh in flight at a time."""

    def __init__(self, load: Callable[[], Awaitable[T]], ttl_s: float) -> None:
        self._load = load
        self._ttl_s = ttl_s
        self._value: T | None = None
        self._at = 0.0
        self._lock = asyncio.Lock()

    async def get(self, fresh: bool = False) -> T:
        if not fresh and self._value is not None and time.monotonic() - self._at < self._ttl_s:
            return self._value
        async with self._lock:
            if not fresh and self._value is not None and time.monotonic() - self._at < self._ttl_s:
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
        snapshot_every_s: float = 1.0,
        leases_every_s: float = 0.0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self._leases = Cached(self._load_leases, leases_every_s)
        self._evidence = Cached(self._load_evidence, snapshot_every_s)
        self._backlog = redis.register_script(_BACKLOG)

    async def _load_leases(self) -> dict[str, LeaseInfo]:
        return await live_workers(self.redis, self.keys)

    async def _load_evidence(self) -> Evidence:
        now = now_ms()
        try:
            snap = await snapshot(self.redis, self.keys, now_ms=now)
            error = None
        except ProjectionError as exc:
            # Route on priors rather than refuse: the projection is evidence, not a precondition.
            log.warning("projection unreadable, routing on priors: %s", exc)
            snap, error = Snapshot(taken_at=now), str(exc)
        return Evidence(snapshot=snap, estimator=build_estimator(snap, now), error=error)

    async def leases(self, fresh: bool = False) -> dict[str, LeaseInfo]:
        """Live workers' leases (cached for `leases_every_s`)."""
        return await self._leases.get(fresh)

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
        """Each model's unread queue entries, head first (one script per queue, run side by side)."""
        wanted = sorted(set(digests))
        rows: list[Any] = await asyncio.gather(
            *(self._backlog(keys=[self.keys.queue(d)], args=[WORKERS_GROUP, BACKLOG_DEPTH]) for d in wanted)
        )
        return {digest: _entries(digest, r) for digest, r in zip(wanted, rows, strict=True)}

    async def fleet(
        self, digests: Iterable[str] | None = None, leases: dict[str, LeaseInfo] | None = None
    ) -> tuple[FleetView, Estimator, int, dict[str, LeaseInfo]]:
        """The FleetView for `digests` (every served model when None), the estimator, now, the leases."""
        snap, est = await self.estimates()
        now = now_ms()
        live = leases if leases is not None else await self.leases()
        wanted = set(digests) if digests is not None else set(served_models(live).values())
        backlog = await self.backlogs(wanted)
        return fleet_view(live, backlog, snap, now), est, now, live


def _entries(digest: str, rows: list[Any]) -> list[BacklogEntry]:
    out: list[BacklogEntry] = []
    for raw_id, flat in rows:
        fields = flat if isinstance(flat, dict) else dict(zip(flat[::2], flat[1::2], strict=False))
        try:
            task = decode_task(fields[F_TASK])
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
            continue  # a malformed entry is the worker's to dead-letter, not the plan's
        out.append(
            BacklogEntry(
                task_id=task.task_id,
                digest=digest,
                enqueued_at_ms=int(as_str(raw_id).split("-")[0]),
                domain=task.domain,
                prompt_tokens=task.prompt_tokens,
                max_tokens=task.max_tokens,
            )
        )
    return out
