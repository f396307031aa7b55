"""The pull gate: a worker with a free slot takes the head of a queue only when that is better
for the system than leaving it to the others.

`decide_take` is the one decision: the worker agent (workers/admission.py, over what it reads from
Redis) and the scheduling simulator (sim/scheduling/policies.py, over its simulated fleet) both
call it for each free slot, and both then take exactly that one task. The rule (GateParams) was
chosen by measuring alternatives in the scheduling simulator (`routeledger sim schedule`) against
the best fixed threshold at each load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    # Size-aware dispatch: lay the queue out by each task's expected size (smallest first) and
    # take the task the plan gives me, not the head, so a slow machine takes a small task from
    # behind a big one the fast machine will run (`_sized_given`). Starvation is bounded: a task
    # that has waited `max_skip_wait_s` is laid out before every task that has not, in queue order,
    # so no later task is taken ahead of it by size any more. Off by default: a real worker's
    # queue hands out its head only (dispatch.queues.TaskQueues.take), so taking a later entry
    # needs a queue operation that does not exist yet; the scheduling simulator turns it on.
    skip_ahead: bool = False
    max_skip_wait_s: float = 120.0


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
    pick: int | None = None,
) -> GateDecision:
    """The decision to take the head because the plan gives `worker` task #pos + 1 of `queue`."""
    k = pick if pick is not None else 0
    return GateDecision(
        take=True,
        worker=worker,
        digest=digest,
        task_id=queue[k].task_id,
        entry_id=queue[k].entry_id,
        position=pos + 1,
        reason=f"the plan gives me task #{pos + 1} of {len(queue)} queued {why}",
        numbers={
            "position": float(pos + 1),
            "backlog": float(len(queue)),
            **numbers,
            "my_finish_s": finish,
        },
    )


def _pick(queue: list[BacklogEntry], pos: int, p: GateParams) -> int | None:
    """Where the size-aware rule takes the task the plan gives me (`pos`), not the head."""
    if not p.skip_ahead or pos <= 0 or pos >= len(queue):
        return None
    return pos


def _size_order(
    queue: list[BacklogEntry], state: PlanState, now_ms: int, p: GateParams
) -> list[BacklogEntry]:
    """`queue` as the size-aware plan lays it out: tasks that waited `max_skip_wait_s` or more
    first, in queue order; then the rest by expected size (`PlanState.size_s`), equal sizes in
    queue order (so a queue of alike tasks keeps its order)."""
    limit = now_ms - int(p.max_skip_wait_s * 1000.0)

    def key(k: int) -> tuple[int, float, int]:
        e = queue[k]
        if e.enqueued_at_ms <= limit:
            return (0, 0.0, k)
        return (1, state.size_s(e), k)

    return [queue[k] for k in sorted(range(len(queue)), key=key)]


def _with_arrivals(
    queue: list[BacklogEntry],
    recent: list[BacklogEntry],
    count: int,
    state: PlanState,
    now_ms: int,
    p: GateParams,
) -> list[BacklogEntry]:
    """`queue` in size order with `count` expected arrivals: tasks like the newest queued ones
    (`recent`, oldest first), enqueued now and holding no conversation."""
    if count <= 0 or not recent:
        return queue
    like = recent[-count:]
    extra = [
        msgspec.structs.replace(like[k % len(like)], prefix=None, task_id="", enqueued_at_ms=now_ms)
        for k in range(count)
    ]
    return _size_order(queue + extra, state, now_ms, p)


def _sized_given(
    fresh: Callable[[], PlanState],
    mine: int,
    queue: list[BacklogEntry],
    known: list[BacklogEntry],
    per_s: float,
    my_first: float,
    now_ms: int,
    p: GateParams,
) -> tuple[int, float] | None:
    """(position in `queue`, my finish) of the task the size-aware plan gives me, or None.

    The plan lays out `queue` (in `_size_order`) with the tasks expected to arrive (`per_s` a
    second) while I would run what it gives me: first over my finish of the smallest, then, as
    long as it gives me a task I would finish later, over that finish (at most 3 times). A big
    task ties me up long, and the small ones arriving meanwhile then go ahead of it in the plan:
    a slow machine takes it only if the plan still gives it to me. Where the plan gives me an
    expected arrival: where every task known (queued and running, `known`) has the same
    expected size, I take the head (the rule for alike tasks: I will be needed, so start now);
    where sizes differ, the arrival's size says nothing certain, so I take nothing yet.
    """
    horizon = my_first
    recent = sorted(queue, key=lambda e: e.enqueued_at_ms)
    pos, finish = 0, my_first
    for _ in range(3):
        state = fresh()
        entries = _with_arrivals(queue, recent, int(per_s * horizon + 0.5), state, now_ms, p)
        given = state.first_given(mine, entries)
        if given is None:
            return None
        pos, finish = given
        if entries[pos].task_id == "":
            sizes = [state.size_s(e) for e in known]
            if max(sizes) > min(sizes) * (1.0 + 1e-9):
                return None
            return 0, fresh().best_on(mine, queue[0])
        if finish <= horizon * (1.0 + 1e-9):
            break
        horizon = finish
    return queue.index(entries[pos]), finish


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
    if p.skip_ahead:
        queue = _size_order(queue, state, now_ms, p)
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
                worker,
                digest,
                queue,
                pos,
                finish,
                f"({state.names[i0]}, free too, gets the first)",
                {},
                _pick(queue, pos, p),
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
    if p.skip_ahead:
        running = [
            BacklogEntry(
                task_id=t.task_id,
                digest=t.digest,
                enqueued_at_ms=t.started_at_ms,
                domain=t.domain,
                prompt_tokens=t.prompt_tokens,
                max_tokens=t.max_tokens,
            )
            for h in holders
            for t in h.running
            if t.digest == digest
        ]
        given = _sized_given(
            lambda: PlanState(holders, est, digest, now_ms, p.plan, backlog=view.backlog),
            mine,
            queue,
            queue + running,
            rate * p.arrival_weight / divisor,
            my_first,
            now_ms,
            p,
        )
    else:
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
            _pick(queue, pos, p),
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
