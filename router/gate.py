"""The pull gate: a worker with a free slot takes the head of a queue only when that is better
for the system than leaving it to the others.

`decide_take` is the one decision: the worker agent (workers/admission.py, over what it reads from
Redis) and the scheduling simulator (sim/scheduling/policies.py, over its simulated fleet) both
call it for each free slot, and both then take exactly that one task. The rule (GateParams) was
chosen by measuring alternatives in the scheduling simulator (`routeledger sim schedule`) against
the best fixed threshold at each load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from projections.snapshot import Snapshot
from router.estimate import Estimator
from router.plan import (
    BacklogEntry,
    FleetView,
    PlanParams,
    PlanState,
    WorkerView,
    arrival_rates,
    holders_by_digest,
)

# The gate looks this far down each queue: the agent reads no more of a queue than this from
# Redis, and the simulator shows the gate no more either.
BACKLOG_DEPTH: Final = 64
# How old the projection snapshot a decision reads (and the estimator fitted to it) may be: the
# agent re-reads it at most this often (a read costs Redis round trips and a fit), and the
# simulator refreshes its own as often.
SNAPSHOT_EVERY_S: Final = 1.0


class GateParams(msgspec.Struct, kw_only=True, frozen=True):
    """How the gate weighs the future."""

    # "plan": take when the plan of the current backlog gives me a task (the selfish rule);
    # "arrivals": the same plan, with the tasks expected to arrive before I get my next chance
    # to take counted into the others' backlog: `arrival_weight` x arrival rate x my finish of
    # the head / d. On a one-slot worker d = 1 (its next chance is when it finishes the head).
    # A worker with k slots gets its next chance when one of its slots frees up: about my finish
    # / n with n tasks running once I take, about my finish / k when full; d is the mean of n
    # and k. Measured in the scheduling simulator: one weight of 0.6 with d = 1 made
    # the 2-slot mini PC of `trio` take too eagerly and its slow laptop too late (5.8% behind
    # best-threshold at load 0.8); d = k alone made the mini PC too reluctant at load 0.5,
    # d = n too eager at 0.7-0.8.
    rule: str = "arrivals"
    arrival_weight: float = 0.8
    plan: PlanParams = PlanParams()
    # See SNAPSHOT_EVERY_S.
    snapshot_every_s: float = SNAPSHOT_EVERY_S


class GateDecision(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Whether `worker` takes `task_id` now, why, and the numbers behind it."""

    take: bool
    worker: str
    reason: str
    digest: str | None = None
    task_id: str | None = None
    # The queue entry of `task_id` (see BacklogEntry.entry_id).
    entry_id: str = ""
    # A take: the position of the task the plan gives the worker (1: the head); None otherwise.
    position: int | None = None
    numbers: dict[str, float] = msgspec.field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "take": self.take,
            "worker": self.worker,
            "reason": self.reason,
            "digest": self.digest,
            "task_id": self.task_id,
            "entry_id": self.entry_id,
            "numbers": dict(self.numbers),
        }


def _head_queue(view: FleetView, holds: set[str]) -> tuple[str, list[BacklogEntry]] | None:
    best: tuple[str, list[BacklogEntry]] | None = None
    for digest in holds:
        q = view.backlog.get(digest)
        if q and (best is None or q[0].enqueued_at_ms < best[1][0].enqueued_at_ms):
            best = (digest, q)
    return best


def _taking(
    worker: str,
    digest: str,
    queue: list[BacklogEntry],
    pos: int,
    finish: float,
    why: str,
    numbers: dict[str, float],
) -> GateDecision:
    """The decision to take the head because the plan gives `worker` task #pos + 1 of `queue`."""
    return GateDecision(
        take=True,
        worker=worker,
        digest=digest,
        task_id=queue[0].task_id,
        entry_id=queue[0].entry_id,
        position=pos + 1,
        reason=f"the plan gives me task #{pos + 1} of {len(queue)} queued {why}",
        numbers={
            "position": float(pos + 1),
            "backlog": float(len(queue)),
            **numbers,
            "my_finish_s": finish,
        },
    )


def should_take(
    worker: str,
    view: FleetView,
    est: Estimator,
    now_ms: int,
    params: GateParams | None = None,
) -> GateDecision:
    """Whether `worker` takes the head of the queue (of the models it serves) that waited longest."""
    p = params or GateParams()
    me = view.worker(worker)
    if me is None:
        return GateDecision(take=False, worker=worker, reason="not live")
    if len(me.running) >= me.slots:
        return GateDecision(take=False, worker=worker, reason="no free slot")
    head = _head_queue(view, me.holds)
    if head is None:
        return GateDecision(take=False, worker=worker, reason="nothing queued for the models I serve")
    digest, queue = head
    holders = holders_by_digest(view)[digest]
    state = PlanState(holders, est, digest, now_ms, p.plan, backlog=view.backlog)
    mine = state.names.index(worker)
    my_first = state.best_on(mine, queue[0])
    # Guard: another holder free right now that finishes the head sooner takes it, whatever comes;
    # unless the plan of what is queued now gives me a task too. Workers ask at once, not in turn:
    # a free worker that the plan of a long backlog gives task #2 takes the head beside the one
    # that gets #1, instead of waiting until that one is full (the tasks are alike: one queue).
    i0, start0, _ = state.best(queue[0])
    if i0 != mine and start0 <= 0.0:
        beside = state.first_given(mine, queue)
        if beside is not None:
            pos, finish = beside
            return _taking(
                worker, digest, queue, pos, finish, f"({state.names[i0]}, free too, gets the first)", {}
            )
        return GateDecision(
            take=False,
            worker=worker,
            digest=digest,
            task_id=queue[0].task_id,
            reason=f"{state.names[i0]} is free and finishes the head sooner",
            numbers={"backlog": float(len(queue)), "my_finish_s": my_first},
        )
    rate = view.arrival_rate.get(digest, 0.0)
    # My next chance to take comes when a slot frees: the mean of (tasks I would run) and slots.
    divisor = (len(me.running) + 1 + max(1, me.slots)) / 2.0
    expected = rate * my_first * p.arrival_weight / divisor if p.rule == "arrivals" else 0.0
    phantoms = int(expected + 0.5)
    # Expected arrivals are like the last task in size, but hold no conversation of theirs.
    phantom = (
        queue[-1]
        if queue[-1].prefix is None and not queue[-1].paced
        else msgspec.structs.replace(queue[-1], prefix=None, paced=False)
    )
    entries = list(queue) + [phantom] * phantoms
    # The walk stops at the first task the plan gives me: the tasks behind it cannot change that.
    given = state.first_given(mine, entries)
    if given is not None:
        pos, finish = given
        return _taking(
            worker,
            digest,
            queue,
            pos,
            finish,
            f"+ {phantoms} expected to arrive before my next chance to take",
            {"expected_arrivals": expected, "arrival_rate_per_s": rate, "arrival_divisor": divisor},
        )
    return GateDecision(
        take=False,
        worker=worker,
        digest=digest,
        task_id=queue[0].task_id,
        reason=(
            f"others finish all {len(queue)} queued + {phantoms} expected tasks sooner"
            f" than I would finish the head"
        ),
        numbers={
            "backlog": float(len(queue)),
            "expected_arrivals": expected,
            "arrival_rate_per_s": rate,
            "arrival_divisor": divisor,
            "my_finish_s": my_first,
        },
    )


def decide_take(
    worker: str,
    workers: Sequence[WorkerView],
    backlog: Mapping[str, Sequence[BacklogEntry]],
    snapshot: Snapshot,
    est: Estimator,
    now_ms: int,
    params: GateParams | None = None,
) -> GateDecision:
    """Whether `worker`, which has a free slot, takes one task now: `should_take` on the live
    workers, the first BACKLOG_DEPTH entries of each queue and each queue's arrival rate from the
    snapshot's demand table. `est` is the estimator fitted to `snapshot`."""
    view = FleetView(
        # The caller's list itself when it is one: the router keeps figures per list of workers.
        workers=workers if isinstance(workers, list) else list(workers),
        backlog={d: list(q[:BACKLOG_DEPTH]) for d, q in backlog.items()},
        arrival_rate=arrival_rates(snapshot, backlog, now_ms),
    )
    return should_take(worker, view, est, now_ms, params)
