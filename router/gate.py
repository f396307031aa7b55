"""The pull gate: a worker with a free slot takes the head of a queue only when that is better
for the system than leaving it to the others.

`decide_take` is the one decision: the worker agent (workers/admission.py, over what it reads from
Redis) and the scheduling simulator (sim/scheduling/policies.py, over its simulated fleet) both
call it for each free slot, and both then take exactly that one task. The rule (GateParams) was
chosen by measuring alternatives in the scheduling simulator (`routeledger sim schedule`) against
the best fixed threshold at each load.
"""

from __future__ import annotations

import heapq
import math
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
    # Size-aware dispatch, where the tasks known (queued and running) differ in expected size:
    # lay the queue out by expected size (smallest first), look ahead with the arrivals expected
    # while I would run what the plan gives me, and take that task rather than the head, so a
    # slow machine takes a small task from behind a big one a fast machine will run and leaves
    # big ones that would tie it up while small ones arrive (`_sized_given`). On alike tasks,
    # and on tasks that carry a prompt chain, the rule is the size-blind one.
    # Starvation is bounded: a task that has waited `max_skip_wait_s` is laid out before every
    # task that has not, in queue order, so from then on no later task goes ahead of it by size.
    # Off by default; the scheduling simulator and the worker's gate (workers.admission.RouterGate)
    # turn it on. A real worker's queue hands out its head only (tasks.store.TaskStore.take),
    # so a worker takes a later task by moving it to its pinned stream (TaskStore.take_given).
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


def _sizes_differ(state: PlanState, known: list[BacklogEntry]) -> bool:
    """Whether the tasks known (queued and running) differ in expected size."""
    if len(known) < 2:
        return False
    sizes = [state.size_s(e) for e in known]
    return max(sizes) > min(sizes) * (1.0 + 1e-9)


def _released_walk(
    state: PlanState, mine: int, items: list[tuple[BacklogEntry, float]]
) -> tuple[int, float] | None:
    """(position, finish) of the first of `items` (a task and the second it arrives, 0: queued
    now) the walk gives holder `mine`, each task to the holder that would finish it earliest,
    starting no sooner than it arrives; None when it gives me none. Slots that slow each other
    down are counted as if they did not (the walk is a look ahead, not the plan)."""
    free = [sorted(f) for f in state.free]
    load = list(state.load_left)
    per_prompt, per_out = state.sp.per_prompt, state.sp.per_out
    default_prompt = state.default_prompt
    for pos, (e, release) in enumerate(items):
        prompt = default_prompt if e.prompt_tokens is None else e.prompt_tokens
        out = state.out_of(e)
        best, best_finish = -1, math.inf
        for i, slots in enumerate(free):
            f = max(slots[0], release) + prompt * per_prompt[i] + out * per_out[i] + load[i]
            if f < best_finish:
                best, best_finish = i, f
        if best == mine:
            return pos, best_finish
        heapq.heapreplace(free[best], best_finish)
        load[best] = 0.0
    return None


def _sized_given(
    state: PlanState,
    mine: int,
    queue: list[BacklogEntry],
    per_s: float,
    my_first: float,
    now_ms: int,
    p: GateParams,
) -> tuple[int, float] | None:
    """(position in `queue`, my finish) of the task the size-aware plan gives me, or None.

    `queue` is in `_size_order`. The walk lays it out with the tasks expected to arrive while I
    would run what it gives me (`per_s` a second, like the newest queued ones, each at its
    expected arrival second, in size order with the rest): first over my finish of the
    smallest, then, as long as it gives me a task I would finish later, over that finish (at
    most 3 times). A big task ties me up long, and small ones arriving meanwhile that the walk
    would give me say I should leave it to a faster machine. Where it gives me an expected
    arrival, I take nothing yet: which size arrives is not known.
    """
    recent = sorted(queue, key=lambda e: e.enqueued_at_ms)
    limit = now_ms - int(p.max_skip_wait_s * 1000.0)
    horizon = my_first
    found: tuple[int, float] | None = None
    for _ in range(3):
        count = int(per_s * horizon + 0.5)
        like = recent[-count:] if count > 0 else []
        items = [(e, 0.0) for e in queue] + [
            (like[k % len(like)], (k + 0.5) / per_s) for k in range(count if like else 0)
        ]
        order = sorted(
            range(len(items)),
            key=lambda k: (
                (0, 0.0, k)
                if k < len(queue) and items[k][0].enqueued_at_ms <= limit
                else (1, state.size_s(items[k][0]), k)
            ),
        )
        given = _released_walk(state, mine, [items[k] for k in order])
        if given is None:
            return None
        pos, finish = given
        k = order[pos]
        if k >= len(queue):
            return None
        found = (k, finish)
        if finish <= horizon * (1.0 + 1e-9):
            break
        horizon = finish
    return found


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
    known: list[BacklogEntry] = []
    if p.skip_ahead:
        known = queue + [
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
    # Sizes matter only where the tasks differ in expected size: on alike tasks the rule is the
    # size-blind one, bit for bit. Nor where queued tasks carry a prompt chain or are paced: what a
    # task costs then depends on which slot holds its conversation, or on its reader, which the
    # size-aware look-ahead does not price (in the simulator it made chats 3-5% slower than the
    # size-blind rule).
    sized = (
        p.skip_ahead and all(e.prefix is None and not e.paced for e in queue) and _sizes_differ(state, known)
    )
    if sized:
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
                _pick(queue, pos, p) if sized else None,
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
    if sized:
        given = _sized_given(state, mine, queue, rate * p.arrival_weight / divisor, my_first, now_ms, p)
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
            _pick(queue, pos, p) if sized else None,
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
