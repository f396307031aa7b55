"""The worker agent: pulls tasks for the models it holds, runs them on its backend, records it all.

It consumes its pinned stream and the shared stream of every model it holds and serves, through the
`workers` consumer group, running up to `slots` tasks at once. Before running a task it checks that
it still holds the model (only holders consume). It keeps its lease and the lease of every running
entry alive, so that the reaper reclaims only what really died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, RedisError, ResponseError

from dispatch.benchmark import (
    PROBE_AFTER_S,
    benchset,
    domains,
    grader_for,
    is_probe,
    needs_benchmark,
    prompt_by_id,
    request_benchmark,
    ungraded,
)
from dispatch.lease import LeaseInfo, Leases, LeaseTaken, RunningInfo
from dispatch.memory import is_oom
from dispatch.modelcard import ModelCard, publish_cards
from dispatch.payload import EMBED, Chunk, Result, TaskMessage, Thought, ToolCall, encode_chunk
from dispatch.prefix import held_after, task_chain
from dispatch.queues import OUTPUT_TTL_MS, QueueEntry, Requeue, Taken, TaskQueues, parse_entry
from dispatch.serving import embeds_only
from events.clock import LedgerClock
from events.codec import encode_fields, encode_flat
from events.connection import send_all
from events.errors import RouteledgerError
from events.event import (
    Event,
    ModelEntry,
    Resources,
    TaskClaimed,
    TaskExpired,
    TaskFailed,
    Timings,
    WorkerOffline,
    WorkerOnline,
    now_ms,
)
from events.keys import Keys
from events.ledger import Ledger
from projections.snapshot import Snapshot
from projections.status import Outcome
from workers.admission import Gate, PlainPull
from workers.backend import Backend, Generated, Inventory, Refusing
from workers.closing import FinishedRun
from workers.config import WorkerConfig
from workers.control import Control
from workers.crash import crash_here
from workers.errors import BackendError, PreemptedError, TaskCancelledError, WorkerNameTakenError
from workers.liveness import Liveness
from workers.resources import max_loaded, read_resources
from workers.slots import Slots
from workers.warmth import Warmth

log = logging.getLogger("routeledger.worker")

T = TypeVar("T")

# Takes in a row that may find the head gone (another worker won it) before a worker pauses a little.
_MISSES_BEFORE_PAUSE = 16
# An idle worker looks at its pinned stream at least this often, even if no wait woke on it.
_PINNED_LOOK_S = 30.0
# Longest pause between tries of a write Redis refused for lack of memory.
_ROOM_WAIT_MAX_S = 2.0
# A background task given up for user work goes back to its stream: it may be given up this many
# times before it is dead-lettered (a machine that is never idle for long is never benchmarked).
_PREEMPT_LIMIT = 100
# A speed benchmark whose answers came back too short to measure is asked again with the next
# prompts, at most this many rounds in a window of this many seconds.
_BENCH_ROUNDS = 3
_BENCH_WINDOW_S = 600.0
# Seconds after the last background run ends before its samples count as folded.
_FOLD_WAIT_S = 2.0


class _Claim:
    """A run's claim round trip (its lease, TaskClaimed, the cancel check), sent while the backend
    is asked: it must be done before anything of the run is written, and says whether the task
    was cancelled before it started."""

    def __init__(self, agent: WorkerAgent, sent: asyncio.Future[list[Any]], at: float, task_id: str) -> None:
        self._agent = agent
        self._sent = sent
        self._at = at
        self._task_id = task_id
        self._done = False

    async def settle(self) -> None:
        """Wait for the claim (once); raise TaskCancelledError when the task was cancelled first."""
        if self._done:
            return
        self._done = True
        replies = await self._sent
        if self._agent.eager_lease:
            self._agent._lease_renewed(self._agent.leases.taken(replies[0]), self._at)
        if replies[-1]:
            raise TaskCancelledError(self._task_id)

    def discard(self) -> None:
        """The run ended without waiting for its claim (it failed first): its failure, if any, is
        taken here and not reported as never retrieved."""
        if not self._done:
            self._done = True
            self._sent.add_done_callback(lambda f: f.cancelled() or f.exception())


class Running(msgspec.Struct, kw_only=True):
    """A task this worker is running."""

    entry: QueueEntry
    started: float
    started_at_ms: int = msgspec.field(default_factory=now_ms)
    task: asyncio.Task[None] | None = None
    lost: bool = False
    # The run is closing (acknowledging or settling its entry): the heartbeat leaves its entry alone.
    closing: bool = False
    # 1 for the first task this process runs, and so on (for the test crash hook).
    ordinal: int = 0
    # This run's nonce: its output chunks and result carry it, so no relay mixes two runs.
    run_id: str = msgspec.field(default_factory=lambda: secrets.token_hex(4))
    # Its claim, on its way while the backend is asked (None: not sent yet).
    claim: _Claim | None = None
    # What the backend has produced so far: whether the first token came (the prompt was
    # evaluated), and the text and thinking pieces it streamed (one a token, as backends stream).
    # A cancelled run reports them, and its API key is charged for them (Projector._charge).
    prompt_done: bool = False
    pieces: int = 0
    # The backend slot it runs in, as this worker models them (workers.slots; None: none, or done).
    slot: int | None = None
    # The backend has answered: its slot is free, though the run still writes what it made.
    answered: bool = False
    # A benchmark or grading answer (from the worker's background stream): given up for user work.
    background: bool = False
    # Given up for user work: it stops at its next read of the backend (PreemptedError) and goes
    # back to the background stream for later.
    preempted: bool = False
    # It is awaiting its backend's next piece: the only place a preemption cancels it, so that no
    # write of the run (its claim, its result, its events) is ever cut in two.
    reading: bool = False

    def given_up(self) -> bool:
        """Whether the run was given up for user work (`preempted`)."""
        return self.preempted

    async def settle_claim(self) -> None:
        """`_Claim.settle` of this run's claim, where one was sent."""
        if self.claim is not None:
            await self.claim.settle()


class Wait(msgspec.Struct, kw_only=True):
    """What to wait on before asking again: nothing was taken, or what was taken was all that waited."""

    # Queue -> the id of its last entry (an XREAD from it wakes on the next new one).
    cursors: dict[str, str]
    # Work waits that the gate left to others: wake on ledger news (claims, completions) as well.
    held_back: bool = False


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
        # Monotonic time until which the lease is known to hold (from the last renewal's sending).
        self._lease_until = 0.0
        self._lease_failing = False
        # The lease lapsed since the ledger last heard this worker start a life: the reaper may have
        # recorded it offline, so it announces itself again once it can (see _lease_loop).
        self._lapsed = False
        self._last_ask = 0.0
        # Takes in a row that found the head moved since the gate looked.
        self._missed = 0
        # Work is likely waiting: the last wait woke on a shared queue, or a task was just taken.
        self.expects_work = True
        # The pinned stream's cursor after the last look that found it empty (None: look next time).
        self._pinned_cursor: str | None = None
        self._pinned_looked = 0.0
        # Another process took this name's lease: this one stops and leaves it alone.
        self.evicted = False
        # Set when the worker has left (drained, or evicted): only then does its lease loop end, so
        # that the lease holds while running tasks finish during a drain.
        self._left = asyncio.Event()
        self._lease_task: asyncio.Task[None] | None = None
        # With an inbox, its output and results go to its own keys, the only ones its ACL lets it write.
        self.queues = TaskQueues(
            redis,
            keys,
            self.ledger,
            dead_max_entries=config.dead_max_entries,
            writer=config.name if config.inbox else None,
        )
        self.token = secrets.token_hex(8)
        self.inventory = Inventory(models=[], loaded=[])
        # The model cards last written to Redis (None: none yet in this life).
        self._cards_published: dict[str, ModelCard] | None = None
        self.backend_ok = False
        self.running: dict[str, Running] = {}
        self.started_at = now_ms()
        # The ledger's clock, for whatever this worker compares with a time another process wrote
        # (a deadline, a submission, a sample's age); its lease says the offset to readers.
        self.clock = LedgerClock(redis)
        self.stopping = asyncio.Event()
        self._cooldown_until = 0.0
        self._failures = 0
        self._slot_freed = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self._inventory_changed = asyncio.Event()
        # The backend refused something (workers.backend.Refusing): read its inventory again now.
        self._inventory_stale = asyncio.Event()
        # digest -> (monotonic time, rounds in the window, the next speed prompt's place) of the
        # last benchmark this worker requested for itself
        self._benched: dict[str, tuple[float, int, int]] = {}
        # When the last benchmark or grading run ended (monotonic).
        self._background_ended = -math.inf
        # (digest, domain) -> (monotonic time, prompts still ungraded then) of the last grading
        # this worker requested: the next batch goes once those grades are folded.
        self._grading: dict[tuple[str, str], tuple[float, frozenset[str]]] = {}
        # When this worker last took an entry from a shared queue (monotonic; grading waits for quiet).
        self._last_shared_take = -math.inf
        self._ordinal = 0
        # What the ledger last heard of this worker's state; the machine's figures go only to the lease.
        self.liveness = Liveness(self.name, config.slots, config.serves)
        self.resources = Resources()
        # Which models are in memory, run by run: whether a run was cold (a load sample) or warm.
        self.warmth = Warmth()
        # What each backend slot holds of earlier prompts (for the plan's prefix pricing).
        self.slots = Slots(config.slots)
        # One report of what the machine holds at a time (a heartbeat's, or one after a pull):
        # two at once could append the same WorkerChanged twice.
        self._reporting = asyncio.Lock()
        # Operators' pulls and deletes on this machine (workers.control).
        self.control = Control(redis, keys, self.name, backend, self._models_changed, self.clock.now_ms)

    # -- what it serves ------------------------------------------------------------------------
    def serving(self) -> list[ModelEntry]:
        """Held models this worker consumes tasks for."""
        if not self.backend_ok:
            return []
        if self.config.serves is None:
            return list(self.inventory.models)
        wanted = set(self.config.serves)
        return [m for m in self.inventory.models if m.name in wanted or m.digest in wanted]

    def local_name(self, digest: str) -> str | None:
        """This backend's name for a digest it serves, or None if it does not serve it."""
        for model in self.serving():
            if model.digest == digest:
                return model.name
        return None

    def shared_queues(self) -> list[str]:
        return sorted({self.keys.queue(m.digest) for m in self.serving()})

    @property
    def pinned(self) -> str:
        return self.keys.pinned(self.name)

    @property
    def background(self) -> str:
        """This worker's stream of benchmark and grading tasks (the lowest priority it has)."""
        return self.keys.background(self.name)

    @property
    def free_slots(self) -> int:
        """Slots free for user work: a benchmark or grading run holds none (it is given up)."""
        return max(0, self.config.slots - sum(1 for r in self.running.values() if not r.background))

    def _background_free(self) -> bool:
        """Whether a background task may start: the worker runs nothing (one answer at a time, and
        never beside user work, which it would slow down on a machine with several slots)."""
        return not self.running

    # -- start and stop -------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until `stopping` is set, then drain and leave."""
        await self._refresh_inventory(first=True)
        self.resources = read_resources()
        await self.clock.sync()
        # Before the lease: what the API asks once it sees this worker live comes after the cursor.
        await self.control.start()
        await self._take_lease()
        await self._announce()
        await self.queues.ensure_group(self.pinned)
        await self.queues.ensure_group(self.background)
        for queue in self.shared_queues():
            await self.queues.ensure_group(queue)
        await self._recover_own_pending()
        self._lease_task = asyncio.create_task(self._lease_loop(), name="lease")
        self._background.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        self._background.append(asyncio.create_task(self.control.run(self.stopping), name="control"))
        if self.config.auto_bench:
            self._background.append(asyncio.create_task(self._benchmark_loop(), name="benchmarks"))
        log.info(
            "worker %s online: %d slot(s), serving %s",
            self.name,
            self.config.slots,
            ", ".join(m.name for m in self.serving()) or "nothing",
        )
        try:
            await self._consume_loop()
        finally:
            await self._drain()

    async def _announce(self) -> None:
        """WorkerOnline, then what is loaded (WorkerOnline does not say): the ledger's start of a life."""
        if self.config.inbox:
            # Listed before its first event, so that the ingest finds the inbox without a SCAN.
            await self.redis.sadd(self.keys.inboxes, self.name)
        online = WorkerOnline(
            worker=self.name,
            slots=self.config.slots,
            backend=self.backend.url,
            backend_kind=self.backend.kind,
            host=socket.gethostname(),
            inventory=list(self.inventory.models),
            serves=self.config.serves,
        )
        await self._append(online)
        self.liveness.online(online)
        await self._report_changes()
        self._cards_published = None  # a new life: written again (Redis may have lost them)
        await self._publish_cards()

    async def _publish_cards(self) -> None:
        """Write what the backend says of its models beyond the lease (dispatch.modelcard) to this
        worker's own hash, when it differs from what was written last."""
        cards = self.inventory.cards
        if cards == self._cards_published:
            return
        try:
            await publish_cards(self.redis, self.keys, self.name, cards)
        except RedisError as exc:
            if not isinstance(exc, NoPermissionError):
                # /api/show lacks the template until a later heartbeat writes it: nothing else waits.
                log.warning("worker %s: could not write its model cards (%s); will retry", self.name, exc)
                return
            # An ACL made before this key existed: said once, not every beat.
            log.warning(
                "worker %s: its Redis user may not write %s (%s); /api/show will lack its templates "
                "until `routeledger acl worker %s` is applied again",
                self.name,
                self.keys.card(self.name),
                exc,
                self.name,
            )
        self._cards_published = cards

    async def _take_lease(self) -> None:
        """Take `rl:live:{name}`; wait out the lease of a previous life, refuse a live twin. The lease
        is a token compare-and-set (dispatch.lease.Leases), so of two processes started at once with
        one name exactly one gets it."""
        deadline = time.monotonic() + self.config.lease_ms / 1000 + 1.0
        while True:
            sent = time.monotonic()
            taken = await self.leases.put(self.lease_info(), self.config.lease_ms)
            if taken.ok:
                self._lease_until = sent + self.config.lease_ms / 1000
                break
            if time.monotonic() > deadline:
                raise WorkerNameTakenError(
                    f"a live worker named {self.name!r} already holds its lease; give this one another --id"
                )
            await asyncio.sleep(0.2)
        await self.redis.srem(self.keys.forgotten, self.name)

    def lease_info(self) -> LeaseInfo:
        """What this worker's lease says now."""
        return LeaseInfo(
            worker=self.name,
            token=self.token,
            slots=self.config.slots,
            in_flight=len(self.running),
            inventory=list(self.inventory.models),
            loaded=list(self.inventory.loaded),
            loaded_known=self.inventory.loaded_known,
            max_loaded=max_loaded(self.inventory, self.resources),
            loaded_models=list(self.inventory.loaded_models),
            cache=self.slots.report(),
            serves=[m.name for m in self.serving()] if self.backend_ok else [],
            draining=self.stopping.is_set(),
            backend_kind=self.backend.kind,
            serves_named=None if self.config.serves is None else list(self.config.serves),
            running=[
                RunningInfo(
                    task_id=r.entry.task.task_id,
                    digest=r.entry.task.digest,
                    started_at=r.started_at_ms,
                    domain=r.entry.task.domain,
                    prompt_tokens=r.entry.task.prompt_tokens,
                    max_tokens=r.entry.task.max_tokens,
                    answered=r.answered,
                    background=r.background,
                )
                for r in self.running.values()
            ],
            since=self.started_at,
            resources=self.resources,
            ledger_offset_ms=self.clock.offset_ms,
            lease_ms=self.config.lease_ms,
        )

    def _lease_renewed(self, taken: LeaseTaken, sent: float) -> None:
        """Account for a renewal sent at monotonic `sent`: the lease holds until a lease after it."""
        if not taken.ok:
            self._evicted(taken.holder)
            return
        if taken.lapsed or sent > self._lease_until:
            # Redis says the lease was gone, or this renewal left after the time until which the
            # lease was known to hold: it may have lapsed, and Redis's word for it may be lost (see
            # _lease_loop). Announcing again when it had not is harmless; not announcing is not.
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
            self._left.set()

    def may_take(self) -> bool:
        """Whether the lease surely holds long enough to take work: at least half a lease is left.
        A worker that cannot renew stops taking before its lease expires and the reaper acts."""
        return time.monotonic() < self._lease_until - self.config.lease_ms / 2000

    def _abandon_runs(self) -> None:
        """The lease has surely expired: the reaper hands this worker's entries to others, so its
        runs stop here rather than run twice (each tries to hand its entry back on the way out)."""
        for run in self.running.values():
            if not run.lost and not run.closing and run.task is not None:
                log.warning(
                    "task %s: this worker's lease expired; stopping the run (it runs elsewhere)",
                    run.entry.task.task_id,
                )
                run.lost = True
                run.task.cancel()

    async def _write_lease(self) -> None:
        sent = time.monotonic()
        self._lease_renewed(await self.leases.put(self.lease_info(), self.config.lease_ms), sent)

    async def _lease_loop(self) -> None:
        """Renew the lease every heartbeat, each try with a hard deadline, apart from everything else
        the heartbeat does (a slow backend or a stalled connection never delays it). A try that
        times out is cancelled, which drops its connection; the next try takes a fresh one. It runs
        until the worker has left: through a drain, the lease says "draining" and still holds."""
        timeout = min(self.config.heartbeat_ms, self.config.lease_ms / 4) / 1000
        while not self._left.is_set():
            pause = self.config.heartbeat_ms / 1000
            sent = time.monotonic()
            try:
                taken = await asyncio.wait_for(
                    self.leases.put(self.lease_info(), self.config.lease_ms), timeout
                )
                self._lease_renewed(taken, sent)
                if taken.ok and self._lapsed:
                    # The lease expired (Redis or this process stalled past it): the reaper may
                    # have recorded this worker offline, so its life starts again in the ledger.
                    # Redis's word for it (`lapsed`) may never come back: after a partition, a
                    # renewal sent into it can arrive late, re-create the lease and answer a
                    # connection already given up, and the renewal after it finds the lease there.
                    # So what this worker saw counts too (_lease_renewed).
                    log.warning("worker %s: its lease had expired; announcing itself again", self.name)
                    await asyncio.wait_for(self._announce(), timeout * 4)
                    self._lapsed = False
            except (RedisError, OSError, TimeoutError) as exc:
                if not self._lease_failing:
                    log.warning(
                        "worker %s: could not renew its lease (%s); retrying", self.name, exc or "timeout"
                    )
                    self._lease_failing = True
                pause = min(pause, 0.5)
                if time.monotonic() > self._lease_until:
                    self._abandon_runs()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._left.wait(), pause)

    async def _recover_own_pending(self) -> None:
        """Entries this name still owns are from a previous life that died: put them back now, but for
        runs it closed whose entry the ingest has yet to finish."""
        queues = [self.pinned, self.background]
        for digest in sorted({m.digest for m in self.serving()}):
            queues += await self.queues.band_queues(digest)
        for queue in queues:
            for pending in await self.ledger.pending(queue, consumer=self.name, count=1000):
                if not self.finishes and await self.queues.closed(
                    queue, pending.entry_id, self.name, pending.deliveries
                ):
                    continue
                moved = await self.queues.requeue(
                    queue,
                    pending.entry_id,
                    delivery_limit=self._delivery_limit(queue),
                    owner=self.name,
                    attempt=pending.deliveries,
                )
                log.warning(
                    "re-queued %s (task %s) left by a previous run of %s",
                    pending.entry_id,
                    moved.task_id,
                    self.name,
                )
                await self._after_requeue(queue, pending.entry_id, moved, "worker restarted")

    async def _drain(self) -> None:
        """Stop taking work, let running tasks finish for a while, hand back the rest, leave."""
        self.stopping.set()
        for task in self._background:
            task.cancel()
        for run in self.running.values():
            if run.background and run.reading and run.task is not None:
                # A benchmark or grading answer is not worth a drain's wait: back to its stream
                # (one whose backend has answered finishes writing what it made).
                run.task.cancel()
        if self._background:
            # A cancel can be lost: on Python 3.11, asyncio.wait_for, which redis-py sends every
            # command through, drops one that lands as the send completes. The loops end on
            # `stopping` as well, so the heartbeat is over before the lease is deleted below and
            # never renews it (or announces the worker again) after it left.
            await asyncio.wait(self._background, timeout=self.config.lease_ms / 1000)
        await self.control.aclose()
        runs = [r.task for r in self.running.values() if r.task is not None]
        if runs:
            log.info(
                "draining: waiting up to %.0fs for %d running task(s)", self.config.drain_timeout_s, len(runs)
            )
            _, still = await asyncio.wait(runs, timeout=self.config.drain_timeout_s)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still)
        self._left.set()
        if self._lease_task is not None:
            await asyncio.wait({self._lease_task}, timeout=self.config.lease_ms / 1000)
            self._lease_task.cancel()
        if not self.evicted:
            with contextlib.suppress(RedisError, OSError):
                await self._append(WorkerOffline(worker=self.name, reason="shutdown"))
                await self.leases.release(self.name, self.token)
        log.info("worker %s stopped", self.name)

    # -- the loops -------------------------------------------------------------------------------
    async def _consume_loop(self) -> None:
        # A wait kept from a take that emptied the queues while it filled the last slot: once a
        # slot is free, it wakes at once on anything queued since (no need to ask the gate first).
        kept: Wait | None = None
        while not self.stopping.is_set():
            if self.free_slots == 0 or not self.backend_ok or not self.may_take():
                self._slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), self.config.block_ms / 1000)
                continue
            try:
                if kept is not None and self._pinned_cursor is None:
                    # Something was handed back to the pinned stream meanwhile (it wakes no read).
                    kept = None
                wait, kept = kept or await self._take_one(), None
                if wait is not None and self.free_slots == 0:
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
        if self._last_ask < self._cooldown_until:
            # After a failure that may be this machine's: nothing, pinned or shared (a hand-off it
            # gave back goes to another worker meanwhile: workers.reaper).
            return Wait(cursors={} if self._pinned_cursor is None else {self.pinned: self._pinned_cursor})
        # The pinned stream is looked at when something may be there: at first, when a wait woke
        # on it, after this worker handed an entry back, and now and then in any case.
        if self._pinned_cursor is None or self._last_ask - self._pinned_looked > _PINNED_LOOK_S:
            pinned = await self.queues.take(self.pinned, self.name)
            if pinned.entry_id:
                self._start(self.pinned, pinned)
                return None
            if pinned.vanished:
                return None
            self._pinned_cursor, self._pinned_looked = pinned.cursor, self._last_ask
        cursors = {self.pinned: self._pinned_cursor}
        shared = self.shared_queues()
        for queue in shared:
            await self.queues.ensure_group(queue)
        admission = await self.gate.admit(self, shared)
        cursors.update(admission.cursors)
        if admission.queue is None:
            if admission.held_back or not self._background_free():
                # User work waits (for this worker or another), or a background run is on: no
                # benchmark or grading answer starts now.
                return Wait(cursors=cursors, held_back=admission.held_back)
            bg = await self.queues.take(self.background, self.name)
            if bg.entry_id:
                self._start(self.background, bg)
                return None
            if bg.vanished:
                return None
            cursors[self.background] = bg.cursor
            return Wait(cursors=cursors)
        if admission.ahead:
            # A later task than the head: moved to the pinned stream and taken there, as a hand-off.
            taken = await self.queues.take_given(
                admission.queue, self.pinned, self.name, admission.entry_id, admission.task_id
            )
            if not taken.entry_id:
                # Not moved: taken or removed meanwhile, or the pinned stream has work (look there next).
                self._pinned_cursor = None
        else:
            taken = await self.queues.take(admission.queue, self.name, admission.entry_id, admission.slack)
        if taken.entry_id:
            self._missed = 0
            self.expects_work = True
            self._last_shared_take = time.monotonic()
            self._start(self.pinned if admission.ahead else admission.queue, taken)
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
            if any(r.background for r in self.running.values()):
                # A benchmark or grading answer runs: when it ends, the next one may start.
                woke = await self._until_background_ends(reading, block_ms / 1000 + 1.0)
            else:
                woke = await asyncio.wait_for(reading, block_ms / 1000 + 1.0)
            if self.pinned in woke:
                self._pinned_cursor = None
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
        self._slot_freed.clear()
        read = asyncio.ensure_future(reading)
        freed = asyncio.ensure_future(self._slot_freed.wait())
        try:
            done, _ = await asyncio.wait(
                {read, freed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            freed.cancel()
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                    await read
        if read in done:
            return read.result()
        if not done:
            raise TimeoutError
        return set()

    async def _heartbeat_loop(self) -> None:
        """Inventory, resources, the entries of running tasks, news for the ledger: every heartbeat.
        The lease is renewed by a loop of its own (_lease_loop)."""
        beat = 0
        while not self.stopping.is_set():
            await asyncio.sleep(self.config.heartbeat_ms / 1000)
            if self.stopping.is_set():
                return
            beat += 1
            try:
                await self.clock.now_ms()  # measures the offset again when it is due
                async with self._reporting:
                    before = (self.backend_ok, self.inventory.routing())
                    await self._refresh_inventory()
                    self.resources = read_resources()
                    await self._publish_cards()
                    if (self.backend_ok, self.inventory.routing()) != before:
                        # What it holds, has loaded or serves changed: the lease says so now, not at
                        # the lease loop's next turn (routing and `ps` read it).
                        await asyncio.wait_for(self._write_lease(), self.config.heartbeat_ms / 1000)
                    await self._keep_entries_alive()
                    await self._report_changes()
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("heartbeat %d could not reach Redis (%s); will retry", beat, exc or "timeout")

    async def _models_changed(self) -> None:
        """After a pull or a delete: what the machine holds, in the lease and the ledger at once."""
        async with self._reporting:
            await self._refresh_inventory()
            await self._publish_cards()
            await asyncio.wait_for(self._write_lease(), self.config.heartbeat_ms / 1000)
            await self._report_changes()

    async def _report_changes(self) -> None:
        """Append WorkerChanged when what the worker holds, has loaded or serves differs from what
        it last appended; a beat with no news appends nothing (the lease says it is alive)."""
        changed = self.liveness.beat(now_ms(), self.inventory.models, self.inventory.loaded)
        if changed is not None:
            await self._append(changed)
            self.liveness.said(changed)

    async def _refresh_inventory(self, first: bool = False) -> None:
        self._inventory_stale.clear()
        try:
            inventory = await self.backend.inventory()
        except BackendError as exc:
            if self.backend_ok or first:
                log.warning(
                    "backend %s unavailable (%s); not taking work until it answers", self.backend.url, exc
                )
            self.backend_ok = False
            return
        if not self.backend_ok and not first:
            log.info("backend %s is back", self.backend.url)
        if {m.digest for m in inventory.models} != {m.digest for m in self.inventory.models}:
            self._inventory_changed.set()
        self.backend_ok = True
        self.inventory = inventory
        self.warmth.listed()
        if inventory.loaded_known:
            # A model the backend unloaded took its slots' caches with it.
            self.slots.forget(d for d in self.slots.digests() if d not in inventory.loaded)

    async def _keep_entries_alive(self) -> None:
        """Reset the idle time of every running entry still ours (TaskQueues.keep). A run
        that is closing (its entry acknowledged, or about to be) is left out and never reported lost."""
        by_queue: dict[str, list[str]] = {}
        for run in self.running.values():
            if not run.closing:
                by_queue.setdefault(run.entry.queue, []).append(run.entry.entry_id)
        for queue, ids in by_queue.items():
            owned = set(await self.queues.keep(queue, self.name, ids))
            for entry_id in ids:
                held = self.running.get(entry_id)
                if entry_id not in owned and held is not None and not held.lost and not held.closing:
                    held.lost = True
                    log.warning(
                        "entry %s on %s is no longer ours (reclaimed); its completion will count only "
                        "if the task was dead-lettered",
                        entry_id,
                        queue,
                    )

    # -- running one task --------------------------------------------------------------------------
    def _start(self, queue: str, taken: Taken) -> None:
        entry_id, fields = taken.entry_id, taken.fields
        try:
            entry = parse_entry(queue, entry_id, fields, taken.attempt)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            task = asyncio.create_task(self._reject_malformed(queue, entry_id, fields, str(exc)))
            self._background.append(task)
            return
        self._ordinal += 1
        run = Running(
            entry=entry, started=time.monotonic(), ordinal=self._ordinal, background=queue == self.background
        )
        if not run.background:
            # User work: no benchmark or grading answer runs beside it.
            self._preempt()
        self.running[entry_id] = run
        run.task = asyncio.create_task(self._run(run), name=f"task-{entry.task.task_id}")

    def _preempt(self) -> None:
        """Give up every background run for user work: each stops at its next read of the backend
        (cancelled at once when it is awaiting one; its backend request is closed, which frees the
        server's slot) and goes back to the background stream. A run whose backend has answered
        finishes: its sample is taken."""
        for run in self.running.values():
            if not run.background or run.preempted or run.answered or run.closing:
                continue
            log.info(
                "task %s (%s) gives its slot to user work; it runs again later",
                run.entry.task.task_id,
                "grading" if prompt_by_id(run.entry.task.bench_prompt or "") else "benchmark",
            )
            run.preempted = True
            if run.reading and run.task is not None:
                run.task.cancel()

    async def _reject_malformed(
        self, queue: str, entry_id: str, fields: dict[bytes, bytes], reason: str
    ) -> None:
        log.error("entry %s on %s is not a task (%s); dead-lettering it", entry_id, queue, reason)
        await self.queues.dead_letter(queue, entry_id, fields, f"malformed entry: {reason}")
        if self.finishes:
            await self.queues.finish(queue, entry_id, self.name)
        # Else it stays pending, unrun: the reaper takes it back after two leases, and past the
        # delivery limit dead-letters and finishes it.

    async def _run(self, run: Running) -> None:
        entry = run.entry
        task = entry.task
        try:
            # The deadline is the submitting API's time: compared on the ledger's clock, not this one.
            if task.deadline_ms is not None and await self.clock.now_ms() > task.deadline_ms:
                await self._expire(run, task.deadline_ms)
                return
            local = self.local_name(task.digest)
            if local is None:
                await self._fail(
                    run,
                    BackendError("model_missing", f"{self.name} does not serve {task.model}", retryable=True),
                )
                return
            crash_here("claim", run.ordinal)
            if task.kind != EMBED:
                # Before the lease below: it must not show the slot this run takes as holding
                # what it held before.
                run.slot = self.slots.start(task.digest, task.prefix or task_chain(task))
            # One round trip: the lease that now lists this task, the claim, and the cancel check.
            # The lease goes first: a worker woken by the TaskClaimed reads it up to date. It is on
            # its way while the backend is asked, and done before anything of the run is written.
            sent = time.monotonic()
            claimed = TaskClaimed(
                task_id=task.task_id,
                worker=self.name,
                digest=task.digest,
                attempt=entry.attempt,
                queue=entry.queue,
                entry_id=entry.entry_id,
                in_flight=len(self.running),
            )
            cancel_key = self.keys.cancel(task.task_id)
            commands: list[tuple[Any, ...]] = []
            lease = (
                self.leases.put_command(self.lease_info(), self.config.lease_ms) if self.eager_lease else None
            )
            if not self.eager_lease or lease is not None:
                if lease is not None:
                    commands.append(lease)
                commands.append(("XADD", self.ledger.appends_to, "*", *encode_flat(claimed)))
                commands.append(("EXISTS", cancel_key))
                replies = send_all(self.redis, commands, raise_on_error=True)
            else:
                # The lease script cannot be sent as a plain command yet (events.scripts.Script.command).
                pipe = self.redis.pipeline(transaction=False)
                await self.leases.put_in(pipe, self.lease_info(), self.config.lease_ms)
                pipe.xadd(self.ledger.appends_to, encode_fields(claimed))  # type: ignore[arg-type]
                pipe.exists(cancel_key)
                replies = pipe.execute()
            claim = _Claim(self, asyncio.ensure_future(replies), sent, task.task_id)
            run.claim = claim
            await self._generate(run, local)
            self._failures = 0
        except TaskCancelledError:
            await self._cancelled(run)
        except PreemptedError:
            await self._hand_back_preempted(run)
        except BackendError as exc:
            try:
                await run.settle_claim()
            except TaskCancelledError:
                await self._cancelled(run)
            else:
                await self._fail(run, exc)
        except asyncio.CancelledError:
            # Shut down mid-run: hand the task back for another worker.
            with contextlib.suppress(RedisError, OSError, TaskCancelledError):
                await run.settle_claim()
            with contextlib.suppress(RedisError, OSError):
                await self._requeue_run(run, "worker shut down mid-run")
            raise
        except (RedisError, OSError) as exc:
            # The entry stays pending for us; if we die, the reaper reclaims it.
            log.error("task %s: Redis failed mid-run (%s); leaving the entry pending", task.task_id, exc)
        finally:
            if run.claim is not None:
                run.claim.discard()
            if run.slot is not None:
                # Ended without an answer: what the slot holds now is not known.
                self.slots.finish(task.digest, run.slot, None)
            if run.background:
                self._background_ended = time.monotonic()
            self.running.pop(entry.entry_id, None)
            self._slot_freed.set()
            if self.eager_lease and not self.stopping.is_set():
                with contextlib.suppress(RedisError, OSError):
                    await asyncio.wait_for(self._write_lease(), self.config.heartbeat_ms / 1000)

    async def _generate(self, run: Running, local: str) -> None:
        entry = run.entry
        task = entry.task
        out_key = self.queues.out_key(task.task_id)
        cancel_key = self.keys.cancel(task.task_id)
        pieces: list[str] = []
        buffer: list[str] = []
        # Tool calls the model made, and those not written to the output yet.
        calls: list[ToolCall] = []
        unsent_calls: list[ToolCall] = []
        # The model's thinking, and what of it is not written to the output yet.
        thoughts: list[str] = []
        unsent_thoughts: list[str] = []
        t0 = time.perf_counter()
        # Decided before the run, from what the backend last listed as loaded (workers.warmth).
        cold = self.warmth.before(task.digest, self.inventory)
        alone = len(self.running) <= 1
        ttft_ms: float | None = None
        last_flush = 0.0
        last_cancel_check = t0
        generated: Generated | None = None
        held: list[bool] = []  # output flushes Redis refused for lack of memory (logged once)

        async def flush(final: Chunk | None = None) -> None:
            await run.settle_claim()
            commands: list[tuple[Any, ...]] = []
            if buffer or unsent_calls or unsent_thoughts:
                piece = Chunk(
                    attempt=entry.attempt,
                    text="".join(buffer),
                    run=run.run_id,
                    tool_calls=list(unsent_calls) or None,
                    thinking="".join(unsent_thoughts),
                )
                commands.append(("XADD", out_key, "*", "c", encode_chunk(piece)))
            if final is not None:
                commands.append(("XADD", out_key, "*", "c", encode_chunk(final)))
            commands.append(("PEXPIRE", out_key, OUTPUT_TTL_MS))
            try:
                await send_all(self.redis, commands, raise_on_error=True)
            except ResponseError as exc:
                if final is not None or not is_oom(exc):
                    raise
                # Redis is at its memory limit: keep the text; a later flush or the close writes it.
                if not held:
                    log.warning("task %s: Redis is out of memory for its output; holding it", task.task_id)
                held.append(True)
                return
            buffer.clear()
            unsent_calls.clear()
            unsent_thoughts.clear()

        stream = self.backend.generate(task, local)
        try:
            while True:
                item = await self._read(run, stream)
                if item is None:
                    break
                if isinstance(item, Generated):
                    generated = item
                    # The backend has answered: the run finishes, whatever work comes now.
                    run.answered = True
                    break
                now = time.perf_counter()
                if ttft_ms is None:
                    ttft_ms = (now - t0) * 1000
                    run.prompt_done = True
                    # A task cancelled before its claim stops at its first token, streamed or not.
                    await run.settle_claim()
                if isinstance(item, list):
                    # Whole calls, which the client acts on: written at once. Calls a refused
                    # write held back still reach the client, from the result (Gateway.relay).
                    calls += item
                    unsent_calls += item
                    if task.stream:
                        await flush()
                        last_flush = now
                    continue
                run.pieces += 0 if isinstance(item, list) else 1
                if isinstance(item, Thought):
                    thoughts.append(item.text)
                    unsent_thoughts.append(item.text)
                    opening = len(thoughts) == 1
                else:
                    pieces.append(item)
                    buffer.append(item)
                    opening = len(pieces) == 1
                if task.stream and (opening or (now - last_flush) * 1000 >= self.config.flush_ms):
                    await flush()
                    last_flush = now
                    crash_here("stream", run.ordinal)
                if (now - last_cancel_check) * 1000 >= self.config.cancel_check_ms:
                    last_cancel_check = now
                    if await self.redis.exists(cancel_key):
                        raise TaskCancelledError(task.task_id)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        if generated is None:
            raise BackendError("disconnect", "the backend stream ended early", retryable=True)
        if unsent_thoughts and task.stream:
            # Thinking goes out before the closing text (a refused write reaches the client from
            # the result: Gateway.relay).
            await flush()
        wall_ms = (time.perf_counter() - t0) * 1000
        reported = generated.timings
        if (
            run.slot is not None
            and self.slots.hit(task.digest, run.slot) > 0
            and reported.prompt_eval_cached_count is None
            and reported.prompt_eval_count is not None
        ):
            # This run should have found its prefix cached, and the backend does not say how
            # much it did (Ollama's count includes cached tokens, with or without saying so): its
            # prompt time is no prompt speed sample. Recorded as all cached, which leaves it out.
            reported = msgspec.structs.replace(reported, prompt_eval_cached_count=reported.prompt_eval_count)
        cold, timings = self.warmth.after(
            task.digest,
            cold,
            reported,
            alone=alone and len(self.running) <= 1,
            prompt_tokens=task.prompt_tokens,
        )
        if timings is not generated.timings:
            generated = msgspec.structs.replace(generated, timings=timings)
        text = "".join(pieces)
        if run.slot is not None:
            holds = held_after(task, text, calls)
            self.slots.finish(task.digest, run.slot, holds)
            run.slot, run.answered = None, True
            if holds is not None and self.eager_lease:
                # The lease says what the slot holds before the answer reaches the client: a
                # chat's next turn, sent at once, is planned with it.
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await asyncio.wait_for(self._write_lease(), self.config.heartbeat_ms / 1000)
        result = Result(
            task_id=task.task_id,
            status="completed",
            worker=self.name,
            attempt=entry.attempt,
            text=text,
            timings=generated.timings,
            ttft_ms=ttft_ms,
            wall_ms=wall_ms,
            done_reason=generated.done_reason,
            run=run.run_id,
            tool_calls=calls or None,
            thinking="".join(thoughts),
            embeddings=generated.embeddings,
        )
        done = Chunk(attempt=entry.attempt, done=True, run=run.run_id)
        # The last text piece and the result in one round trip. A run that lost its entry (the
        # reaper took it back) stores its result only over a dead letter: then it is the task's
        # completion; otherwise the task's new run answers.
        await run.settle_claim()
        rest = "".join(buffer)
        buffer.clear()
        if not task.stream:
            # Nobody streams it: its whole text goes out with the done chunk, so that a reader (a
            # waiting client, or a pipeline relaying it) wakes once, not for a text chunk and again
            # for the done chunk. The outcome is stored first all the same (close_run).
            done = Chunk(attempt=entry.attempt, done=True, run=run.run_id, text=rest)
            rest = ""
        lost = run.lost
        first = stored = await self._until_room(
            task.task_id, "result", lambda: self.queues.close_run(result, rest, only_over_dead=lost)
        )
        crash_here("result", run.ordinal)
        if not first and not run.lost:
            # A stored result without its TaskCompleted: its writer died in between; count ours.
            first = await self.queues.take_over_log(task.task_id, entry.attempt)
        finished = FinishedRun(
            worker=self.name,
            task=task,
            attempt=entry.attempt,
            generated=generated,
            text=text,
            ttft_ms=ttft_ms,
            wall_ms=wall_ms,
            in_flight=len(self.running),
            cold=cold,
        )
        closing = finished.closing_events(counts=first)
        carried = result if stored else None
        # The closing events and the done chunk, written in full (Redis out of memory is waited
        # out: the result stays here, the entry pending and kept alive); only then the acknowledgement.
        await self.queues.log_run(
            task.task_id,
            closing,
            counts=first,
            done=done,
            carried=carried,
            wait_for_room=lambda rounds: self._wait_for_room(task.task_id, "completion", rounds),
        )
        crash_here("ack", run.ordinal)
        run.closing = True
        if not self.finishes:
            return  # the ingest finishes the entry as it moves the TaskCompleted into the ledger
        acked = await self.queues.finish(entry.queue, entry.entry_id, self.name)
        if acked == 0 and first:
            log.warning(
                "task %s completed on %s after it was dead-lettered: the completion counts",
                task.task_id,
                self.name,
            )
        elif acked == 0:
            log.warning(
                "entry %s on %s was reclaimed while we ran it; this completion is a duplicate",
                entry.entry_id,
                entry.queue,
            )

    async def _benchmark_loop(self) -> None:
        """Benchmark every served model whose speed row on this worker is thin or stale."""
        from projections.reader import snapshot

        first = True
        while not self.stopping.is_set():
            try:
                now = await self.clock.now_ms()
                snap = await snapshot(self.redis, self.keys, now_ms=now)
                for model in self.serving():
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
            self._inventory_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._inventory_changed.wait(), self.config.bench_check_s)

    async def _background_done(self) -> bool:
        """Whether every benchmark and grading task this worker asked for has run and been folded:
        none runs, none waits in its background stream, and the last ended a moment ago."""
        if any(r.background for r in self.running.values()):
            return False
        if time.monotonic() - self._background_ended < _FOLD_WAIT_S:
            return False
        return int(await self.redis.xlen(self.background)) == 0

    async def _grade(self, snap: Snapshot) -> None:
        """Grade each served model's ungraded prompts, per domain, when this worker is the one that
        grades it (dispatch.benchmark: one holder, a batch per domain and check, each prompt once
        per digest; a prompt asked for in the last 10 minutes is not asked again meanwhile). Only
        while the worker is quiet (`grade_quiet_s`): grading is never worth delaying user work."""
        if self.running or time.monotonic() - self._last_shared_take < self.config.grade_quiet_s:
            return
        for model in self.serving():
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

    async def _fail(self, run: Running, exc: BackendError) -> None:
        entry = run.entry
        log.warning("task %s attempt %d failed on %s: %s", entry.task.task_id, entry.attempt, self.name, exc)
        await self._record_failure(run, exc.kind, exc.retryable, exc.message)
        if exc.kind not in ("model_missing", "bad_request", "unsupported"):
            # The backend misbehaves (it did not refuse the request itself): step back from shared
            # work for a while so others take it.
            self._failures += 1
            pause = min(self.config.max_cooldown_s, self.config.cooldown_s * 2 ** (self._failures - 1))
            self._cooldown_until = time.monotonic() + pause
        if exc.kind == "unsupported":
            # The server cannot do this for the model (a 501): say so in the lease before the
            # client hears, so that the next such request is refused at submission.
            self.backend_refused(entry.task)
        if exc.retryable:
            run.closing = True
            await self._requeue_run(run, f"{exc.kind}: {exc.message[:200]}")
            return
        await self._settle(run, "failed", str(exc), refused=exc.kind in ("bad_request", "unsupported"))

    def backend_refused(self, task: TaskMessage) -> None:
        """Learn from the backend's refusal of `task`: its inventory (and the lease) now says the
        model lacks what was asked, at the next renewal, which is asked for now."""
        if task.kind == EMBED and isinstance(self.backend, Refusing):
            local = self.local_name(task.digest)
            if local is not None:
                self.backend.refused(local, "embedding")
                self._inventory_stale.set()

    async def _read(
        self, run: Running, stream: AsyncIterator[str | Thought | list[ToolCall] | Generated]
    ) -> str | Thought | list[ToolCall] | Generated | None:
        """The backend's next piece (None at its end). A background run given up for user work
        stops here, before or during the read (PreemptedError), and nowhere else."""
        if run.preempted:
            raise PreemptedError(run.entry.task.task_id)
        run.reading = True
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            # Read again: `_preempt` sets it from another task while this one awaits.
            if run.given_up() and not self.stopping.is_set() and current is not None:
                # Cancelled by `_preempt`, not by a shutdown: the run hands its task back.
                current.uncancel()
                raise PreemptedError(run.entry.task.task_id) from None
            raise
        finally:
            run.reading = False

    async def _hand_back_preempted(self, run: Running) -> None:
        """A run given up for user work: its claim settled, its reason recorded, its task back in
        the background stream."""
        with contextlib.suppress(RedisError, OSError, TaskCancelledError):
            await run.settle_claim()
        with contextlib.suppress(RedisError, OSError):
            await self._record_failure(run, "preempted", True, "gave its slot to user work; runs again later")
            run.closing = True
            await self._requeue_run(run, "preempted by user work")

    async def _cancelled(self, run: Running) -> None:
        log.info("task %s cancelled by its client", run.entry.task.task_id)
        task = run.entry.task
        # Charged to the task's key (Projector._charge): the prompt (as estimated at submission:
        # the backend reports its count only at the end) once the first token showed the backend
        # had evaluated it, and every piece of output generated.
        done = Timings(
            prompt_eval_count=task.prompt_tokens if run.prompt_done else None,
            eval_count=run.pieces or None,
            counted="stream" if run.pieces else None,
        )
        await self._record_failure(run, "cancelled", False, "cancelled by the client", done)
        await self._settle(run, "cancelled", "cancelled")

    async def _record_failure(
        self, run: Running, kind: str, retryable: bool, message: str, timings: Timings | None = None
    ) -> None:
        entry = run.entry
        await self._append(
            TaskFailed(
                task_id=entry.task.task_id,
                worker=self.name,
                digest=entry.task.digest,
                attempt=entry.attempt,
                kind=kind,
                retryable=retryable,
                message=message[:500],
                timings=timings or Timings(),
            )
        )

    async def _settle(self, run: Running, status: Outcome, error: str, *, refused: bool = False) -> None:
        """A final outcome without a completion: record it, close the output, finish the entry."""
        entry = run.entry
        task_id = entry.task.task_id
        if self._inventory_stale.is_set():
            # What the backend refused reaches the lease before the client's answer does.
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await self._refresh_inventory()
                await asyncio.wait_for(self._write_lease(), self.config.heartbeat_ms / 1000)
        await self.queues.record_result(
            Result(
                task_id=task_id,
                status=status,
                worker=self.name,
                attempt=entry.attempt,
                error=error,
                refused=refused,
            )
        )
        await self.queues.end_output(task_id, entry.attempt, error)
        run.closing = True
        if self.finishes:
            await self.queues.finish(entry.queue, entry.entry_id, self.name)

    async def _expire(self, run: Running, deadline: int) -> None:
        """A task taken after its `deadline`: nobody waits for it any more, so it never runs."""
        entry = run.entry
        task = entry.task
        now = await self.clock.now_ms()
        late = now - deadline
        log.info(
            "task %s expired %.1fs before %s took it; not running it", task.task_id, late / 1000, self.name
        )
        await self._append(
            TaskExpired(
                task_id=task.task_id,
                queue=entry.queue,
                worker=self.name,
                deadline=deadline,
                entry_id=entry.entry_id,
                waited_ms=max(0, now - task.submitted_at),
            )
        )
        await self._settle(
            run, "cancelled", f"expired: its deadline passed {late / 1000:.1f}s before a worker took it"
        )

    async def _requeue_run(self, run: Running, reason: str) -> None:
        """Put the run's entry back in its queue as its next attempt (dead-lettered past its
        delivery limit, with `reason`)."""
        entry = run.entry
        moved = await self.queues.requeue(
            entry.queue,
            entry.entry_id,
            delivery_limit=self._delivery_limit(entry.queue),
            owner=self.name,
            attempt=entry.attempt,
        )
        await self._after_requeue(entry.queue, entry.entry_id, moved, reason)

    def _delivery_limit(self, queue: str) -> int:
        """How many deliveries an entry of `queue` may have: a background task's are spent by
        preemptions as well as failures, so it has more."""
        return _PREEMPT_LIMIT if queue == self.background else self.config.delivery_limit

    async def _after_requeue(self, queue: str, entry_id: str, moved: Requeue, reason: str) -> None:
        """Dead-letter a task whose deliveries are spent; log anything odd."""
        if queue == self.pinned:
            self._pinned_cursor = None  # a re-queued entry wakes nobody: look at it next time
        if not await self.queues.settle_requeue(
            queue, entry_id, moved, reason, self._delivery_limit(queue), finish=self.finishes
        ):
            log.warning(
                "could not re-queue %s on %s (status %s): it was no longer ours",
                entry_id,
                queue,
                moved.status,
            )

    async def _until_room(self, task_id: str, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """`op`, tried again for as long as Redis refuses it for lack of memory (OOM)."""
        rounds = 0
        while True:
            try:
                return await op()
            except ResponseError as exc:
                if not is_oom(exc):
                    raise
            rounds += 1
            await self._wait_for_room(task_id, what, rounds)

    async def _wait_for_room(self, task_id: str, what: str, rounds: int) -> None:
        """Pause before writing again what Redis refused for lack of memory: the run keeps its result,
        and its entry stays pending and kept alive (XCLAIM needs no memory), so nothing is lost."""
        if rounds == 1:
            log.warning(
                "task %s: Redis is at its memory limit (OOM) and refused its %s; keeping it and retrying "
                "until there is room (run `routeledger archive` or raise redis_maxmemory)",
                task_id,
                what,
            )
        await asyncio.sleep(min(_ROOM_WAIT_MAX_S, 0.05 * 2**rounds))

    async def _append(self, event: Event) -> None:
        await self.ledger.append(event)
