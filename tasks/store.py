"""The task queues: the scripts that finish, re-queue, reclaim and cancel entries, and the outcome.

A queue entry is never moved by reading it back and writing it elsewhere in two steps: every change
that must not be seen half-done is one Lua script on the queue's own key (one hash slot). The ledger
event that records the change is appended after the script; the projector tolerates it arriving
late or twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from events.codec import as_str, encode_batch, encode_flat
from events.connection import is_oom, send_all
from events.event import Event, TaskDeadLettered, now_ms
from events.keys import DEAD_MAX_ENTRIES, REQUEUED_CONSUMER, WORKERS_GROUP, Keys, band_order
from events.ledger import Ledger
from events.scripts import EVENTS_LUA, ScriptDef, read_lua
from tasks.outputs import Outputs, RegisteredWorkers, run_writers
from tasks.payload import (
    F_ATTEMPT,
    F_ID,
    F_TASK,
    Chunk,
    Result,
    TaskMessage,
    decode_task,
    encode_chunk,
    encode_result,
    queue_fields,
    result_decoder,
)

# The Lua this module runs (tasks/lua/*.lua), each file headed by the KEYS and ARGV it takes.
_LUA: Final = Path(__file__).parent / "lua"

_FINISH: Final = read_lua(_LUA / "finish.lua")
_REQUEUE: Final = read_lua(_LUA / "requeue.lua")
_KEEP: Final = read_lua(_LUA / "keep.lua")
_TAKE: Final = read_lua(_LUA / "take.lua")

_SUBMIT: Final = read_lua(EVENTS_LUA / "lib_append_blob.lua", _LUA / "lib_depth.lua", _LUA / "submit.lua")

_RESULT_ONCE: Final = read_lua(_LUA / "lib_store.lua", _LUA / "result_once.lua")
_CLOSE_RUN: Final = read_lua(_LUA / "lib_store.lua", _LUA / "close_run.lua")
_TAKE_OVER: Final = read_lua(_LUA / "take_over.lua")
_CANCEL_QUEUED: Final = read_lua(_LUA / "cancel_queued.lua")
_REVIVE: Final = read_lua(_LUA / "revive.lua")

# The scripts above as functions of the routeledger library (events/scripts.py), which a worker
# calls with FCALL; allow_oom for those that free or keep entries (they ran at the memory limit).
_FINISH_DEF: Final = ScriptDef("finish", _FINISH, allow_oom=True)
_REQUEUE_DEF: Final = ScriptDef("requeue", _REQUEUE, allow_oom=True)
_RESULT_ONCE_DEF: Final = ScriptDef("result_once", _RESULT_ONCE)
_CANCEL_QUEUED_DEF: Final = ScriptDef("cancel_queued", _CANCEL_QUEUED, allow_oom=True)
_TAKE_OVER_DEF: Final = ScriptDef("take_over", _TAKE_OVER)
_CLOSE_RUN_DEF: Final = ScriptDef("close_run", _CLOSE_RUN)
_TAKE_DEF: Final = ScriptDef("take", _TAKE, allow_oom=True)

_UNTAKEN: Final = read_lua(_LUA / "lib_handoff.lua", _LUA / "untaken.lua")

_UNTAKEN_DEF: Final = ScriptDef("untaken", _UNTAKEN)
_TAKE_GIVEN: Final = read_lua(_LUA / "lib_handoff.lua", _LUA / "take_given.lua")

_TAKE_GIVEN_DEF: Final = ScriptDef("take_given", _TAKE_GIVEN, allow_oom=True)
_HAND_BACK: Final = read_lua(_LUA / "lib_handoff.lua", _LUA / "hand_back.lua")

_HAND_BACK_DEF: Final = ScriptDef("hand_back", _HAND_BACK)
_HAND_BACK_REQUEUED: Final = read_lua(_LUA / "lib_handoff.lua", _LUA / "hand_back_requeued.lua")

_HAND_BACK_REQUEUED_DEF: Final = ScriptDef("hand_back_requeued", _HAND_BACK_REQUEUED)
_KEEP_DEF: Final = ScriptDef("keep", _KEEP, allow_oom=True)
_SUBMIT_DEF: Final = ScriptDef("submit", _SUBMIT)
_DEPTH: Final = read_lua(_LUA / "lib_depth.lua", _LUA / "depth.lua")
_DEPTH_DEF: Final = ScriptDef("depth", _DEPTH)
_REVIVE_DEF: Final = ScriptDef("revive", _REVIVE, allow_oom=True)

CANCEL_REMOVED: Final = 2
CANCEL_RUNNING: Final = 1
CANCEL_ABSENT: Final = 0

REQUEUED: Final = 1
NOT_OURS: Final = 0
VANISHED: Final = -1
OVER_LIMIT: Final = 2

# How long finished results and output chunks are kept.
RESULT_TTL_MS: Final = 24 * 3600 * 1000
OUTPUT_TTL_MS: Final = 3600 * 1000


class AtCapError(Exception):
    """A submission refused: the model's queues hold `held` entries, at the cap it was given."""

    def __init__(self, held: int) -> None:
        super().__init__(f"the model's queues hold {held} entries")
        self.held = held


class Requeue(msgspec.Struct, frozen=True):
    """What a re-queue or reclaim did."""

    status: int
    new_entry: str
    attempt: int
    task_id: str


class QueueEntry(msgspec.Struct, frozen=True):
    """A task as read from a queue, with where it came from."""

    queue: str
    entry_id: str
    attempt: int
    task: TaskMessage


class Completion(msgspec.Struct, frozen=True):
    """How a run's close went (TaskStore.complete)."""

    # Its completion is the task's one that counts (it stored the first outcome, or took over one
    # whose writer died before logging it).
    counts: bool
    # What acknowledging its entry did (TaskStore.finish: 0 when someone had reclaimed it); None
    # when the ingest finishes it.
    acked: int | None


class Taken(msgspec.Struct, frozen=True):
    """What one take did: the entry taken (its id, attempt and fields), or nothing and the queue's
    cursor (the id of its last entry: an XREAD from it wakes on the next new one)."""

    entry_id: str = ""
    attempt: int = 0
    fields: dict[bytes, bytes] = msgspec.field(default_factory=dict)
    cursor: str = "0-0"
    # The entry taken had been deleted meanwhile: nothing was taken, look again at once.
    vanished: bool = False


def parse_entry(
    queue: str, entry_id: str, fields: dict[bytes, bytes], attempt: int | None = None
) -> QueueEntry:
    """A queue entry's fields as a QueueEntry (`attempt` when the take said, else the entry's own);
    raises msgspec errors on a malformed one."""
    raw = fields.get(F_TASK)
    if raw is None:
        raise msgspec.ValidationError(f"queue entry {entry_id} has no task field")
    return QueueEntry(queue, entry_id, attempt or int(fields.get(F_ATTEMPT, b"1")), decode_task(raw))


T = TypeVar("T")

# Sent again after a connection failure: only calls that are safe to repeat go through resend.
_RESEND_TRIES: Final = 3
# What a sending that may be repeated fails with.
_RESENT: Final = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)
# The pause before the second sending (each later one waits twice as long, at most 0.5 s).
_FIRST_PAUSE_S: Final = 0.05


async def resend(op: Callable[[], Awaitable[T]]) -> T:
    """`op`, sent again (up to _RESEND_TRIES in all, after short pauses) when the connection fails or
    times out. The client itself never repeats a command (routeledger.runtime turns its retries
    off), so a repeat happens only here, for operations whose repetition is harmless.

    The first sending is a plain call: tenacity's retrying loop cost more CPU than the command it
    wrapped (a task's acknowledgement), so it is built only once a sending has failed."""
    try:
        return await op()
    except _RESENT:
        pass
    await asyncio.sleep(_FIRST_PAUSE_S)
    async for attempt in AsyncRetrying(
        stop=stop_after_attempt(_RESEND_TRIES - 1),
        wait=wait_exponential(multiplier=2 * _FIRST_PAUSE_S, max=0.5),
        retry=retry_if_exception_type(_RESENT),
        reraise=True,
    ):
        with attempt:
            return await op()
    raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover


# Longest reason a dead letter keeps (a backend's message can be long).
_REASON_MAX: Final = 500


def _kind_of(fields: dict[bytes, bytes]) -> bytes:
    """The task's kind (`chat`, `generate`, `benchmark`), or `unreadable` for an entry that is not a task."""
    raw = fields.get(F_TASK)
    if raw is None:
        return b"unreadable"
    try:
        task = decode_task(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return b"unreadable"
    return b"benchmark" if task.bench_id else task.kind.encode()


async def requeued_count(redis: aioredis.Redis, queue: str) -> int:
    """How many of a queue's pending entries wait re-queued (held by REQUEUED_CONSUMER, run by
    nobody): queued, not running, for whoever counts."""
    try:
        summary: Any = await redis.xpending(queue, WORKERS_GROUP)
    except ResponseError:
        return 0
    for consumer in summary.get("consumers") or []:
        if as_str(consumer["name"]) == REQUEUED_CONSUMER:
            return int(consumer["pending"])
    return 0


async def band_queues(redis: aioredis.Redis, keys: Keys, digest: str) -> list[str]:
    """A model's queues, in the order they are served: its band queues that were ever used, with its
    plain queue (band 0, round 0) in its place whether it was used or not."""
    raw: Any = await redis.zrange(keys.bands(digest), 0, -1, withscores=True)
    return band_list(keys.queue(digest), [(as_str(q), int(score)) for q, score in raw])


def band_list(plain: str, scored: Sequence[tuple[str, int]]) -> list[str]:
    """A model's band queues in serving order, its plain queue placed by band_order(0, 0)."""
    rows = dict(scored)
    rows.setdefault(plain, band_order(0, 0))
    return sorted(rows, key=lambda q: (rows[q], q))


class TaskStore:
    """Operations on the task queues, shared by the submitter, the workers and the reaper."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        ledger: Ledger | None = None,
        *,
        dead_max_entries: int = DEAD_MAX_ENTRIES,
        writer: str | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        # A worker that writes under its own ACL: its runs' output and results go to its own keys
        # (Keys.run_out, Keys.run_result); None: the task's shared keys (trusted processes).
        self.writer = writer
        self.ledger = ledger or Ledger(redis, keys)
        self.dead_max_entries = dead_max_entries
        self._finish = _FINISH_DEF.bind(redis)
        self._requeue = _REQUEUE_DEF.bind(redis)
        self._result_once = _RESULT_ONCE_DEF.bind(redis)
        self._cancel_queued = _CANCEL_QUEUED_DEF.bind(redis)
        self._take_over = _TAKE_OVER_DEF.bind(redis)
        self._close_run = _CLOSE_RUN_DEF.bind(redis)
        self._take = _TAKE_DEF.bind(redis)
        self._keep = _KEEP_DEF.bind(redis)
        self._submit = _SUBMIT_DEF.bind(redis)
        self._depth = _DEPTH_DEF.bind(redis)
        self._revive = _REVIVE_DEF.bind(redis)
        self._untaken = _UNTAKEN_DEF.bind(redis)
        self._take_given = _TAKE_GIVEN_DEF.bind(redis)
        self._hand_back = _HAND_BACK_DEF.bind(redis)
        self._hand_back_requeued = _HAND_BACK_REQUEUED_DEF.bind(redis)
        self._groups: set[str] = set()

    def out_key(self, task_id: str) -> str:
        """Where this process writes a task's output chunks (see `writer`)."""
        return self.keys.run_out(self.writer, task_id) if self.writer else self.keys.out(task_id)

    def result_key(self, task_id: str) -> str:
        """Where this process writes a task's outcome (see `writer`)."""
        return self.keys.run_result(self.writer, task_id) if self.writer else self.keys.result(task_id)

    async def ensure_group(self, queue: str) -> None:
        """Create the `workers` group on `queue` once per process, and register the queue."""
        if queue not in self._groups:
            await self.ledger.ensure_group(queue, WORKERS_GROUP, "0")
            await self.redis.sadd(self.keys.queues, queue)
            self._groups.add(queue)

    async def enqueue(self, queue: str, task: TaskMessage, attempt: int = 1) -> str:
        await self.ensure_group(queue)
        raw: Any = await self.redis.xadd(queue, queue_fields(task, attempt))  # type: ignore[arg-type]
        return str(raw.decode())

    async def submit(
        self,
        queue: str,
        task: TaskMessage,
        events: Sequence[Event],
        info: Mapping[str, str | bytes],
        *,
        bands: str = "",
        order: int | None = None,
        cap: int | None = None,
    ) -> tuple[bool, str]:
        """Record `events`, the task's lookup hash (`info`, plus its entry id) and its queue entry, at
        once and only once per task id (see _SUBMIT): (queued now, entry id). Sending it again after
        a lost reply is safe: the second finds the task and queues nothing. A band queue names its
        model's zset of bands (`bands`) and its place there (`order`). With `cap`, a new task is
        refused (AtCapError, with the depth) when the queues of the task's model hold that many
        entries (see depth)."""
        flat: list[Any] = []
        for field, value in info.items():
            flat += [field, value]
        entry: list[Any] = []
        for raw, value in queue_fields(task).items():
            entry += [raw, value]
        reply: Any = await self._submit(
            keys=[
                self.keys.events,
                self.keys.task(task.task_id),
                queue,
                self.keys.queues,
                bands or queue,
                self.keys.queue(task.digest),
                self.keys.bands(task.digest),
            ],
            args=[
                encode_batch(events),
                str(RESULT_TTL_MS),
                WORKERS_GROUP,
                str(len(flat)),
                "" if order is None or not bands else str(order),
                "" if cap is None else str(cap),
                *flat,
                *entry,
            ],
        )
        created, entry_id = reply
        if int(created) < 0:
            raise AtCapError(int(entry_id))
        return int(created) == 1, as_str(entry_id)

    async def depth(self, digest: str) -> int:
        """How many entries the model's queue holds, every band together (see _DEPTH)."""
        return int(await self._depth(keys=[self.keys.queue(digest), self.keys.bands(digest)]))

    async def band_queues(self, digest: str) -> list[str]:
        """The model's queues, in the order they are served (see band_queues)."""
        return await band_queues(self.redis, self.keys, digest)

    async def keep(self, queue: str, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        """Reset the idle time of the entries `consumer` still holds (see _KEEP); the ids it holds."""
        if not entry_ids:
            return []
        reply: Any = await self._keep(keys=[queue], args=[WORKERS_GROUP, consumer, *entry_ids])
        return [as_str(i) for i in reply]

    async def take(self, queue: str, consumer: str, expected: str = "", slack: int = 0) -> Taken:
        """Take one entry of `queue` for `consumer`: the oldest re-queued one, else the head nobody
        has read, and only if it is `expected` (when given) or, with `slack` k - 1 for a caller the
        plan gave task #k, if at most that many were taken by others since; see _TAKE."""
        reply: Any = await self._take(
            keys=[queue], args=[WORKERS_GROUP, consumer, expected, REQUEUED_CONSUMER, str(slack)]
        )
        entry_id, attempt, flat, cursor = reply
        if int(attempt) < 0:
            return Taken(vanished=True)
        if not entry_id:
            return Taken(cursor=as_str(cursor))
        fields = dict(zip(flat[::2], flat[1::2], strict=False))
        return Taken(entry_id=as_str(entry_id), attempt=int(attempt), fields=fields)

    async def take_given(self, queue: str, pinned: str, consumer: str, entry_id: str, task_id: str) -> Taken:
        """Take entry `entry_id` of `queue` (task `task_id`) for `consumer` though it is not the
        head: it moves to the consumer's pinned stream `pinned` and is delivered there (the Taken's
        entry id is the new one, on `pinned`); nothing when it was taken or removed meanwhile, or
        when `pinned` has work of its own for the consumer. See _TAKE_GIVEN."""
        reply: Any = await self._take_given(
            keys=[queue, pinned, self.keys.task(task_id), self.keys.queues],
            args=[WORKERS_GROUP, consumer, entry_id, task_id, REQUEUED_CONSUMER],
        )
        taken_id, attempt, flat, cursor = reply
        if not taken_id:
            return Taken(cursor=as_str(cursor))
        fields = dict(zip(flat[::2], flat[1::2], strict=False))
        return Taken(entry_id=as_str(taken_id), attempt=int(attempt), fields=fields)

    async def untaken(self, queue: str, count: int = 200) -> list[tuple[str, str]]:
        """(entry id, task id) of the entries of `queue` nobody has taken yet, oldest first."""
        reply: Any = await self._untaken(keys=[queue], args=[WORKERS_GROUP, str(count)])
        return [(as_str(reply[i]), as_str(reply[i + 1])) for i in range(0, len(reply), 2)]

    async def hand_back(
        self, pinned: str, entry_id: str, task_id: str, *, requeued: bool = False
    ) -> str | None:
        """Move a handed-off task from the pinned stream `pinned` to the shared queue its lookup
        hash names (`fallback`): one nobody took, or (`requeued`) one its worker gave back, as its
        next attempt. Its new entry id; None when it is not a hand-off (a benchmark), was taken
        meanwhile, or is gone."""
        raw: Any = await self.redis.hget(self.keys.task(task_id), "fallback")
        if not raw:
            return None
        keys = [pinned, self.keys.task(task_id), as_str(raw), self.keys.queues]
        if requeued:
            moved: Any = await self._hand_back_requeued(
                keys=keys, args=[WORKERS_GROUP, entry_id, REQUEUED_CONSUMER]
            )
        else:
            moved = await self._hand_back(keys=keys, args=[WORKERS_GROUP, entry_id])
        return as_str(moved) or None

    async def finish(self, queue: str, entry_id: str, owner: str = "") -> int:
        """Acknowledge and delete an entry `owner` holds ('' = whoever does); 0 means it was no longer
        pending for it (someone reclaimed it). Sent again when the connection fails: a second sending
        that finds the entry gone reports 1, since it was this caller's first that acknowledged it."""
        first = True

        async def once() -> int:
            nonlocal first
            sent_before, first = not first, False
            acked = int(await self._finish(keys=[queue], args=[WORKERS_GROUP, entry_id, owner]))
            return 1 if sent_before and acked == 0 else acked

        return await resend(once)

    async def requeue(
        self,
        queue: str,
        entry_id: str,
        *,
        delivery_limit: int,
        owner: str | None = None,
        min_idle_ms: int | None = None,
        bump: bool = True,
        attempt: int | None = None,
    ) -> Requeue:
        """Put a pending entry back in its place, with the next attempt unless `bump` is False (see
        _REQUEUE). `attempt`, the attempt the caller ran, makes a re-send after a lost reply answer
        as the first did; it is sent again once when the connection fails."""
        args = [
            WORKERS_GROUP,
            entry_id,
            owner or "",
            "" if min_idle_ms is None else str(min_idle_ms),
            str(delivery_limit),
            "1" if bump else "0",
            "" if attempt is None else str(attempt),
            REQUEUED_CONSUMER,
        ]

        async def call() -> Any:
            return await self._requeue(keys=[queue], args=args)

        reply: Any = await (resend(call) if attempt is not None else call())
        status, new, next_attempt, task_id = reply
        return Requeue(int(status), as_str(new), int(next_attempt), as_str(task_id))

    async def cancels_asked(self, task_ids: Sequence[str]) -> list[bool]:
        """Whether a client asked each task to stop (its cancel key, Gateway.cancel), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.exists(self.keys.cancel(task_id))
        return [bool(n) for n in await pipe.execute()]

    async def cancel_asked(self, task_id: str) -> bool:
        """Whether a client asked the task to stop: a run of it that ends, however it ends, finishes
        its entry then; re-queued, it would run again for nobody."""
        return bool(await self.redis.exists(self.keys.cancel(task_id)))

    async def cancel_queued(self, queue: str, entry_id: str) -> tuple[int, str, int]:
        """Delete the task's entry `entry_id` unless a worker holds it: (status, entry id, attempt);
        see _CANCEL_QUEUED."""
        reply: Any = await self._cancel_queued(
            keys=[queue], args=[WORKERS_GROUP, entry_id, REQUEUED_CONSUMER]
        )
        status, found, attempt = reply
        return int(status), as_str(found), int(attempt)

    async def revive(self, queue: str, page: int = 500) -> list[tuple[str, str, int]]:
        """Put back, re-queued in place, every entry of `queue` that was delivered and acknowledged
        without being deleted (see _REVIVE): (entry id, task id, next attempt) of each."""
        out: list[tuple[str, str, int]] = []
        start = "-"
        while start:
            reply: Any = await self._revive(
                keys=[queue], args=[WORKERS_GROUP, REQUEUED_CONSUMER, start, str(page)]
            )
            revived, nxt = reply
            out += [(as_str(e), as_str(t), int(a)) for e, t, a in revived]
            start = as_str(nxt)
        return out

    async def closed(self, queue: str, entry_id: str, owner: str, attempt: int) -> bool:
        """True when `owner`, a worker that writes to an inbox, closed its run `attempt` of the
        entry: its stored outcome (Keys.run_result) is that run's and, for a completion, its
        closing events were appended (the `logged` mark). Such a worker leaves the entry pending
        until the ingest moves the closing event into the ledger and finishes the entry."""
        fields = await self.entry(queue, entry_id)
        task_id = as_str(fields.get(F_ID, b"")) if fields is not None else ""
        if not task_id:
            return False
        raw: list[Any] = await self.redis.hmget(
            self.keys.run_result(owner, task_id), ["status", "worker", "attempt", "logged"]
        )
        status, worker, ran, logged = raw
        if status is None or worker is None or as_str(worker) != owner or ran is None:
            return False
        if as_str(ran) != str(attempt):
            return False
        return as_str(status) != "completed" or logged is not None

    async def entry(self, queue: str, entry_id: str) -> dict[bytes, bytes] | None:
        """The fields of one entry, or None if it is gone."""
        rows: Any = await self.redis.xrange(queue, entry_id, entry_id)
        return dict(rows[0][1]) if rows else None

    async def dead_letter(self, queue: str, entry_id: str, fields: dict[bytes, bytes], reason: str) -> str:
        """Record an entry in `rl:dead` with the reason (the caller finishes the original after).

        The record names the task (id, attempt, kind, queue, entry) but holds no prompt: the stream
        is capped at `dead_max_entries` (older records are trimmed) and never expires, so a payload
        kept there would outlive every retention the task's own keys have.
        """
        record = {
            b"source": b"queue",
            b"queue": queue.encode(),
            b"entry": entry_id.encode(),
            b"reason": reason[:_REASON_MAX].encode(),
            b"at": str(now_ms()).encode(),
            b"type": _kind_of(fields),
            **{k: v for k, v in fields.items() if k in (F_ATTEMPT, F_ID)},
        }
        raw: Any = await self.redis.xadd(
            self.keys.dead,
            record,  # type: ignore[arg-type]
            maxlen=self.dead_max_entries,
            approximate=True,
        )
        return str(raw.decode())

    async def end_output(self, task_id: str, attempt: int, error: str | None = None, run: str = "") -> None:
        """Close a task's output stream (with the error, if it failed) so relays stop waiting."""
        out_key = self.out_key(task_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(out_key, {b"c": encode_chunk(Chunk(attempt=attempt, done=True, error=error, run=run))})
        pipe.pexpire(out_key, OUTPUT_TTL_MS)
        await pipe.execute()

    async def break_output(self, task_id: str, attempt: int, run: str, error: str) -> None:
        """Say in a task's output stream that run `run` broke off (its task goes back to the queue):
        a relay that has passed on some of its text cannot pass on another run's, so it tells its
        client to retry and withdraws the task, rather than let the re-run go on for nobody."""
        out_key = self.out_key(task_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(out_key, {b"c": encode_chunk(Chunk(attempt=attempt, error=error, run=run))})
        pipe.pexpire(out_key, OUTPUT_TTL_MS)
        await pipe.execute()

    async def settle_requeue(
        self,
        queue: str,
        entry_id: str,
        moved: Requeue,
        reason: str,
        delivery_limit: int,
        *,
        finish: bool = True,
    ) -> bool:
        """After a re-queue: dead-letter a task whose deliveries are spent. True if it was moved or settled.

        The copy in `rl:dead` is written before the queue entry is removed, so that a crash in
        between leaves a duplicate in the dead letters rather than a lost task. Without `finish`
        (a worker that writes to an inbox) the entry is left for the ingest, which finishes it when
        it moves the TaskDeadLettered.
        """
        if moved.status == REQUEUED:
            return True
        if moved.status != OVER_LIMIT:
            return False
        full_reason = f"delivery limit {delivery_limit} reached; last failure: {reason}"
        fields = await self.entry(queue, entry_id)
        if fields is not None:
            await self.dead_letter(queue, entry_id, fields, full_reason)
        await self.record_result(
            Result(task_id=moved.task_id, status="dead", attempt=moved.attempt, error=full_reason)
        )
        await self.end_output(moved.task_id, moved.attempt, f"dead-lettered: {full_reason}")
        await self.ledger.append(
            TaskDeadLettered(task_id=moved.task_id, queue=queue, reason=full_reason, attempts=moved.attempt)
        )
        if finish:
            await self.finish(queue, entry_id)
        return True

    async def record_result(self, result: Result, ttl_ms: int = RESULT_TTL_MS) -> bool:
        """Store a task's outcome unless one is stored already; True for the first (the one that counts)."""
        won = await self._result_once(
            keys=[self.result_key(result.task_id)],
            args=[
                encode_result(result),
                result.status,
                result.worker or "",
                str(result.attempt),
                str(ttl_ms),
            ],
        )
        return bool(won)

    async def close_run(
        self, result: Result, text: str = "", ttl_ms: int = RESULT_TTL_MS, *, only_over_dead: bool = False
    ) -> bool:
        """Write the run's last `text` piece and store the outcome unless one is stored already (a
        completion replaces a dead letter), in one round trip; True for the outcome that counts. With
        `only_over_dead` the outcome is stored only over a dead letter. The output stream stays
        open: log_run closes it."""
        won = await self._close_run(
            keys=[self.result_key(result.task_id), self.out_key(result.task_id)],
            args=[
                encode_result(result),
                result.status,
                result.worker or "",
                str(result.attempt),
                str(ttl_ms),
                encode_chunk(Chunk(attempt=result.attempt, text=text, run=result.run)) if text else b"",
                str(OUTPUT_TTL_MS),
                "1" if only_over_dead else "",
            ],
        )
        return bool(won)

    async def log_run(
        self,
        task_id: str,
        events: Sequence[Event],
        *,
        counts: bool,
        done: Chunk | None = None,
        carried: Result | None = None,
        wait_for_room: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """Append a run's closing events and, when they hold the counting completion, mark its stored
        result as logged (see _TAKE_OVER); then close the output stream with `done` (carrying
        `carried`, the stored result, so that a waiting client needs no second read). One round trip,
        in that order. The caller acknowledges the entry after this returns, never with it: Redis at
        its memory limit refuses the appends but not an XACK, and an entry acknowledged without its
        TaskCompleted would be a completion nobody records.

        When Redis refuses a write for lack of memory (OOM) and `wait_for_room` is given, it is
        awaited (with the round's number) and what did not land is sent again, events first and the
        `logged` mark only once every event is in, so that nothing is appended twice and a result
        is never marked logged ahead of its TaskCompleted. Without it, or on any other error, raises.
        """
        left = list(events)
        mark, close = counts, done is not None
        rounds = 0
        while True:
            commands: list[tuple[Any, ...]] = [
                ("XADD", self.ledger.appends_to, "*", *encode_flat(event)) for event in left
            ]
            # After a refusal the mark waits for a round in which no event is outstanding.
            with_rest = rounds == 0 or not left
            if mark and with_rest:
                commands.append(("HSET", self.result_key(task_id), "logged", "1"))
            if close and with_rest:
                out_key = self.out_key(task_id)
                chunk = (b"c", encode_chunk(done))  # type: ignore[arg-type]
                carry = (b"r", encode_result(carried)) if carried is not None else ()
                commands.append(("XADD", out_key, "*", *chunk, *carry))
                commands.append(("PEXPIRE", out_key, OUTPUT_TTL_MS))
            replies = await send_all(self.redis, commands)
            failed = [r for r in replies if isinstance(r, Exception)]
            if not failed:
                return
            other = next((r for r in failed if not is_oom(r)), None)
            if other is not None or wait_for_room is None:
                raise other or failed[0]
            landed = [not isinstance(r, Exception) for r in replies]
            unsent = [event for event, ok in zip(left, landed, strict=False) if not ok]
            rest = landed[len(left) :]
            if with_rest and mark:
                marked, rest = rest[0], rest[1:]
                if marked and unsent:
                    # The mark landed though an event did not (memory was freed in between): take it
                    # back, so that a crash now leaves the result for a later run to take over.
                    await self.redis.hdel(self.result_key(task_id), "logged")
                mark = not (marked and not unsent)
            if with_rest and close:
                close = not rest[0]
            left = unsent
            rounds += 1
            await wait_for_room(rounds)

    async def take_over_log(self, task_id: str, attempt: int) -> bool:
        """True if this run must append the counting TaskCompleted its result's writer never did."""
        return bool(await self._take_over(keys=[self.result_key(task_id)], args=[str(attempt)]))

    async def complete(
        self,
        result: Result,
        *,
        rest: str,
        done: Chunk,
        closing: Callable[[bool], Sequence[Event]],
        entry: QueueEntry,
        owner: str,
        acknowledge: bool = True,
        lost: bool = False,
        wait_for_room: Callable[[str, int], Awaitable[None]],
        at: Callable[[str], None] = lambda step: None,
    ) -> Completion:
        """Close a completed run: the one protocol a worker follows, whose steps are correct only
        in this order.

        1. The run's last `rest` text and its outcome, in one script (close_run): the first outcome
           stored counts. A run that `lost` its entry (the reaper took it back) stores it only over
           a dead letter.
        2. A stored outcome without its TaskCompleted (its writer died between the two) is taken
           over: this run appends the counting completion (take_over_log).
        3. The closing events (`closing(counts)`, counts: this run's completion is the one that
           counts) and the `done` chunk, carrying the stored outcome (log_run).
        4. The queue `entry`, which `owner` holds, acknowledged (finish); not where the worker does
           not `acknowledge` its own entries: the ingest finishes it as it moves the TaskCompleted
           into the ledger.

        Redis refusing a write for lack of memory is waited out at steps 1 and 3 (`wait_for_room`
        with what was refused and the round's number): the outcome stays with the caller and its
        entry pending, so nothing is lost. `at` is called after step 1 ("result") and after step 3
        ("ack"): where a crash would leave the most to recover (the reliability tests kill a
        worker there).
        """
        rounds = 0
        while True:
            try:
                stored = await self.close_run(result, rest, only_over_dead=lost)
                break
            except ResponseError as exc:
                if not is_oom(exc):
                    raise
            rounds += 1
            await wait_for_room("result", rounds)
        at("result")
        counts = stored
        if not stored and not lost:
            # A stored result without its TaskCompleted: its writer died in between; count ours.
            counts = await self.take_over_log(result.task_id, result.attempt)
        await self.log_run(
            result.task_id,
            closing(counts),
            counts=counts,
            done=done,
            carried=result if stored else None,
            wait_for_room=lambda rounds: wait_for_room("completion", rounds),
        )
        at("ack")
        acked = await self.finish(entry.queue, entry.entry_id, owner) if acknowledge else None
        return Completion(counts=counts, acked=acked)

    async def writers(self, task_id: str) -> list[str]:
        """The workers whose own output and outcome may be served for a task (outputs.run_writers)."""
        return await run_writers(self.redis, self.keys, task_id)

    def relay(self, task_id: str, workers: RegisteredWorkers | None = None) -> Outputs:
        """A reader of a task's output streams, from the first chunk (tasks.outputs.Outputs);
        `workers`: the registered workers' names, shared by the readers of one process."""
        return Outputs(self.redis, self.keys, task_id, workers)

    async def result(self, task_id: str, writers: Sequence[str] | None = None) -> Result | None:
        """A task's outcome: the one in its shared key (written by trusted processes, and by workers
        that run with the server's credentials), unless that is a dead letter or missing; then a
        completion one of its `writers` (default: those of `writers()`) stored in its own key (the
        earliest attempt), else the dead letter, else any such writer's outcome."""
        if writers is None:
            writers = await self.writers(task_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.result(task_id), "result")
        for name in writers:
            pipe.hget(self.keys.run_result(name, task_id), "result")
        raw: list[Any] = await pipe.execute()
        shared = None if raw[0] is None else result_decoder.decode(raw[0])
        if shared is not None and shared.status != "dead":
            return shared
        own = sorted((result_decoder.decode(r) for r in raw[1:] if r is not None), key=lambda r: r.attempt)
        done = [r for r in own if r.status == "completed"]
        if done:
            return done[0]
        return shared or (own[0] if own else None)
