"""Benchmarking and grading: the worker asks for its own speed benchmarks and reference grades.

Every served model whose speed row on this worker is thin or stale gets a benchmark; each served
model's ungraded prompts are graded by the one holder that grades it (dispatch.benchmark). Both go
to the worker's background stream, run only when it runs nothing else, and are given up for user
work (workers.runner).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from dispatch.benchmark import (
    PROBE_AFTER_S,
    grader_for,
    is_probe,
    needs_benchmark,
    request_benchmark,
    ungraded,
)
from dispatch.serving import embeds_only
from events.clock import LedgerClock
from events.errors import RouteledgerError
from events.keys import Keys
from projections.benchset import benchset, domains
from projections.snapshot import Snapshot
from tasks.store import TaskStore
from workers.config import WorkerConfig
from workers.consumer import Consumer
from workers.holdings import Holdings
from workers.runs import Runs

log = logging.getLogger("routeledger.worker")

# A speed benchmark whose answers came back too short to measure is asked again with the next
# prompts, at most this many rounds in a window of this many seconds.
_BENCH_ROUNDS = 3
_BENCH_WINDOW_S = 600.0
# Seconds after the last background run ends before its samples count as folded.
_FOLD_WAIT_S = 2.0


class Benchmarks:
    """Requests one worker's benchmarks and gradings, as its speed table and grades need them."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        config: WorkerConfig,
        clock: LedgerClock,
        queues: TaskStore,
        holdings: Holdings,
        runs: Runs,
        consumer: Consumer,
        *,
        background: str,
        stopping: asyncio.Event,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.config = config
        self.name = config.name
        self.clock = clock
        self.queues = queues
        self.holdings = holdings
        self.runs = runs
        self.consumer = consumer
        # This worker's stream of benchmark and grading tasks.
        self.background = background
        self.stopping = stopping
        # digest -> (monotonic time, rounds in the window, the next speed prompt's place) of the
        # last benchmark this worker requested for itself
        self._benched: dict[str, tuple[float, int, int]] = {}
        # (digest, domain) -> (monotonic time, prompts still ungraded then) of the last grading
        # this worker requested: the next batch goes once those grades are folded.
        self._grading: dict[tuple[str, str], tuple[float, frozenset[str]]] = {}

    async def run(self) -> None:
        """Benchmark every served model whose speed row on this worker is thin or stale."""
        from projections.reader import snapshot

        first = True
        while not self.stopping.is_set():
            try:
                now = await self.clock.now_ms()
                snap = await snapshot(self.redis, self.keys, now_ms=now)
                for model in self.holdings.serving():
                    asked = self._benched.get(model.digest)
                    if asked is not None and not await self._background_done():
                        continue  # asked already; its results are not in yet
                    embed = embeds_only(model)
                    need = needs_benchmark(
                        snap,
                        self.name,
                        model.digest,
                        now,
                        min_samples=self.config.bench_min_samples,
                        stale_after_s=self.config.bench_stale_after_s,
                        probe_after_s=PROBE_AFTER_S,
                        embed=embed,
                    )
                    if need is None:
                        continue
                    count, why = need
                    rounds, start = 1, 0 if asked is None else asked[2]
                    if (
                        asked is not None
                        and time.monotonic() - asked[0] < _BENCH_WINDOW_S
                        and not is_probe(why)
                    ):
                        # Its answers came back and some were too short to measure (a model may
                        # stop early on any prompt): the next speed prompts, a few times a window.
                        if asked[1] >= _BENCH_ROUNDS:
                            continue
                        rounds = asked[1] + 1
                    reason = "joined" if first else why
                    await request_benchmark(
                        self.queues,
                        worker=self.name,
                        model=model.name,
                        digest=model.digest,
                        domain=self.config.bench_domain,
                        count=count,
                        reason=reason,
                        embed=embed,
                        start=start,
                    )
                    # The next round starts past the prompts sent: a prompt that came back short
                    # is not sent again at once.
                    self._benched[model.digest] = (time.monotonic(), rounds, start + count)
                    log.info("benchmarking %s on %s (%s)", model.name, self.name, reason)
                await self._grade(snap)
                first = False
            except (RedisError, OSError) as exc:
                log.warning("could not check benchmarks (%s); will retry", exc)
            except RouteledgerError as exc:
                log.warning("could not read the speed table (%s); will retry", exc)
            self.holdings.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.holdings.changed.wait(), self.config.bench_check_s)

    async def _background_done(self) -> bool:
        """Whether every benchmark and grading task this worker asked for has run and been folded:
        none runs, none waits in its background stream, and the last ended a moment ago."""
        if any(r.background for r in self.runs.running.values()):
            return False
        if time.monotonic() - self.runs.background_ended < _FOLD_WAIT_S:
            return False
        return int(await self.redis.xlen(self.background)) == 0

    async def _grade(self, snap: Snapshot) -> None:
        """Grade each served model's ungraded prompts, per domain, when this worker is the one that
        grades it (dispatch.benchmark: one holder, a batch per domain and check, each prompt once
        per digest; a prompt asked for in the last 10 minutes is not asked again meanwhile). Only
        while the worker is quiet (`grade_quiet_s`): grading is never worth delaying user work."""
        if self.runs.running or time.monotonic() - self.consumer.last_shared_take < self.config.grade_quiet_s:
            return
        for model in self.holdings.serving():
            if embeds_only(model) or grader_for(snap, model.digest) != self.name:
                continue  # an embedding model writes no answer to grade
            for domain in domains():
                missing = ungraded(snap, model.digest, domain)
                if not missing:
                    continue
                total = sum(1 for p in benchset() if p.domain == domain)
                done = total - len(missing)
                key = (model.digest, domain)
                asked = self._grading.get(key)
                if asked is not None and time.monotonic() - asked[0] < 600:
                    # Prompts asked for lately whose grades are not folded yet are not asked again.
                    missing = [p for p in missing if p.id not in asked[1]]
                    if not missing:
                        continue
                batch = missing[: self.config.grade_batch]
                await request_benchmark(
                    self.queues,
                    worker=self.name,
                    model=model.name,
                    digest=model.digest,
                    domain=domain,
                    reason=f"grading: {done} of {total} {domain} prompts graded",
                    prompts=batch,
                )
                pending = asked[1] if asked is not None and time.monotonic() - asked[0] < 600 else frozenset()
                self._grading[key] = (time.monotonic(), pending | {p.id for p in batch})
                log.info("grading %s in %s on %s (%d prompts)", model.name, domain, self.name, len(batch))
