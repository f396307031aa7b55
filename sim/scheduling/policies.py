"""Named scheduling policies for the simulator: ours, the peers', and the yardsticks.

Push policies pick a backend at arrival (the backend queues it, as Ollama does); pull policies
leave tasks in the model's shared queue and let a free worker decide whether to take the head.
`routeledger` makes the worker agent's own decision (`router.gate.decide_take`, one task per
decision) on statistics folded with the real `projections.snapshot.fold` and the projector's
half-lives, read as often as the agent re-reads its snapshot; it learns from an empty ledger (or a
given snapshot) with benchmarks on join by the worker's own rule, and probes a machine that looks
slow as the worker does. `routeledger-oracle` is the same gate fed the true speeds at every moment
(a slowdown window included). On chats `routeledger` also prices what the workers' slots hold of
each turn's conversation, and hands a turn straight to one worker when the API would
(`router.handoff`); `routeledger-noprefix` is the same with caches left out of every decision.

The peers `sticky`, `pair` and `herd` follow their projects' published rules (cited where each
is defined).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable

import msgspec

from dispatch.benchmark import BENCH_MIN_SAMPLES, BENCH_STALE_AFTER_S, PROBE_AFTER_S, needs_benchmark
from projections.shift import detect, fold_sample
from projections.snapshot import DemandRow, LengthRow, Snapshot, SpeedRow, Stat, fold
from router.choose import Decision, RouteQuery, rank_workers
from router.estimate import Estimator, build_estimator
from router.gate import BACKLOG_DEPTH, GateParams, decide_take
from router.handoff import handoff_worker
from router.plan import FleetView, WorkerView
from sim.errors import FleetError
from sim.scheduling.schedule import Measured, Simulation, SimWorker
from sim.scheduling.workload import Job, capped_mean

# How often the agent's benchmark loop looks (workers.config's default `bench_check_s`).
BENCH_CHECK_S = 30.0


class _Base:
    name = "base"
    pull = False

    def start(self, sim: Simulation) -> None:
        return None

    def joined(self, sim: Simulation, worker: SimWorker) -> int:
        return 0

    def arrived(self, sim: Simulation, job: Job) -> None:
        return None

    def pin(self, sim: Simulation, job: Job) -> SimWorker | None:
        return None

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        raise FleetError(f"{self.name} is a pull policy")

    def take(self, sim: Simulation, worker: SimWorker) -> bool:
        raise FleetError(f"{self.name} is a push policy")

    def pick(self, sim: Simulation, worker: SimWorker) -> int | None:
        return 0 if self.take(sim, worker) else None

    def completed(self, sim: Simulation, worker: SimWorker, job: Job, measured: Measured) -> None:
        return None

    def speed_changed(self, sim: Simulation, worker: SimWorker) -> None:
        return None


def _online(sim: Simulation) -> list[SimWorker]:
    return [w for w in sim.workers if w.online]


def _true_rate(w: SimWorker, sim: Simulation) -> float:
    """Tasks per second the worker serves at the workload's mean (yardsticks only)."""
    mean = sum(j.output_tokens for j in sim.jobs[:200]) / max(1, min(200, len(sim.jobs)))
    return float(w.slots**w.exponent) / w.true.seconds(sim.workload.prompt_tokens, mean, True)


class RoundRobin(_Base):
    name = "round-robin"

    def __init__(self) -> None:
        self.i = 0

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        online = _online(sim)
        self.i += 1
        return online[(self.i - 1) % len(online)]


class RandomChoice(_Base):
    name = "random"

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        return self.rng.choice(_online(sim))


class LeastBusy(_Base):
    """LiteLLM's least-busy: fewest in flight; ties to the first registered."""

    name = "least-busy"

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        return min(_online(sim), key=lambda w: w.in_system())


class LeastConnections(_Base):
    """Olla's least-connections: fewest active connections; ties rotated."""

    name = "least-connections"

    def __init__(self) -> None:
        self.turn = 0

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        online = _online(sim)
        fewest = min(w.in_system() for w in online)
        tied = [w for w in online if w.in_system() == fewest]
        self.turn += 1
        return tied[self.turn % len(tied)]


class LitellmLatency(_Base):
    """LiteLLM's lowest-latency routing: mean of the last 10 end-to-end seconds per output token
    per deployment; a deployment never measured counts as 0; ties broken at random."""

    name = "litellm-latency"

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.samples: dict[str, deque[float]] = {}

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        def score(w: SimWorker) -> float:
            s = self.samples.get(w.name)
            return sum(s) / len(s) if s else 0.0

        online = _online(sim)
        best = min(score(w) for w in online)
        return self.rng.choice([w for w in online if score(w) == best])

    def arrived(self, sim: Simulation, job: Job) -> None:
        job.arrival = job.arrival  # the end-to-end clock starts at arrival (kept on the job)

    def completed(self, sim: Simulation, worker: SimWorker, job: Job, measured: Measured) -> None:
        if job.bench:
            return
        wall = sim.now - job.arrival
        self.samples.setdefault(worker.name, deque(maxlen=10)).append(wall / max(1, job.output_tokens))


class ShortestExpectedDelay(_Base):
    """SED with the true speeds: the worker minimising (tasks it has + 1) / its service rate."""

    name = "sed"

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        return min(_online(sim), key=lambda w: (w.in_system() + 1) / _true_rate(w, sim))


class Sticky(_Base):
    """Olla's sticky sessions: a conversation's turns go to the backend that served its first turn
    while that backend is routable; a new conversation (or one whose backend is gone) goes where
    the configured balancer sends it, and is pinned there. The balancer here is Olla's
    least-connections (`LeastConnections`, fewest active connections; ties rotated): the default
    `priority` balancer picks at random within a priority tier, and these fleets set no priorities.
    Olla also expires a pin after a TTL; the think times here are far below any TTL, so none is
    modelled.

    Rule: https://thushan.github.io/olla/concepts/sticky-sessions/ ("Hit: the pinned backend is
    still routable ... Miss: ... forwarded to the underlying balancer, and the selected backend is
    stored. Repin: ... no longer routable") and https://thushan.github.io/olla/concepts/load-balancing
    (source: github.com/thushan/olla, internal/adapter/balancer/sticky.go).
    """

    name = "sticky"

    def __init__(self) -> None:
        self.home: dict[int, str] = {}
        self.balancer = LeastConnections()

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        name = self.home.get(job.conv)
        if name is not None:
            home = sim.by_name[name]
            if home.online:
                return home
        chosen = self.balancer.route(sim, job)
        if job.conv >= 0:
            self.home[job.conv] = chosen.name
        return chosen


# PAIR's coarse GPU pressure: utilization at or above each threshold adds one unit (0-3).
PAIR_PRESSURE = (0.40, 0.70, 0.85)


class Pair(_Base):
    """NVIDIA PAIR's node order: among the nodes holding the model, by pending jobs (queued or
    running there) plus GPU pressure, then pressure, then node id. Pressure maps the busiest GPU's
    utilization to 0-3 units at 40%, 70% and 85%; here utilization is the share of the machine's
    slots in use (the simulator has no GPU counters), without PAIR's smoothing and hysteresis.
    Node id order is registration order. PAIR's proxy counts its own just-dispatched requests at
    once, as the simulator's counts are.

    Rule: https://github.com/NVIDIA/Personal-AI-Router/blob/main/docs/architecture.mdx ("How a
    Node Is Chosen": "Nodes sort by pending plus pressure, then by pressure, then by node ID").
    """

    name = "pair"

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        def key(w: SimWorker) -> tuple[int, int, int]:
            used = len(w.runs) / w.slots
            pressure = sum(1 for t in PAIR_PRESSURE if used >= t)
            return (w.in_system() + pressure, pressure, w.index)

        return min(_online(sim), key=key)


class Herd(_Base):
    """Ollama Herd's score, its signals that tell these machines apart: model thermal state (+50
    loaded, +30 unloaded within the last 30 minutes, +10 cold on disk), memory fit (+20: the model
    fits every machine here comfortably), queue depth (-6 per request, at most -30), and the
    estimated wait (-(depth x the node x model's p75 latency) / 10 s, at most -25). Depth counts
    the requests the node has for the model, running or queued. Latency is each run's seconds on
    that node (the last 100); with none yet, 10 s (Herd's guess for a model of unknown size).
    Role affinity, availability trend and context fit score alike on every machine here and are
    left out. The highest score wins; ties go to the first registered.

    Rule: https://ollamaherd.com/guides/concepts ("Scoring Signals") and
    https://github.com/geeks-accelerator/ollama-herd/blob/main/src/fleet_manager/server/scorer.py
    with the weights of src/fleet_manager/models/config.py.
    """

    name = "herd"
    WARM_S = 1800.0
    DEFAULT_P75_S = 10.0

    def __init__(self) -> None:
        self.latency: dict[str, deque[float]] = {}

    def _p75(self, w: SimWorker) -> float:
        xs = sorted(self.latency.get(w.name, ()))
        if not xs:
            return self.DEFAULT_P75_S
        return xs[min(len(xs) - 1, math.ceil(0.75 * len(xs)) - 1)]

    def score(self, sim: Simulation, w: SimWorker) -> float:
        if w.loaded and not (w.idle_since is not None and sim.now - w.idle_since > w.spec.keep_alive_s):
            thermal = 50.0
        elif w.unloaded_at is not None and sim.now - w.unloaded_at < self.WARM_S:
            thermal = 30.0
        else:
            thermal = 10.0
        depth = w.in_system()
        queue = -min(30.0, 6.0 * depth)
        wait = -min(25.0, depth * self._p75(w) / 10.0) if depth else 0.0
        return thermal + 20.0 + queue + wait

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        online = _online(sim)
        scores = [self.score(sim, w) for w in online]
        return online[scores.index(max(scores))]

    def completed(self, sim: Simulation, worker: SimWorker, job: Job, measured: Measured) -> None:
        if not job.bench:
            self.latency.setdefault(worker.name, deque(maxlen=100)).append(measured.wall_s)


class StoryOriginal(_Base):
    """The story's first router: speed statistics keyed by model only (the same for every worker,
    so they cannot tell machines apart), a congestion score that averages only the metrics a
    worker reports (a worker reporting none scores a perfect 0), a sample-depth bonus, and
    benchmarks sent only to the current winner."""

    name = "story-original"

    def __init__(self) -> None:
        self.samples: dict[str, int] = {}

    def _score(self, w: SimWorker) -> float:
        congestion = min(1.0, w.in_system() / w.slots) if w.spec.reports_resources else 0.0
        depth = min(1.0, self.samples.get(w.name, 0) / 50.0)
        return congestion + 0.5 * (1.0 - depth)

    def start(self, sim: Simulation) -> None:
        # The nightly benchmark went to the current winner: the first registered worker.
        if sim.workers:
            self.samples[sim.workers[0].name] = 58

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        return min(_online(sim), key=self._score)

    def completed(self, sim: Simulation, worker: SimWorker, job: Job, measured: Measured) -> None:
        self.samples[worker.name] = self.samples.get(worker.name, 0) + 1


class FastOnly(_Base):
    """Only the fastest online worker takes work."""

    name = "fast-only"
    pull = True

    def take(self, sim: Simulation, worker: SimWorker) -> bool:
        fastest = max(_online(sim), key=lambda w: (_true_rate(w, sim) / w.slots**w.exponent, -w.index))
        return worker is fastest


class Threshold(_Base):
    """The slow-server threshold policy: the fastest worker always takes; a slower one takes
    only when at least `k` tasks wait (per speed rank: `ks[i]` for the i-th fastest after it)."""

    pull = True

    def __init__(self, ks: tuple[int, ...]) -> None:
        self.ks = ks
        self.name = f"threshold-{','.join(map(str, ks))}"
        self._rank: dict[str, int] = {}

    def start(self, sim: Simulation) -> None:
        by_speed = sorted(sim.workers, key=lambda w: (-w.true.decode_tps, w.index))
        self._rank = {w.name: i for i, w in enumerate(by_speed)}

    def take(self, sim: Simulation, worker: SimWorker) -> bool:
        rank = self._rank[worker.name]
        # Online faster machines: if none is online, this one is the fastest there is.
        faster = [w for w in sim.workers if w.online and self._rank[w.name] < rank]
        if not faster:
            return True
        k = self.ks[min(rank - 1, len(self.ks) - 1)]
        return len(sim.queue) >= k


def _by_speed(sim: Simulation) -> list[SimWorker]:
    """The serving workers, fastest first (by solo decode speed; ties to the first registered)."""
    return sorted(sim.workers, key=lambda w: (-w.true.decode_tps, w.index))


def exact_size(sim: Simulation, job: Job) -> float:
    """A job's true solo seconds on the fastest worker, model loaded: the size SITA cuts by."""
    return _by_speed(sim)[0].true.seconds(job.prompt_tokens, job.output_tokens, True)


class Sita(_Base):
    """Size-interval task assignment with exact sizes: the slowest worker gets the jobs below the
    first cutoff, the next one those up to the second, and so on; the fastest gets the largest.
    Each worker serves its own queue in arrival order. A job whose worker is offline goes to the
    nearest online one by speed, faster first. The cutoffs are swept per load
    (sim.scheduling.experiment.sweep_sita): the best of them is a strong bound on what knowing
    sizes is worth, since no router knows a task's output length before it runs."""

    pull = False

    def __init__(self, cutoffs: tuple[float, ...]) -> None:
        self.cutoffs = cutoffs
        self.name = f"sita-{','.join(f'{c:.3g}' for c in cutoffs)}"
        self._slowest_first: list[SimWorker] = []

    def start(self, sim: Simulation) -> None:
        self._slowest_first = list(reversed(_by_speed(sim)))

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        size = exact_size(sim, job)
        order = self._slowest_first
        k = len(order) - 1
        for i, c in enumerate(self.cutoffs[: len(order) - 1]):
            if size < c:
                k = i
                break
        nearest: list[SimWorker] = [*order[k:], *reversed(order[:k])]
        for w in nearest:
            if w.online:
                return w
        return _online(sim)[0]


def _size_estimate(sim: Simulation, job: Job, w: SimWorker) -> float:
    """Expected solo seconds of `job` on `w` from what a request says before it runs: its prompt
    tokens and its class's mean output capped by its max_tokens (the mix's law, or the model's
    mean), never its true output."""
    return w.true.seconds(job.prompt_tokens, _expected_output(sim, job), True)


def _expected_output(sim: Simulation, job: Job) -> float:
    mix = sim.workload.mix
    if mix is not None:
        for c in mix.classes:
            if c.domain == job.domain:
                return capped_mean(c)
    mean = sim.workload.mean_tokens or sim.fleet.model_spec(sim.model).output.mean
    return mean if job.max_tokens is None else min(mean, float(job.max_tokens))


def _work_left(sim: Simulation, w: SimWorker) -> float:
    """Expected solo seconds of what `w` has: its running tasks' estimates less the time they ran
    (never below 0), and its queued ones whole, shared over its slots."""
    running = sum(max(0.0, _size_estimate(sim, r.job, w) - (sim.now - r.started)) for r in w.runs)
    queued = sum(_size_estimate(sim, j, w) for j in w.own)
    return (running + queued) / float(w.slots**w.exponent)


class SedSize(_Base):
    """SED with size estimates: the worker where the job is expected to finish first, counting the
    expected work it has (`_work_left`) and the job's own expected size there."""

    name = "sed-size"

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        return min(_online(sim), key=lambda w: _work_left(sim, w) + _size_estimate(sim, job, w))


class LeastBusySize(_Base):
    """Least-busy by expected work instead of task count: the worker with the least expected solo
    seconds left (`_work_left`), whatever the job's own size there."""

    name = "least-busy-size"

    def route(self, sim: Simulation, job: Job) -> SimWorker:
        return min(_online(sim), key=lambda w: _work_left(sim, w))


def _copy(snapshot: Snapshot) -> Snapshot:
    """A snapshot whose tables later folds do not reach (folds replace rows, never change them)."""
    return msgspec.structs.replace(
        snapshot,
        speed=dict(snapshot.speed),
        length=dict(snapshot.length),
        quality=dict(snapshot.quality),
        fleet=dict(snapshot.fleet),
        demand=dict(snapshot.demand),
    )


class Routeledger(_Base):
    """The worker agent's decision, learning online: benchmarks on join, samples folded as the
    projector does, the decision made on a snapshot at most `gate.snapshot_every_s` old.

    `snapshot`: the projection to start from (a real one, to replay what a real fleet saw; its
    half-lives are then the ones the tables are folded with); an empty one by default.
    """

    name = "routeledger"
    pull = True

    def __init__(
        self,
        gate: GateParams | None = None,
        oracle: bool = False,
        snapshot: Snapshot | None = None,
        prefix: bool = True,
        name: str | None = None,
    ) -> None:
        # Size-aware dispatch on (router.gate.GateParams.skip_ahead): the simulator's queue can
        # hand out any entry.
        self.gate = gate or GateParams(skip_ahead=True)
        self.oracle = oracle
        if oracle:
            self.name = "routeledger-oracle"
        # False: decisions see no slot contents (the `prefix_pricing` setting off).
        self.prefix = prefix
        if not prefix:
            self.name = "routeledger-noprefix"
        if name is not None:
            self.name = name
        # Turns handed straight to a worker (`pin`).
        self.handoffs = 0
        # What the projector holds: every arrival and completion is folded in at once.
        self.tables = _copy(snapshot) if snapshot is not None else Snapshot()
        # What the agent decides on: a copy of the tables and its estimator, re-read as often as
        # the agent re-reads the projection (it trails the tables by up to that).
        self._read: tuple[Snapshot, Estimator] | None = None
        self._read_at = 0.0
        # Folds of speed and length rows so far, and how many the last fit saw.
        self._folds = 0
        self._fitted = -1
        # When the agent last looked for benchmarks to ask for, and when it last probed each worker
        # (it does not ask again before the last probe's results can have been folded).
        self._checked_at = -math.inf
        self._probed: dict[str, float] = {}
        # (simulated second, worker, shifted slower / faster / cleared / adopted) each time the
        # decode field's shift state changed: what the projector would append as SpeedShiftDetected.
        self.shifts: list[tuple[float, str, str]] = []

    def start(self, sim: Simulation) -> None:
        if self.oracle:
            mean = sum(j.output_tokens for j in sim.jobs) / len(sim.jobs)
            for w in sim.workers:
                self._know(sim, w)
            self.tables.length[(sim.digest, sim.workload.domain)] = LengthRow(
                digest=sim.digest, domain=sim.workload.domain, output_tokens=_known(mean)
            )

    def _know(self, sim: Simulation, w: SimWorker) -> None:
        """The oracle's row of `w`: its true speeds at this moment."""
        self.tables.speed[(w.name, sim.digest)] = SpeedRow(
            worker=w.name,
            digest=sim.digest,
            decode_tps=_known(w.true.decode_tps * w.factor),
            prompt_tps=_known(w.true.prompt_tps * w.factor),
            load_s=_known(w.true.load_s / w.factor),
        )
        self._folds += 1
        # The agent's next read sees it (the oracle knows at once).
        self._read = None

    def speed_changed(self, sim: Simulation, worker: SimWorker) -> None:
        if self.oracle:
            self._know(sim, worker)

    def joined(self, sim: Simulation, worker: SimWorker) -> int:
        if self.oracle:
            return 0
        need = self._need(sim, worker.name)
        return 0 if need is None else need[0]

    def _need(
        self, sim: Simulation, worker: str, probe_after_s: float | None = None
    ) -> tuple[int, str] | None:
        """What the agent's grading schedule (`needs_benchmark`) asks of `worker` now."""
        return needs_benchmark(
            self.tables,
            worker,
            sim.digest,
            sim.now_ms,
            min_samples=BENCH_MIN_SAMPLES,
            stale_after_s=BENCH_STALE_AFTER_S,
            probe_after_s=probe_after_s,
        )

    def _probe(self, sim: Simulation) -> None:
        """The agent's benchmark loop (every `BENCH_CHECK_S`): probe a worker that looks slow."""
        if self.oracle or sim.now - self._checked_at < BENCH_CHECK_S:
            return
        self._checked_at = sim.now
        for w in sim.workers:
            if not w.online or sim.now - self._probed.get(w.name, -math.inf) < PROBE_AFTER_S:
                continue
            need = self._need(sim, w.name, PROBE_AFTER_S)
            if need is not None and need[1].startswith("probe:"):
                self._probed[w.name] = sim.now
                sim.benchmark(w, need[0])

    def arrived(self, sim: Simulation, job: Job) -> None:
        self._probe(sim)
        row = self.tables.demand.get(sim.digest) or DemandRow(digest=sim.digest)
        self.tables.demand[sim.digest] = DemandRow(
            digest=sim.digest,
            arrivals=fold(row.arrivals, 1.0, sim.now_ms, self.tables.demand_half_life_s),
        )

    def _evidence(self, sim: Simulation) -> tuple[Snapshot, Estimator]:
        if self._read is None or sim.now - self._read_at >= self.gate.snapshot_every_s:
            snap = _copy(self.tables)
            est = self._read[1] if self._read is not None and self._fitted == self._folds else None
            if est is None:
                # The agent refits on every read; on unchanged rows a refit differs only by the
                # statistics' week-long decay over the seconds between, so it is skipped here.
                est = build_estimator(snap, sim.now_ms)
                self._fitted = self._folds
            self._read = (snap, est)
            self._read_at = sim.now
        return self._read

    def take(self, sim: Simulation, worker: SimWorker) -> bool:
        snap, est = self._evidence(sim)
        view = sim.view
        # A copy: the simulation changes its workers' views in place (what runs, what is loaded),
        # and the router keeps figures per list of workers, which a new list renews.
        workers = self._workers(sim)
        return decide_take(worker.name, workers, view.backlog, snap, est, sim.now_ms, self.gate).take

    def pick(self, sim: Simulation, worker: SimWorker) -> int | None:
        snap, est = self._evidence(sim)
        workers = self._workers(sim)
        d = decide_take(worker.name, workers, sim.view.backlog, snap, est, sim.now_ms, self.gate)
        if not d.take:
            return None
        for k, e in enumerate(sim.queue[:BACKLOG_DEPTH]):
            if e.task_id == d.task_id:
                return k
        return 0

    def _workers(self, sim: Simulation) -> list[WorkerView]:
        if self.prefix:
            return list(sim.view.workers)
        return [msgspec.structs.replace(w, cache=[]) if w.cache else w for w in sim.view.workers]

    def pin(self, sim: Simulation, job: Job) -> SimWorker | None:
        """The API's pinned hand-off (router.handoff): the plan's best holder for the turn, when an
        idle slot there holds part of it, it has a free slot, and every other holder's finish is at
        least HANDOFF_RATIO (1.25) times its own."""
        if not self.prefix or job.chain is None or not job.chain.hashes:
            return None
        workers = self._workers(sim)
        if not workers:
            return None
        _, est = self._evidence(sim)
        view = FleetView(workers=workers, backlog={sim.digest: sim.queue[:BACKLOG_DEPTH]})
        query = RouteQuery(
            model=sim.model,
            domain=job.domain,
            prompt_tokens=job.prompt_tokens,
            prefix=job.chain,
            paced=job.paced,
        )
        ranking = rank_workers(view, est, sim.digest, sim.now_ms, query, params=self.gate.plan)
        decision = Decision(model=sim.model, digest=sim.digest, domain=job.domain, ranking=ranking)
        name = handoff_worker(decision)
        if name is None:
            return None
        self.handoffs += 1
        return sim.by_name[name]

    def completed(self, sim: Simulation, worker: SimWorker, job: Job, measured: Measured) -> None:
        if self.oracle:
            return
        at = sim.now_ms
        hl = self.tables.half_life_s
        self._folds += 1
        key = (worker.name, sim.digest)
        row = self.tables.speed.get(key) or SpeedRow(worker=worker.name, digest=sim.digest)
        before = detect("decode_tps", row.decode_tps, row.decode_recent)
        decode = fold_sample(
            "decode_tps",
            row.decode_tps,
            row.decode_recent,
            measured.decode_tps,
            at,
            hl,
            row.decode_held,
            row.decode_held_since,
        )
        prompt = fold_sample(
            "prompt_tps",
            row.prompt_tps,
            row.prompt_recent,
            measured.prompt_tps,
            at,
            hl,
            row.prompt_held,
            row.prompt_held_since,
        )
        self.tables.speed[key] = SpeedRow(
            worker=row.worker,
            digest=row.digest,
            decode_tps=decode.stat,
            prompt_tps=prompt.stat,
            load_s=row.load_s if measured.load_s is None else fold(row.load_s, measured.load_s, at, hl),
            ttft_s=row.ttft_s,
            in_flight=fold(row.in_flight, float(measured.in_flight), at, hl),
            decode_recent=decode.window,
            prompt_recent=prompt.window,
            sampled_at=at if row.sampled_at is None else max(row.sampled_at, at),
            decode_held=decode.held,
            decode_held_since=decode.held_since,
            prompt_held=prompt.held,
            prompt_held_since=prompt.held_since,
        )
        after = decode.shift
        if decode.adopted is not None:
            self.shifts.append((sim.now, worker.name, "adopted"))
            before = None
        state = "cleared" if after is None else ("slower" if after.slower else "faster")
        if (before is None) != (after is None) or (before and after and before.slower != after.slower):
            self.shifts.append((sim.now, worker.name, state))
        if not job.bench:
            lkey = (sim.digest, job.domain)
            lrow = self.tables.length.get(lkey) or LengthRow(digest=sim.digest, domain=job.domain)
            self.tables.length[lkey] = LengthRow(
                digest=lrow.digest,
                domain=lrow.domain,
                output_tokens=fold(lrow.output_tokens, float(measured.output_tokens), at, hl),
            )


def _known(x: float) -> Stat:
    """A statistic of a value known exactly (a million samples of it)."""
    many = 1_000_000
    return Stat(
        n=many, sum=x * many, sumsq=x * x * many, dn=many, dsum=x * many, dsumsq=x * x * many, updated_at=0
    )


POLICIES: dict[str, Callable[[], _Base]] = {
    "routeledger": Routeledger,
    "routeledger-oracle": lambda: Routeledger(oracle=True),
    "routeledger-noprefix": lambda: Routeledger(prefix=False),
    "routeledger-sizeblind": lambda: Routeledger(gate=GateParams(), name="routeledger-sizeblind"),
    "round-robin": RoundRobin,
    "random": RandomChoice,
    "least-busy": LeastBusy,
    "litellm-latency": LitellmLatency,
    "least-connections": LeastConnections,
    "fast-only": FastOnly,
    "sed": ShortestExpectedDelay,
    "sed-size": SedSize,
    "least-busy-size": LeastBusySize,
    "story-original": StoryOriginal,
    "sticky": Sticky,
    "pair": Pair,
    "herd": Herd,
}
# `best-threshold` and `sita` are not one policy each but sweeps of `Threshold` and `Sita`
# (sim.scheduling.experiment).
POLICY_NAMES: tuple[str, ...] = (*POLICIES, "best-threshold", "sita")


def make_policy(name: str) -> _Base:
    """A fresh policy by name (`best-threshold` and `sita` are swept by the runner, not made here)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise FleetError(f"unknown policy {name!r}; policies: {', '.join(POLICY_NAMES)}")
    return factory()
