"""The dispatch plan: who would finish each queued task earliest, counting what each holder runs.

Service time of a task on a worker = load seconds if the model is not loaded there + prompt tokens
/ prompt tok/s + expected output tokens (capped by the task's max tokens) / decode tok/s. A slot
running a task is expected free at (expected service - elapsed), never sooner than a fraction of
the expected service: a task past its estimate is still running, so it is not "free now".

The plan assigns the backlog in queue order, each task to the live holder whose slot would finish
it earliest. Times are seconds from `now`. `FleetView` holds the live facts the ledger projections
do not (the queues' backlog and the running tasks' start times); the caller fills it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from projections.snapshot import Snapshot
from router.estimate import Estimator


class PlanParams(msgspec.Struct, kw_only=True, frozen=True):
    """Assumptions of the plan where a fact is missing."""

    # Prompt size assumed for a task whose prompt tokens were not counted.
    default_prompt_tokens: int = 64
    # A running task past its estimate is expected to need at least this share of it again.
    overdue_fraction: float = 0.1
    # Demand decay for the arrival rate; None: the snapshot's half-life.
    demand_half_life_s: float | None = None


class RunningTask(msgspec.Struct, kw_only=True, gc=False):
    """A task a worker claimed and has not finished (from TaskClaimed: who, when, what)."""

    task_id: str
    digest: str
    started_at_ms: int
    domain: str = "general"
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    # The expected service recorded when it was routed; None: estimate it now.
    expected_s: float | None = None


class WorkerView(msgspec.Struct, kw_only=True, gc=False):
    """One live worker: slots, the digests it serves, what is loaded, what it runs."""

    name: str
    slots: int
    holds: set[str]
    loaded: set[str] = msgspec.field(default_factory=set)
    running: list[RunningTask] = msgspec.field(default_factory=list)


class BacklogEntry(msgspec.Struct, kw_only=True, gc=False):
    """A task waiting in a model's shared queue (from TaskSubmitted and the queue's order)."""

    task_id: str
    digest: str
    enqueued_at_ms: int
    domain: str = "general"
    prompt_tokens: int | None = None
    max_tokens: int | None = None


class FleetView(msgspec.Struct, kw_only=True, gc=False):
    """The live state a decision needs. The router reads it and never changes it.

    `workers` lists live workers only, in registration order; `backlog[digest]` is the model's
    queue, head first; `arrival_rate[digest]` is submissions per second (from the demand table).
    """

    workers: list[WorkerView] = msgspec.field(default_factory=list)
    backlog: dict[str, list[BacklogEntry]] = msgspec.field(default_factory=dict)
    arrival_rate: dict[str, float] = msgspec.field(default_factory=dict)

    def worker(self, name: str) -> WorkerView | None:
        """The live worker called `name`, or None."""
        for w in self.workers:
            if w.name == name:
                return w
        return None

    def holders(self, digest: str) -> list[WorkerView]:
        """Live workers that serve `digest`, in registration order."""
        return [w for w in self.workers if digest in w.holds]


class Service(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Expected service of one task on one worker, term by term (seconds)."""

    load_s: float
    prompt_s: float
    decode_s: float
    output_tokens: float

    @property
    def total_s(self) -> float:
        return self.load_s + self.prompt_s + self.decode_s


def expected_output(est: Estimator, digest: str, domain: str, max_tokens: int | None) -> float:
    """Expected output tokens, capped by the request's max tokens."""
    out = est.output_tokens(digest, domain).value
    return out if max_tokens is None else min(out, float(max_tokens))


def service(
    est: Estimator,
    worker: str,
    digest: str,
    *,
    domain: str = "general",
    prompt_tokens: int | None = None,
    max_tokens: int | None = None,
    loaded: bool = True,
    params: PlanParams | None = None,
) -> Service:
    """Expected service of a task of `digest` on `worker`, with its terms."""
    p = params or PlanParams()
    sp = est.speed(worker, digest)
    out = expected_output(est, digest, domain, max_tokens)
    prompt = p.default_prompt_tokens if prompt_tokens is None else prompt_tokens
    return Service(
        load_s=0.0 if loaded else sp.load_s.value,
        prompt_s=prompt / sp.prompt_tps.value,
        decode_s=out / sp.decode_tps.value,
        output_tokens=out,
    )


class _Coef(msgspec.Struct, kw_only=True, gc=False):
    """Per (worker, digest, domain): service = load·[not loaded] + p·per_prompt + min(out, max)·per_out."""

    load_s: float
    per_prompt: float
    per_out: float
    out: float

    def seconds(self, prompt_tokens: int, max_tokens: int | None, loaded: bool) -> float:
        out = self.out if max_tokens is None or max_tokens >= self.out else float(max_tokens)
        return (0.0 if loaded else self.load_s) + prompt_tokens * self.per_prompt + out * self.per_out


def _coef(est: Estimator, worker: str, digest: str, domain: str) -> _Coef:
    key = (worker, digest, domain)
    hit = est.memo.get(key)
    if isinstance(hit, _Coef):
        return hit
    sp = est.speed(worker, digest)
    coef = _Coef(
        load_s=sp.load_s.value,
        per_prompt=1.0 / sp.prompt_tps.value,
        per_out=1.0 / sp.decode_tps.value,
        out=est.output_tokens(digest, domain).value,
    )
    est.memo[key] = coef
    return coef


def slot_free_times(
    worker: WorkerView, est: Estimator, now_ms: int, params: PlanParams | None = None
) -> list[float]:
    """When each of the worker's slots is expected free, seconds from now, earliest first."""
    p = params or PlanParams()
    if not worker.running:
        return [0.0] * max(1, worker.slots)
    remaining: list[float] = []
    for t in worker.running:
        expected = t.expected_s
        if expected is None:
            prompt = p.default_prompt_tokens if t.prompt_tokens is None else t.prompt_tokens
            expected = _coef(est, worker.name, t.digest, t.domain).seconds(prompt, t.max_tokens, True)
        elapsed = max(0.0, (now_ms - t.started_at_ms) / 1000.0)
        remaining.append(max(expected - elapsed, p.overdue_fraction * expected))
    remaining.sort()
    slots = max(1, worker.slots)
    free = [0.0] * max(0, slots - len(remaining)) + remaining[:slots]
    # More running than slots (it serves several queues): the extra ones wait for a slot.
    for extra in remaining[slots:]:
        i = free.index(min(free))
        free[i] += extra
    free.sort()
    return free


class Assignment(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One queued task in the plan: who runs it, when it starts and finishes (s from now)."""

    task_id: str
    worker: str
    start_s: float
    finish_s: float


class Plan(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """The backlog of one model assigned in order; `free_s[worker]` is each slot's free time after it."""

    digest: str
    assignments: list[Assignment]
    free_s: dict[str, list[float]]

    def first_for(self, worker: str) -> Assignment | None:
        """The first task the plan gives `worker`, or None."""
        for a in self.assignments:
            if a.worker == worker:
                return a
        return None

    def to_dict(self) -> dict[str, object]:
        return {
            "digest": self.digest,
            "backlog": len(self.assignments),
            "assignments": [
                {"task_id": a.task_id, "worker": a.worker, "start_s": a.start_s, "finish_s": a.finish_s}
                for a in self.assignments
            ],
            "makespan_s": max((a.finish_s for a in self.assignments), default=0.0),
        }


class PlanState:
    """Mutable slot state of the holders of one model while a plan is laid out."""

    __slots__ = ("_digest", "_est", "coefs", "default_prompt", "free", "loaded", "names")

    def __init__(
        self,
        holders: Sequence[WorkerView],
        est: Estimator,
        digest: str,
        now_ms: int,
        params: PlanParams,
        free: Mapping[str, list[float]] | None = None,
    ) -> None:
        self.names = [w.name for w in holders]
        known = free or {}
        self.free = [
            list(known[w.name]) if w.name in known else slot_free_times(w, est, now_ms, params)
            for w in holders
        ]
        self.loaded = [digest in w.loaded for w in holders]
        self.coefs: dict[str, list[_Coef]] = {}
        self.default_prompt = params.default_prompt_tokens
        self._est = est
        self._digest = digest

    def coefs_for(self, domain: str) -> list[_Coef]:
        c = self.coefs.get(domain)
        if c is None:
            c = [_coef(self._est, n, self._digest, domain) for n in self.names]
            self.coefs[domain] = c
        return c

    def best(self, entry: BacklogEntry, ready_s: float = 0.0) -> tuple[int, float, float]:
        """(holder index, start, finish) of the slot that would finish `entry` earliest."""
        coefs = self.coefs_for(entry.domain)
        prompt = self.default_prompt if entry.prompt_tokens is None else entry.prompt_tokens
        cap = entry.max_tokens
        best_i, best_start, best_finish = -1, 0.0, math.inf
        free, loaded = self.free, self.loaded
        for i, c in enumerate(coefs):
            start = free[i][0]
            if start < ready_s:
                start = ready_s
            out = c.out if cap is None or cap >= c.out else cap
            finish = start + prompt * c.per_prompt + out * c.per_out + (0.0 if loaded[i] else c.load_s)
            if finish < best_finish:
                best_i, best_start, best_finish = i, start, finish
        return best_i, best_start, best_finish

    def best_on(self, i: int, entry: BacklogEntry, ready_s: float = 0.0) -> float:
        """When holder `i` would finish `entry` if it were given it next."""
        c = self.coefs_for(entry.domain)[i]
        prompt = self.default_prompt if entry.prompt_tokens is None else entry.prompt_tokens
        return max(self.free[i][0], ready_s) + c.seconds(prompt, entry.max_tokens, self.loaded[i])

    def assign(self, i: int, finish: float) -> None:
        slots = self.free[i]
        heapq.heapreplace(slots, finish)
        self.loaded[i] = True


def plan_queue(
    view: FleetView,
    est: Estimator,
    digest: str,
    now_ms: int,
    *,
    backlog: Iterable[BacklogEntry] | None = None,
    params: PlanParams | None = None,
    free: Mapping[str, list[float]] | None = None,
) -> Plan:
    """Assign `digest`'s backlog (or the given entries) in order to the holder finishing each earliest.

    `free`: each worker's slot free times (`slot_free_times`) when the caller already has them.
    """
    p = params or PlanParams()
    holders = view.holders(digest)
    entries = view.backlog.get(digest, []) if backlog is None else backlog
    if not holders:
        return Plan(digest=digest, assignments=[], free_s={})
    state = PlanState(holders, est, digest, now_ms, p, free=free)
    out: list[Assignment] = []
    for e in entries:
        i, start, finish = state.best(e)
        state.assign(i, finish)
        out.append(Assignment(task_id=e.task_id, worker=state.names[i], start_s=start, finish_s=finish))
    return Plan(digest=digest, assignments=out, free_s=dict(zip(state.names, state.free, strict=True)))


def arrival_rate(snapshot: Snapshot, digest: str, now_ms: int, half_life_s: float | None = None) -> float:
    """Recent submissions per second of `digest`: decayed count over the decay's mean life."""
    row = snapshot.demand.get(digest)
    if row is None:
        return 0.0
    # The demand table is folded with its own short half-life; the weight must decay with the same.
    hl = half_life_s or float(getattr(snapshot, "demand_half_life_s", snapshot.half_life_s))
    return row.arrivals.weight_at(now_ms, hl) / (hl / math.log(2.0))


def fleet_view(
    snapshot: Snapshot,
    now_ms: int,
    *,
    backlog: Mapping[str, Sequence[BacklogEntry]],
    running: Mapping[str, RunningTask],
    live: Iterable[str] | None = None,
    params: PlanParams | None = None,
) -> FleetView:
    """A FleetView from the fleet table plus the live facts only Redis has.

    `backlog`: each model's queued entries, head first. `running`: task id -> RunningTask for
    the ids in each FleetRow's `in_flight` (a task id missing there is counted by its row anyway,
    as a task started now). `live`: names of workers whose lease is alive; None: status "online".
    Resource metrics are deliberately not read.
    """
    p = params or PlanParams()
    if live is None and getattr(snapshot, "live", None):
        live = list(snapshot.live)
    alive = set(live) if live is not None else None
    workers: list[WorkerView] = []
    for row in snapshot.fleet.values():
        if (alive is not None and row.worker not in alive) or (alive is None and row.status != "online"):
            continue
        inventory = row.inventory.value if isinstance(row.inventory.value, dict) else {}
        serves = row.serves.value
        held = {str(d) for name, d in inventory.items() if serves is None or name in serves}  # type: ignore[operator]
        loaded_value = row.loaded.value
        loaded = {str(d) for d in loaded_value} if isinstance(loaded_value, list) else set()
        slots_value = row.slots.value
        slots = slots_value if isinstance(slots_value, int) and slots_value > 0 else 1
        tasks = [
            running.get(t) or RunningTask(task_id=t, digest=next(iter(held), ""), started_at_ms=now_ms)
            for t in row.in_flight
        ]
        workers.append(WorkerView(name=row.worker, slots=slots, holds=held, loaded=loaded, running=tasks))
    digests = set(backlog) | {d for w in workers for d in w.holds}
    return FleetView(
        workers=workers,
        backlog={d: list(entries) for d, entries in backlog.items()},
        arrival_rate={d: arrival_rate(snapshot, d, now_ms, p.demand_half_life_s) for d in digests},
    )
