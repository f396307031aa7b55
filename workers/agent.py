"""The worker agent: pulls tasks for the models it holds, runs them on its backend, records it all.

It consumes its pinned stream and the shared stream of every model it holds and serves, through the
`workers` consumer group, running up to `slots` tasks at once. Before running a task it checks that
it still holds the model (only holders consume). It keeps its lease and the lease of every running
entry alive, so that the reaper reclaims only what really died.

The agent composes one part per concern, each depending only on those before it:
workers.runs (the runs it keeps), workers.holdings (what the machine holds, and its reports),
workers.heartbeat (its lease and heartbeat), workers.endings (runs that do not complete),
workers.runner (the run lifecycle), workers.consumer (consumption of its queues, through its gate),
workers.benchmarks (benchmarking and grading). Here: their wiring, the start and the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from events.cancellation import cancel_and_wait
from events.clock import LedgerClock
from events.event import ModelEntry, Resources, WorkerOffline
from events.keys import Keys
from events.ledger import Ledger
from tasks.lease import LeaseInfo, Leases
from tasks.payload import TaskMessage
from tasks.store import TaskStore
from workers.admission import Gate, PlainPull
from workers.backend import Backend, Inventory
from workers.benchmarks import Benchmarks
from workers.config import WorkerConfig
from workers.consumer import Consumer
from workers.control import Control
from workers.endings import Endings
from workers.heartbeat import Heartbeat
from workers.holdings import Holdings
from workers.liveness import Liveness
from workers.pinned import PinnedStream
from workers.resources import read_resources
from workers.runner import Runner
from workers.runs import Running, Runs
from workers.slots import Slots
from workers.warmth import Warmth

log = logging.getLogger("routeledger.worker")

# Seconds each step of undoing a failed start may take (see WorkerAgent._abandon_start).
ABANDON_S = 2.0


class WorkerAgent:
    """One worker process's loop over its streams."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        backend: Backend,
        config: WorkerConfig,
        gate: Gate | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.backend = backend
        self.config = config
        self.name = config.name
        self.gate: Gate = gate or PlainPull(redis, keys)
        # A speed-aware gate plans with what every worker runs, so the lease says so at once.
        self.eager_lease = not isinstance(self.gate, PlainPull)
        self.ledger = Ledger(redis, keys, inbox=config.name if config.inbox else None)
        # A worker that writes to an inbox never acknowledges a queue entry (its ACL has no XACK or
        # XDEL): the ingest finishes the entry when it moves the event that closes the run.
        self.finishes = not config.inbox
        self.leases = Leases(redis, keys)
        # With an inbox, its output and results go to its own keys, the only ones its ACL lets it write.
        self.queues = TaskStore(
            redis,
            keys,
            self.ledger,
            dead_max_entries=config.dead_max_entries,
            writer=config.name if config.inbox else None,
        )
        # The ledger's clock, for whatever this worker compares with a time another process wrote
        # (a deadline, a submission, a sample's age); its lease says the offset to readers.
        self.clock = LedgerClock(redis)
        self.stopping = asyncio.Event()
        # Set once started (lease taken, life announced, loops running): before that, a stop has
        # nothing to drain, and `start` gives back what it took.
        self.online = False
        # The loops beside consumption (heartbeat, control, benchmarks) and a malformed entry's
        # rejection: cancelled when the worker drains.
        self._background: list[asyncio.Task[None]] = []
        self._lease_task: asyncio.Task[None] | None = None
        self.runs = Runs(config.slots)
        self.holdings = Holdings(redis, keys, self.ledger, backend, config)
        self.heartbeat = Heartbeat(
            redis, keys, config, self.leases, self.clock, self.queues, self.holdings, self.runs, self.stopping
        )
        self.pinned_stream = PinnedStream(keys.pinned(self.name))
        self.endings = Endings(
            config,
            self.clock,
            self.ledger,
            self.queues,
            self.holdings,
            self.heartbeat,
            self.pinned_stream,
            self.background,
        )
        self.runner = Runner(
            redis,
            keys,
            config,
            backend,
            self.clock,
            self.ledger,
            self.queues,
            self.leases,
            self.holdings,
            self.heartbeat,
            self.endings,
            self.runs,
            background=self.background,
            eager_lease=self.eager_lease,
            stopping=self.stopping,
            chores=self._background,
        )
        self.consumer = Consumer(
            keys,
            config,
            self.ledger,
            self.queues,
            self.gate,
            self.holdings,
            self.heartbeat,
            self.endings,
            self.runner,
            self.runs,
            self.pinned_stream,
            background=self.background,
            stopping=self.stopping,
        )
        self.benchmarks = Benchmarks(
            redis,
            keys,
            config,
            self.clock,
            self.queues,
            self.holdings,
            self.runs,
            self.consumer,
            background=self.background,
            stopping=self.stopping,
        )
        # Operators' pulls and deletes on this machine (workers.control).
        self.control = Control(
            redis, keys, self.name, backend, self.heartbeat.models_changed, self.clock.now_ms
        )

    # -- what it holds and serves (workers.holdings) ---------------------------------------------
    @property
    def inventory(self) -> Inventory:
        return self.holdings.inventory

    @inventory.setter
    def inventory(self, inventory: Inventory) -> None:
        self.holdings.inventory = inventory

    @property
    def backend_ok(self) -> bool:
        return self.holdings.backend_ok

    @backend_ok.setter
    def backend_ok(self, ok: bool) -> None:
        self.holdings.backend_ok = ok

    @property
    def resources(self) -> Resources:
        return self.holdings.resources

    @property
    def liveness(self) -> Liveness:
        return self.holdings.liveness

    @property
    def warmth(self) -> Warmth:
        return self.holdings.warmth

    @property
    def slots(self) -> Slots:
        return self.holdings.slots

    def serving(self) -> list[ModelEntry]:
        """Held models this worker consumes tasks for."""
        return self.holdings.serving()

    def local_name(self, digest: str) -> str | None:
        """This backend's name for a digest it serves, or None if it does not serve it."""
        return self.holdings.local_name(digest)

    def shared_queues(self) -> list[str]:
        return self.holdings.shared_queues()

    def backend_refused(self, task: TaskMessage) -> None:
        """Learn from the backend's refusal of `task` (Holdings.refused)."""
        self.holdings.refused(task)

    # -- its streams and runs --------------------------------------------------------------------
    @property
    def pinned(self) -> str:
        return self.keys.pinned(self.name)

    @property
    def background(self) -> str:
        """This worker's stream of benchmark and grading tasks (the lowest priority it has)."""
        return self.keys.background(self.name)

    @property
    def running(self) -> dict[str, Running]:
        return self.runs.running

    @property
    def free_slots(self) -> int:
        """Slots free for user work: a benchmark or grading run holds none (it is given up)."""
        return self.runs.free_slots()

    @property
    def expects_work(self) -> bool:
        """Work is likely waiting: the last wait woke on a shared queue, or a task was just taken."""
        return self.consumer.expects_work

    # -- its lease (workers.heartbeat) -----------------------------------------------------------
    @property
    def token(self) -> str:
        return self.heartbeat.token

    @property
    def started_at(self) -> int:
        return self.heartbeat.started_at

    @property
    def evicted(self) -> bool:
        """Another process took this name's lease: this one stops and leaves it alone."""
        return self.heartbeat.evicted

    def lease_info(self) -> LeaseInfo:
        """What this worker's lease says now."""
        return self.heartbeat.info()

    def may_take(self) -> bool:
        """Whether the lease surely holds long enough to take work (Heartbeat.may_take)."""
        return self.heartbeat.may_take()

    # -- start and stop -------------------------------------------------------------------------
    async def run(self) -> None:
        """Start, run until `stopping` is set, then drain and leave."""
        await self.start()
        try:
            await self.consumer.consume()
        finally:
            await self._drain()

    async def start(self) -> None:
        """Take the lease, announce this worker's life and start its loops. A start that fails (or is
        cancelled: a signal while it starts) gives back what it took, so that no lease shows the
        machine online after it, and the next start does not wait for that lease to expire."""
        await self.holdings.refresh(first=True)
        self.holdings.resources = read_resources()
        await self.clock.sync()
        # Before the lease: what the API asks once it sees this worker live comes after the cursor.
        await self.control.start()
        try:
            await self.heartbeat.take()
            await self.holdings.announce()
            await self.queues.ensure_group(self.pinned)
            await self.queues.ensure_group(self.background)
            for queue in self.shared_queues():
                await self.queues.ensure_group(queue)
            await self.endings.recover_own_pending()
        except BaseException:
            await self._abandon_start()
            raise
        self._lease_task = asyncio.create_task(self.heartbeat.keep_lease(), name="lease")
        self._background.append(asyncio.create_task(self.heartbeat.beat(), name="heartbeat"))
        self._background.append(asyncio.create_task(self.control.run(self.stopping), name="control"))
        self._background.append(asyncio.create_task(self.runner.watch_cancels(), name="cancels"))
        if self.config.auto_bench:
            self._background.append(asyncio.create_task(self.benchmarks.run(), name="benchmarks"))
        self.online = True
        log.info(
            "worker %s online: %d slot(s), serving %s",
            self.name,
            self.config.slots,
            ", ".join(m.name for m in self.serving()) or "nothing",
        )

    async def _abandon_start(self) -> None:
        """Undo a start that failed: the lease back (if this process holds it), and the life it may
        have announced ended in the ledger. Each step has a deadline: the start may have failed
        because Redis stopped answering."""
        await self.control.aclose()
        if self.heartbeat.evicted:
            return
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            if self.holdings.liveness.announced:
                await asyncio.wait_for(
                    self.ledger.append(WorkerOffline(worker=self.name, reason="shutdown")), ABANDON_S
                )
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            if await asyncio.wait_for(self.leases.release(self.name, self.heartbeat.token), ABANDON_S):
                log.info("worker %s: its start failed; its lease is given back", self.name)

    async def _drain(self) -> None:
        """Stop taking work, let running tasks finish for a while, hand back the rest, leave."""
        self.stopping.set()
        for task in self._background:
            task.cancel()
        for run in self.runs.running.values():
            if run.background and run.reading and run.task is not None:
                # A benchmark or grading answer is not worth a drain's wait: back to its stream
                # (one whose backend has answered finishes writing what it made).
                run.task.cancel()
        if self._background:
            # A cancel can be lost (events.cancellation); the loops end on `stopping` as well, so
            # the heartbeat is over before the lease is deleted below and never renews it (or
            # announces the worker again) after it left.
            await asyncio.wait(self._background, timeout=self.config.lease_ms / 1000)
        await self.control.aclose()
        runs = [r.task for r in self.runs.running.values() if r.task is not None]
        if runs:
            log.info(
                "draining: waiting up to %.0fs for %d running task(s)", self.config.drain_timeout_s, len(runs)
            )
            _, still = await asyncio.wait(runs, timeout=self.config.drain_timeout_s)
            await cancel_and_wait(still)
        self.heartbeat.left.set()
        if self._lease_task is not None:
            await asyncio.wait({self._lease_task}, timeout=self.config.lease_ms / 1000)
            self._lease_task.cancel()
        if not self.heartbeat.evicted:
            with contextlib.suppress(RedisError, OSError):
                await self.ledger.append(WorkerOffline(worker=self.name, reason="shutdown"))
                await self.leases.release(self.name, self.heartbeat.token)
        log.info("worker %s stopped", self.name)
