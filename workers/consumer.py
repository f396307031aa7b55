"""Consumption of this worker's queues: its pinned stream, the shared queues of the models it
serves (as its gate admits), and its background stream of benchmarks and grading, while a slot
is free; and the wait for new work when there is none.

The worker asks its gate (workers.admission) as an `Applicant`: this consumer is that view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable

import msgspec
from redis.exceptions import RedisError

from events.cancellation import cancel_and_wait
from events.event import ModelEntry
from events.keys import Keys
from events.ledger import Ledger
from tasks.lease import LeaseInfo
from tasks.store import TaskStore
from workers.admission import Gate
from workers.config import WorkerConfig
from workers.endings import Endings
from workers.heartbeat import Heartbeat
from workers.holdings import Holdings
from workers.pinned import PinnedStream
from workers.runner import Runner
from workers.runs import Runs

log = logging.getLogger("routeledger.worker")

# Takes in a row that may find the head gone (another worker won it) before a worker pauses a little.
_MISSES_BEFORE_PAUSE = 16
# An idle worker looks at its pinned stream at least this often, even if no wait woke on it.
_PINNED_LOOK_S = 30.0


class Wait(msgspec.Struct, kw_only=True):
    """What to wait on before asking again: nothing was taken, or what was taken was all that waited."""

    # Queue -> the id of its last entry (an XREAD from it wakes on the next new one).
    cursors: dict[str, str]
    # Work waits that the gate left to others: wake on ledger news (claims, completions) as well.
    held_back: bool = False


class Consumer:
    """Takes one worker's work, one entry at a time, and starts its runs (workers.runner)."""

    def __init__(
        self,
        keys: Keys,
        config: WorkerConfig,
        ledger: Ledger,
        queues: TaskStore,
        gate: Gate,
        holdings: Holdings,
        heartbeat: Heartbeat,
        endings: Endings,
        runner: Runner,
        runs: Runs,
        pinned: PinnedStream,
        *,
        background: str,
        stopping: asyncio.Event,
    ) -> None:
        self.keys = keys
        self.config = config
        self.name = config.name
        self.ledger = ledger
        self.queues = queues
        self.gate = gate
        self.holdings = holdings
        self.heartbeat = heartbeat
        self.endings = endings
        self.runner = runner
        self.runs = runs
        self.pinned = pinned
        # This worker's stream of benchmark and grading tasks (the lowest priority it has).
        self.background = background
        self.stopping = stopping
        # A worker that writes to an inbox never acknowledges a queue entry (its ACL has no XACK or
        # XDEL): the ingest finishes the entry when it moves the event that closes the run.
        self.finishes = not config.inbox
        self._last_ask = 0.0
        # Takes in a row that found the head moved since the gate looked.
        self._missed = 0
        # Work is likely waiting: the last wait woke on a shared queue, or a task was just taken.
        self.expects_work = True
        # When this worker last took an entry from a shared queue (monotonic; grading waits for quiet).
        self.last_shared_take = -math.inf

    # -- what the gate reads (workers.admission.Applicant) ---------------------------------------
    def serving(self) -> list[ModelEntry]:
        """Held models this worker consumes tasks for."""
        return self.holdings.serving()

    def lease_info(self) -> LeaseInfo:
        """What this worker's lease says now."""
        return self.heartbeat.info()

    # -- the loop --------------------------------------------------------------------------------
    async def consume(self) -> None:
        # A wait kept from a take that emptied the queues while it filled the last slot: once a
        # slot is free, it wakes at once on anything queued since (no need to ask the gate first).
        kept: Wait | None = None
        while not self.stopping.is_set():
            if self.runs.free_slots() == 0 or not self.holdings.backend_ok or not self.heartbeat.may_take():
                self.runs.freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.runs.freed.wait(), self.config.block_ms / 1000)
                continue
            try:
                if kept is not None and self.pinned.cursor is None:
                    # Something was handed back to the pinned stream meanwhile (it wakes no read).
                    kept = None
                wait, kept = kept or await self._take_one(), None
                if wait is not None and self.runs.free_slots() == 0:
                    kept = wait
                elif wait is not None:
                    await self._wait_for_work(wait)
            except (RedisError, OSError) as exc:
                log.warning("Redis unavailable while taking work (%s); retrying", exc)
                await asyncio.sleep(1.0)

    async def _take_one(self) -> Wait | None:
        """Take one entry: from the pinned stream, else the one the gate decided on, if it is still
        the head. None when something was taken or the head moved (ask again at once); else what
        to wait on."""
        self._last_ask = time.monotonic()
        if self._last_ask < self.endings.cooldown_until:
            # After a failure that may be this machine's: nothing, pinned or shared (a hand-off it
            # gave back goes to another worker meanwhile: workers.reaper).
            return Wait(cursors={} if self.pinned.cursor is None else {self.pinned.key: self.pinned.cursor})
        # The pinned stream is looked at when something may be there: at first, when a wait woke
        # on it, after this worker handed an entry back, and now and then in any case.
        if self.pinned.cursor is None or self._last_ask - self.pinned.looked > _PINNED_LOOK_S:
            pinned = await self.queues.take(self.pinned.key, self.name)
            if pinned.entry_id:
                self.runner.start(self.pinned.key, pinned)
                return None
            if pinned.vanished:
                return None
            self.pinned.cursor, self.pinned.looked = pinned.cursor, self._last_ask
        cursors = {self.pinned.key: self.pinned.cursor}
        shared = self.holdings.shared_queues()
        for queue in shared:
            await self.queues.ensure_group(queue)
        admission = await self.gate.admit(self, shared)
        cursors.update(admission.cursors)
        if admission.queue is None:
            if admission.held_back or not self.runs.background_free():
                # User work waits (for this worker or another), or a background run is on: no
                # benchmark or grading answer starts now.
                return Wait(cursors=cursors, held_back=admission.held_back)
            bg = await self.queues.take(self.background, self.name)
            if bg.entry_id:
                self.runner.start(self.background, bg)
                return None
            if bg.vanished:
                return None
            cursors[self.background] = bg.cursor
            return Wait(cursors=cursors)
        if admission.ahead:
            # A later task than the head: moved to the pinned stream and taken there, as a hand-off.
            taken = await self.queues.take_given(
                admission.queue, self.pinned.key, self.name, admission.entry_id, admission.task_id
            )
            if not taken.entry_id:
                # Not moved: taken or removed meanwhile, or the pinned stream has work (look there next).
                self.pinned.cursor = None
        else:
            taken = await self.queues.take(admission.queue, self.name, admission.entry_id, admission.slack)
        if taken.entry_id:
            self._missed = 0
            self.expects_work = True
            self.last_shared_take = time.monotonic()
            self.runner.start(self.pinned.key if admission.ahead else admission.queue, taken)
            if admission.alone and taken.entry_id == admission.alone:
                # It was the only task waiting when the gate looked: wait for what came since.
                return Wait(cursors=cursors)
            return None
        # The head moved since the gate looked (another worker took it, or it was cancelled): the
        # decision was about a task that is not there; ask again, pausing a little if it repeats.
        self._missed += 1
        log.debug(
            "the head of %s moved before %s could take it (%d in a row)",
            admission.queue,
            self.name,
            self._missed,
        )
        if self._missed > _MISSES_BEFORE_PAUSE:
            # Many in a row: others win every race for the head; let them, briefly.
            await asyncio.sleep(min(0.05, 0.001 * self._missed))
        return None

    async def _wait_for_work(self, wait: Wait) -> None:
        """Block until one of the queues gets a new entry (reading none: the gate decides on it), or,
        when the gate held work back, until the ledger records news (a claim or a completion changes
        the plan), at most `recheck_ms`; otherwise at most `block_ms` (a re-queued task wakes nobody,
        so an idle worker looks again that often)."""
        self._missed = 0
        streams = dict(wait.cursors)
        block_ms = self.config.block_ms
        if wait.held_back:
            streams[self.keys.events] = "$"
            block_ms = self.config.recheck_ms
        self.expects_work = False
        # A hard deadline as well: on a half-open connection the read would wait for the client's
        # socket timeout; cancelled, its connection is dropped and the next read takes a fresh one.
        with contextlib.suppress(TimeoutError):
            reading = self.ledger.wait_on(streams, block_ms)
            if any(r.background for r in self.runs.running.values()):
                # A benchmark or grading answer runs: when it ends, the next one may start.
                woke = await self._until_background_ends(reading, block_ms / 1000 + 1.0)
            else:
                woke = await asyncio.wait_for(reading, block_ms / 1000 + 1.0)
            if self.pinned.key in woke:
                self.pinned.cursor = None
            # A queue's new entry, or ledger news while work was held back: the gate will decide.
            self.expects_work = bool(woke)
        if wait.held_back:
            # Asked again no sooner than recheck_min_ms after the last time: a busy ledger wakes a
            # held-back worker on every event.
            rest = self.config.recheck_min_ms / 1000 - (time.monotonic() - self._last_ask)
            if rest > 0:
                await asyncio.sleep(rest)

    async def _until_background_ends(self, reading: Awaitable[set[str]], timeout_s: float) -> set[str]:
        """The streams `reading` woke on, or none when a slot was freed first (its read cancelled,
        which drops its connection); TimeoutError past `timeout_s`."""
        self.runs.freed.clear()
        read = asyncio.ensure_future(reading)
        freed = asyncio.ensure_future(self.runs.freed.wait())
        try:
            done, _ = await asyncio.wait(
                {read, freed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            freed.cancel()
            if not read.done():
                await cancel_and_wait((read,))
                with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                    await read
        if read in done:
            return read.result()
        if not done:
            raise TimeoutError
        return set()
