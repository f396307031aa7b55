"""The router's inputs, read from Redis: the projection snapshot plus the live facts it lacks.

`router/` is pure; this is where its FleetView is filled: live workers from their leases (slots,
what they serve, what is loaded, what each slot runs and since when), each queue's backlog
(entries no worker has read yet), arrival rates and estimates from the snapshot. The gate in every
worker, the preview command and the API all read the fleet through this one module.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgspec
import redis.asyncio as aioredis

from events.event import now_ms
from events.keys import WORKERS_GROUP, Keys
from events.lease import LeaseInfo, live_workers
from events.ledger import next_id
from events.task import F_TASK, decode_task
from projections.reader import snapshot
from projections.snapshot import Snapshot
from router.estimate import Estimator, build_estimator
from router.plan import BacklogEntry, FleetView, RunningTask, WorkerView, arrival_rate

# The plan looks this far down each queue; tasks behind it cannot change who takes the head.
BACKLOG_DEPTH = 64


def served_models(leases: dict[str, LeaseInfo]) -> dict[str, str]:
    """Every model name (and alias) live workers serve, with its digest."""
    out: dict[str, str] = {}
    for info in leases.values():
        for entry in info.serving():
            out.setdefault(entry.name, entry.digest)
    return out


def worker_views(leases: dict[str, LeaseInfo]) -> list[WorkerView]:
    """Live, non-draining workers in the order they came online."""
    return [
        WorkerView(
            name=info.worker,
            slots=info.slots,
            holds={m.digest for m in info.serving()},
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


class LiveView:
    """Builds FleetViews; the snapshot and the estimator's fit are refreshed at most once a period."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, snapshot_every_s: float = 1.0) -> None:
        self.redis = redis
        self.keys = keys
        self.snapshot_every_s = snapshot_every_s
        self._snapshot: Snapshot | None = None
        self._estimator: Estimator | None = None
        self._taken_at = 0.0

    async def estimates(self) -> tuple[Snapshot, Estimator]:
        if self._snapshot is None or time.monotonic() - self._taken_at > self.snapshot_every_s:
            self._snapshot = await snapshot(self.redis, self.keys)
            self._estimator = build_estimator(self._snapshot, now_ms())
            self._taken_at = time.monotonic()
        assert self._estimator is not None
        return self._snapshot, self._estimator

    async def backlog(self, digest: str) -> list[BacklogEntry]:
        """The entries of the model's queue that no worker has read yet, head first."""
        queue = self.keys.queue(digest)
        try:
            groups: Any = await self.redis.xinfo_groups(queue)
        except aioredis.ResponseError:
            return []  # no queue yet: nothing was ever submitted for this model
        last = next((g["last-delivered-id"] for g in groups if _s(g["name"]) == WORKERS_GROUP), b"0-0")
        rows: Any = await self.redis.xrange(queue, next_id(_s(last)), "+", count=BACKLOG_DEPTH)
        out: list[BacklogEntry] = []
        for raw_id, fields in rows:
            try:
                task = decode_task(fields[F_TASK])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                continue  # a malformed entry is the worker's to dead-letter, not the plan's
            out.append(
                BacklogEntry(
                    task_id=task.task_id,
                    digest=digest,
                    enqueued_at_ms=int(_s(raw_id).split("-")[0]),
                    domain=task.domain,
                    prompt_tokens=task.prompt_tokens,
                    max_tokens=task.max_tokens,
                )
            )
        return out

    async def fleet(
        self, digests: Iterable[str] | None = None, leases: dict[str, LeaseInfo] | None = None
    ) -> tuple[FleetView, Estimator, int, dict[str, LeaseInfo]]:
        """The FleetView for `digests` (every served model when None), the estimator, now, the leases."""
        snap, est = await self.estimates()
        now = now_ms()
        live = leases if leases is not None else await live_workers(self.redis, self.keys)
        wanted = set(digests) if digests is not None else set(served_models(live).values())
        backlog = {d: await self.backlog(d) for d in sorted(wanted)}
        rates = {d: arrival_rate(snap, d, now, snap.demand_half_life_s) for d in wanted}
        return FleetView(workers=worker_views(live), backlog=backlog, arrival_rate=rates), est, now, live


def _s(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw
