"""The discrete-event scheduling simulator: one model's tasks on a fleet, in simulated time.

No Redis and no clock: a run is a pure function of (fleet, model, workload, policy), so the same
seed gives the same figures. Workers pull from one shared queue (pull policies: the gate decides)
or get tasks pushed to their own FIFO at arrival (push policies: LiteLLM, Olla and the like send
each request to a backend that queues it). A worker with k tasks at once runs each at
k**parallel_exponent / k of its solo speed. A model not used for `keep_alive_s` is unloaded and
costs its load time again. A worker that goes offline loses what it runs: those tasks go back to
the head of the queue they came from and start again. A worker's `slowdown` windows multiply its
speed meanwhile: what it runs at the change goes on at the new speed from there.

Prompt caches (chat workloads, whose jobs carry a conversation and a chain): each of a worker's
`slots` keeps the conversation text of the last run it served, its prompt and its answer, as
Ollama's and llama.cpp's slots keep their KV cache. A run takes the idle slot holding the longest
prefix of its conversation (none: the least recently used idle slot, whose content it evicts) and
evaluates only the rest of its prompt; unloading the model or going offline loses every slot's
content. The workers' views report the slots (`WorkerView.cache`) as a real worker's lease does, and
queued tasks carry their chain (`BacklogEntry.prefix`). Jobs without a conversation cache nothing,
so the other workloads run exactly as before. A run's first token comes after its load and its
uncached prompt, at the speed it gets meanwhile (`RunResult.ttft_s`).

A pull policy may hand a task straight to one worker at its arrival (`Policy.pin`): the worker's
pinned list, served before the shared queue, as the API's pinned hand-off does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Protocol

import msgspec

from projections.benchset import SPEED_MAX_TOKENS
from projections.shift import MIN_RATIO
from router.plan import BacklogEntry, FleetView, RunningTask, WorkerView
from router.prefix import SlotCache, marks_of
from sim.fleetspec import Fleet, WorkerSpec, default_digest
from sim.scheduling.workload import (
    Job,
    ModelSpeeds,
    WorkloadSpec,
    conversation_hashes,
    generate,
    serving,
    speeds,
    tokens_blocks,
)

# A benchmark prompt (a policy says how many a joining worker runs): a shipped speed prompt, whose
# answer runs until the benchmark's cap cuts it (dispatch.benchmark.SPEED_MAX_TOKENS).
BENCH_PROMPT_TOKENS = 32
BENCH_OUTPUT_TOKENS = SPEED_MAX_TOKENS

_ARRIVE, _DONE, _ONLINE, _OFFLINE, _SPEED = 0, 1, 2, 3, 4


class Measured(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """What the backend reports for a finished run, as Ollama's timings would."""

    load_s: float | None  # None: the model was already loaded
    prompt_tps: float
    decode_tps: float
    output_tokens: int
    wall_s: float
    in_flight: int


class _Run:
    """A job on a worker: remaining solo seconds, and the parts of its solo time."""

    __slots__ = ("decode_s", "first", "job", "load_s", "remaining", "slot", "solo", "started", "task")

    def __init__(
        self,
        job: Job,
        solo: float,
        load_s: float,
        started: float,
        task: RunningTask,
        decode_s: float = 0.0,
        slot: int | None = None,
    ) -> None:
        self.job = job
        self.solo = solo
        self.remaining = solo
        self.load_s = load_s
        self.started = started
        self.task = task
        # Solo seconds of its output: the first token comes when only these remain.
        self.decode_s = decode_s
        # When its first token came (None: not yet).
        self.first: float | None = None
        # The cache slot it runs in (None: caches are not modelled in this run).
        self.slot = slot


class _Slot:
    """What one backend slot holds: `tokens` tokens of conversation `conv`'s text (-1: nothing
    reusable), whether a run uses it, and when it was last given one."""

    __slots__ = ("busy", "conv", "tokens", "used")

    def __init__(self) -> None:
        self.conv = -1
        self.tokens = 0
        self.busy = False
        self.used = -math.inf


class SimWorker:
    """One simulated machine's state."""

    def __init__(self, index: int, spec: WorkerSpec, model: str, digest: str) -> None:
        self.index = index
        self.spec = spec
        self.name = spec.name
        self.true: ModelSpeeds = speeds(spec, model)
        self.slots = spec.slots
        self.exponent = spec.parallel_exponent
        self.online = False
        self.runs: list[_Run] = []
        self.version = 0
        self.last = 0.0
        self.idle_since: float | None = 0.0
        self.loaded = False
        self.own: list[Job] = []  # pushed tasks, FIFO (push policies)
        self.pinned: list[Job] = []  # hand-offs, served before the shared queue
        # Benchmarks, its lowest priority: run one at a time while no work waits for it, and
        # given up (back to the front of this list) when work comes (workers.agent).
        self.background: list[Job] = []
        self.done = 0
        # Its speed now relative to `true` (the fleet's slowdown windows).
        self.factor = 1.0
        self.view = WorkerView(name=spec.name, slots=spec.slots, holds={digest})
        # Its slots' prompt caches (chat workloads only).
        self.cache = [_Slot() for _ in range(spec.slots)]
        # When it last unloaded the model (None: never).
        self.unloaded_at: float | None = None

    @property
    def free(self) -> bool:
        """A slot free for work: a benchmark's slot is, since work stops it."""
        return self.online and sum(1 for r in self.runs if not r.job.bench) < self.slots

    def rate(self) -> float:
        k = len(self.runs)
        return self.factor if k <= 1 else self.factor * k**self.exponent / k

    def in_system(self) -> int:
        """Tasks it has: running and waiting in its own queue (what least-busy counts)."""
        return len(self.runs) + len(self.own)


def _share(k: int, exponent: float) -> float:
    """The fraction of its solo speed each of k tasks at once gets (see `SimWorker.rate`)."""
    return 1.0 if k <= 1 else k**exponent / k


class Policy(Protocol):
    """A scheduling policy plug-in. Pull policies answer `take`, push policies `route`."""

    name: str
    pull: bool

    def start(self, sim: Simulation) -> None:
        """Called once before the first event."""

    def joined(self, sim: Simulation, worker: SimWorker) -> int:
        """A worker came online; how many benchmark prompts it runs first (0: none)."""

    def arrived(self, sim: Simulation, job: Job) -> None:
        """A task was submitted (before it is queued)."""

    def pin(self, sim: Simulation, job: Job) -> SimWorker | None:
        """Pull: the worker to hand `job` to at its arrival, past the shared queue (None: queue it)."""

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        """Push: the online worker whose own queue gets `job`."""

    def take(self, sim: Simulation, worker: SimWorker) -> bool:
        """Pull: whether `worker`, which has a free slot, takes the head of the shared queue now."""

    def pick(self, sim: Simulation, worker: SimWorker) -> int | None:
        """Pull: the position in the shared queue of the task `worker` takes now (None: none)."""

    def completed(self, sim: Simulation, worker: SimWorker, job: Job, measured: Measured) -> None:
        """A run finished (benchmarks included) with what the backend reports."""

    def speed_changed(self, sim: Simulation, worker: SimWorker) -> None:
        """A worker's speed changed (`worker.factor`); only a policy that knows the truth uses it."""


class RunResult(msgspec.Struct, kw_only=True):
    """Per-task outcome of one run."""

    policy: str
    response_s: list[float]
    finish_s: list[float]
    worker_of: list[str]
    start_order: list[str]  # worker of each started task, in start order
    first_arrival_s: float
    benchmarks: int
    # When each started task started (simulated seconds), in start order, beside `start_order`.
    start_s: list[float] = msgspec.field(default_factory=list)
    # Per started task, in start order: the fastest worker with a free slot that would have run it
    # more than MIN_RATIO times faster than the one that took it, at that moment (slowdowns and its
    # share beside running tasks counted; '' if none): the task went to a slower machine than it
    # had to.
    misrouted: list[str] = msgspec.field(default_factory=list)
    # Per task, by index: from its arrival to its first token (queue wait, load and the prompt it
    # evaluated, at the speed its run got).
    ttft_s: list[float] = msgspec.field(default_factory=list)
    # Per task, by index: prompt tokens a slot's cache held for it.
    cached_tokens: list[int] = msgspec.field(default_factory=list)

    @property
    def mean_s(self) -> float:
        return sum(self.response_s) / len(self.response_s)

    def p95_s(self) -> float:
        xs = sorted(self.response_s)
        return xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)]

    @property
    def makespan_s(self) -> float:
        return max(self.finish_s) - self.first_arrival_s

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s)

    def p95_ttft_s(self) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)]


class Simulation:
    """One run: build it, call `run()`."""

    def __init__(
        self,
        fleet: Fleet,
        model: str,
        workload: WorkloadSpec,
        policy: Policy,
        jobs: Sequence[Job] | None = None,
        epoch_ms: int = 0,
    ) -> None:
        self.fleet = fleet
        # The clock time of simulated second 0, in ms: a run that starts from a real projection
        # snapshot lines up with its timestamps.
        self.epoch_ms = epoch_ms
        self.model = model
        self.workload = workload
        self.policy = policy
        specs = serving(fleet, model)
        self.digest = fleet.digest_of(specs[0], model) if specs else default_digest(model)
        self.workers = [SimWorker(i, s, model, self.digest) for i, s in enumerate(specs)]
        self.by_name = {w.name: w for w in self.workers}
        given = list(jobs) if jobs is not None else generate(fleet, model, workload)
        # Chats: later turns' arrivals are set as the run goes, on copies (a caller runs every
        # policy on the same jobs).
        self.chat = any(j.conv >= 0 for j in given)
        self.jobs: list[Job] = [msgspec.structs.replace(j) for j in given] if self.chat else given
        self._hashes: dict[int, tuple[int, ...]] = {}
        self.now = 0.0
        self.queue: list[BacklogEntry] = []
        # The live facts a decision reads: online workers (what each runs) and the queue.
        self.view = FleetView(workers=[], backlog={self.digest: self.queue})
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        n = len(self.jobs)
        self.finish: list[float] = [math.nan] * n
        self.worker_of: list[str] = [""] * n
        self.start_order: list[str] = []
        self.start_s: list[float] = []
        self.misrouted: list[str] = []
        self.ttft: list[float] = [math.nan] * n
        self.cached: list[int] = [0] * n
        self.benchmarks = 0
        # Benchmark runs stopped for work (`_preempt`).
        self.preempted = 0
        self._bench_index = n

    @property
    def now_ms(self) -> int:
        return self.epoch_ms + int(self.now * 1000.0)

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, a, b))

    def _windows(self) -> None:
        joins = dict(self.workload.joins)
        leaves = dict(self.workload.leaves)
        for w in self.workers:
            windows = w.spec.online or [(0.0, math.inf)]
            if w.name in joins:
                windows = [(max(a, joins[w.name]), b) for a, b in windows if b > joins[w.name]]
            if w.name in leaves:
                windows = [(a, min(b, leaves[w.name])) for a, b in windows if a < leaves[w.name]]
            for a, b in windows:
                self._push(a, _ONLINE, w.index)
                if math.isfinite(b):
                    self._push(b, _OFFLINE, w.index)
            for slow in w.spec.slowdown:
                self._push(slow.from_s, _SPEED, w.index)
                self._push(slow.until_s, _SPEED, w.index)

    def run(self) -> RunResult:
        """Simulate until every task finished; the per-task figures."""
        for j in self.jobs:
            if math.isfinite(j.arrival):
                self._push(j.arrival, _ARRIVE, j.index)
        self._windows()
        self.policy.start(self)
        events = self._events
        while events:
            t, _, kind, a, b = heapq.heappop(events)
            self.now = t
            if kind == _DONE:
                w = self.workers[a]
                if b != w.version:
                    continue
                self._complete(w)
            elif kind == _ARRIVE:
                self._arrive(self.jobs[a])
            elif kind == _ONLINE:
                self._online(self.workers[a])
            elif kind == _SPEED:
                self._speed(self.workers[a])
            else:
                self._offline(self.workers[a])
            self._dispatch()
        missing = [j.index for j in self.jobs if math.isnan(self.finish[j.index])]
        if missing:
            # Nobody who serves the model was online after they arrived.
            for i in missing:
                self.finish[i] = math.inf
                self.ttft[i] = math.inf
        return RunResult(
            policy=self.policy.name,
            response_s=[self.finish[j.index] - j.arrival for j in self.jobs],
            finish_s=list(self.finish),
            worker_of=list(self.worker_of),
            start_order=list(self.start_order),
            start_s=list(self.start_s),
            misrouted=list(self.misrouted),
            first_arrival_s=min(j.arrival for j in self.jobs),
            benchmarks=self.benchmarks,
            ttft_s=list(self.ttft),
            cached_tokens=list(self.cached),
        )

    # -- events ---------------------------------------------------------------------------------

    def _arrive(self, job: Job) -> None:
        self.policy.arrived(self, job)
        if self.policy.pull:
            pinned = self.policy.pin(self, job)
            if pinned is not None and pinned.online:
                pinned.pinned.append(job)
                return
            self.queue.append(self._entry(job))
            return
        online = [w for w in self.workers if w.online]
        if not online:
            self.queue.append(self._entry(job))  # held until someone is online
            return
        self.policy.route(self, job).own.append(job)

    def _entry(self, job: Job) -> BacklogEntry:
        return BacklogEntry(
            task_id=str(job.index),
            digest=self.digest,
            enqueued_at_ms=self.epoch_ms + int(job.arrival * 1000.0),
            domain=job.domain,
            prompt_tokens=job.prompt_tokens,
            max_tokens=job.max_tokens,
            prefix=job.chain,
            # A chat turn streamed to the person who reads it, where pacing is on (WorkloadSpec.paced).
            paced=job.paced,
        )

    def _online(self, w: SimWorker) -> None:
        if w.online:
            return
        w.online = True
        w.last = self.now
        w.idle_since = self.now
        self.view.workers = [x.view for x in self.workers if x.online]
        self.benchmark(w, self.policy.joined(self, w))
        if not self.policy.pull and self.queue:
            held, self.queue[:] = list(self.queue), []
            for e in held:
                self.policy.route(self, self.jobs[int(e.task_id)]).own.append(self.jobs[int(e.task_id)])

    def benchmark(self, w: SimWorker, count: int) -> None:
        """Queue `count` benchmark prompts on `w`'s own background queue (its lowest priority)."""
        for _ in range(count):
            self._bench_index += 1
            w.background.append(
                Job(
                    index=self._bench_index,
                    arrival=self.now,
                    prompt_tokens=BENCH_PROMPT_TOKENS,
                    output_tokens=BENCH_OUTPUT_TOKENS,
                    bench=True,
                )
            )

    def _offline(self, w: SimWorker) -> None:
        if not w.online:
            return
        w.online = False
        w.version += 1
        # What it ran, and tasks handed to it that it had not started (a hand-off goes back to
        # the shared queue when its worker is gone).
        lost = [r.job for r in w.runs if not r.job.bench] + [j for j in w.pinned if not j.bench]
        w.runs.clear()
        w.view.running.clear()
        w.pinned.clear()
        w.background.clear()
        if w.loaded:
            w.unloaded_at = self.now
        w.loaded = False
        w.view.loaded.clear()
        self._forget(w)
        self.view.workers = [x.view for x in self.workers if x.online]
        # What it ran or held goes back to the head of the queue, in arrival order.
        back = sorted(lost, key=lambda j: j.index) + w.own
        w.own = []
        if self.policy.pull or not any(x.online for x in self.workers):
            self.queue[:0] = [self._entry(j) for j in back]
        else:
            for j in back:
                self.policy.route(self, j).own.append(j)

    def _speed(self, w: SimWorker) -> None:
        """Its slowdown windows say another speed from now: what runs goes on at that one."""
        self._advance(w)
        w.factor = w.spec.speed_factor(self.now)
        self._reschedule(w)
        self.policy.speed_changed(self, w)

    def _advance(self, w: SimWorker) -> None:
        if w.runs:
            rate = w.rate()
            dt = (self.now - w.last) * rate
            for r in w.runs:
                if r.first is None and r.remaining - dt <= r.decode_s:
                    # Its prompt was done within this stretch, at this rate.
                    r.first = w.last + max(0.0, r.remaining - r.decode_s) / rate
                r.remaining -= dt
        w.last = self.now

    def _reschedule(self, w: SimWorker) -> None:
        w.version += 1
        if w.runs:
            soonest = min(r.remaining for r in w.runs)
            self._push(self.now + max(0.0, soonest) / w.rate(), _DONE, w.index, w.version)

    def _complete(self, w: SimWorker) -> None:
        self._advance(w)
        k = len(w.runs)
        finished = [r for r in w.runs if r.remaining <= 1e-9]
        if not finished:
            finished = [min(w.runs, key=lambda r: r.remaining)]
        for r in finished:
            w.runs.remove(r)
            if not r.job.bench:
                w.view.running.remove(r.task)
            job = r.job
            wall = self.now - r.started
            slowdown = wall / r.solo if r.solo > 0 else 1.0
            measured = Measured(
                load_s=r.load_s * slowdown if r.load_s > 0 else None,
                prompt_tps=w.true.prompt_tps / slowdown,
                decode_tps=w.true.decode_tps / slowdown,
                output_tokens=job.output_tokens,
                wall_s=wall,
                in_flight=k,
            )
            if r.slot is not None:
                slot = w.cache[r.slot]
                slot.busy = False
                slot.used = self.now
                # The slot holds the prompt and what was generated: the next turn extends it.
                slot.tokens = job.prompt_tokens + job.output_tokens if job.conv >= 0 else 0
            if job.bench:
                self.benchmarks += 1
            else:
                self.finish[job.index] = self.now
                self.ttft[job.index] = (self.now if r.first is None else r.first) - job.arrival
                self.worker_of[job.index] = w.name
                w.done += 1
                if job.next >= 0:
                    turn = self.jobs[job.next]
                    turn.arrival = self.now + turn.think_s
                    self._push(turn.arrival, _ARRIVE, turn.index)
            self.policy.completed(self, w, job, measured)
        if self.chat:
            self._report(w)
        if not w.runs:
            w.idle_since = self.now
        self._reschedule(w)

    def _start(self, w: SimWorker, job: Job) -> None:
        self._advance(w)
        self._expire(w)
        if not job.bench:
            # Work: no benchmark runs beside it (workers.agent).
            self._preempt(w)
        load = 0.0 if w.loaded else w.true.load_s
        slot, cached = self._take_slot(w, job) if self.chat else (None, 0)
        decode_s = job.output_tokens / w.true.decode_tps
        solo = load + (job.prompt_tokens - cached) / w.true.prompt_tps + decode_s
        w.loaded = True
        w.view.loaded.add(self.digest)
        w.idle_since = None
        task = RunningTask(
            task_id=str(job.index),
            digest=self.digest,
            started_at_ms=self.now_ms,
            domain=job.domain,
            prompt_tokens=job.prompt_tokens,
            max_tokens=job.max_tokens,
        )
        w.runs.append(_Run(job, solo, load, self.now, task, decode_s, slot))
        if not job.bench:
            # A benchmark's slot is free to every plan (workers.agent marks it `background`).
            w.view.running.append(task)
        if self.chat:
            self._report(w)
        if not job.bench:
            self.cached[job.index] = cached
            self.start_order.append(w.name)
            self.start_s.append(self.now)
            # The speed the task gets here (its share beside what runs already) against the one a
            # free slot elsewhere would give it; a lead under MIN_RATIO is not worth routing on
            # (the detector's floor) and ordinary estimates make such calls either way.
            mine = w.true.decode_tps * w.factor * _share(len(w.runs), w.exponent)
            there = {
                x.name: x.true.decode_tps * x.factor * _share(len(x.runs) + 1, x.exponent)
                for x in self.workers
                if x.free
            }
            faster = [n for n, v in there.items() if v > MIN_RATIO * mine]
            self.misrouted.append(max(faster, key=there.__getitem__) if faster else "")
        self._reschedule(w)

    def _preempt(self, w: SimWorker) -> None:
        """Stop the benchmark running on `w` for work that starts there: it goes back to the front
        of the worker's background queue and runs again later, from its start."""
        run = next((r for r in w.runs if r.job.bench), None)
        if run is None:
            return
        w.runs.remove(run)
        self.preempted += 1
        w.background.insert(0, run.job)
        if run.slot is not None:
            slot = w.cache[run.slot]
            slot.busy, slot.conv, slot.tokens = False, -1, 0

    def _expire(self, w: SimWorker) -> None:
        """Unload the model of a worker idle for longer than its keep-alive."""
        idle = w.idle_since
        if w.loaded and not w.runs and idle is not None and self.now - idle > w.spec.keep_alive_s:
            w.loaded = False
            w.view.loaded.clear()
            # When it unloaded, not when the next look noticed.
            w.unloaded_at = idle + w.spec.keep_alive_s
            self._forget(w)

    # -- prompt caches (chat workloads) ------------------------------------------------------------

    def _take_slot(self, w: SimWorker, job: Job) -> tuple[int, int]:
        """(slot, cached prompt tokens) of a run of `job` starting on `w`: the idle slot holding
        the longest prefix of its conversation, else the least recently used idle slot."""
        idle = [k for k, s in enumerate(w.cache) if not s.busy]
        best, cached = -1, 0
        if job.conv >= 0:
            for k in idle:
                s = w.cache[k]
                if s.conv == job.conv and cached < s.tokens <= job.prompt_tokens:
                    best, cached = k, s.tokens
        if best < 0:
            best = min(idle, key=lambda k: w.cache[k].used)
        slot = w.cache[best]
        slot.busy = True
        slot.used = self.now
        # What it held is replaced by this prompt (its common prefix kept).
        slot.conv = job.conv
        slot.tokens = job.prompt_tokens if job.conv >= 0 else 0
        return best, cached

    def _forget(self, w: SimWorker) -> None:
        """The model left its memory: no slot holds anything."""
        if not self.chat:
            return
        for s in w.cache:
            s.conv, s.tokens, s.busy = -1, 0, False
        self._report(w)

    def _conv_hashes(self, conv: int, tokens: int) -> tuple[int, ...]:
        blocks = tokens_blocks(tokens)
        held = self._hashes.get(conv)
        if held is None or len(held) < blocks:
            held = self._hashes[conv] = conversation_hashes(conv, max(blocks, 2 * len(held or ())))
        return held[:blocks]

    def _report(self, w: SimWorker) -> None:
        """`w`'s view of its slots, as its lease would report them."""
        w.view.cache = [
            SlotCache(
                marks=marks_of(self._conv_hashes(s.conv, s.tokens)) if s.conv >= 0 else (),
                busy=s.busy,
                used_ms=self.epoch_ms + int(s.used * 1000.0) if math.isfinite(s.used) else 0,
                digest=self.digest,
            )
            for s in w.cache
        ]

    def _dispatch(self) -> None:
        """Give free slots work until nobody takes anything more."""
        pull = self.policy.pull
        for w in self.workers:
            self._expire(w)
        for w in self.workers:
            while w.free:
                if w.pinned:
                    self._start(w, w.pinned.pop(0))
                elif not pull:
                    if not w.own:
                        break
                    self._start(w, w.own.pop(0))
                elif self.queue and (k := self.policy.pick(self, w)) is not None:
                    entry = self.queue.pop(k)
                    self._start(w, self.jobs[int(entry.task_id)])
                else:
                    break
            # Its benchmarks: one at a time, only while it runs nothing and no work waits for it
            # (none queued for the model on a pull policy, none pushed to it otherwise).
            waiting = bool(self.queue) if pull else bool(w.own)
            if w.online and w.background and not waiting and not w.runs:
                self._start(w, w.background.pop(0))


def simulate(
    fleet: Fleet,
    model: str,
    workload: WorkloadSpec,
    policy: Policy,
    jobs: Sequence[Job] | None = None,
    epoch_ms: int = 0,
) -> RunResult:
    """Run one policy on one workload (simulated second 0 at clock time `epoch_ms`)."""
    return Simulation(fleet, model, workload, policy, jobs, epoch_ms).run()
