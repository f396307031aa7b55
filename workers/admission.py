"""Admission: what a worker with a free slot may take now (the seam `WorkerAgent.gate`).

`RouterGate`, the default, asks `router.gate.decide_take` whether taking the head task is better
for the system than leaving it to the others; the decision is pure (the scheduling simulator makes
it through the same function), its facts come from `dispatch.view.LiveView`. `PlainPull` takes the
head of whichever queue waited longest. Either way the worker then takes exactly that one entry,
and only if it is still the head (`TaskStore.take`), or, for a later task the size-aware plan gave
it, only if it is still queued (`TaskStore.take_given`, which moves it to the worker's pinned
stream), and asks again for its next free slot.

A gate reads the worker that asks it through `Applicant`, the few things it needs (what it
serves, what its lease says, whether work is likely waiting), not through the agent itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

import msgspec
import redis.asyncio as aioredis

from dispatch.view import LiveView, with_own, worker_views
from events.event import ModelEntry
from events.keys import Keys
from router.gate import GateDecision, GateParams, decide_take
from router.plan import BacklogEntry, WorkerView
from tasks.lease import LeaseInfo

log = logging.getLogger("routeledger.gate")

# How many queued tasks per model the gate reads first (BACKLOG_DEPTH when that is not enough).
FIRST_LOOK = 16
# How long the gate reuses the leases it read. Short: a held-back worker is woken by another's
# claim and must see that worker busy (its lease is written just before the claim is appended).
LEASES_EVERY_S = 0.04


class Admission(msgspec.Struct, kw_only=True):
    """What a gate allows a worker with a free slot to take now."""

    # The queue to take from; None: nothing now.
    queue: str | None = None
    # The entry decided on ('' = the head, whatever it is).
    entry_id: str = ""
    # The plan gave the worker task #k of the queue: k - 1 others may take theirs first (TaskStore.take).
    slack: int = 0
    # Work waits that the gate leaves to others for now (the worker asks again when things change).
    held_back: bool = False
    # The entry decided on is not the head (the size-aware plan gave the worker a later task): the
    # worker moves it to its pinned stream and takes it there (TaskStore.take_given).
    ahead: bool = False
    # The task of `entry_id`, when known (a take ahead names its lookup hash).
    task_id: str = ""
    # Each queue looked at -> the id of its last entry (an XREAD from it wakes on the next new one).
    cursors: dict[str, str] = msgspec.field(default_factory=dict)
    # The id of the entry admitted when it was the only one waiting in every queue looked at (nothing
    # re-queued, nothing behind it), else ''. Once the worker has taken exactly that entry, nothing
    # is left to decide on: it waits on `cursors`, which wake it on anything queued since the look,
    # instead of reading the backlog again only to find it empty.
    alone: str = ""


class Applicant(Protocol):
    """What a gate reads of the worker that asks it (workers.consumer.Consumer is this view)."""

    @property
    def name(self) -> str: ...

    # Work is likely waiting (a queue woke the worker, or it has just taken a task).
    @property
    def expects_work(self) -> bool: ...

    # The worker acknowledges the entries it takes (it does not write to an inbox).
    @property
    def finishes(self) -> bool: ...

    def serving(self) -> list[ModelEntry]:
        """The held models the worker consumes tasks for."""
        ...

    def lease_info(self) -> LeaseInfo:
        """What the worker's lease says now (what it runs included)."""
        ...


class Gate(Protocol):
    """The seam for the router's speed-aware gate: what may this worker take from these queues now?"""

    async def admit(self, agent: Applicant, queues: Sequence[str]) -> Admission: ...


def _digests(agent: Applicant, keys: Keys, queues: Sequence[str]) -> list[str]:
    wanted = set(queues)
    return [m.digest for m in agent.serving() if keys.queue(m.digest) in wanted]


def _one_band(backlog: dict[str, list[BacklogEntry]]) -> bool:
    """Whether each model's queued tasks wait in one queue. Where they wait in several (priority
    bands, fair-share rounds), tasks are served band by band, and the size-aware order, which lays
    a model's tasks out by size whatever their band, would not keep that: the gate is size-blind there."""
    return all(len({e.queue for e in q}) <= 1 for q in backlog.values())


def _alone(backlog: dict[str, list[BacklogEntry]]) -> str:
    """The entry id of the only entry waiting in `backlog`; '' when there are more, or none."""
    waiting = [e for q in backlog.values() for e in q]
    return waiting[0].entry_id if len(waiting) == 1 else ""


class PlainPull:
    """Take the head of whichever queue waited longest (the behaviour before the router's gate).
    It reads each queue's head and the entry behind it, no more: the heads decide, and the second
    tells whether the head is the only one waiting (Admission.alone)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.view = LiveView(redis, keys)
        self.keys = keys

    async def admit(self, agent: Applicant, queues: Sequence[str]) -> Admission:
        backlog, cursors = await self.view.backlogs_and_cursors(_digests(agent, self.keys, queues), 2)
        heads = [(q[0].enqueued_at_ms, d) for d, q in backlog.items() if q]
        if not heads:
            return Admission(cursors=cursors)
        _, digest = min(heads)
        return Admission(
            queue=backlog[digest][0].queue or self.keys.queue(digest), cursors=cursors, alone=_alone(backlog)
        )


class RouterGate:
    """Admits a task of a shared queue (the head, or a later one by expected size) only when the
    router's gate says this worker should take it."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, params: GateParams | None = None) -> None:
        # Size-aware: a worker may take a later task than the head (Admission.ahead).
        self.params = params or GateParams(skip_ahead=True)
        # For a worker that writes to an inbox (its ACL may not delete a queue entry or write a
        # task's lookup hash, so it cannot move a later task to its pinned stream: take_given),
        # and for a model whose tasks wait in several bands (_one_band).
        self._head_only = msgspec.structs.replace(self.params, skip_ahead=False)
        self.view = LiveView(
            redis, keys, snapshot_every_s=self.params.snapshot_every_s, leases_every_s=LEASES_EVERY_S
        )
        self.keys = keys
        self.last: GateDecision | None = None
        # The live workers with this one as it is: one list while neither the leases read nor what
        # this worker runs changes, so that the router's per-list figures (its holder index and
        # each model's starting slot state) serve every check until then.
        self._views: tuple[object, list[WorkerView], list[WorkerView]] | None = None

    async def admit(self, agent: Applicant, queues: Sequence[str]) -> Admission:
        digests = _digests(agent, self.keys, queues)
        # When work is likely waiting (a queue woke the worker, or it has just taken a task), the
        # leases are read beside the backlog rather than after it: one round trip less before the take.
        early = (
            asyncio.ensure_future(self.view.leases())
            if agent.expects_work and self.view.leases_stale()
            else None
        )
        try:
            return await self._admit(agent, digests)
        finally:
            if early is not None:
                # Never cancelled mid-command; its value stays cached, its failure is the next read's.
                await asyncio.gather(early, return_exceptions=True)

    async def _admit(self, agent: Applicant, digests: list[str]) -> Admission:
        # A short look first: under a long backlog the plan gives a worker a task within the first
        # few, and reading (and decoding) 64 queued tasks per take is most of a take's cost. Only a
        # "leave" on a look that was cut short is decided again on the whole depth.
        backlog, cursors = await self.view.backlogs_and_cursors(digests, FIRST_LOOK)
        if not any(backlog.values()):
            # Nothing waits: no lease or statistics read at all (an idle worker costs Redis little).
            return Admission(cursors=cursors)
        admission = await self._decide(agent, backlog, cursors)
        if admission.queue is None and any(len(q) >= FIRST_LOOK for q in backlog.values()):
            backlog, cursors = await self.view.backlogs_and_cursors(digests)
            admission = await self._decide(agent, backlog, cursors)
        return admission

    async def _decide(
        self, agent: Applicant, backlog: dict[str, list[BacklogEntry]], cursors: dict[str, str]
    ) -> Admission:
        snap, est = await self.view.estimates()
        # The cached leases, with this worker's own as it is now (it knows what it runs).
        leases = await self.view.leases()
        mine = agent.lease_info()
        me = worker_views({agent.name: mine})
        if self._views is not None and self._views[0] is leases and self._views[1] == me:
            views = self._views[2]
        else:
            placed = with_own(self.view.worker_views(leases), mine)
            views = worker_views({**leases, agent.name: mine}) if placed is None else placed
            self._views = (leases, me, views)
        # The snapshot's ages and the queue entries' waits are the ledger's clock, not this machine's.
        now = await self.view.clock.now_ms()
        params = self.params if agent.finishes and _one_band(backlog) else self._head_only
        decision = decide_take(agent.name, views, backlog, snap, est, now, params)
        self.last = decision
        if not decision.take or decision.digest is None:
            if decision.task_id is not None:
                log.debug("leaving %s: %s", decision.task_id, decision.reason)
            return Admission(held_back=decision.task_id is not None, cursors=cursors)
        log.debug("taking %s: %s", decision.task_id, decision.reason)
        # The plan gave me task #k: up to k - 1 others may take theirs first (k within the real
        # backlog of the band queue that holds the head: a take looks at that queue only).
        own = backlog.get(decision.digest) or []
        band = next((e.queue for e in own if e.entry_id == decision.entry_id), "") if own else ""
        head = next((e for e in own if e.queue == band), None)
        if head is not None and decision.entry_id and head.entry_id != decision.entry_id:
            # A later task than its queue's head: taken exactly, or not at all.
            return Admission(
                queue=band or self.keys.queue(decision.digest),
                entry_id=decision.entry_id,
                ahead=True,
                task_id=decision.task_id or "",
                cursors=cursors,
            )
        queued = sum(1 for e in own if e.queue == band)
        slack = 0 if decision.position is None else max(0, min(decision.position, queued) - 1)
        return Admission(
            queue=band or self.keys.queue(decision.digest),
            entry_id=decision.entry_id,
            slack=slack,
            cursors=cursors,
            alone=_alone(backlog),
        )
