"""A synthetic ledger history: the events a small fleet leaves over months, made in seconds.

The long-run test and benchmark need millions of tasks of history with a realistic mix: most tasks
are routed, claimed and completed once; some fail and run again elsewhere, are reclaimed from a
dead worker, cancelled or dead-lettered; workers come and go; benchmarks and grades arrive now and
then. Each task's TaskRouted carries a decision the real router made on a fleet of `holders`
workers, so that its size is what production writes. Everything is seeded: the same arguments give
the same events.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Final

from events.event import (
    BenchmarkResult,
    Event,
    QualityScored,
    TaskCancelled,
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskFailed,
    TaskReclaimed,
    TaskRouted,
    TaskSubmitted,
    Timings,
    WorkerOffline,
    WorkerOnline,
)
from events.keys import Keys
from projections.snapshot import DEFAULT_HALF_LIFE_S, LengthRow, QualityRow, Snapshot, SpeedRow, Stat, fold
from router.choose import RouteQuery, decide
from router.estimate import build_estimator
from router.plan import FleetView, WorkerView

MODEL: Final = "qwen3:8b"
DIGEST: Final = "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41"
DOMAINS: Final = ("general", "code", "ja")
YEAR_MS: Final = 365 * 86_400_000


def worker_names(holders: int) -> list[str]:
    """The fleet's workers: the first is fast, the rest slower and slower."""
    return [f"w{i:02d}" for i in range(holders)]


def _stat(value: float, n: int, at_ms: int) -> Stat:
    s = Stat()
    for _ in range(n):
        s = fold(s, value, at_ms, DEFAULT_HALF_LIFE_S)
    return s


def routed_breakdown(
    workers: list[str], now_ms: int, *, model: str = MODEL, digest: str = DIGEST, speed: float = 83.0
) -> tuple[dict[str, object], str, float]:
    """What the real router records in the ledger for one decision among `workers`, which all hold
    the model: the breakdown, the chosen worker and its expected finish."""
    snap = Snapshot(half_life_s=DEFAULT_HALF_LIFE_S, taken_at=now_ms)
    views = []
    for i, name in enumerate(workers):
        tps = speed / (1 + i)
        snap.speed[(name, digest)] = SpeedRow(
            worker=name,
            digest=digest,
            decode_tps=_stat(tps, 20, now_ms),
            prompt_tps=_stat(tps * 15, 20, now_ms),
            load_s=_stat(6.0, 5, now_ms),
        )
        views.append(WorkerView(name=name, slots=1 + i % 2, holds={digest}, loaded={digest}))
    for domain in DOMAINS:
        snap.length[(digest, domain)] = LengthRow(
            digest=digest, domain=domain, output_tokens=_stat(300.0, 20, now_ms)
        )
        snap.quality[(digest, domain)] = QualityRow(digest=digest, domain=domain, score=_stat(0.8, 3, now_ms))
    view = FleetView(workers=views, backlog={}, arrival_rate={digest: 0.05})
    decision = decide(
        RouteQuery(model=model, domain="general", prompt_tokens=400),
        {model: digest},
        view,
        build_estimator(snap, now_ms),
        now_ms,
    )
    best = decision.ranking.best
    return decision.to_record(), best.worker, best.expected_finish_s


class HistoryMaker:
    """Makes the events of tasks `0 … tasks-1`, spread evenly over `span_ms` from `start_ms`."""

    def __init__(
        self,
        tasks: int,
        *,
        holders: int = 3,
        start_ms: int = 1_735_689_600_000,
        span_ms: int = YEAR_MS,
        seed: int = 7,
        keys: Keys | None = None,
        model: str = MODEL,
        digest: str = DIGEST,
        workers: list[str] | None = None,
        speed: float = 83.0,
    ) -> None:
        self.tasks = tasks
        self.holders = holders
        self.start_ms = start_ms
        self.span_ms = span_ms
        self.seed = seed
        self.model = model
        self.digest = digest
        self.speed = speed
        self.queue = (keys or Keys()).queue(digest)
        self.workers = (workers or worker_names(holders))[:holders]
        self.breakdown, self.expected_worker, self.expected_finish_s = routed_breakdown(
            self.workers, start_ms, model=model, digest=digest, speed=speed
        )

    def batches(self, tasks_per_batch: int = 10_000, first: int = 0) -> Iterator[list[Event]]:
        """The events of tasks `first …`, `tasks_per_batch` tasks at a time, in ledger order."""
        for start in range(first, self.tasks, tasks_per_batch):
            out: list[Event] = []
            for i in range(start, min(start + tasks_per_batch, self.tasks)):
                # One generator per task: the events do not depend on how they are batched.
                out.extend(self.task_events(i, random.Random(self.seed * 1_000_003 + i)))
            yield out

    def task_events(self, i: int, rnd: random.Random) -> list[Event]:
        """One task's events, with now and then a fleet or benchmark event beside them."""
        at = self.start_ms + i * self.span_ms // max(1, self.tasks)
        task_id = f"{i:016x}{rnd.getrandbits(64):016x}"
        domain = DOMAINS[i % len(DOMAINS)]
        events: list[Event] = [
            TaskSubmitted(
                at=at,
                task_id=task_id,
                model=self.model,
                digest=self.digest,
                queue=self.queue,
                domain=domain,
                prompt_tokens=rnd.randint(20, 4000),
                max_tokens=rnd.choice((None, 256, 1024)),
                prompt_bytes=rnd.randint(80, 16_000),
                prompt_sha256=f"{rnd.getrandbits(256):064x}",
            ),
            TaskRouted(
                at=at,
                task_id=task_id,
                digest=self.digest,
                queue=self.queue,
                breakdown=self.breakdown,
                expected_worker=self.expected_worker,
                expected_finish_s=self.expected_finish_s,
            ),
        ]
        fate = rnd.random()
        worker = self.workers[0] if rnd.random() < 0.7 else rnd.choice(self.workers)
        if fate < 0.02:
            events.append(TaskCancelled(at=at + 500, task_id=task_id, queue=self.queue))
            return events
        events.append(self._claimed(task_id, worker, 1, at + 50))
        attempt = 1
        if fate < 0.04:
            events.append(
                TaskDeadLettered(
                    at=at + 900, task_id=task_id, queue=self.queue, reason="backend error", attempts=3
                )
            )
            return events
        if fate < 0.09:
            events.append(
                TaskFailed(
                    at=at + 400,
                    task_id=task_id,
                    worker=worker,
                    digest=self.digest,
                    attempt=1,
                    kind="backend",
                    retryable=True,
                    message="connection reset by peer",
                )
            )
            attempt, worker = 2, rnd.choice(self.workers)
            events.append(self._claimed(task_id, worker, attempt, at + 600))
        elif fate < 0.12:
            events.append(
                TaskReclaimed(
                    at=at + 30_000,
                    task_id=task_id,
                    queue=self.queue,
                    old_entry=f"{at}-0",
                    new_entry=f"{at + 30_000}-0",
                    owner=worker,
                    attempt=2,
                    idle_ms=30_000,
                )
            )
            attempt, worker = 2, rnd.choice(self.workers)
            events.append(self._claimed(task_id, worker, attempt, at + 30_050))
        events.append(self._completed(task_id, worker, attempt, domain, at + 2_000, rnd))
        if i % 5_000 == 4_999:
            events.extend(self._benchmark(i, at + 3_000, rnd))
        if i % 20_000 == 19_999:
            name = rnd.choice(self.workers)
            events.append(WorkerOffline(at=at + 4_000, worker=name, reason="shutdown"))
            events.append(WorkerOnline(at=at + 60_000, worker=name, slots=2, backend="http://sim:11434"))
        return events

    def _claimed(self, task_id: str, worker: str, attempt: int, at: int) -> TaskClaimed:
        return TaskClaimed(
            at=at,
            task_id=task_id,
            worker=worker,
            digest=self.digest,
            attempt=attempt,
            queue=self.queue,
            entry_id=f"{at}-0",
        )

    def _completed(
        self, task_id: str, worker: str, attempt: int, domain: str, at: int, rnd: random.Random
    ) -> TaskCompleted:
        tps = self.speed / (1 + self.workers.index(worker))
        tokens = rnd.randint(10, 900)
        prompt = rnd.randint(20, 4000)
        return TaskCompleted(
            at=at,
            task_id=task_id,
            worker=worker,
            digest=self.digest,
            attempt=attempt,
            domain=domain,
            timings=Timings(
                prompt_eval_count=prompt,
                prompt_eval_duration=int(prompt / (tps * 15) * 1e9),
                eval_count=tokens,
                eval_duration=int(tokens / tps * 1e9 * rnd.uniform(0.9, 1.1)),
                load_duration=rnd.choice((0, 3_000_000, 6_000_000_000)),
                total_duration=int((tokens / tps + 0.3) * 1e9),
            ),
            ttft_ms=rnd.uniform(50.0, 900.0),
            wall_ms=rnd.uniform(500.0, 20_000.0),
            output_bytes=tokens * 4,
            output_sha256=f"{rnd.getrandbits(256):064x}",
            done_reason="stop",
        )

    def _benchmark(self, i: int, at: int, rnd: random.Random) -> list[Event]:
        bench_id = f"b{i:015x}"
        out: list[Event] = []
        for n, worker in enumerate(self.workers):
            task_id = f"{bench_id}-{n}"
            tps = self.speed / (1 + n)
            t = Timings(eval_count=32, eval_duration=int(32 / tps * 1e9), prompt_eval_count=40)
            out.append(
                BenchmarkResult(
                    at=at, bench_id=bench_id, worker=worker, digest=self.digest, task_id=task_id, timings=t
                )
            )
        out.append(QualityScored(at=at, digest=self.digest, domain="general", score=rnd.choice((0.0, 1.0))))
        return out
