"""The reaper: reclaims only delivered entries whose owner died, and reports what nobody took.

It also ends, in the ledger, the life of a worker whose lease expired without a WorkerOffline (it
was killed, or lost its machine): the projected fleet would otherwise say "online" forever.

A worker that writes to an inbox does not acknowledge its entries: the ingest finishes an entry as it
moves the event that closes the run. Until then the entry stays pending for a worker that is no
longer running it; the reaper leaves such an entry alone while its owner's stored outcome says the
run closed (`TaskStore.closed`), for up to `ingest_grace_ms`, so that the ingest's lag never makes
a finished task run again. It also revives entries that were delivered and then acknowledged
without being deleted (`TaskStore.revive`): a consumer's XREADGROUP NOACK or XCLAIM LASTID would
otherwise leave a task neither queued nor running, with no event.

Design rule 5: nothing unowned is reaped. An entry enters a consumer's pending list only when a
worker read it; it is reclaimed only when that worker's lease key is gone AND the entry has been
idle for longer than a lease (a live worker refreshes its running entries). An entry that nobody
read is *stalled*: reported once with TaskStalled, and left where it is for a holder to take.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from events.clock import LedgerClock
from events.codec import as_str, decode_rows
from events.event import TaskReclaimed, TaskStalled, WorkerOffline, WorkerOnline, now_ms
from events.keys import DEAD_MAX_ENTRIES, REQUEUED_CONSUMER, WORKERS_GROUP, Keys
from events.ledger import Ledger, PendingEntry, next_id
from events.singleton import DEFAULT_LEASE_MS, SingletonLease
from projections import store
from projections.errors import ProjectionError
from projections.snapshot import FleetRow
from tasks.lease import Leases, decode_lease, live_workers, registered
from tasks.payload import F_ID, Result
from tasks.store import REQUEUED, TaskStore
from workers.waker import Waker, WakerConfig

log = logging.getLogger("routeledger.reaper")

LEASE_EXPIRED = "lease expired"
# The owner a revived entry's TaskReclaimed names: nobody held it (it had left the pending list).
UNACKNOWLEDGED = "(unacknowledged)"
# Projected statuses of a worker that is still taking part: its death must be recorded.
_ALIVE_STATUSES = frozenset({"online", "draining"})
# The events that begin or end a worker's life (an entry's type is its second value).
_LIFE_TYPES: Final = frozenset({b"WorkerOnline", b"WorkerOffline"})
# The most ledger entries past the projection's checkpoint a sweep reads to judge a death: a
# projector that far behind is catching up, and deaths wait for it rather than cost every sweep.
_TAIL_MAX: Final = 20_000


class ReaperConfig(msgspec.Struct, kw_only=True):
    lease_ms: int = DEFAULT_LEASE_MS
    delivery_limit: int = 3
    stall_after_s: float = 600.0
    # How often to sweep; a reclaim happens within lease + interval of a death.
    interval_s: float = 1.0
    dead_max_entries: int = DEAD_MAX_ENTRIES
    # How long an entry whose owner closed its run may wait for the ingest to finish it before it
    # is reclaimed like any other (the owner's word that it closed is trusted only this long).
    ingest_grace_ms: int = 120_000
    # How long a handed-off task (router.handoff) may wait untaken on its worker's pinned stream
    # before it goes to the shared queue although that worker lives: it was handed off because it
    # could start at once there, so a wait this long means that worker is not taking work.
    handoff_wait_ms: int = 5_000
    # How often sleeping machines are looked at against the queues (workers/waker.py); 0: never.
    wake_interval_s: float = 2.0


class Sweep(msgspec.Struct, kw_only=True):
    """What one sweep did."""

    queues: int = 0
    reclaimed: int = 0
    dead_lettered: int = 0
    stalled: int = 0
    skipped_live: int = 0
    offline: int = 0
    # Closed runs of inbox workers left for the ingest to finish.
    awaiting_ingest: int = 0
    # Entries found delivered but neither pending nor deleted, and re-queued.
    revived: int = 0
    # Handed-off tasks moved from a pinned stream to their shared queue.
    handed_back: int = 0
    # Entries of tasks their clients withdrew, whose workers died: finished, not re-queued.
    withdrawn: int = 0


class Reaper:
    """One sweep at a time over every task queue."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, config: ReaperConfig, *, clock: LedgerClock | None = None
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.config = config
        self.ledger = Ledger(redis, keys)
        # Queue entries' waits are stream ids (the ledger's clock): judged on that clock (a test
        # hands in one it moves, rather than waiting for a stall in real time).
        self.clock = clock or LedgerClock(redis)
        self.queues = TaskStore(redis, keys, self.ledger, dead_max_entries=config.dead_max_entries)
        self._seeded = False
        self.leases = Leases(redis, keys)
        # Workers that write to an inbox (their entries are finished by the ingest), as of this sweep.
        self._inboxes: set[str] = set()
        self.waker = Waker(redis, keys, WakerConfig(interval_s=config.wake_interval_s))

    async def run(self, stop: asyncio.Event) -> None:
        """Hold the reaper lease (one active reaper), sweep until `stop`."""
        lease = SingletonLease(self.redis, self.keys, "reaper", ttl_ms=max(3000, self.config.lease_ms))
        await lease.hold()
        log.info(
            "reaper active: lease %d ms, delivery limit %d, stall after %.0fs",
            self.config.lease_ms,
            self.config.delivery_limit,
            self.config.stall_after_s,
        )
        next_wake = 0.0
        loop = asyncio.get_running_loop()
        try:
            while not stop.is_set():
                if lease.lost.is_set():
                    await lease.hold()
                if self.config.wake_interval_s > 0 and loop.time() >= next_wake:
                    next_wake = loop.time() + self.config.wake_interval_s
                    try:
                        await self.waker.tick()
                    except (RedisError, OSError) as exc:
                        log.warning("waker failed, Redis unavailable (%s); retrying", exc)
                try:
                    report = await self.sweep()
                    if (
                        report.reclaimed
                        or report.dead_lettered
                        or report.stalled
                        or report.offline
                        or report.revived
                        or report.handed_back
                    ):
                        log.info("sweep: %s", msgspec.json.encode(report).decode())
                except (RedisError, OSError) as exc:
                    log.warning("sweep failed, Redis unavailable (%s); retrying", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.interval_s)
        finally:
            await lease.release()

    async def _queue_names(self) -> list[str]:
        """Every task queue, from the registry that submissions and workers add to (no SCAN)."""
        if not self._seeded:
            await self._seed_queues()
        names: Any = await self.redis.smembers(self.keys.queues)
        return sorted(as_str(n) for n in names)

    async def _seed_queues(self) -> None:
        """Once per process: register queues made before the registry existed (the only SCAN left,
        off every hot path)."""
        found = [
            as_str(k)
            async for k in self.redis.scan_iter(match=self.keys.queue_pattern, count=500, _type="stream")
        ]
        if found:
            await self.redis.sadd(self.keys.queues, *found)
        self._seeded = True

    async def _live(self) -> set[str]:
        """Workers whose lease is alive (the registry's names, their leases read at once); names
        whose lease is gone leave the registry."""
        names = await registered(self.redis, self.keys)
        live = set(await live_workers(self.redis, self.keys))
        await self.leases.prune([n for n in names if n not in live])
        return live

    async def sweep(self) -> Sweep:
        report = Sweep()
        # The projection first, then the leases: a worker that starts in between has its lease
        # already, and a death is dated before the sweep looked (a new WorkerOnline is later).
        fleet, checkpoint = await self._fleet()
        at = now_ms()
        live = await self._live()
        await self._end_expired(fleet, checkpoint, live, at, report)
        raw: Any = await self.redis.smembers(self.keys.inboxes)
        self._inboxes = {as_str(n) for n in raw}
        for queue in await self._queue_names():
            report.queues += 1
            await self._revive(queue, report)
            await self._reclaim_dead_owners(queue, live, report)
            await self._hand_back(queue, live, report)
            if self.keys.background_worker(queue) is None:
                # A worker's benchmarks wait for its idle time by design: no stall.
                await self._report_stalls(queue, report)
        return report

    async def _fleet(self) -> tuple[dict[str, FleetRow], str]:
        """The projected fleet and the last ledger id folded into it, or nothing when there is no
        projection (yet) or it does not decode."""
        try:
            ns = await store.current(self.redis, self.keys)
            if ns is None:
                return {}, "0-0"
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(self.keys.table(ns, store.FLEET))
            pipe.get(self.keys.checkpoint(ns))
            raw, checkpoint = await pipe.execute()
            return store.decode_fleet(raw), "0-0" if checkpoint is None else as_str(checkpoint)
        except (msgspec.DecodeError, msgspec.ValidationError, ProjectionError) as exc:
            log.warning("cannot read the projected fleet (%s); worker deaths wait", exc)
            return {}, "0-0"

    async def _unfolded_lives(self, checkpoint: str) -> set[str] | None:
        """Workers with a WorkerOnline or WorkerOffline in the ledger past `checkpoint` (what the
        projection has not folded yet), or None when that tail is too long to read every sweep.

        The projection's "online" is only as fresh as its checkpoint: a worker that said goodbye
        while the projector was stopping (Ctrl-C stops them all at once) is still online there
        after a restart, though its lease is gone because it left, not because it died."""
        workers: set[str] = set()
        read = 0
        async for batch in self.ledger.read_raw(next_id(checkpoint), "+", count=_TAIL_MAX + 1):
            read += len(batch)
            if read > _TAIL_MAX:
                return None
            lives = [(i, flat) for i, flat in batch if len(flat) > 1 and flat[1] in _LIFE_TYPES]
            for _, event in decode_rows(lives, lambda exc: None):
                if isinstance(event, WorkerOnline | WorkerOffline):
                    workers.add(event.worker)
        return workers

    async def _end_expired(
        self, fleet: dict[str, FleetRow], checkpoint: str, live: set[str], at: int, report: Sweep
    ) -> None:
        """WorkerOffline(reason="lease expired") for each worker the projection says is online whose
        lease is gone, once per death: `rl:expired` remembers which life (its `status_since`) was
        ended, across sweeps and restarts, until the projection has folded the event; and a worker
        whose life changed in the ledger past the projection's checkpoint is left until the
        projector has folded that change (its goodbye, most often)."""
        raw: Any = await self.redis.hgetall(self.keys.expired)
        ended = {as_str(k): as_str(v) for k, v in raw.items()}
        settled = [w for w in ended if w not in fleet or fleet[w].status not in _ALIVE_STATUSES]
        if settled:
            await self.redis.hdel(self.keys.expired, *settled)
        gone = [
            name
            for name, row in sorted(fleet.items())
            if row.status in _ALIVE_STATUSES and name not in live and ended.get(name) != str(row.status_since)
        ]
        if not gone:
            return
        unfolded = await self._unfolded_lives(checkpoint)
        if unfolded is None:
            log.debug("the projection is over %d entries behind the ledger; worker deaths wait", _TAIL_MAX)
            return
        for name in gone:
            if name in unfolded:
                continue  # it said goodbye (or came back) after the projection's checkpoint
            life = str(fleet[name].status_since)
            await self.ledger.append(WorkerOffline(at=at, worker=name, reason=LEASE_EXPIRED))
            await self.redis.hset(self.keys.expired, name, life)
            report.offline += 1
            log.info("worker %s: lease expired with no goodbye; recorded it offline", name)

    async def _hand_back(self, queue: str, live: set[str], report: Sweep) -> None:
        """Move handed-off tasks nobody took from a pinned stream to their shared queue: all of
        them when its worker's lease is gone, those waiting past `handoff_wait_ms` otherwise.
        Benchmarks stay: they are meant for that worker alone (TaskStore.hand_back)."""
        worker = self.keys.pinned_worker(queue)
        if worker is None:
            return
        # Given back by its worker (a retryable failure, a shutdown, its death): the shared queue
        # gives another worker the next attempt, where the pinned stream would give it to the same.
        for pending in await self.ledger.pending(queue, consumer=REQUEUED_CONSUMER, count=100):
            raw: Any = await self.redis.xrange(queue, pending.entry_id, pending.entry_id)
            if not raw:
                continue
            ident = as_str(raw[0][1].get(F_ID, b""))
            if ident and await self.queues.hand_back(queue, pending.entry_id, ident, requeued=True):
                report.handed_back += 1
                log.info(
                    "task %s: handed off to %s, which gave it back; moved to the shared queue", ident, worker
                )
        cutoff = await self.clock.now_ms() - self.config.handoff_wait_ms
        for entry_id, task_id in await self.queues.untaken(queue):
            if worker in live and int(entry_id.split("-")[0]) > cutoff:
                break  # oldest first: the rest waited less
            moved = await self.queues.hand_back(queue, entry_id, task_id)
            if moved is not None:
                report.handed_back += 1
                log.info(
                    "task %s: handed off to %s, which did not take it (%s); moved to the shared queue",
                    task_id,
                    worker,
                    "its lease is gone" if worker not in live else "waited too long",
                )

    async def _reclaim_dead_owners(self, queue: str, live: set[str], report: Sweep) -> None:
        try:
            summary: Any = await self.redis.xpending(queue, WORKERS_GROUP)
        except RedisError as exc:
            if "NOGROUP" in str(exc):
                return
            raise
        for consumer in summary.get("consumers") or []:
            owner = as_str(consumer["name"])
            if owner == REQUEUED_CONSUMER:
                continue  # re-queued entries waiting to be taken again: nobody runs them
            if owner in live:
                report.skipped_live += int(consumer["pending"])
                await self._reclaim_abandoned(queue, owner, report)
                continue
            start = "-"
            while True:
                batch = await self.ledger.pending(
                    queue, consumer=owner, min_idle_ms=self.config.lease_ms, start=start, count=100
                )
                for pending in batch:
                    await self._reclaim(queue, owner, pending, report)
                if len(batch) < 100:
                    break
                start = next_id(batch[-1].entry_id)

    async def _revive(self, queue: str, report: Sweep) -> None:
        """Re-queue entries that left the pending list without being deleted (see TaskStore.revive)."""
        for entry_id, task_id, attempt in await self.queues.revive(queue):
            report.revived += 1
            log.warning(
                "task %s on %s was delivered and acknowledged but never finished; re-queued it (attempt %d)",
                task_id,
                queue,
                attempt,
            )
            await self.ledger.append(
                TaskReclaimed(
                    task_id=task_id,
                    queue=queue,
                    old_entry=entry_id,
                    new_entry=entry_id,
                    owner=UNACKNOWLEDGED,
                    attempt=attempt,
                    reason="delivered and acknowledged but never finished",
                )
            )

    async def _reclaim_abandoned(self, queue: str, owner: str, report: Sweep) -> None:
        """Reclaim what a live worker holds but no longer runs.

        A live worker refreshes every entry it runs each heartbeat, so an entry of its idle for two
        leases is one it let go of without acknowledging: its run failed while Redis was down, or a
        kill -9 of Redis lost the acknowledgement from the AOF. Left alone it would wait for the
        worker's next restart. An entry the worker's lease still lists as running is left alone.
        The lease is the longer of the worker's own (which its heartbeats are shorter than) and this
        reaper's: a reaper set shorter than its workers would otherwise take a run that has not yet
        reached the worker's lease record (it is listed from the next heartbeat) from a live worker.
        """
        idle = 2 * self.config.lease_ms
        batch = await self.ledger.pending(queue, consumer=owner, min_idle_ms=idle, count=100)
        if not batch:
            return
        raw: bytes | None = await self.redis.get(self.keys.live(owner))  # type: ignore[assignment]
        running: set[str] = set()
        if raw is not None:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                info = decode_lease(raw)
                running = {r.task_id for r in info.running}
                if info.lease_ms is not None:  # None: a worker from before records carried it
                    idle = 2 * max(self.config.lease_ms, info.lease_ms)
        for pending in batch:
            if pending.idle_ms < idle:
                continue
            fields = await self.queues.entry(queue, pending.entry_id)
            if fields is not None and as_str(fields.get(F_ID, b"")) in running:
                continue
            report.skipped_live -= 1
            await self._reclaim(
                queue,
                owner,
                pending,
                report,
                min_idle_ms=idle,
                why=f"its worker {owner} let it go without an ack (idle {pending.idle_ms} ms)",
            )

    async def _reclaim(
        self,
        queue: str,
        owner: str,
        pending: PendingEntry,
        report: Sweep,
        *,
        min_idle_ms: int | None = None,
        why: str | None = None,
    ) -> None:
        entry_id, idle_ms = pending.entry_id, pending.idle_ms
        if (
            owner in self._inboxes
            and idle_ms < self.config.ingest_grace_ms
            and await self.queues.closed(queue, entry_id, owner, pending.deliveries)
        ):
            # Its owner closed the run; the ingest finishes the entry as it moves the closing event.
            report.awaiting_ingest += 1
            return
        fields = await self.queues.entry(queue, entry_id)
        task_id = as_str(fields.get(F_ID, b"")) if fields is not None else ""
        if task_id and await self.queues.cancel_asked(task_id):
            # Its client withdrew it: re-queued, it would run again for nobody.
            await self._finish_withdrawn(queue, owner, pending, task_id, report)
            return
        reason = why or f"its worker {owner} died (lease expired, idle {idle_ms} ms)"
        moved = await self.queues.requeue(
            queue,
            entry_id,
            delivery_limit=self.config.delivery_limit,
            owner=owner,
            min_idle_ms=min_idle_ms or self.config.lease_ms,
            attempt=pending.deliveries,
        )
        if moved.status == REQUEUED:
            report.reclaimed += 1
            log.info(
                "reclaimed task %s from %s (idle %d ms): attempt %d",
                moved.task_id,
                owner,
                idle_ms,
                moved.attempt,
            )
            await self.ledger.append(
                TaskReclaimed(
                    task_id=moved.task_id,
                    queue=queue,
                    old_entry=entry_id,
                    new_entry=moved.new_entry,
                    owner=owner,
                    attempt=moved.attempt,
                    idle_ms=idle_ms,
                    reason=reason,
                )
            )
            return
        if await self.queues.settle_requeue(queue, entry_id, moved, reason, self.config.delivery_limit):
            report.dead_lettered += 1

    async def _finish_withdrawn(
        self, queue: str, owner: str, pending: PendingEntry, task_id: str, report: Sweep
    ) -> None:
        """Finish the entry of a task its client withdrew while `owner` ran it, and owner is gone:
        its outcome is `cancelled` (the gateway's TaskCancelled is its event), its output closed
        so that no relay waits, and nothing runs it again."""
        if not await self.queues.finish(queue, pending.entry_id, owner):
            return  # no longer the owner's: whoever holds it now ends it
        report.withdrawn += 1
        log.info(
            "task %s: its client withdrew it and its worker %s is gone; finished, not re-run", task_id, owner
        )
        error = f"cancelled; its worker {owner} stopped before the run ended"
        await self.queues.record_result(
            Result(task_id=task_id, status="cancelled", attempt=pending.deliveries, error=error)
        )
        await self.queues.end_output(task_id, pending.deliveries, "cancelled")

    async def _report_stalls(self, queue: str, report: Sweep) -> None:
        """TaskStalled, once, for each entry nobody has read for `stall_after_s`."""
        groups: Any = await self.redis.xinfo_groups(queue)
        last = next(
            (as_str(g["last-delivered-id"]) for g in groups if as_str(g["name"]) == WORKERS_GROUP), None
        )
        if last is None:
            return
        await self._forget_taken(queue, last)
        now = await self.clock.now_ms()
        cutoff = now - int(self.config.stall_after_s * 1000)
        rows: Any = await self.redis.xrange(queue, next_id(last), f"{cutoff}-0", count=200)
        for raw_id, fields in rows:
            entry_id = as_str(raw_id)
            member = f"{queue} {entry_id}"
            if not await self.redis.sadd(self.keys.stalled, member):
                continue
            report.stalled += 1
            waited = now - int(entry_id.split("-")[0])
            task_id = as_str(fields.get(F_ID, b""))
            log.warning("task %s on %s has waited %.0fs and nobody took it", task_id, queue, waited / 1000)
            await self.ledger.append(
                TaskStalled(task_id=task_id, queue=queue, entry_id=entry_id, waited_ms=waited)
            )

    async def _forget_taken(self, queue: str, last_delivered: str) -> None:
        """Drop stall markers of entries a worker has since read (the set stays small)."""
        done: list[str] = []
        async for raw in self.redis.sscan_iter(self.keys.stalled, match=f"{queue} *", count=200):
            member = as_str(raw)
            if _id_key(member.split(" ", 1)[1]) <= _id_key(last_delivered):
                done.append(member)
        if done:
            await self.redis.srem(self.keys.stalled, *done)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
