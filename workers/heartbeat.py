"""The worker's lease and its heartbeat: what keeps the worker, and each entry it runs, alive.

The lease (`rl:live:{name}`, tasks.lease.Leases) says what the worker is and runs now; it is
renewed by a loop of its own with a hard deadline, so that nothing else the worker does delays it.
The heartbeat reads the inventory and the machine's resources, writes the model cards, keeps the
entries of running tasks ours and tells the ledger what changed. A worker whose lease lapsed
announces itself again; one whose lease another process took stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from events.clock import LedgerClock
from events.event import now_ms
from events.keys import Keys
from tasks.lease import LeaseInfo, Leases, LeaseTaken, RunningInfo
from tasks.store import TaskStore
from workers.config import WorkerConfig
from workers.errors import WorkerNameTakenError
from workers.holdings import Holdings
from workers.resources import max_loaded, read_resources
from workers.runs import Runs

log = logging.getLogger("routeledger.worker")


def _said(exc: BaseException) -> str:
    """An exception for a log line: a timeout's str() is empty (an exception is truthy even then,
    so `exc or "timeout"` printed "()"); its type says what happened."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Heartbeat:
    """Takes and renews one worker's lease, and beats: inventory, resources, running entries, news."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        config: WorkerConfig,
        leases: Leases,
        clock: LedgerClock,
        queues: TaskStore,
        holdings: Holdings,
        runs: Runs,
        stopping: asyncio.Event,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.config = config
        self.name = config.name
        self.leases = leases
        self.clock = clock
        self.queues = queues
        self.holdings = holdings
        self.runs = runs
        self.stopping = stopping
        self.token = secrets.token_hex(8)
        self.started_at = now_ms()
        # Monotonic time until which the lease is known to hold (from the last renewal's sending).
        self._lease_until = 0.0
        self._lease_failing = False
        # The lease lapsed since the ledger last heard this worker start a life: the reaper may have
        # recorded it offline, so it announces itself again once it can (see keep_lease).
        self._lapsed = False
        # Another process took this name's lease: this one stops and leaves it alone.
        self.evicted = False
        # Set when the worker has left (drained, or evicted): only then does its lease loop end, so
        # that the lease holds while running tasks finish during a drain.
        self.left = asyncio.Event()
        # One report of what the machine holds at a time (a heartbeat's, or one after a pull):
        # two at once could append the same WorkerChanged twice.
        self._reporting = asyncio.Lock()

    async def take(self) -> None:
        """Take `rl:live:{name}`; wait out the lease of a previous life, refuse a live twin. The lease
        is a token compare-and-set (tasks.lease.Leases), so of two processes started at once with
        one name exactly one gets it."""
        deadline = time.monotonic() + self.config.lease_ms / 1000 + 1.0
        waiting = False
        while True:
            sent = time.monotonic()
            taken = await self.leases.put(self.info(), self.config.lease_ms)
            if taken.ok:
                self._lease_until = sent + self.config.lease_ms / 1000
                break
            if time.monotonic() > deadline:
                raise WorkerNameTakenError(
                    f"a live worker named {self.name!r} already holds its lease; give this one another --id"
                )
            if not waiting:
                # Silence here read as a hang: a previous life of this name that did not give its
                # lease back (killed, or cut off from Redis) holds it until it expires.
                log.warning(
                    "worker %s: another process (token %s) holds this name's lease, a previous life "
                    "or a twin; waiting up to %.0fs for it to expire",
                    self.name,
                    taken.holder,
                    deadline - time.monotonic(),
                )
                waiting = True
            await asyncio.sleep(0.2)
        await self.redis.srem(self.keys.forgotten, self.name)

    def info(self) -> LeaseInfo:
        """What this worker's lease says now."""
        return LeaseInfo(
            worker=self.name,
            token=self.token,
            slots=self.config.slots,
            in_flight=len(self.runs.running),
            inventory=list(self.holdings.inventory.models),
            loaded=list(self.holdings.inventory.loaded),
            loaded_known=self.holdings.inventory.loaded_known,
            max_loaded=max_loaded(self.holdings.inventory, self.holdings.resources),
            loaded_models=list(self.holdings.inventory.loaded_models),
            cache=self.holdings.slots.report(),
            serves=[m.name for m in self.holdings.serving()] if self.holdings.backend_ok else [],
            draining=self.stopping.is_set(),
            backend_kind=self.holdings.backend.kind,
            serves_named=None if self.config.serves is None else list(self.config.serves),
            running=[
                RunningInfo(
                    task_id=r.entry.task.task_id,
                    digest=r.entry.task.digest,
                    started_at=r.started_at_ms,
                    domain=r.entry.task.domain_or_general(),
                    prompt_tokens=r.entry.task.prompt_tokens,
                    max_tokens=r.entry.task.max_tokens,
                    answered=r.answered,
                    background=r.background,
                )
                for r in self.runs.running.values()
            ],
            since=self.started_at,
            resources=self.holdings.resources,
            ledger_offset_ms=self.clock.offset_ms,
            lease_ms=self.config.lease_ms,
        )

    def renewed(self, taken: LeaseTaken, sent: float) -> None:
        """Account for a renewal sent at monotonic `sent`: the lease holds until a lease after it."""
        if not taken.ok:
            self._evicted(taken.holder)
            return
        if taken.lapsed or sent > self._lease_until:
            # Redis says the lease was gone, or this renewal left after the time until which the
            # lease was known to hold: it may have lapsed, and Redis's word for it may be lost (see
            # keep_lease). Announcing again when it had not is harmless; not announcing is not.
            self._lapsed = True
        self._lease_until = sent + self.config.lease_ms / 1000
        if self._lease_failing:
            log.info("worker %s: its lease is renewed again", self.name)
            self._lease_failing = False

    def _evicted(self, holder: str) -> None:
        """Another process holds this name's lease (this one's lapsed and a twin took it): stop."""
        if not self.stopping.is_set():
            log.error(
                "worker %s: another process (token %s) holds this name's lease; stopping this one",
                self.name,
                holder,
            )
            self.evicted = True
            self.stopping.set()
            self.left.set()

    def may_take(self) -> bool:
        """Whether the lease surely holds long enough to take work: at least half a lease is left.
        A worker that cannot renew stops taking before its lease expires and the reaper acts."""
        return time.monotonic() < self._lease_until - self.config.lease_ms / 2000

    def _abandon_runs(self) -> None:
        """The lease has surely expired: the reaper hands this worker's entries to others, so its
        runs stop here rather than run twice (each tries to hand its entry back on the way out)."""
        for run in self.runs.running.values():
            if not run.lost and not run.closing and run.task is not None:
                log.warning(
                    "task %s: this worker could not renew its lease in time (Redis unreachable), so the "
                    "reaper may give the task to another worker; stopping the run here so that it "
                    "does not run twice",
                    run.entry.task.task_id,
                )
                run.lost = True
                run.task.cancel()

    async def write(self) -> None:
        sent = time.monotonic()
        self.renewed(await self.leases.put(self.info(), self.config.lease_ms), sent)

    async def keep_lease(self) -> None:
        """Renew the lease every heartbeat, each try with a hard deadline, apart from everything else
        the heartbeat does (a slow backend or a stalled connection never delays it). A try that
        times out is cancelled, which drops its connection; the next try takes a fresh one. It runs
        until the worker has left: through a drain, the lease says "draining" and still holds."""
        timeout = min(self.config.heartbeat_ms, self.config.lease_ms / 4) / 1000
        while not self.left.is_set():
            pause = self.config.heartbeat_ms / 1000
            sent = time.monotonic()
            try:
                taken = await asyncio.wait_for(self.leases.put(self.info(), self.config.lease_ms), timeout)
                self.renewed(taken, sent)
                if taken.ok and self._lapsed:
                    # The lease expired (Redis or this process stalled past it): the reaper may
                    # have recorded this worker offline, so its life starts again in the ledger.
                    # Redis's word for it (`lapsed`) may never come back: after a partition, a
                    # renewal sent into it can arrive late, re-create the lease and answer a
                    # connection already given up, and the renewal after it finds the lease there.
                    # So what this worker saw counts too (renewed).
                    log.warning("worker %s: its lease had expired; announcing itself again", self.name)
                    await asyncio.wait_for(self.holdings.announce(), timeout * 4)
                    self._lapsed = False
            except (RedisError, OSError, TimeoutError) as exc:
                if not self._lease_failing:
                    log.warning("worker %s: could not renew its lease (%s); retrying", self.name, _said(exc))
                    self._lease_failing = True
                pause = min(pause, 0.5)
                if time.monotonic() > self._lease_until:
                    self._abandon_runs()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.left.wait(), pause)

    def claimed(self, reply: Any, sent: float) -> None:
        """A run's claim carried the lease (`Leases.put_command`): account for its reply."""
        self.renewed(self.leases.taken(reply), sent)

    async def beat(self) -> None:
        """Inventory, resources, the entries of running tasks, news for the ledger: every heartbeat.
        The lease is renewed by a loop of its own (keep_lease)."""
        beat = 0
        while not self.stopping.is_set():
            await asyncio.sleep(self.config.heartbeat_ms / 1000)
            if self.stopping.is_set():
                return
            beat += 1
            try:
                await self.clock.now_ms()  # measures the offset again when it is due
                async with self._reporting:
                    before = (self.holdings.backend_ok, self.holdings.inventory.routing())
                    await self.holdings.refresh()
                    self.holdings.resources = read_resources()
                    await self.holdings.publish_cards()
                    if (self.holdings.backend_ok, self.holdings.inventory.routing()) != before:
                        # What it holds, has loaded or serves changed: the lease says so now, not at
                        # the lease loop's next turn (routing and `ps` read it).
                        await asyncio.wait_for(self.write(), self.config.heartbeat_ms / 1000)
                    await self.keep_entries_alive()
                    await self.holdings.report_changes()
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("heartbeat %d could not reach Redis (%s); will retry", beat, _said(exc))

    async def models_changed(self) -> None:
        """After a pull or a delete: what the machine holds, in the lease and the ledger at once."""
        async with self._reporting:
            await self.holdings.refresh()
            await self.holdings.publish_cards()
            await asyncio.wait_for(self.write(), self.config.heartbeat_ms / 1000)
            await self.holdings.report_changes()

    async def keep_entries_alive(self) -> None:
        """Reset the idle time of every running entry still ours (TaskStore.keep). A run
        that is closing (its entry acknowledged, or about to be) is left out and never reported lost."""
        by_queue: dict[str, list[str]] = {}
        for run in self.runs.running.values():
            if not run.closing:
                by_queue.setdefault(run.entry.queue, []).append(run.entry.entry_id)
        for queue, ids in by_queue.items():
            owned = set(await self.queues.keep(queue, self.name, ids))
            for entry_id in ids:
                held = self.runs.running.get(entry_id)
                if entry_id not in owned and held is not None and not held.lost and not held.closing:
                    held.lost = True
                    log.warning(
                        "entry %s on %s is no longer ours (reclaimed); its completion will count only "
                        "if the task was dead-lettered",
                        entry_id,
                        queue,
                    )
