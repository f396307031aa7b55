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
    # Its id in the queue ('' where no queue holds it: the simulator's, a preview's); a worker takes
    # the entry its gate decided on only if it is still the head (dispatch.queues.TaskQueues.take).
    entry_id: str = ""


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
    prompt_tps: float
    decode_tps: float

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
        prompt_tps=sp.prompt_tps.value,
        decode_tps=sp.decode_tps.value,
    )
    est.memo[key] = coef
    return coef


Factors = tuple[float, ...]


def _factors(est: Estimator, worker: str, digest: str, slots: int) -> Factors | None:
    """Wall seconds per expected second with k tasks at once (index k, 1..slots), or None when
    running several at once slows none of them (one slot, or no evidence of sharing)."""
    if slots <= 1:
        return None
    key = (worker, digest, slots)
    memo = est.memo
    if key in memo:
        return memo[key]  # type: ignore[return-value]
    conc = est.concurrency(worker, digest)
    fac = None if conc.exponent.value == 1.0 else tuple(conc.factor(max(1, k)) for k in range(slots + 1))
    memo[key] = fac
    return fac


def _shared_ends(start: float, works: Sequence[float], fac: Factors) -> list[float]:
    """When each of several tasks running together from `start` ends, `works` in expected seconds
    at the speed one alone would have, each slowed by how many share the machine at each moment."""
    order = sorted(range(len(works)), key=works.__getitem__)
    ends = [0.0] * len(works)
    t, done, k = start, 0.0, len(works)
    for j in order:
        t += (works[j] - done) * fac[min(k, len(fac) - 1)]
        done = works[j]
        ends[j] = t
        k -= 1
    return ends


def _works_left(start: float, ends: Sequence[float], fac: Factors) -> list[float]:
    """The inverse of `_shared_ends`: the work left at `start` of tasks sharing until `ends` (sorted)."""
    out: list[float] = []
    t, acc, k = start, 0.0, len(ends)
    for e in ends:
        acc += (e - t) / fac[min(k, len(fac) - 1)]
        out.append(acc)
        t, k = e, k - 1
    return out


def slot_free_times(
    worker: WorkerView, est: Estimator, now_ms: int, params: PlanParams | None = None
) -> list[float]:
    """When each of the worker's slots is expected free, seconds from now, earliest first."""
    p = params or PlanParams()
    if not worker.running:
        return [0.0] * max(1, worker.slots)
    slots = max(1, worker.slots)
    fac = None
    for t in worker.running:
        fac = _factors(est, worker.name, t.digest, slots)
        if fac is not None:
            break
    m = min(len(worker.running), slots)
    share = 1.0 if fac is None else fac[m]
    remaining: list[float] = []
    for t in worker.running:
        expected = t.expected_s
        if expected is None:
            prompt = p.default_prompt_tokens if t.prompt_tokens is None else t.prompt_tokens
            expected = _coef(est, worker.name, t.digest, t.domain).seconds(prompt, t.max_tokens, True)
        elapsed = max(0.0, (now_ms - t.started_at_ms) / 1000.0)
        if fac is None:
            remaining.append(max(expected - elapsed, p.overdue_fraction * expected))
        else:
            # Work done so far went at the speed of `m` sharing: the rest is in solo-expected seconds.
            remaining.append(max(expected - elapsed / share, p.overdue_fraction * expected))
    remaining.sort()
    if fac is not None:
        remaining[:slots] = _shared_ends(0.0, remaining[:slots], fac)
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


class _Speeds(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Per holder of one model (in holder order), what the plan multiplies by: seconds per prompt
    and per output token, load seconds, the speeds themselves, and the sharing factors."""

    per_prompt: list[float]
    per_out: list[float]
    load_s: list[float]
    prompt_tps: list[float]
    decode_tps: list[float]
    fac: list[Factors | None]
    shared: bool


def _speeds(est: Estimator, holders: Sequence[WorkerView], digest: str) -> _Speeds:
    names = tuple([w.name for w in holders])
    slots = tuple([w.slots for w in holders])
    key = ("#holders", digest, names, slots)
    hit = est.memo.get(key)
    if isinstance(hit, _Speeds):
        return hit
    sps = [est.speed(n, digest) for n in names]
    fac = [_factors(est, n, digest, max(1, s)) for n, s in zip(names, slots, strict=True)]
    out = _Speeds(
        per_prompt=[1.0 / sp.prompt_tps.value for sp in sps],
        per_out=[1.0 / sp.decode_tps.value for sp in sps],
        load_s=[sp.load_s.value for sp in sps],
        prompt_tps=[sp.prompt_tps.value for sp in sps],
        decode_tps=[sp.decode_tps.value for sp in sps],
        fac=fac,
        shared=any(f is not None for f in fac),
    )
    est.memo[key] = out
    return out


class PlanState:
    """Mutable slot state of the holders of one model while a plan is laid out.

    `free[i]` is holder i's slot free times as a heap (earliest first), `head[i]` its earliest.
    On a worker whose slots slow each other down (`fac[i]` not None) a task's finish is worked out
    by sharing the machine with whatever its other slots still run, and giving it a task stretches
    those. Output tokens belong to the model, so one figure per domain serves every holder.
    """

    __slots__ = (
        "_digest",
        "_est",
        "_own",
        "default_prompt",
        "fac",
        "free",
        "head",
        "load_left",
        "loaded",
        "names",
        "outs",
        "shared",
        "sp",
    )

    def __init__(
        self,
        holders: Sequence[WorkerView],
        est: Estimator,
        digest: str,
        now_ms: int,
        params: PlanParams,
        free: Mapping[str, list[float]] | None = None,
    ) -> None:
        self.names = names = [w.name for w in holders]
        # Slot lists are shared with `free` until a task is assigned there (most holders get none).
        self._own: set[int] = set()
        try:
            self.free = [free[n] for n in names]  # type: ignore[index]
        except (KeyError, TypeError):
            known = free or {}
            self.free = [
                known[w.name] if w.name in known else slot_free_times(w, est, now_ms, params) for w in holders
            ]
        self.head = [f[0] for f in self.free]
        self.loaded = [digest in w.loaded for w in holders]
        self.sp = _speeds(est, holders, digest)
        self.fac = self.sp.fac
        self.shared = self.sp.shared
        # Load seconds a task would pay there: none once the model is loaded (or planned there).
        self.load_left = [0.0 if ld else s for ld, s in zip(self.loaded, self.sp.load_s, strict=True)]
        self.outs: dict[str, float] = {}
        self.default_prompt = params.default_prompt_tokens
        self._est = est
        self._digest = digest

    def _out(self, entry: BacklogEntry) -> float:
        out = self.outs.get(entry.domain)
        if out is None:
            out = self._est.output_tokens(self._digest, entry.domain).value
            self.outs[entry.domain] = out
        cap = entry.max_tokens
        return out if cap is None or cap >= out else cap

    def _shared_finish(self, i: int, start: float, work: float) -> float:
        return self._shared(i, start, work)[0]

    def _shared(self, i: int, start: float, work: float) -> tuple[float, float]:
        """(finish of a task of `work` started on holder i at `start`, how much later the tasks
        it shares the machine with finish because of it, summed)."""
        fac = self.fac[i]
        assert fac is not None
        busy = sorted(f for f in self.free[i][1:] if f > start)
        if not busy:
            return start + work * fac[1], 0.0
        works = _works_left(start, busy, fac)
        works.append(work)
        ends = _shared_ends(start, works, fac)
        return ends[-1], sum(ends[:-1]) - sum(busy)

    def best(self, entry: BacklogEntry) -> tuple[int, float, float]:
        """(holder index, start, finish) of the slot that would finish `entry` earliest."""
        prompt = self.default_prompt if entry.prompt_tokens is None else entry.prompt_tokens
        out = self._out(entry)
        sp = self.sp
        finishes = [
            h + prompt * a + out * b + ld
            for h, a, b, ld in zip(self.head, sp.per_prompt, sp.per_out, self.load_left, strict=True)
        ]
        if not self.shared:
            finish = min(finishes)
            # The first of equals wins: holders are in registration order.
            i = finishes.index(finish)
            return i, self.head[i], finish
        # On a shared machine the task also delays the ones already there: the system pays both
        # (the head finishing sooner is not worth more in total waiting than it costs them).
        costs = list(finishes)
        for i, fac in enumerate(self.fac):
            if fac is not None:
                work = prompt * sp.per_prompt[i] + out * sp.per_out[i] + self.load_left[i]
                finishes[i], delay = self._shared(i, self.head[i], work)
                costs[i] = finishes[i] + delay
        i = costs.index(min(costs))
        return i, self.head[i], finishes[i]

    def _work(self, i: int, entry: BacklogEntry) -> float:
        prompt = self.default_prompt if entry.prompt_tokens is None else entry.prompt_tokens
        return prompt * self.sp.per_prompt[i] + self._out(entry) * self.sp.per_out[i] + self.load_left[i]

    def best_on(self, i: int, entry: BacklogEntry) -> float:
        """When holder `i` would finish `entry` if it were given it next."""
        work = self._work(i, entry)
        start = self.head[i]
        return start + work if self.fac[i] is None else self._shared_finish(i, start, work)

    def assign(self, i: int, finish: float, start: float = 0.0, entry: BacklogEntry | None = None) -> None:
        """Give holder `i` the task `best` placed there (from `start` to `finish`)."""
        slots = self.free[i]
        if i not in self._own:
            slots = self.free[i] = list(slots)
            self._own.add(i)
        fac = self.fac[i]
        if fac is None or entry is None:
            heapq.heapreplace(slots, finish)
        else:
            # The tasks it shares the machine with now take longer: their ends move too.
            busy = sorted(f for f in slots[1:] if f > start)
            idle = [f for f in slots[1:] if f <= start]
            works = _works_left(start, busy, fac)
            works.append(self._work(i, entry))
            slots[:] = sorted([*idle, *_shared_ends(start, works, fac)])
        self.head[i] = slots[0]
        self.loaded[i] = True
        self.load_left[i] = 0.0

    def lay_out(self, entries: Iterable[BacklogEntry], record: bool = False) -> list[Assignment]:
        """Assign `entries` in order, each to the holder finishing it earliest; the assignments
        when `record` (a ranking needs only the slots' state afterwards)."""
        out: list[Assignment] = []
        names = self.names
        if self.shared:
            for e in entries:
                i, start, finish = self.best(e)
                self.assign(i, finish, start, e)
                if record:
                    out.append(Assignment(task_id=e.task_id, worker=names[i], start_s=start, finish_s=finish))
            return out
        # `best` and `assign` inlined: this loop is most of a decision's time.
        head, load_left, free, own, loaded = self.head, self.load_left, self.free, self._own, self.loaded
        per_prompt, per_out = self.sp.per_prompt, self.sp.per_out
        default_prompt, replace = self.default_prompt, heapq.heapreplace
        for e in entries:
            prompt = default_prompt if e.prompt_tokens is None else e.prompt_tokens
            o = self._out(e)
            finishes = [
                h + prompt * a + o * b + ld
                for h, a, b, ld in zip(head, per_prompt, per_out, load_left, strict=True)
            ]
            finish = min(finishes)
            i = finishes.index(finish)
            start = head[i]
            slots = free[i]
            if i not in own:
                slots = free[i] = list(slots)
                own.add(i)
            replace(slots, finish)
            head[i] = slots[0]
            loaded[i] = True
            load_left[i] = 0.0
            if record:
                out.append(Assignment(task_id=e.task_id, worker=names[i], start_s=start, finish_s=finish))
        return out

    def new_task(self, i: int, prompt_tokens: int, out: float) -> tuple[float, float, float, float, float]:
        """(wait, load, prompt, decode, finish) seconds of a new task given to holder `i` after the plan."""
        wait = self.head[i]
        load = self.load_left[i]
        prompt_s = prompt_tokens / self.sp.prompt_tps[i]
        decode_s = out / self.sp.decode_tps[i]
        if self.fac[i] is None:
            return wait, load, prompt_s, decode_s, wait + load + prompt_s + decode_s
        return wait, load, prompt_s, decode_s, self._shared_finish(i, wait, load + prompt_s + decode_s)

    def finishes(self, prompt_tokens: int, out: float) -> list[float]:
        """`new_task`'s finish on every holder (the same arithmetic, without the terms)."""
        sp = self.sp
        res = [
            h + ld + prompt_tokens / p + out / d
            for h, ld, p, d in zip(self.head, self.load_left, sp.prompt_tps, sp.decode_tps, strict=True)
        ]
        if self.shared:
            for i, fac in enumerate(self.fac):
                if fac is not None:
                    work = self.load_left[i] + prompt_tokens / sp.prompt_tps[i] + out / sp.decode_tps[i]
                    res[i] = self._shared_finish(i, self.head[i], work)
        return res


def holders_by_digest(view: FleetView) -> dict[str, list[WorkerView]]:
    """Every digest's live holders in registration order: one pass over the fleet for all models."""
    out: dict[str, list[WorkerView]] = {}
    for w in view.workers:
        for d in w.holds:
            lst = out.get(d)
            if lst is None:
                out[d] = [w]
            else:
                lst.append(w)
    return out


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
    plan, _ = plan_state(view, est, digest, now_ms, backlog=backlog, params=params, free=free)
    return plan


def plan_state(
    view: FleetView,
    est: Estimator,
    digest: str,
    now_ms: int,
    *,
    backlog: Iterable[BacklogEntry] | None = None,
    params: PlanParams | None = None,
    free: Mapping[str, list[float]] | None = None,
    holders: Sequence[WorkerView] | None = None,
) -> tuple[Plan, PlanState | None]:
    """`plan_queue`, with the slot state after it (None without a holder) for ranking a new task."""
    p = params or PlanParams()
    hs = view.holders(digest) if holders is None else holders
    entries = view.backlog.get(digest, []) if backlog is None else backlog
    if not hs:
        return Plan(digest=digest, assignments=[], free_s={}), None
    state = PlanState(hs, est, digest, now_ms, p, free=free)
    out = state.lay_out(entries, record=True)
    return Plan(digest=digest, assignments=out, free_s=dict(zip(state.names, state.free, strict=True))), state


def arrival_rate(snapshot: Snapshot, digest: str, now_ms: int) -> float:
    """Recent submissions per second of `digest`: decayed count over the decay's mean life."""
    row = snapshot.demand.get(digest)
    if row is None:
        return 0.0
    # The demand table is folded with its own short half-life; the weight must decay with the same.
    hl = snapshot.demand_half_life_s
    return row.arrivals.weight_at(now_ms, hl) / (hl / math.log(2.0))


def arrival_rates(snapshot: Snapshot, digests: Iterable[str], now_ms: int) -> dict[str, float]:
    """`arrival_rate` of each of `digests`."""
    return {d: arrival_rate(snapshot, d, now_ms) for d in digests}
