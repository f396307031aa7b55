"""Months of history squeezed into minutes: the long-run test and benchmark drive this.

A synthetic history (sim/synthetic.py) is appended with stream ids spread over its span, as a
ledger that really lived that long would hold them (the ledger's clock is the stream id: day
shards and their retention read it). Between batches a projector folds what was appended and the
archiver moves what is past the hot window to Parquet and trims it off the stream, as `routeledger
up` would over those months; the archiver's "now" is the history's own time (a live ledger's newest
entry is now), so each moment of the squeeze holds what that moment of a real year would. At
chosen history lengths it measures what must stay flat: a new projector's start time and Redis's
memory.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from events.event import Event
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from replay.archive import ArchiveOptions, ArchiveReport, archive
from sim.synthetic import HistoryMaker

DAY_MS: Final = 86_400_000


class Mark(msgspec.Struct, kw_only=True):
    """The state of the run after `tasks` tasks of history."""

    tasks: int
    events: int
    # Median of several fresh projectors' `start()`, in seconds.
    projector_start_s: float
    used_memory: int
    stream_length: int
    archived_events: int
    segments: int


class LongRun:
    """Appends `tasks` tasks of history over `span_ms` ending now, folding and archiving as it goes."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        archive_dir: str | Path,
        *,
        tasks: int,
        span_ms: int = 365 * DAY_MS,
        holders: int = 3,
        hot_window_s: float = 86_400.0,
        batch_tasks: int = 50_000,
        archive_every_tasks: int = 250_000,
        projector_batch: int = 5_000,
        seed: int = 7,
        end_ms: int | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.tasks = tasks
        self.batch_tasks = batch_tasks
        self.archive_every_tasks = archive_every_tasks
        self.projector_batch = projector_batch
        end = end_ms if end_ms is not None else time.time_ns() // 1_000_000 - 60_000
        self.start_ms = end - span_ms
        self.span_ms = span_ms
        self.maker = HistoryMaker(
            tasks, holders=holders, start_ms=self.start_ms, span_ms=span_ms, seed=seed, keys=keys
        )
        self.options = ArchiveOptions(directory=str(archive_dir), hot_window_s=hot_window_s)
        self.ledger = Ledger(redis, keys)
        self.appended = 0
        self.appended_tasks = 0
        self.projector = Projector(redis, keys, batch=projector_batch)
        self.reports: list[ArchiveReport] = []

    def _task_ms(self, i: int) -> int:
        return self.start_ms + i * self.span_ms // max(1, self.tasks)

    async def append_tasks(self, first: int, count: int) -> int:
        """Append the events of tasks `first … first+count-1`, each task's under ids of its own ms."""
        events: list[Event] = []
        ids: list[str] = []
        for i in range(first, min(first + count, self.tasks)):
            task_events = self.maker.task_events(i, random.Random(self.maker.seed * 1_000_003 + i))
            ms = self._task_ms(i)
            ids.extend(f"{ms}-{k}" for k in range(len(task_events)))
            events.extend(task_events)
            if len(events) >= 2_000:
                await self._send(events, ids)
                events, ids = [], []
        if events:
            await self._send(events, ids)
        self.appended_tasks = max(self.appended_tasks, min(first + count, self.tasks))
        return self.appended

    async def _send(self, events: list[Event], ids: list[str]) -> None:
        await self.ledger.append_many(events, ids)
        self.appended += len(events)

    async def fold(self) -> int:
        """Let the projector fold everything appended so far."""
        if self.projector.tables is None:
            await self.projector.start()
        return await self.projector.catch_up()

    @property
    def ledger_ms(self) -> int:
        """The history's own time: that of the newest task appended (a live ledger's is now)."""
        return self._task_ms(max(0, self.appended_tasks - 1))

    async def archive(self) -> ArchiveReport:
        """One archiver run, as `up` makes them, at the history's own time."""
        report = await archive(self.redis, self.keys, self.options, now_ms=self.ledger_ms)
        self.reports.append(report)
        return report

    async def start_time(self, repeats: int = 5) -> float:
        """Median seconds a fresh projector takes to start; the last one carries on folding."""
        times: list[float] = []
        for _ in range(repeats):
            projector = Projector(self.redis, self.keys, batch=self.projector_batch)
            started = time.perf_counter()
            await projector.start()
            times.append(time.perf_counter() - started)
            self.projector = projector
        return statistics.median(times)

    async def mark(self, tasks: int) -> Mark:
        info: Any = await self.redis.info("memory")
        state: Any = await self.redis.hgetall(self.keys.archive)
        return Mark(
            tasks=tasks,
            events=self.appended,
            projector_start_s=await self.start_time(),
            used_memory=int(info["used_memory"]),
            stream_length=int(await self.redis.xlen(self.keys.events)),
            archived_events=int(state.get(b"events", 0)),
            segments=int(state.get(b"segments", 0)),
        )

    async def run(self, marks: Sequence[int] = ()) -> list[Mark]:
        """The whole history: append, fold, archive on schedule; a Mark at each of `marks` tasks."""
        out: list[Mark] = []
        wanted = sorted(set(marks))
        done = 0
        next_archive = self.archive_every_tasks
        while done < self.tasks:
            step = min(self.batch_tasks, self.tasks - done, *(m - done for m in wanted if m > done))
            await self.append_tasks(done, step)
            done += step
            await self.fold()
            if done >= next_archive or done == self.tasks:
                await self.archive()
                next_archive = done + self.archive_every_tasks
            if done in wanted:
                await self.archive()
                out.append(await self.mark(done))
        return out
