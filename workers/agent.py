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
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from dispatch.benchmark import needs_benchmark, request_benchmark
from dispatch.lease import LeaseInfo, RunningInfo, decode_lease, encode_lease
from dispatch.memory import is_oom
from dispatch.payload import Chunk, Result, encode_chunk
from dispatch.queues import OUTPUT_TTL_MS, QueueEntry, Requeue, TaskQueues, parse_entry
from events.codec import encode_fields
from events.errors import RouteledgerError
from events.event import (
    Event,
    ModelEntry,
    Resources,
    TaskClaimed,
    TaskFailed,
    WorkerOffline,
    WorkerOnline,
    now_ms,
)
from events.keys import Keys
from events.ledger import Ledger
from projections.status import Outcome
from workers.admission import Gate, PlainPull
from workers.backend import Backend, Generated, Inventory
from workers.closing import FinishedRun
from workers.config import WorkerConfig
from workers.crash import crash_here
from workers.errors import BackendError, TaskCancelledError, WorkerNameTakenError
from workers.liveness import Liveness
from workers.resources import read_resources

log = logging.getLogger("routeledger.worker")

T = TypeVar("T")

# Longest pause between tries of a write Redis refused for lack of memory.
_ROOM_WAIT_MAX_S = 2.0


class Running(msgspec.Struct, kw_only=True):
    """A task this worker is running."""

    entry: QueueEntry
    started: float
    started_at_ms: int = msgspec.field(default_factory=now_ms)
    task: asyncio.Task[None] | None = None
    lost: bool = False
    # 1 for the first task this process runs, and so on (for the test crash hook).
    ordinal: int = 0


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
        self.gate: Gate = gate or PlainPull()
        # A speed-aware gate plans with what every worker runs, so the lease says so at once.
        self.eager_lease = not isinstance(self.gate, PlainPull)
        self.ledger = Ledger(redis, keys)
        self.queues = TaskQueues(redis, keys, self.ledger, dead_max_entries=config.dead_max_entries)
        self.token = secrets.token_hex(8)
        self.inventory = Inventory(models=[], loaded=[])
        self.backend_ok = False
        self.running: dict[str, Running] = {}
        self.started_at = now_ms()
        self.stopping = asyncio.Event()
        self._cooldown_until = 0.0
        self._failures = 0
        self._slot_freed = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self._inventory_changed = asyncio.Event()
        # digest -> monotonic time of the last benchmark this worker requested for itself
        self._benched: dict[str, float] = {}
        self._ordinal = 0
        # What the ledger last heard of this worker's state; the machine's figures go only to the lease.
        self.liveness = Liveness(self.name, config.slots, config.serves)
        self.resources = Resources()

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
    def free_slots(self) -> int:
        return max(0, self.config.slots - len(self.running))

    # -- start and stop -------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until `stopping` is set, then drain and leave."""
        await self._refresh_inventory(first=True)
        self.resources = read_resources()
        await self._take_lease()
        await self._announce()
        await self.queues.ensure_group(self.pinned)
        for queue in self.shared_queues():
            await self.queues.ensure_group(queue)
        await self._recover_own_pending()
        self._background.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
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

    async def _take_lease(self) -> None:
        """Take `rl:live:{name}`; wait out the lease of a previous life, refuse a live twin."""
        key = self.keys.live(self.name)
        deadline = time.monotonic() + self.config.lease_ms / 1000 + 1.0
        while True:
            current: bytes | None = await self.redis.get(key)  # type: ignore[assignment]
            if current is None:
                break
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                if decode_lease(current).token == self.token:
                    break
            if time.monotonic() > deadline:
                raise WorkerNameTakenError(
                    f"a live worker named {self.name!r} already holds its lease; give this one another --id"
                )
            await asyncio.sleep(0.2)
        await self.redis.srem(self.keys.forgotten, self.name)
        await self._write_lease()

    def _lease_value(self) -> bytes:
        """What this worker's lease says now."""
        info = LeaseInfo(
            worker=self.name,
            token=self.token,
            slots=self.config.slots,
            in_flight=len(self.running),
            inventory=list(self.inventory.models),
            loaded=list(self.inventory.loaded),
            serves=[m.name for m in self.serving()] if self.backend_ok else [],
            draining=self.stopping.is_set(),
            running=[
                RunningInfo(
                    task_id=r.entry.task.task_id,
                    digest=r.entry.task.digest,
                    started_at=r.started_at_ms,
                    domain=r.entry.task.domain,
                    prompt_tokens=r.entry.task.prompt_tokens,
                    max_tokens=r.entry.task.max_tokens,
                )
                for r in self.running.values()
            ],
            since=self.started_at,
            resources=self.resources,
        )
        return encode_lease(info)

    async def _write_lease(self) -> None:
        await self.redis.set(self.keys.live(self.name), self._lease_value(), px=self.config.lease_ms)

    async def _renew_lease(self) -> bool:
        """Write the lease; True when there was none to renew (it had expired)."""
        previous: Any = await self.redis.set(
            self.keys.live(self.name), self._lease_value(), px=self.config.lease_ms, get=True
        )
        return previous is None

    async def _recover_own_pending(self) -> None:
        """Entries this name still owns are from a previous life that died: put them back now."""
        for queue in [self.pinned, *self.shared_queues()]:
            for pending in await self.ledger.pending(queue, consumer=self.name, count=1000):
                moved = await self.queues.requeue(
                    queue, pending.entry_id, delivery_limit=self.config.delivery_limit, owner=self.name
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
        if self._background:
            # A cancel can be lost: on Python 3.11, asyncio.wait_for, which redis-py sends every
            # command through, drops one that lands as the send completes. The loops end on
            # `stopping` as well, so the heartbeat is over before the lease is deleted below and
            # never renews it (or announces the worker again) after it left.
            await asyncio.wait(self._background, timeout=self.config.lease_ms / 1000)
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
        with contextlib.suppress(RedisError, OSError):
            await self._append(WorkerOffline(worker=self.name, reason="shutdown"))
            await self.redis.delete(self.keys.live(self.name))
        log.info("worker %s stopped", self.name)

    # -- the loops -------------------------------------------------------------------------------
    async def _consume_loop(self) -> None:
        while not self.stopping.is_set():
            if self.free_slots == 0 or not self.backend_ok:
                self._slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), self.config.block_ms / 1000)
                continue
            try:
                entries = await self._read_work()
            except (RedisError, OSError) as exc:
                log.warning("Redis unavailable while reading work (%s); retrying", exc)
                await asyncio.sleep(1.0)
                continue
            for queue, entry_id, fields in entries:
                self._start(queue, entry_id, fields)

    async def _read_work(self) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """Up to `free_slots` entries: pinned first, then the shared queues the gate admits."""
        queues = [self.pinned]
        held_back: list[str] = []
        if time.monotonic() >= self._cooldown_until:
            shared = self.shared_queues()
            for queue in shared:
                await self.queues.ensure_group(queue)
            admitted = await self.gate.admit(self, shared)
            held_back = [q for q in shared if q not in admitted]
            queues += admitted
        got: list[tuple[str, str, dict[bytes, bytes]]] = []
        # Non-blocking, one queue at a time, so that no more than the free slots are taken.
        for queue in queues:
            free = self.free_slots - len(got)
            if free <= 0:
                return got
            for stream, rows in await self.ledger.group_read(self.name, {queue: ">"}, count=free):
                got.extend((stream, entry_id, fields) for entry_id, fields in rows)
        if got:
            return got
        if held_back:
            # The gate decides on every new task, so a held-back worker must not consume on the
            # wake-up: it waits (XREAD, no group) until any of its streams gets an entry, and asks
            # the gate again. The backlog's owners or the fleet may change without writing to its
            # streams, so it asks again after `recheck_ms` in any case.
            await self.ledger.wait_for_entries([*queues, *held_back], self.config.recheck_ms)
            return []
        # Nothing waiting and nothing held back: block on all of them until one gets an entry.
        reply = await self.ledger.group_read(
            self.name, dict.fromkeys(queues, ">"), count=1, block_ms=self.config.block_ms
        )
        for stream, rows in reply:
            got.extend((stream, entry_id, fields) for entry_id, fields in rows)
        for queue, entry_id, _ in got[self.free_slots :]:
            # Two queues answered one blocking read at once: hand the extra back unspent.
            await self.queues.requeue(queue, entry_id, delivery_limit=self.config.delivery_limit, bump=False)
        return got[: self.free_slots]

    async def _heartbeat_loop(self) -> None:
        beat = 0
        while not self.stopping.is_set():
            await asyncio.sleep(self.config.heartbeat_ms / 1000)
            if self.stopping.is_set():
                return
            beat += 1
            try:
                await self._refresh_inventory()
                self.resources = read_resources()
                # Entries first: XCLAIM needs no memory, so they stay ours even while Redis, at its
                # memory limit, refuses the lease's SET (and the reaper cannot take them).
                await self._keep_entries_alive()
                lapsed = await self._renew_lease()
                if lapsed:
                    # The lease expired (Redis or this process stalled past it): the reaper may
                    # have recorded this worker offline, so its life starts again in the ledger.
                    log.warning("worker %s: its lease had expired; announcing itself again", self.name)
                    await self._announce()
                else:
                    await self._report_changes()
            except (RedisError, OSError) as exc:
                log.warning("heartbeat %d could not reach Redis (%s); will retry", beat, exc)

    async def _report_changes(self) -> None:
        """Append WorkerChanged when what the worker holds, has loaded or serves differs from what
        it last appended; a beat with no news appends nothing (the lease says it is alive)."""
        changed = self.liveness.beat(now_ms(), self.inventory.models, self.inventory.loaded)
        if changed is not None:
            await self._append(changed)
            self.liveness.said(changed)

    async def _refresh_inventory(self, first: bool = False) -> None:
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

    async def _keep_entries_alive(self) -> None:
        """XCLAIM JUSTID every running entry to itself: resets idle time, counts no delivery."""
        by_queue: dict[str, list[str]] = {}
        for run in self.running.values():
            by_queue.setdefault(run.entry.queue, []).append(run.entry.entry_id)
        for queue, ids in by_queue.items():
            owned = set(await self.ledger.claim(queue, self.name, ids, justid=True))
            for entry_id in ids:
                if entry_id not in owned and entry_id in self.running and not self.running[entry_id].lost:
                    self.running[entry_id].lost = True
                    log.warning(
                        "entry %s on %s is no longer ours (reclaimed); its completion will not count",
                        entry_id,
                        queue,
                    )

    # -- running one task --------------------------------------------------------------------------
    def _start(self, queue: str, entry_id: str, fields: dict[bytes, bytes]) -> None:
        try:
            entry = parse_entry(queue, entry_id, fields)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            task = asyncio.create_task(self._reject_malformed(queue, entry_id, fields, str(exc)))
            self._background.append(task)
            return
        self._ordinal += 1
        run = Running(entry=entry, started=time.monotonic(), ordinal=self._ordinal)
        self.running[entry_id] = run
        run.task = asyncio.create_task(self._run(run), name=f"task-{entry.task.task_id}")

    async def _reject_malformed(
        self, queue: str, entry_id: str, fields: dict[bytes, bytes], reason: str
    ) -> None:
        log.error("entry %s on %s is not a task (%s); dead-lettering it", entry_id, queue, reason)
        await self.queues.dead_letter(queue, entry_id, fields, f"malformed entry: {reason}")
        await self.queues.finish(queue, entry_id)

    async def _run(self, run: Running) -> None:
        entry = run.entry
        task = entry.task
        try:
            local = self.local_name(task.digest)
            if local is None:
                await self._fail(
                    run,
                    BackendError("model_missing", f"{self.name} does not serve {task.model}", retryable=True),
                )
                return
            crash_here("claim", run.ordinal)
            # One round trip: the claim, the lease that now lists this task, and the cancel check.
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(
                self.keys.events,
                encode_fields(  # type: ignore[arg-type]
                    TaskClaimed(
                        task_id=task.task_id,
                        worker=self.name,
                        digest=task.digest,
                        attempt=entry.attempt,
                        queue=entry.queue,
                        entry_id=entry.entry_id,
                        in_flight=len(self.running),
                    )
                ),
            )
            if self.eager_lease:
                pipe.set(self.keys.live(self.name), self._lease_value(), px=self.config.lease_ms)
            pipe.exists(self.keys.cancel(task.task_id))
            replies: list[Any] = await pipe.execute()
            if replies[-1]:
                raise TaskCancelledError(task.task_id)
            await self._generate(run, local)
            self._failures = 0
        except TaskCancelledError:
            await self._cancelled(run)
        except BackendError as exc:
            await self._fail(run, exc)
        except asyncio.CancelledError:
            # Shut down mid-run: hand the task back for another worker.
            with contextlib.suppress(RedisError, OSError):
                moved = await self.queues.requeue(
                    entry.queue, entry.entry_id, delivery_limit=self.config.delivery_limit, owner=self.name
                )
                await self._after_requeue(entry.queue, entry.entry_id, moved, "worker shut down mid-run")
            raise
        except (RedisError, OSError) as exc:
            # The entry stays pending for us; if we die, the reaper reclaims it.
            log.error("task %s: Redis failed mid-run (%s); leaving the entry pending", task.task_id, exc)
        finally:
            self.running.pop(entry.entry_id, None)
            self._slot_freed.set()
            if self.eager_lease and not self.stopping.is_set():
                with contextlib.suppress(RedisError, OSError):
                    await self._write_lease()

    async def _generate(self, run: Running, local: str) -> None:
        entry = run.entry
        task = entry.task
        out_key = self.keys.out(task.task_id)
        cancel_key = self.keys.cancel(task.task_id)
        pieces: list[str] = []
        buffer: list[str] = []
        t0 = time.perf_counter()
        ttft_ms: float | None = None
        last_flush = 0.0
        last_cancel_check = t0
        generated: Generated | None = None
        held: list[bool] = []  # output flushes Redis refused for lack of memory (logged once)

        async def flush(final: Chunk | None = None) -> None:
            pipe = self.redis.pipeline(transaction=False)
            if buffer:
                pipe.xadd(out_key, {b"c": encode_chunk(Chunk(attempt=entry.attempt, text="".join(buffer)))})
            if final is not None:
                pipe.xadd(out_key, {b"c": encode_chunk(final)})
            pipe.pexpire(out_key, OUTPUT_TTL_MS)
            try:
                await pipe.execute()
            except ResponseError as exc:
                if final is not None or not is_oom(exc):
                    raise
                # Redis is at its memory limit: keep the text; a later flush or the close writes it.
                if not held:
                    log.warning("task %s: Redis is out of memory for its output; holding it", task.task_id)
                held.append(True)
                return
            buffer.clear()

        stream = self.backend.generate(task, local)
        try:
            async for item in stream:
                if isinstance(item, Generated):
                    generated = item
                    break
                now = time.perf_counter()
                if ttft_ms is None:
                    ttft_ms = (now - t0) * 1000
                pieces.append(item)
                buffer.append(item)
                if task.stream and (len(pieces) == 1 or (now - last_flush) * 1000 >= self.config.flush_ms):
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
        wall_ms = (time.perf_counter() - t0) * 1000
        text = "".join(pieces)
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
        )
        # The output stream's done chunk: None when it is written already (a lost run's, here).
        done: Chunk | None = Chunk(attempt=entry.attempt, done=True)
        stored = False  # whether the stored result is this run's, so the done chunk can carry it
        if run.lost:
            first = False
            await flush(done)
            done = None
        else:
            # The last text piece and the result in one round trip.
            rest = "".join(buffer)
            buffer.clear()
            first = stored = await self._until_room(
                task.task_id, "result", lambda: self.queues.close_run(result, rest)
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
        acked = await self.queues.finish(entry.queue, entry.entry_id)
        if acked == 0:
            log.warning(
                "XACK of %s on %s returned 0: the entry was reclaimed while we ran it; "
                "this completion is a duplicate",
                entry.entry_id,
                entry.queue,
            )

    async def _benchmark_loop(self) -> None:
        """Benchmark every served model whose speed row on this worker is thin or stale."""
        from projections.reader import snapshot

        first = True
        while not self.stopping.is_set():
            try:
                snap = await snapshot(self.redis, self.keys)
                now = now_ms()
                for model in self.serving():
                    recent = self._benched.get(model.digest)
                    if recent is not None and time.monotonic() - recent < 600:
                        continue  # asked already; its results may not be folded yet
                    need = needs_benchmark(
                        snap,
                        self.name,
                        model.digest,
                        now,
                        min_samples=self.config.bench_min_samples,
                        stale_after_s=self.config.bench_stale_after_s,
                    )
                    if need is None:
                        continue
                    count, why = need
                    reason = "joined" if first else why
                    await request_benchmark(
                        self.queues,
                        worker=self.name,
                        model=model.name,
                        digest=model.digest,
                        domain=self.config.bench_domain,
                        count=count,
                        reason=reason,
                    )
                    self._benched[model.digest] = time.monotonic()
                    log.info("benchmarking %s on %s (%s)", model.name, self.name, reason)
                first = False
            except (RedisError, OSError) as exc:
                log.warning("could not check benchmarks (%s); will retry", exc)
            except RouteledgerError as exc:
                log.warning("could not read the speed table (%s); will retry", exc)
            self._inventory_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._inventory_changed.wait(), self.config.bench_check_s)

    async def _fail(self, run: Running, exc: BackendError) -> None:
        entry = run.entry
        log.warning("task %s attempt %d failed on %s: %s", entry.task.task_id, entry.attempt, self.name, exc)
        await self._record_failure(run, exc.kind, exc.retryable, exc.message)
        if exc.kind not in ("model_missing", "bad_request"):
            # The backend misbehaves: step back from shared work for a while so others take it.
            self._failures += 1
            pause = min(self.config.max_cooldown_s, self.config.cooldown_s * 2 ** (self._failures - 1))
            self._cooldown_until = time.monotonic() + pause
        if exc.retryable:
            moved = await self.queues.requeue(
                entry.queue, entry.entry_id, delivery_limit=self.config.delivery_limit, owner=self.name
            )
            await self._after_requeue(entry.queue, entry.entry_id, moved, f"{exc.kind}: {exc.message[:200]}")
            return
        await self._settle(run, "failed", str(exc))

    async def _cancelled(self, run: Running) -> None:
        log.info("task %s cancelled by its client", run.entry.task.task_id)
        await self._record_failure(run, "cancelled", False, "cancelled by the client")
        await self._settle(run, "cancelled", "cancelled")

    async def _record_failure(self, run: Running, kind: str, retryable: bool, message: str) -> None:
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
            )
        )

    async def _settle(self, run: Running, status: Outcome, error: str) -> None:
        """A final outcome without a completion: record it, close the output, finish the entry."""
        entry = run.entry
        task_id = entry.task.task_id
        await self.queues.record_result(
            Result(task_id=task_id, status=status, worker=self.name, attempt=entry.attempt, error=error)
        )
        await self.queues.end_output(task_id, entry.attempt, error)
        await self.queues.finish(entry.queue, entry.entry_id)

    async def _after_requeue(self, queue: str, entry_id: str, moved: Requeue, reason: str) -> None:
        """Dead-letter a task whose deliveries are spent; log anything odd."""
        if not await self.queues.settle_requeue(queue, entry_id, moved, reason, self.config.delivery_limit):
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
