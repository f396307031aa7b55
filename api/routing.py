"""What the fleet looks like to the API: live models and their holders, and the router's view of it.

The live leases are the source of truth for "who serves what now" (a projection may lag); the
projection tables are the evidence the estimates use. Both are read through a short cache,
because every request needs them and they change on the scale of heartbeats, not requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import msgspec
import redis.asyncio as aioredis

from events.event import ModelEntry, now_ms
from events.keys import Keys
from events.lease import LeaseInfo, live_workers
from projections.errors import ProjectionError
from projections.reader import snapshot as read_snapshot
from projections.snapshot import Snapshot
from router.estimate import Estimator, build_estimator
from router.plan import BacklogEntry, FleetView, arrival_rate
from workers.view import worker_views

log = logging.getLogger("routeledger.api")

T = TypeVar("T")


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


class ModelInfo(msgspec.Struct, kw_only=True):
    """One model name the live fleet serves, with its identity and who serves it."""

    name: str
    entry: ModelEntry
    holders: list[str]
    slots: int
    loaded_on: list[str]


def catalog(leases: dict[str, LeaseInfo]) -> list[ModelInfo]:
    """Every model name (and alias) a live, non-draining worker serves, with its live slots."""
    by_name: dict[str, ModelInfo] = {}
    for info in sorted(leases.values(), key=lambda i: i.worker):
        if info.draining:
            continue
        for entry in info.serving():
            m = by_name.get(entry.name)
            if m is None:
                m = by_name[entry.name] = ModelInfo(
                    name=entry.name, entry=entry, holders=[], slots=0, loaded_on=[]
                )
            if entry.digest != m.entry.digest:
                continue  # one name with two digests: the first holder's identity wins, as find_holders does
            m.holders.append(info.worker)
            m.slots += info.slots
            if entry.digest in info.loaded:
                m.loaded_on.append(info.worker)
    return [by_name[k] for k in sorted(by_name)]


def fleet_view(
    leases: dict[str, LeaseInfo], snap: Snapshot, now: int, backlog: dict[str, list[BacklogEntry]]
) -> FleetView:
    """The router's view: live workers with what each slot runs (workers.view), backlog, arrival rates."""
    workers = worker_views(leases)
    digests = set(backlog) | {d for w in workers for d in w.holds}
    return FleetView(
        workers=workers,
        backlog=backlog,
        arrival_rate={d: arrival_rate(snap, d, now, snap.demand_half_life_s) for d in digests},
    )


class Evidence(msgspec.Struct, kw_only=True):
    """A projection snapshot and the estimator built from it."""

    snapshot: Snapshot
    estimator: Estimator
    error: str | None = None


class FleetState:
    """The cached live leases and projection evidence of one API process."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, lease_ttl_s: float = 0.5, evidence_ttl_s: float = 2.0
    ) -> None:
        self.redis = redis
        self.keys = keys
        self._leases = Cached(self._load_leases, lease_ttl_s)
        self._evidence = Cached(self._load_evidence, evidence_ttl_s)

    async def _load_leases(self) -> dict[str, LeaseInfo]:
        return await live_workers(self.redis, self.keys)

    async def _load_evidence(self) -> Evidence:
        now = now_ms()
        try:
            snap = await read_snapshot(self.redis, self.keys, now_ms=now)
            error = None
        except ProjectionError as exc:
            log.warning("projection unreadable, routing on priors: %s", exc)
            snap, error = Snapshot(taken_at=now), str(exc)
        return Evidence(snapshot=snap, estimator=build_estimator(snap, now), error=error)

    async def leases(self, fresh: bool = False) -> dict[str, LeaseInfo]:
        return await self._leases.get(fresh)

    async def evidence(self, fresh: bool = False) -> Evidence:
        return await self._evidence.get(fresh)
