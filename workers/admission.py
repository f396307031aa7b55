"""Admission: which shared queues a worker with a free slot may read now (the seam `WorkerAgent.gate`).

`RouterGate`, the default, asks `router.gate.should_take` whether taking the head task is better
for the system than leaving it to the others; the decision is pure, its facts come from
`dispatch.view.LiveView`. `PlainPull` takes whatever the streams give.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import redis.asyncio as aioredis

from dispatch.view import LiveView
from events.keys import Keys
from router.gate import GateDecision, GateParams, should_take

if TYPE_CHECKING:
    from workers.agent import WorkerAgent

log = logging.getLogger("routeledger.gate")


class Gate(Protocol):
    """The seam for the router's speed-aware gate: which shared queues may this worker read now?"""

    async def admit(self, agent: WorkerAgent, queues: Sequence[str]) -> list[str]: ...


class PlainPull:
    """Take whatever the streams give (the behaviour before the router's gate)."""

    async def admit(self, agent: WorkerAgent, queues: Sequence[str]) -> list[str]:
        return list(queues)


class RouterGate:
    """Admits a shared queue only when the router's gate says this worker should take its head."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, params: GateParams | None = None) -> None:
        self.view = LiveView(redis, keys)
        self.keys = keys
        self.params = params or GateParams()
        self.last: GateDecision | None = None

    async def admit(self, agent: WorkerAgent, queues: Sequence[str]) -> list[str]:
        digests = [m.digest for m in agent.serving() if self.keys.queue(m.digest) in queues]
        fleet, est, now, _ = await self.view.fleet(digests)
        decision = should_take(agent.name, fleet, est, now, self.params)
        self.last = decision
        if not decision.take or decision.digest is None:
            if decision.task_id is not None:
                log.debug("leaving %s: %s", decision.task_id, decision.reason)
            return []
        log.debug("taking %s: %s", decision.task_id, decision.reason)
        return [self.keys.queue(decision.digest)]
