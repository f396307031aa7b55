"""The dispatch plan: who would finish each queued task earliest, counting what each holder runs.

Service time of a task on a worker = load seconds if the model is not loaded there + prompt tokens
/ prompt tok/s + expected output tokens (capped by the task's max tokens) / decode tok/s. A slot
running a task is expected free at (expected service - elapsed), never sooner than a fraction of
the expected service: a task past its estimate is still running, so it is not "free now".

Overdue work is evidence. A task past its estimate is a censored sample (it has run at least this
long), so it is expected to need what a task of the measured length spread (a lognormal fitted to
the length table's mean and variance) still needs on average once it is that long
(`Estimator.output_left`). A worker running one beyond the time the plausibly longest output (the
99th percentile of that spread, or the task's own max_tokens, whichever is shorter; never under
`overdue_tolerance` times its estimate) would take is planned slower for new work by that ratio: a
machine that silently slowed stops getting work before its first slow sample completes, while a
long answer, which says nothing about the machine, does not count against it.

A model's load is charged where it is not loaded, and on a machine with room for one model
(`WorkerView.max_loaded == 1`) also where another model goes first (`runs_another_first`): one it
runs now, or one it holds whose queue head waited longer than this model's next task, because its
gate turns to the queue that waited longest and loading that model evicts this one. Plans are per
model; this is how one model's plan sees the others' queues, from the same backlog the gate and
`auto` read. It does not foresee a later switch (the other model's task arriving after this one's
first task there), and it charges the load even where that older task will go to another holder.

The plan assigns the backlog in queue order, each task to the live holder whose slot would finish
it earliest; a paced task (a person reads its answer as it streams: `BacklogEntry.paced`) to the
one where its reader would finish reading it earliest. A reader who starts at the first token
and reads at `PlanParams.reading_tps` finishes at first token + output / min(decode tok/s,
reading tok/s): past the first token, decoding faster than they read gains them nothing, so a
machine that starts the answer sooner and streams it at least at reading pace serves them
better than a faster one they would wait for. This is the quality of experience Andes (Liu et
al., 2024, arXiv:2404.16283) defines for streamed text; the slot is still planned busy until the
task's real finish. Times are seconds from `now`. `FleetView` holds the live facts the ledger projections
do not (the queues' backlog and the running tasks' start times); the caller fills it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, TypeVar, cast

import msgspec

from projections.snapshot import Snapshot
from router.estimate import Estimator, SpeedEstimate
from router.prefix import PromptChain, SlotCache, tokens_of_blocks


class PlanParams(msgspec.Struct, kw_only=True, frozen=True):
    """Assumptions of the plan where a fact is missing."""

    # Prompt size assumed for a task whose prompt tokens were not counted.
    default_prompt_tokens: int = 64
    # A running task past its estimate is expected to need at least this share of it again.
    overdue_fraction: float = 0.1
    # A running task beyond this multiple of its estimate slows the worker down in the plan.
    overdue_tolerance: float = 2.0
    # Find each task's holder by computing every holder's finish, and for `auto` lay out every
    # model's queue. By default the walk leaves out holders that cannot finish a task first (the
    # same plan, bit for bit: PlanState.walk) and `auto` the queues of models that cannot win (the
    # same choice; those models show bounds: router.choose.ModelCandidate). This is the
    # reference the tests and benchmarks compare the default against.
    full_walk: bool = False
    # Tokens per second a person reads a streamed answer at (0: no task is paced; each finishes
    # as soon as it can). Adults read non-fiction silently at about 238 words a minute
    # (Brysbaert, 2019, a meta-analysis of 190 studies), about 5.3 tokens/s at the 0.75 words a
    # token of English under common LLM tokenizers.
    reading_tps: float = 5.3


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
    # False: its backend cannot say what is loaded; `loaded` is then no evidence of anything.
    loaded_known: bool = True
    # How many of its models fit in its memory at once; 1: running one evicts any other. None: unknown.
    max_loaded: int | None = None
    # What its backend's slots hold of earlier prompts (router.prefix); empty: nothing known.
    cache: list[SlotCache] = msgspec.field(default_factory=list)


def load_to_pay(
    worker: WorkerView,
    digest: str,
    est: Estimator,
    load_s: float,
    backlog: Mapping[str, Sequence[BacklogEntry]] | None = None,
    head_ms: int | None = None,
) -> float:
    """Seconds a task of `digest` on `worker` is expected to spend loading the model first.

    Nothing where it is loaded, unless the machine has room for one model and another goes first
    (`runs_another_first`: that one evicts it). `load_s` where it is not. For a backend that cannot
    say what is loaded, the expected load its own runs have shown (Estimator.unknown_load: nothing
    until a run showed one).
    """
    if not worker.loaded_known:
        return est.unknown_load(worker.name, digest).value
    if digest not in worker.loaded:
        return load_s
    if runs_another_first(worker, digest, backlog, head_ms):
        return load_s
    return 0.0


def runs_another_first(
    worker: WorkerView,
    digest: str,
    backlog: Mapping[str, Sequence[BacklogEntry]] | None = None,
    head_ms: int | None = None,
) -> bool:
    """On a machine with room for one model: whether it runs another model before the next task of
    `digest` (whose queue's head was enqueued at `head_ms`), evicting `digest`.

    It does when it runs another model now, or when another model it holds has a queue whose head
    waited longer: its gate looks at the queue that waited longest first (router.gate._head_queue),
    so it takes that task or waits for it to go before it turns to `digest`. That it may wait while
    another holder takes that task is not counted (the cost is one load, on one machine).
    """
    if worker.max_loaded != 1:
        return False
    if any(t.digest != digest for t in worker.running):
        return True
    if not backlog or head_ms is None:
        return False
    for other in worker.holds:
        if other != digest:
            queue = backlog.get(other)
            if queue and queue[0].enqueued_at_ms < head_ms:
                return True
    return False


class BacklogEntry(msgspec.Struct, kw_only=True, gc=False):
    """A task waiting in a model's shared queue (from TaskSubmitted and the queue's order)."""

    task_id: str
    digest: str
    enqueued_at_ms: int
    domain: str = "general"
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    # Its id in the queue ('' where no queue holds it: the simulator's, a preview's); a worker takes
    # the entry its gate decided on only if it is still the head (tasks.store.TaskStore.take).
    entry_id: str = ""
    # The queue that holds it (one of its model's band queues; '' where no queue holds it). A
    # model's backlog lists its band queues in serving order: higher priority first, then the
    # earlier fair-share round, each queue head first.
    queue: str = ""
    # Its prompt's chain (router.prefix): a worker whose idle slot holds a prefix of it evaluates
    # only the rest. None: not known (a task without messages, or from before chains).
    prefix: PromptChain | None = None
    # A person reads its answer as it streams (an API client streaming a chat or a completion):
    # placed where its reader finishes reading first (module docstring), not where it finishes.
    paced: bool = False


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
    """Expected output tokens, capped by the request's max tokens (`Estimator.capped_output`)."""
    return est.capped_output(digest, domain, max_tokens).value


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


def _pareto(per_prompt: Sequence[float], per_out: Sequence[float]) -> list[tuple[float, float]]:
    """The (seconds per prompt token, per output token) pairs no other pair is at most in both:
    for non-negative token counts the least time over all holders is the least over these, the
    same float, since a dominated pair's products and sum are no smaller."""
    front: list[tuple[float, float]] = []
    for a, b in sorted(zip(per_prompt, per_out, strict=True)):
        if not front or b < front[-1][1]:
            front.append((a, b))
    return front


def _spread(values: list[_V], most: int) -> list[_V]:
    """At most about `most` of the sorted `values`, evenly spread, the least first (each class's
    reference is the least value it holds)."""
    return values if len(values) <= most else values[:: -(-len(values) // most)]


_V = TypeVar("_V", int, float)


class _Class:
    """One class of a pruned walk's tasks: its least prompt (0 for plain tasks) and output, the
    seconds per output token it compares by, their least, and its heap once built."""

    __slots__ = ("b_min", "by", "heap", "o", "p")

    def __init__(self, p: int, o: float, by: Sequence[float], b_min: float) -> None:
        self.p, self.o, self.by, self.b_min = p, o, by, b_min
        self.heap: list[tuple[float, int, int]] | None = None


# A pruned walk's heap of holders: (key, holder index, version).
_Heap = list[tuple[float, int, int]]
# (holder index, start, finish) of one task in a walk of the backlog.
Step = tuple[int, float, float]

# A pruned walk first builds a heap of the holders: below these many tasks or holders, computing
# every holder's finish for every task costs less (measured with bench/scale.py's fleets).
PRUNE_MIN_TASKS = 8
PRUNE_MIN_HOLDERS = 16
# At most this many output classes (heaps) in a pruned walk; see `PlanState._walk_pruned`.
_OUTPUT_CLASSES = 8
# A holder whose earliest slot frees within this many seconds counts as free now (`guard_paced`).
_FREE_S: Final = 1e-9


def guard_paced(
    costs: Sequence[float], finishes: Sequence[float], firsts: Sequence[float], free: Sequence[bool]
) -> list[float]:
    """A paced task's costs (its reader's finish on each holder), guarded so that pacing never hands
    it to a slower machine while a faster one is free (design rule 13). Where some holder is free,
    only the holders whose first token and finish both come no later than those of the free holder
    that finishes first (and the holder that finishes first of all) keep their reader's finish;
    every other holder is ordered after them all, by its finish. Where none is free, the costs
    stand: the reader's finish decides."""
    n = len(costs)
    free_ones = [i for i in range(n) if free[i]]
    if not free_ones:
        return list(costs)
    fastest_free = min(free_ones, key=lambda i: (finishes[i], i))
    first_of_all = min(range(n), key=lambda i: (finishes[i], i))
    f_first, f_finish = firsts[fastest_free], finishes[fastest_free]
    allowed = [i == first_of_all or (firsts[i] <= f_first and finishes[i] <= f_finish) for i in range(n)]
    top = max(c for c, ok in zip(costs, allowed, strict=True) if ok)
    return [c if ok else top + 1.0 + max(0.0, f) for c, f, ok in zip(costs, finishes, allowed, strict=True)]


# A paced kind's prompt classes (heaps); see `PlanState._walk_pruned`.
_PACED_CLASSES = 8
# The relative margin by which a pruning bound must pass the best finish before the holders behind
# it are left out: far above the few units in the last place that rounding a sum of four
# non-negative terms in a different order can move it, far below any difference that matters.
_BOUND_SLACK = 1e-9


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


def _expected_s(worker: WorkerView, t: RunningTask, est: Estimator, p: PlanParams) -> float:
    """Seconds running task `t` is expected to take on `worker`: its own figure, else the estimate."""
    if t.expected_s is not None:
        return t.expected_s
    prompt = p.default_prompt_tokens if t.prompt_tokens is None else t.prompt_tokens
    c = _coef(est, worker.name, t.digest, t.domain)
    if t.max_tokens is None:
        return c.seconds(prompt, None, True)
    # Capped: the expected output under its cap (Estimator.capped_output), as the plan counts it.
    return prompt * c.per_prompt + est.capped_output(t.digest, t.domain, t.max_tokens).value * c.per_out


def slot_free_times(
    worker: WorkerView, est: Estimator, now_ms: int, params: PlanParams | None = None
) -> list[float]:
    """When each of the worker's slots is expected free, seconds from now, earliest first."""
    p = params or PlanParams()
    if not worker.running:
        return [0.0] * max(1, worker.slots)
    return _free_times(worker, est, now_ms, p, [_expected_s(worker, t, est, p) for t in worker.running])


def _free_times(
    worker: WorkerView, est: Estimator, now_ms: int, p: PlanParams, expecteds: Sequence[float]
) -> list[float]:
    """`slot_free_times` of a busy worker, given `_expected_s` of each of its running tasks."""
    slots = max(1, worker.slots)
    fac = None
    for t in worker.running:
        fac = _factors(est, worker.name, t.digest, slots)
        if fac is not None:
            break
    m = min(len(worker.running), slots)
    share = 1.0 if fac is None else fac[m]
    remaining: list[float] = []
    for t, expected in zip(worker.running, expecteds, strict=True):
        elapsed = max(0.0, (now_ms - t.started_at_ms) / 1000.0)
        # Never before now, whatever a malformed task says (a negative expected time or size):
        # the plan's floors on a finish count on free times of 0 or later. Work done so far went at
        # the speed of `m` sharing: the rest is in solo-expected seconds.
        done = elapsed if fac is None else elapsed / share
        if expected > 0.0 and done > expected:
            # Past its estimate: a censored sample of its length (it ran at least this long), so
            # it needs what a task that long still needs on average (the lengths' own tail).
            left = expected * est.output_left(t.digest, t.domain, done / expected)
        else:
            left = expected - done
        remaining.append(max(left, p.overdue_fraction * expected, 0.0))
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


def _running_state(
    worker: WorkerView,
    est: Estimator,
    now_ms: int,
    p: PlanParams,
    expecteds: Sequence[float] | None = None,
) -> tuple[list[float], float]:
    """(`slot_free_times`, `overdue_slowdown`) of a busy worker, in one pass over its running tasks
    (`expecteds`: their `_expected_s`, where the caller has them).

    Most busy workers run one task on slots that do not slow each other down: that case is worked
    out inline, with the same arithmetic as `_free_times` (this runs for every busy holder of every
    queue a decision lays out)."""
    running = worker.running
    if len(running) == 1:
        t = running[0]
        slots = max(1, worker.slots)
        if slots == 1 or _factors(est, worker.name, t.digest, slots) is None:
            expected = _expected_s(worker, t, est, p) if expecteds is None else expecteds[0]
            elapsed = max(0.0, (now_ms - t.started_at_ms) / 1000.0)
            if expected > 0.0 and elapsed > expected:
                left = expected * est.output_left(t.digest, t.domain, elapsed / expected)
            else:
                left = expected - elapsed
            free = [0.0] * (slots - 1)
            free.append(max(left, p.overdue_fraction * expected, 0.0))
            # `_slowdown`'s first test, inline: most tasks are within the tolerance.
            if expected <= 0.0 or elapsed / expected <= p.overdue_tolerance:
                return free, 1.0
            return free, _slowdown(worker, est, now_ms, p, (expected,))
    if expecteds is None:
        expecteds = [_expected_s(worker, t, est, p) for t in running]
    return _free_times(worker, est, now_ms, p, expecteds), _slowdown(worker, est, now_ms, p, expecteds)


def overdue_slowdown(
    worker: WorkerView, est: Estimator, now_ms: int, params: PlanParams | None = None
) -> float:
    """How much slower than estimated the worker's running tasks show it to be (1.0: no sign):
    the most overdue task's elapsed time over `overdue_tolerance` times its estimate."""
    p = params or PlanParams()
    return _slowdown(worker, est, now_ms, p, [_expected_s(worker, t, est, p) for t in worker.running])


def _slowdown(
    worker: WorkerView, est: Estimator, now_ms: int, p: PlanParams, expecteds: Sequence[float]
) -> float:
    """`overdue_slowdown`, given `_expected_s` of each of the worker's running tasks."""
    worst = 1.0
    for t, expected in zip(worker.running, expecteds, strict=True):
        if expected <= 0.0:
            continue
        over = (now_ms - t.started_at_ms) / 1000.0 / expected
        if over <= p.overdue_tolerance:
            continue  # within the tolerance that every tail allows (most tasks: nothing to look up)
        # A long answer is no sign of a slow machine: only time beyond what the plausible longest
        # output (or the task's own cap, whichever is shorter) takes at the estimated speed is.
        tail = est.output_tail(t.digest, t.domain)
        if t.max_tokens is not None:
            c = _coef(est, worker.name, t.digest, t.domain)
            tail = min(tail, max(1.0, t.max_tokens / c.out)) if c.out > 0 else tail
        worst = max(worst, over / max(p.overdue_tolerance, tail))
    return worst


def _slowed(sp: _Speeds, slow: Sequence[tuple[int, float]]) -> _Speeds:
    """`sp` with each listed holder i's speeds divided by its k (`slow`: (i, k) pairs); the rest
    are copied as they are (times 1, bit for bit)."""
    per_prompt, per_out = list(sp.per_prompt), list(sp.per_out)
    prompt_tps, decode_tps = list(sp.prompt_tps), list(sp.decode_tps)
    for i, k in slow:
        per_prompt[i] *= k
        per_out[i] *= k
        prompt_tps[i] /= k
        decode_tps[i] /= k
    return msgspec.structs.replace(
        sp, per_prompt=per_prompt, per_out=per_out, prompt_tps=prompt_tps, decode_tps=decode_tps
    )


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
    # The estimates themselves, with their sources, for a ranking's breakdown.
    estimates: list[SpeedEstimate]


def _speeds(est: Estimator, holders: Sequence[WorkerView], digest: str) -> _Speeds:
    names = tuple(map(_name, holders))
    slots = tuple(map(_slots, holders))
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
        estimates=sps,
    )
    est.memo[key] = out
    return out


class _Fastest(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Of the holders of one model: the fastest prompt and decode speeds, the holder decoding
    fastest, and whether running several tasks at once slows any of them down (with more than one
    slot: this holds whatever their slot counts, so that a lookup needs only their names)."""

    prompt_tps: float
    decode_tps: float
    holder: int
    sharing: bool


def _fastest(est: Estimator, holders: Sequence[WorkerView], digest: str) -> _Fastest:
    names = tuple(map(_name, holders))
    key = ("#fastest", digest, names)
    hit = est.memo.get(key)
    if isinstance(hit, _Fastest):
        return hit
    sps = [est.speed(n, digest) for n in names]
    decode = [sp.decode_tps.value for sp in sps]
    out = _Fastest(
        prompt_tps=max(sp.prompt_tps.value for sp in sps),
        decode_tps=max(decode),
        holder=decode.index(max(decode)),
        sharing=any(est.concurrency(n, digest).exponent.value != 1.0 for n in names),
    )
    est.memo[key] = out
    return out


class _Template:
    """What a `PlanState` of one model's holders starts from that depends only on the holders and
    the estimator: their names and speeds, idle holders' slots (free now) and every holder's load
    (None-free slots and a 0 head stand for the busy ones, filled in per decision), and which
    holders are busy or a one-model machine with the model loaded (whose load depends on the
    queues)."""

    __slots__ = (
        "_digest",
        "_est",
        "_expecteds",
        "_holders",
        "_prefixes",
        "busy",
        "free",
        "head",
        "load_left",
        "names",
        "one_model",
        "sp",
    )

    def __init__(self, holders: Sequence[WorkerView], est: Estimator, digest: str) -> None:
        self._est = est
        self._holders = holders
        self._digest = digest
        self._prefixes: _Prefixes | bool | None = False
        # Per default prompt size: each busy holder's running tasks' `_expected_s`.
        self._expecteds: dict[int, list[tuple[float, ...]]] = {}
        self.names = tuple(map(_name, holders))
        self.sp = _speeds(est, holders, digest)
        self.busy = [(i, w) for i, w in enumerate(holders) if w.running]
        idle: list[float] = []
        self.free: list[list[float]] = [idle if w.running else [0.0] * max(1, w.slots) for w in holders]
        self.head = [0.0] * len(holders)
        self.one_model = [
            (i, w)
            for i, w in enumerate(holders)
            if w.loaded_known and w.max_loaded == 1 and digest in w.loaded
        ]
        # Without the queues: a one-model machine's load is worked out per decision (`one_model`).
        self.load_left = [
            load_to_pay(w, digest, est, s) for w, s in zip(holders, self.sp.load_s, strict=True)
        ]

    def expecteds(self, p: PlanParams) -> list[tuple[float, ...]]:
        """`_expected_s` of each busy holder's running tasks (in `busy` order): they depend on the
        estimates and the default prompt size, not on the time."""
        hit = self._expecteds.get(p.default_prompt_tokens)
        if hit is None:
            est = self._est
            hit = self._expecteds[p.default_prompt_tokens] = [
                tuple(_expected_s(w, t, est, p) for t in w.running) for _, w in self.busy
            ]
        return hit

    def prefixes(self) -> _Prefixes | None:
        """What the holders' idle slots hold of earlier prompts; None when none holds anything."""
        if self._prefixes is False:
            self._prefixes = _Prefixes.of(self._holders, self._digest)
        assert not isinstance(self._prefixes, bool)
        return self._prefixes


class _Prefixes:
    """The holders' idle slots' checkpoints (router.prefix.SlotCache.marks), by (blocks, hash):
    a task's longest match on every holder costs one lookup per distinct checkpoint position,
    whatever the number of holders."""

    __slots__ = ("_matches", "by_mark", "idle", "positions")

    def __init__(self, by_mark: dict[tuple[int, int], list[tuple[int, int]]], idle: list[int]) -> None:
        # (blocks, hash) -> the (holder index, slot index) of every idle slot with that checkpoint.
        self.by_mark = by_mark
        # Longest first: a slot's first match is its longest.
        self.positions = sorted({b for b, _ in by_mark}, reverse=True)
        self.idle = idle
        # Per queued task's chain (by identity; the chain is kept so that its id is not reused):
        # every matching slot. A queue is laid out again on every decision while these holders
        # last, and its tasks' chains with it.
        self._matches: dict[int, tuple[PromptChain, dict[int, list[tuple[int, int]]]]] = {}

    @classmethod
    def of(cls, holders: Sequence[WorkerView], digest: str) -> _Prefixes | None:
        by_mark: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i, w in enumerate(holders):
            for k, slot in enumerate(w.cache):
                if slot.busy or (slot.digest and slot.digest != digest):
                    continue
                for mark in slot.marks:
                    by_mark.setdefault(mark, []).append((i, k))
        if not by_mark:
            return None
        idle = [max(0, w.slots - len(w.running)) for w in holders]
        return cls(by_mark, idle)

    def _longest(self, chain: PromptChain) -> dict[int, list[tuple[int, int]]]:
        """Holder index -> (blocks, slot index) of each of its idle slots holding a prefix of
        `chain`, longest first."""
        hit = self._matches.get(id(chain))
        if hit is not None and hit[0] is chain:
            return hit[1]
        hashes = chain.hashes
        n = len(hashes)
        seen: set[tuple[int, int]] = set()
        out: dict[int, list[tuple[int, int]]] = {}
        by_mark = self.by_mark
        for pos in self.positions:
            if pos > n:
                continue
            for slot in by_mark.get((pos, hashes[pos - 1]), ()):
                if slot not in seen:
                    seen.add(slot)
                    out.setdefault(slot[0], []).append((pos, slot[1]))
        if len(self._matches) >= _MATCHES_MAX:
            self._matches.clear()
        self._matches[id(chain)] = (chain, out)
        return out

    def blocks(
        self, chain: PromptChain, given: Sequence[int], used: set[tuple[int, int]]
    ) -> dict[int, tuple[int, int]]:
        """Holder index -> (blocks, slot index) of `chain` its idle slot holds, for the holders
        where the slot would still hold them when the task starts: the `given[i]` tasks laid out
        there before it fit in its other idle slots (the backend gives each the least recently
        used idle slot, or the one sharing its prefix; a conversation's own slot is its most
        recently used), and no task laid out before it took that slot for its own hit (`used`)."""
        idle = self.idle
        out: dict[int, tuple[int, int]] = {}
        for i, slots in self._longest(chain).items():
            if given[i] >= idle[i]:
                continue
            for blocks, k in slots:
                if (i, k) not in used:
                    out[i] = (blocks, k)
                    break
        return out


# `_Prefixes` keeps at most this many chains' matches (a queue's worth, several times over).
_MATCHES_MAX = 8192


def _template(holders: Sequence[WorkerView], est: Estimator, digest: str) -> _Template:
    """The `_Template` of `holders`: kept in the holder index when they are its holders of
    `digest` (every view read since the list of workers was), built afresh otherwise."""
    ix = next((x for x in _INDEX if x.by_digest.get(digest) is holders), None)
    if ix is None:
        return _Template(holders, est, digest)
    memo = _index_memo(ix, est)
    hit = memo.templates.get(digest)
    if hit is None:
        hit = memo.templates[digest] = _Template(holders, est, digest)
    return hit


_name = operator.attrgetter("name")
_slots = operator.attrgetter("slots")
_first = operator.itemgetter(0)


class PlanState:
    """Mutable slot state of the holders of one model while a plan is laid out.

    `free[i]` is holder i's slot free times as a heap (earliest first), `head[i]` its earliest.
    On a worker whose slots slow each other down (`fac[i]` not None) a task's finish is worked out
    by sharing the machine with whatever its other slots still run, and giving it a task stretches
    those. Output tokens belong to the model, so one figure per domain serves every holder.
    """

    __slots__ = (
        "_est",
        "_front",
        "_own",
        "_pfx",
        "default_prompt",
        "digest",
        "fac",
        "free",
        "full_walk",
        "given",
        "head",
        "load_left",
        "loaded",
        "names",
        "outs",
        "pace",
        "read_out",
        "shared",
        "sp",
        "used",
    )

    def __init__(
        self,
        holders: Sequence[WorkerView],
        est: Estimator,
        digest: str,
        now_ms: int,
        params: PlanParams,
        free: dict[str, list[float]] | None = None,
        slowdowns: dict[str, float] | None = None,
        backlog: Mapping[str, Sequence[BacklogEntry]] | None = None,
    ) -> None:
        """`free` (worker -> `slot_free_times`) and `slowdowns` (worker -> `overdue_slowdown`),
        both filled as met, are one decision's caches across the queues it lays out. `backlog`
        (every model's queue) tells whether a one-model machine runs another model first
        (`runs_another_first`)."""
        # Slot lists are shared with `free` (or the holders' template) until a task is assigned
        # there (most holders get none).
        self._own: set[int] = set()
        known: dict[str, list[float]] = {} if free is None else free
        seen = {} if slowdowns is None else slowdowns
        tpl = _template(holders, est, digest)
        self.names = list(tpl.names)
        # Idle holders' slots and loads come from the template; each busy holder's running tasks
        # are looked at once per decision for both its free times and its slowdown.
        free_lists = list(tpl.free)
        self.free = free_lists
        head = list(tpl.head)
        slow: list[tuple[int, float]] | None = None
        expecteds = tpl.expecteds(params) if tpl.busy else []
        for (i, w), exp in zip(tpl.busy, expecteds, strict=True):
            name = w.name
            slots = known.get(name)
            k = seen.get(name)
            if slots is None or k is None:
                both = _running_state(w, est, now_ms, params, exp)
                if slots is None:
                    slots = known[name] = both[0]
                if k is None:
                    k = seen[name] = both[1]
            if k > 1.0:
                if slow is None:
                    slow = []
                slow.append((i, k))
            free_lists[i] = slots
            head[i] = slots[0]
        self.head = head
        self.sp = tpl.sp
        if slow is not None:
            self.sp = _slowed(self.sp, slow)
        self.fac = self.sp.fac
        self.shared = self.sp.shared
        # Load seconds a task would pay there: none once the model is loaded (or planned there).
        # Only a one-model machine's depends on the queues (`runs_another_first`): the next task
        # of this model is its queue's head, or a new one (enqueued now).
        self.load_left = list(tpl.load_left)
        if tpl.one_model:
            own = None if backlog is None else backlog.get(digest)
            head_ms = own[0].enqueued_at_ms if own else now_ms
            for i, w in tpl.one_model:
                self.load_left[i] = load_to_pay(w, digest, est, self.sp.load_s[i], backlog, head_ms)
        self.loaded = [ld == 0.0 for ld in self.load_left]
        self.outs: dict[str, float] = {}
        self.default_prompt = params.default_prompt_tokens
        self.full_walk = params.full_walk
        self._est = est
        self.digest = digest
        # Where an idle slot holds part of an earlier prompt: the tasks laid out on each holder
        # (a hit holds only while they fit in its other idle slots: `_Prefixes.blocks`).
        self._pfx = tpl.prefixes()
        self.given: list[int] | None = None if self._pfx is None else [0] * len(self.names)
        # The (holder, slot) pairs whose content a task laid out already counted as its hit.
        self.used: set[tuple[int, int]] = set()
        # The holders no other is faster than in both prompt and output (`size_s`), when needed.
        self._front: list[tuple[float, float]] | None = None
        # A paced task's cost per output token on each holder: its decode time or its reading
        # time, whichever is longer (`pace`: the reading time beyond decoding). None: no pacing.
        r = params.reading_tps
        if r > 0.0:
            self.read_out: list[float] | None = [max(b, 1.0 / r) for b in self.sp.per_out]
            self.pace: list[float] | None = [
                rb - b for rb, b in zip(self.read_out, self.sp.per_out, strict=True)
            ]
        else:
            self.read_out = self.pace = None

    def cached(self, chain: PromptChain | None, prompt_tokens: int) -> dict[int, int]:
        """Holder index -> prompt tokens of a task with `chain` (of `prompt_tokens` tokens) that
        an idle slot of that holder holds, where it still would when the task starts there now."""
        return {i: tokens for i, (tokens, _) in self._hits(chain, prompt_tokens).items()}

    def _hits(self, chain: PromptChain | None, prompt_tokens: int) -> dict[int, tuple[int, int]]:
        """`cached`, with the slot of each hit: holder index -> (tokens, slot index)."""
        px, given = self._pfx, self.given
        if px is None or given is None or chain is None or not chain.hashes:
            return {}
        out: dict[int, tuple[int, int]] = {}
        for i, (blocks, k) in px.blocks(chain, given, self.used).items():
            tokens = tokens_of_blocks(blocks, chain.chars, prompt_tokens)
            if tokens > 0:
                out[i] = (tokens, k)
        return out

    def _out(self, entry: BacklogEntry) -> float:
        cap = entry.max_tokens
        if cap is None:
            out = self.outs.get(entry.domain)
            if out is None:
                out = self.outs[entry.domain] = self._est.output_tokens(self.digest, entry.domain).value
            return out
        return self._est.capped_output(self.digest, entry.domain, cap).value

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
        hits = self.cached(entry.prefix, prompt) if self._pfx is not None else None
        if hits:
            for i, tokens in hits.items():
                finishes[i] = (
                    self.head[i]
                    + (prompt - tokens) * sp.per_prompt[i]
                    + out * sp.per_out[i]
                    + self.load_left[i]
                )
        pace = self.pace if entry.paced else None
        if not self.shared and pace is None:
            finish = min(finishes)
            # The first of equals wins: holders are in registration order.
            i = finishes.index(finish)
            return i, self.head[i], finish
        # On a shared machine the task also delays the ones already there: the system pays both
        # (the head finishing sooner is not worth more in total waiting than it costs them).
        costs = list(finishes)
        for i, fac in enumerate(self.fac):
            if fac is not None:
                uncached = prompt - hits.get(i, 0) if hits else prompt
                work = uncached * sp.per_prompt[i] + out * sp.per_out[i] + self.load_left[i]
                finishes[i], delay = self._shared(i, self.head[i], work)
                costs[i] = finishes[i] + delay
        if pace is not None:
            # Its reader's finish: past decoding, the time they still read; never at the cost of a
            # free faster machine (guard_paced).
            costs = [c + out * x for c, x in zip(costs, pace, strict=True)]
            left = [prompt - (hits.get(k, 0) if hits else 0) for k in range(len(finishes))]
            firsts = [
                h + u * a + ld
                for h, u, a, ld in zip(self.head, left, sp.per_prompt, self.load_left, strict=True)
            ]
            costs = guard_paced(costs, finishes, firsts, [h <= _FREE_S for h in self.head])
        i = costs.index(min(costs))
        return i, self.head[i], finishes[i]

    def _work(self, i: int, entry: BacklogEntry) -> float:
        prompt = self.default_prompt if entry.prompt_tokens is None else entry.prompt_tokens
        if self._pfx is not None:
            prompt -= self.cached(entry.prefix, prompt).get(i, 0)
        return prompt * self.sp.per_prompt[i] + self._out(entry) * self.sp.per_out[i] + self.load_left[i]

    def out_of(self, entry: BacklogEntry) -> float:
        """Expected output tokens of `entry` (its domain's lengths, capped by its max_tokens)."""
        return self._out(entry)

    def size_s(self, entry: BacklogEntry) -> float:
        """Expected solo seconds of `entry` on the fastest holder, model loaded: its size."""
        prompt = self.default_prompt if entry.prompt_tokens is None else entry.prompt_tokens
        out = self._out(entry)
        sp = self.sp
        if prompt < 0 or out < 0:
            # A malformed count: the front below holds only for non-negative ones.
            return min(prompt * a + out * b for a, b in zip(sp.per_prompt, sp.per_out, strict=True))
        front = self._front
        if front is None:
            front = self._front = _pareto(sp.per_prompt, sp.per_out)
        return min(prompt * a + out * b for a, b in front)

    def best_on(self, i: int, entry: BacklogEntry) -> float:
        """When holder `i` would finish `entry` if it were given it next."""
        work = self._work(i, entry)
        start = self.head[i]
        return start + work if self.fac[i] is None else self._shared_finish(i, start, work)

    def assign(self, i: int, finish: float, start: float = 0.0, entry: BacklogEntry | None = None) -> None:
        """Give holder `i` the task `best` placed there (from `start` to `finish`)."""
        won = None
        if entry is not None and self._pfx is not None and entry.prefix is not None:
            prompt = self.default_prompt if entry.prompt_tokens is None else entry.prompt_tokens
            won = self._hits(entry.prefix, prompt).get(i)
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
        if self.given is not None:
            self.given[i] += 1
        if won is not None:
            # Its hit's slot is its own now (after its work above was priced with it).
            self.used.add((i, won[1]))

    def walk(self, entries: Sequence[BacklogEntry]) -> list[Step]:
        """Assign `entries` in order, each to the holder finishing it earliest: (holder index,
        start, finish) per entry, which `assignments` and `plan` turn into `Assignment`s (a
        ranking needs only the slots' state afterwards)."""
        steps, _, _ = self._walk(entries, -1)
        return steps

    def assignments(self, entries: Sequence[BacklogEntry], steps: Sequence[Step]) -> list[Assignment]:
        """The `Assignment`s of `steps`, the walk of `entries`."""
        names = self.names
        return [
            Assignment(task_id=e.task_id, worker=names[i], start_s=start, finish_s=finish)
            for e, (i, start, finish) in zip(entries, steps, strict=False)
        ]

    def plan(self, entries: Sequence[BacklogEntry], steps: Sequence[Step]) -> Plan:
        """The `Plan` of `steps`, the walk of `entries` that left this state."""
        return Plan(
            digest=self.digest,
            assignments=self.assignments(entries, steps),
            free_s=dict(zip(self.names, self.free, strict=True)),
        )

    def first_given(self, i: int, entries: Sequence[BacklogEntry]) -> tuple[int, float] | None:
        """(position, finish) of the first of `entries` the plan gives holder `i`, the ones before
        it assigned to the others; None when it gives `i` none of them. The walk stops there: what
        comes after cannot change that answer."""
        _, pos, finish = self._walk(entries, i)
        return None if pos < 0 else (pos, finish)

    def _walk(self, entries: Sequence[BacklogEntry], until: int) -> tuple[list[Step], int, float]:
        """Assign `entries` in order until one goes to holder `until`: (the steps before it, its
        position, its finish), or (all steps, -1, 0.0)."""
        if self.shared:
            return self._walk_each(entries, until)
        default_prompt, out_of = self.default_prompt, self._out
        work = [(default_prompt if e.prompt_tokens is None else e.prompt_tokens, out_of(e)) for e in entries]
        # Where slots hold prompts, each task's chain (its hits are looked up as it is laid out:
        # a hit lasts only while the tasks laid out before it fit in the holder's other slots).
        chains = [e.prefix for e in entries] if self._pfx is not None else None
        paced = [e.paced for e in entries] if self.read_out is not None else None
        if paced is not None and not any(paced):
            paced = None
        if paced is not None:
            # Paced tasks are placed one by one by `best`, which guards them (guard_paced).
            return self._walk_each(entries, until)
        if self.full_walk or len(work) < PRUNE_MIN_TASKS or len(self.head) < PRUNE_MIN_HOLDERS:
            return self._walk_all(work, until, chains, paced)
        # The bound below adds non-negative terms; negative token counts (a malformed request)
        # or free times would break it, and take the walk that needs no bound.
        if min(p for p, _ in work) < 0 or min(o for _, o in work) < 0 or min(self.head) < 0:
            return self._walk_all(work, until, chains, paced)
        return self._walk_pruned(work, until, chains, paced)

    def _cheaper_hit(
        self,
        chain: PromptChain | None,
        prompt: int,
        o: float,
        i: int,
        finish: float,
        per_out: Sequence[float] | None = None,
    ) -> tuple[int, float]:
        """(holder, finish) of the best of holder `i` finishing at `finish` (the best without
        caches) and the holders whose idle slot holds part of `chain`: a hit only lowers a
        holder's finish, so nobody else can beat them both. Equal finishes go to the first
        registered, as in the walks. The slot of the winner's hit, if it has one, is taken.
        `per_out`: the seconds per output token to compare by (a paced task's `read_out`; then
        `finish` and the answer are its reader's finish)."""
        if chain is None or not chain.hashes:
            return i, finish
        hits = self._hits(chain, prompt)
        if not hits:
            return i, finish
        head, load_left, per_prompt = self.head, self.load_left, self.sp.per_prompt
        if per_out is None:
            per_out = self.sp.per_out
        for j, (tokens, _) in hits.items():
            f = head[j] + (prompt - tokens) * per_prompt[j] + o * per_out[j] + load_left[j]
            if f < finish or (f == finish and j < i):
                i, finish = j, f
        won = hits.get(i)
        if won is not None:
            self.used.add((i, won[1]))
        return i, finish

    def _walk_each(self, entries: Sequence[BacklogEntry], until: int) -> tuple[list[Step], int, float]:
        steps: list[Step] = []
        for pos, e in enumerate(entries):
            i, start, finish = self.best(e)
            if i == until:
                return steps, pos, finish
            self.assign(i, finish, start, e)
            steps.append((i, start, finish))
        return steps, -1, 0.0

    def _walk_all(
        self,
        work: list[tuple[int, float]],
        until: int,
        chains: Sequence[PromptChain | None] | None = None,
        paced: Sequence[bool] | None = None,
    ) -> tuple[list[Step], int, float]:
        """Every task's finish on every holder (`best` and `assign` inlined); `chains`: the tasks'
        prompt chains, where some holder's slots hold prompts (`_cheaper_hit`); `paced`: which
        tasks go where their reader finishes first (`BacklogEntry.paced`)."""
        steps: list[Step] = []
        head, load_left, free, own, loaded = self.head, self.load_left, self.free, self._own, self.loaded
        given = self.given
        per_prompt, per_out = self.sp.per_prompt, self.sp.per_out
        read_out, pace = self.read_out, self.pace
        replace = heapq.heapreplace
        for pos, (prompt, o) in enumerate(work):
            reads = paced is not None and paced[pos]
            by = read_out if reads and read_out is not None else per_out
            finishes = [
                h + prompt * a + o * b + ld
                for h, a, b, ld in zip(head, per_prompt, by, load_left, strict=True)
            ]
            finish = min(finishes)
            i = finishes.index(finish)
            if chains is not None:
                i, finish = self._cheaper_hit(chains[pos], prompt, o, i, finish, by)
            if reads and pace is not None:
                # The reader's finish, back to the task's own.
                finish -= o * pace[i]
            if i == until:
                return steps, pos, finish
            start = head[i]
            slots = free[i]
            if i not in own:
                slots = free[i] = list(slots)
                own.add(i)
            replace(slots, finish)
            head[i] = slots[0]
            loaded[i] = True
            load_left[i] = 0.0
            if given is not None:
                given[i] += 1
            steps.append((i, start, finish))
        return steps, -1, 0.0

    def _walk_pruned(
        self,
        work: list[tuple[int, float]],
        until: int,
        chains: Sequence[PromptChain | None] | None = None,
        paced: Sequence[bool] | None = None,
    ) -> tuple[list[Step], int, float]:
        """The same assignments as `_walk_all`, looking at only the holders that might finish a
        task first.

        A task of `prompt` tokens and `o` output tokens finishes on holder i at
        head + prompt·a_i + o·b_i + load (a, b: seconds per prompt and per output token). The
        tasks' outputs fall in a few classes (a model's output length per domain, capped by a few
        max_tokens); each class c has a heap of the holders by key_i = head + o_c·b_i + load, o_c
        the least output in the class, so that for a task of the class
        finish_i >= key_i + prompt·min(a) + (o - o_c)·min(b). A task takes holders from its
        class's heap in key order until that bound passes the best finish found: the rest finish
        later. The holder that gets a task is pushed again into every heap under its new key
        (the entries it leaves behind are skipped by their version), so each task costs a few
        heap operations instead of a pass over every holder.

        The finishes are computed by the same expression as `_walk_all`, so they are equal bit for
        bit; the bound is rounded differently, so it must pass the best by a margin (_BOUND_SLACK)
        that rounding cannot make up before a holder is left out. Every holder within the bound
        is looked at, so of equal finishes the first registered wins, as in the full walk.

        Paced tasks (`paced`) compare their readers' finishes: their classes key holders by
        `read_out` instead of b, with the same bound over its least value.
        """
        steps: list[Step] = []
        head, load_left, free, own, loaded = self.head, self.load_left, self.free, self._own, self.loaded
        given = self.given
        per_prompt, per_out = self.sp.per_prompt, self.sp.per_out
        read_out, pace = self.read_out, self.pace
        a_min = min(per_prompt)
        flags = paced if paced is not None and read_out is not None else [False] * len(work)
        # Per kind (plain, paced), its classes (`_Class`), each with a heap of (key, holder,
        # version) keyed by its least prompt and output. A paced task's cost
        # on the holders that stream faster than its reader reads differs only by their wait
        # and prompt time, so its classes span prompt sizes too: keyed by output alone, every
        # idle holder would fall within the bound.
        kinds: list[list[_Class]] = []
        class_of: dict[tuple[int, float, bool], _Class] = {}
        version = [0] * len(head)
        by: Sequence[float]
        for reads in (False, True):
            mine = {(p if reads else 0, o) for (p, o), f in zip(work, flags, strict=True) if f == reads}
            if not mine:
                continue
            by = read_out if reads and read_out is not None else per_out
            b_min = min(by)
            # Paced: one output class, since past reading pace every holder's output term is
            # the same (o x the reading time per token) and only the slow decoders' differ.
            o_refs = _spread(sorted({o for _, o in mine}), 1 if reads else _OUTPUT_CLASSES)
            p_refs = _spread(sorted({p for p, _ in mine}), _PACED_CLASSES) if reads else [0]
            made = {(p_c, o_c): _Class(p_c, o_c, by, b_min) for p_c in p_refs for o_c in o_refs}
            kinds.append(list(made.values()))
            for p, o in mine:
                p_c = p_refs[bisect.bisect_right(p_refs, p) - 1]
                o_c = o_refs[bisect.bisect_right(o_refs, o) - 1]
                class_of[(p, o, reads)] = made[(p_c, o_c)]
        pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
        slack = _BOUND_SLACK
        for pos, (prompt, o) in enumerate(work):
            reads = flags[pos]
            cls = class_of[(prompt if reads else 0, o, reads)]
            p_c, o_c, by, b_min = cls.p, cls.o, cls.by, cls.b_min
            heap = cls.heap
            if heap is None:
                # Built when first needed, from the holders' state now: a walk that stops at a
                # holder's first task seldom needs them all.
                heap = cls.heap = (
                    [
                        (h + p_c * a + o_c * b + ld, i, version[i])
                        for i, (h, a, b, ld) in enumerate(zip(head, per_prompt, by, load_left, strict=True))
                    ]
                    if p_c
                    else [
                        (h + o_c * b + ld, i, version[i])
                        for i, (h, b, ld) in enumerate(zip(head, by, load_left, strict=True))
                    ]
                )
                heapq.heapify(heap)
            bound = (prompt - p_c) * a_min + (o - o_c) * b_min
            best = pop(heap)
            while best[2] != version[best[1]]:
                best = pop(heap)
            i = best[1]
            finish = head[i] + prompt * per_prompt[i] + o * by[i] + load_left[i]
            limit = finish + finish * slack - bound
            seen: list[tuple[float, int, int]] = []
            while heap and heap[0][0] <= limit:
                item = pop(heap)
                j = item[1]
                if item[2] != version[j]:
                    continue
                f = head[j] + prompt * per_prompt[j] + o * by[j] + load_left[j]
                if f < finish or (f == finish and j < i):
                    seen.append(best)
                    best, finish, i = item, f, j
                    limit = finish + finish * slack - bound
                else:
                    seen.append(item)
            if chains is not None:
                j, finish = self._cheaper_hit(chains[pos], prompt, o, i, finish, by)
                if j != i:
                    # A holder whose slot holds the task wins; the best without caches goes back
                    # (the winner's old entries are left behind by its new version).
                    seen.append(best)
                    i = j
            if reads and pace is not None:
                # The reader's finish, back to the task's own.
                finish -= o * pace[i]
            for item in seen:
                push(heap, item)
            if i == until:
                return steps, pos, finish
            start = head[i]
            slots = free[i]
            if i not in own:
                slots = free[i] = list(slots)
                own.add(i)
            replace(slots, finish)
            h = head[i] = slots[0]
            loaded[i] = True
            load_left[i] = 0.0
            if given is not None:
                given[i] += 1
            v = version[i] = version[i] + 1
            a = per_prompt[i]
            for classes_k in kinds:
                b = classes_k[0].by[i]
                for c in classes_k:
                    if c.heap is not None:
                        push(c.heap, (h + c.p * a + c.o * b if c.p else h + c.o * b, i, v))
            steps.append((i, start, finish))
        return steps, -1, 0.0

    def new_task(
        self, i: int, prompt_tokens: int, out: float, cached: int = 0
    ) -> tuple[float, float, float, float, float]:
        """(wait, load, prompt, decode, finish) seconds of a new task given to holder `i` after the
        plan, `cached` of its prompt tokens held by a slot there (`cached`)."""
        wait = self.head[i]
        load = self.load_left[i]
        prompt_s = (prompt_tokens - cached) / self.sp.prompt_tps[i]
        decode_s = out / self.sp.decode_tps[i]
        if self.fac[i] is None:
            return wait, load, prompt_s, decode_s, wait + load + prompt_s + decode_s
        return wait, load, prompt_s, decode_s, self._shared_finish(i, wait, load + prompt_s + decode_s)

    def firsts(self, prompt_tokens: int, cached: Mapping[int, int] | None = None) -> list[float]:
        """When a new task given to each holder after the plan would show its first token: its
        wait, load and prompt (sharing a machine is left out: it slows the first token less than
        it does the whole answer)."""
        sp, got = self.sp, cached or {}
        return [
            h + ld + (prompt_tokens - got.get(i, 0)) / p
            for i, (h, ld, p) in enumerate(zip(self.head, self.load_left, sp.prompt_tps, strict=True))
        ]

    def free_now(self) -> list[bool]:
        """Which holders have a slot free now, after the plan."""
        return [h <= _FREE_S for h in self.head]

    def finishes(
        self, prompt_tokens: int, out: float, cached: Mapping[int, int] | None = None
    ) -> list[float]:
        """`new_task`'s finish on every holder (the same arithmetic, without the terms); `cached`:
        holder index -> its prompt tokens held there (`cached`)."""
        sp = self.sp
        res = [
            h + ld + prompt_tokens / p + out / d
            for h, ld, p, d in zip(self.head, self.load_left, sp.prompt_tps, sp.decode_tps, strict=True)
        ]
        if cached:
            for i, tokens in cached.items():
                res[i] = self.head[i] + self.load_left[i] + (prompt_tokens - tokens) / sp.prompt_tps[i]
                res[i] += out / sp.decode_tps[i]
        if self.shared:
            for i, fac in enumerate(self.fac):
                if fac is not None:
                    uncached = prompt_tokens - (cached or {}).get(i, 0)
                    work = self.load_left[i] + uncached / sp.prompt_tps[i] + out / sp.decode_tps[i]
                    res[i] = self._shared_finish(i, self.head[i], work)
        return res

    def finish_floor(
        self,
        prompt_tokens: int,
        out: float,
        entries: Sequence[BacklogEntry],
        cached: Mapping[int, int] | None = None,
    ) -> tuple[int, float] | None:
        """(holder, finish) of the least finish a new task could have after `entries` are laid out
        from here, without laying them out; None where `floors_hold` says no floor holds.

        Laying out a task only moves a slot's free time later. On a one-slot holder a task that
        loads the model ends after that load, so `finishes` now is a floor. On a holder with more
        slots another slot may load the model for it, so its load is left out. The arithmetic is
        `finishes`', so the floor is never above the finish it bounds. `cached` (`cached` now) only
        shrinks as tasks are laid out, so what it takes off holds as a floor too.
        """
        if self.shared or not floors_hold(entries, self.default_prompt):
            return None
        sp = self.sp
        floors = [
            h + (ld if len(slots) == 1 else 0.0) + prompt_tokens / p + out / d
            for h, ld, slots, p, d in zip(
                self.head, self.load_left, self.free, sp.prompt_tps, sp.decode_tps, strict=True
            )
        ]
        if cached:
            for i, tokens in cached.items():
                ld = self.load_left[i] if len(self.free[i]) == 1 else 0.0
                floors[i] = (
                    self.head[i] + ld + (prompt_tokens - tokens) / sp.prompt_tps[i] + out / sp.decode_tps[i]
                )
        floor = min(floors)
        return floors.index(floor), floor


def floors_hold(entries: Sequence[BacklogEntry], default_prompt: int) -> bool:
    """Whether laying out `entries` only moves slots' free times later, as the floors on a new
    task's finish (`service_floor`, `PlanState.finish_floor`) assume: not when a task's token
    counts are negative (a malformed request: its "finish" could come before its start)."""
    if default_prompt < 0:
        return False
    # A loop, not all(...): a generator costs three times as much per task, and every queued task
    # of every model is checked on each `auto` decision.
    for e in entries:  # noqa: SIM110
        if (e.prompt_tokens or 0) < 0 or (e.max_tokens or 0) < 0:
            return False
    return True


def service_floor(
    est: Estimator,
    holders: Sequence[WorkerView],
    digest: str,
    prompt_tokens: int,
    out: float,
    entries: Sequence[BacklogEntry],
    default_prompt: int,
    view: FleetView | None = None,
) -> tuple[int, float] | None:
    """(holder, seconds) of a floor on the finish a new task could have on any of `holders` after
    `entries` are laid out, when every slot is free at 0 or later (`slot_free_times` gives no
    less): its prompt at the fastest prompt speed among them and its output at the fastest decode
    speed, with no wait and no load; the holder is the one decoding fastest. None where no such
    floor holds: on machines whose tasks slow each other down (a task sharing one can run faster
    than the speeds say), for a task of negative size, and where `floors_hold` says so. It reads
    only figures cached per snapshot, so it costs no pass over the holders beyond finding them in
    that cache (`view`: the view `holders` come from, whose index keeps the figures per list of
    workers); `PlanState.finish_floor` is higher, and counts the holders' waits and loads.
    """
    fast = _fastest(est, holders, digest) if view is None else fastest_holders(view, est, digest)
    if fast.sharing or prompt_tokens < 0 or out < 0 or not floors_hold(entries, default_prompt):
        return None
    # `finishes`' arithmetic with wait and load at their least (0) and every divisor at its
    # greatest: no holder's finish is less, rounding included.
    return fast.holder, prompt_tokens / fast.prompt_tps + out / fast.decode_tps


class _HolderIndex:
    """Every digest's holders among one list of workers, and the figures that depend only on
    those holders and one estimator (`_fastest`), kept while the list is the one a view reads."""

    __slots__ = ("by_digest", "count", "token", "workers")

    def __init__(self, workers: list[WorkerView]) -> None:
        out: defaultdict[str, list[WorkerView]] = defaultdict(list)
        for w in workers:
            for d in w.holds:
                out[d].append(w)
        self.by_digest: dict[str, list[WorkerView]] = dict(out)
        self.workers = workers
        self.count = len(workers)
        self.token = next(_TOKENS)


class _IndexMemo:
    """The figures of one holder index that also depend on an estimator, kept in its memo (so
    that they go with the estimates, as `Estimator.clear_cache` says)."""

    __slots__ = ("fastest", "templates", "token")

    def __init__(self, token: int) -> None:
        self.token = token
        self.fastest: dict[str, _Fastest] = {}
        self.templates: dict[str, _Template] = {}


def _index_memo(ix: _HolderIndex, est: Estimator) -> _IndexMemo:
    """`ix`'s figures on `est` (kept for the indexes kept)."""
    memos = est.memo.get("#index")
    if not isinstance(memos, list):
        memos = est.memo["#index"] = []
    for hit in memos:
        if hit.token == ix.token:
            return cast(_IndexMemo, hit)
    # Only the kept indexes' figures stay: an estimator can outlive many reads of the leases.
    hit = _IndexMemo(ix.token)
    memos[:] = [hit, *(m for m in memos if any(x.token == m.token for x in _INDEX))]
    return hit


# The indexes of the last lists of workers asked about, newest first. A production view's workers
# are one list per read of the leases (`LiveView`), shared by every decision until the next read.
# The router never changes a view, and whoever changes a worker's view (what it runs or has
# loaded) passes a new list to the next decision: the figures kept per list would be stale.
_INDEX: list[_HolderIndex] = []
# Tells indexes apart in an estimator's memo (an id() could be reused once one is gone).
_TOKENS = itertools.count()


_INDEXES_KEPT: Final = 2


def _holder_index(view: FleetView) -> _HolderIndex:
    workers = view.workers
    for ix in _INDEX:
        if ix.workers is workers and ix.count == len(workers):
            return ix
    ix = _HolderIndex(workers)
    # Two: a process that both routes (the API's list) and checks a gate (a worker's own list)
    # keeps both.
    _INDEX[:] = [ix, *_INDEX[: _INDEXES_KEPT - 1]]
    return ix


def holders_by_digest(view: FleetView) -> dict[str, list[WorkerView]]:
    """Every digest's live holders in registration order: one pass over the fleet for all models,
    once per list of workers. The answer is shared: read it, never change it."""
    return _holder_index(view).by_digest


def fastest_holders(view: FleetView, est: Estimator, digest: str) -> _Fastest:
    """`_fastest` of `digest`'s holders in `view`, looked up once per list of workers and estimator."""
    ix = _holder_index(view)
    memo = _index_memo(ix, est)
    hit = memo.fastest.get(digest)
    if hit is None:
        hit = memo.fastest[digest] = _fastest(est, ix.by_digest.get(digest, []), digest)
    return hit


def plan_queue(
    view: FleetView,
    est: Estimator,
    digest: str,
    now_ms: int,
    *,
    backlog: Iterable[BacklogEntry] | None = None,
    params: PlanParams | None = None,
    free: dict[str, list[float]] | None = None,
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
    free: dict[str, list[float]] | None = None,
    holders: Sequence[WorkerView] | None = None,
) -> tuple[Plan, PlanState | None]:
    """`plan_queue`, with the slot state after it (None without a holder) for ranking a new task."""
    p = params or PlanParams()
    hs = view.holders(digest) if holders is None else holders
    entries = view.backlog.get(digest, []) if backlog is None else backlog
    if not hs:
        return Plan(digest=digest, assignments=[], free_s={}), None
    todo = entries if isinstance(entries, list) else list(entries)
    queues = view.backlog if backlog is None else {**view.backlog, digest: todo}
    state = PlanState(hs, est, digest, now_ms, p, free=free, backlog=queues)
    return state.plan(todo, state.walk(todo)), state


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
