"""The router's speed-aware gate, fed from Redis: the seam `WorkerAgent.gate` plugs into.

Before a worker with a free slot reads a shared queue, it asks `router.gate.should_take` whether
taking the head task is better for the system than leaving it to the others. The decision is pure;
this module only gathers its facts: the live workers from their leases (slots, what they serve,
what is loaded, what each slot runs and since when), each queue's backlog (entries no worker has
read yet), the arrival rate and the estimates from the projection snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import redis.asyncio as aioredis

from events.event import now_ms
from events.keys import WORKERS_GROUP, Keys
from events.lease import live_workers
from events.ledger import next_id
from events.task import F_TASK, decode_task
from projections.reader import snapshot
from projections.snapshot import Snapshot
from router.estimate import Estimator, build_estimator
from router.gate import GateDecision, GateParams, should_take
from router.plan import BacklogEntry, FleetView, RunningTask, WorkerView, arrival_rate

if TYPE_CHECKING:
    from workers.agent import WorkerAgent

log = logging.getLogger("routeledger.gate")

# The plan looks this far down each queue; tasks behind it cannot change who takes the head.
BACKLOG_DEPTH = 64


class RouterGate:
    """Admits a shared queue only when the router's gate says this worker should take its head."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        params: GateParams | None = None,
        *,
        snapshot_every_s: float = 1.0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.params = params or GateParams()
        self.snapshot_every_s = snapshot_every_s
        self._snapshot: Snapshot | None = None
        self._estimator: Estimator | None = None
        self._taken_at = 0.0
        self.last: GateDecision | None = None

    async def _estimates(self) -> tuple[Snapshot, Estimator]:
        # The fit behind the estimator is the costly part; it is redone once per snapshot.
        if self._snapshot is None or time.monotonic() - self._taken_at > self.snapshot_every_s:
            self._snapshot = await snapshot(self.redis, self.keys)
            self._estimator = build_estimator(self._snapshot, now_ms())
            self._taken_at = time.monotonic()
        assert self._estimator is not None
        return self._snapshot, self._estimator

    async def backlog(self, queue: str, digest: str) -> list[BacklogEntry]:
        """The entries of `queue` no worker has read yet, head first."""
        groups: Any = await self.redis.xinfo_groups(queue)
        last = next((g["last-delivered-id"] for g in groups if _s(g["name"]) == WORKERS_GROUP), b"0-0")
        rows: Any = await self.redis.xrange(queue, next_id(_s(last)), "+", count=BACKLOG_DEPTH)
        out: list[BacklogEntry] = []
        for raw_id, fields in rows:
            entry_id = _s(raw_id)
            try:
                task = decode_task(fields[F_TASK])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                continue  # a malformed entry is the worker's to dead-letter, not the plan's
            out.append(
                BacklogEntry(
                    task_id=task.task_id,
                    digest=digest,
                    enqueued_at_ms=int(entry_id.split("-")[0]),
                    domain=task.domain,
                    prompt_tokens=task.prompt_tokens,
                    max_tokens=task.max_tokens,
                )
            )
        return out

    async def view(self, agent: WorkerAgent, queues: Sequence[str]) -> tuple[FleetView, Estimator, int]:
        """The facts of one decision."""
        snap, est = await self._estimates()
        now = now_ms()
        leases = await live_workers(self.redis, self.keys)
        workers = [
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
        digests = {self.keys.queue(m.digest): m.digest for m in agent.serving()}
        backlog = {digests[q]: await self.backlog(q, digests[q]) for q in queues if q in digests}
        rates = {d: arrival_rate(snap, d, now, snap.demand_half_life_s) for d in backlog}
        return FleetView(workers=workers, backlog=backlog, arrival_rate=rates), est, now

    async def admit(self, agent: WorkerAgent, queues: Sequence[str]) -> list[str]:
        view, est, now = await self.view(agent, queues)
        decision = should_take(agent.name, view, est, now, self.params)
        self.last = decision
        if not decision.take or decision.digest is None:
            if decision.task_id is not None:
                log.debug("leaving %s: %s", decision.task_id, decision.reason)
            return []
        log.debug("taking %s: %s", decision.task_id, decision.reason)
        return [self.keys.queue(decision.digest)]


def _s(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw
