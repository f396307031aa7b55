"""The task queues: the scripts that finish, re-queue, reclaim and cancel entries, and the outcome.

A queue entry is never moved by reading it back and writing it elsewhere in two steps: every change
that must not be seen half-done is one Lua script on the queue's own key (one hash slot). The ledger
event that records the change is appended after the script; the projector tolerates it arriving
late or twice.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from dispatch.memory import is_oom
from dispatch.payload import (
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
)
from events.codec import as_str, encode_fields
from events.event import Event, TaskDeadLettered, now_ms
from events.keys import DEAD_MAX_ENTRIES, WORKERS_GROUP, Keys
from events.ledger import Ledger

# Acknowledge and delete a finished entry (prompts do not outlive their task).
# KEYS[1] queue; ARGV group, entry id. Returns XACK's count: 0 means the entry was not ours any more.
_FINISH: Final = """
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return acked
"""

# Re-add a pending entry with attempt + 1, then acknowledge and delete the old one, all at once, so
# that a crash can neither lose the task nor leave two copies.
# KEYS[1] queue; ARGV group, entry id, owner ('' = any), min idle ms ('' = no check), delivery limit,
# bump ('1': a delivery was spent, raise the attempt; '0': handed back unread, keep it).
# Returns {status, new id or '', new attempt, task id}: status 1 re-queued; 0 not pending for that
# owner (or not idle enough: its owner came back); -1 the entry vanished (acknowledged here);
# 2 past the delivery limit: nothing moved, the caller dead-letters it first and then finishes it.
_REQUEUE: Final = """
local p
if ARGV[4] ~= '' then
  p = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[4], ARGV[2], ARGV[2], 1)
else
  p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
end
if #p == 0 then return {0, '', 0, ''} end
if ARGV[3] ~= '' and p[1][2] ~= ARGV[3] then return {0, '', 0, ''} end
local rows = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if #rows == 0 then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  return {-1, '', 0, ''}
end
local flat = rows[1][2]
local task, attempt, id = nil, 1, ''
for i = 1, #flat, 2 do
  if flat[i] == 'task' then task = flat[i + 1]
  elseif flat[i] == 'attempt' then attempt = tonumber(flat[i + 1])
  elseif flat[i] == 'id' then id = flat[i + 1] end
end
local next = attempt
if ARGV[6] == '1' then
  next = attempt + 1
  if next > tonumber(ARGV[5]) then return {2, '', attempt, id} end
end
local new = redis.call('XADD', KEYS[1], '*', 'task', task, 'attempt', tostring(next), 'id', id)
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return {1, new, next, id}
"""

# Record the first outcome of a task and nothing after it. KEYS[1] result hash; ARGV result
# (msgpack), status, worker, attempt, ttl ms. Returns 1 for the first writer, 0 for any later one.
_RESULT_ONCE: Final = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'result', ARGV[1], 'status', ARGV[2], 'worker', ARGV[3], 'attempt', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

# Close a run: its last text piece (if any), then its outcome unless one is stored already, at once.
# The done chunk follows with the closing events (TaskQueues.log_run), so that a client that sees it
# finds the completion in the ledger. KEYS[1] result hash, KEYS[2] output stream; ARGV result
# (msgpack), status, worker, attempt, ttl ms, text chunk ('' = none), output ttl ms.
# Returns 1 for the first writer, 0 for any later one.
_CLOSE_RUN: Final = """
if ARGV[6] ~= '' then
  redis.call('XADD', KEYS[2], '*', 'c', ARGV[6])
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'result', ARGV[1], 'status', ARGV[2], 'worker', ARGV[3], 'attempt', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

# A later run of a completed task finds a stored result whose writer never marked it `logged` (it
# died between storing the result and appending TaskCompleted): the first such run takes over the
# ledger record, so that the completion still counts once. KEYS[1] result hash; ARGV attempt.
# Returns 1 to the one run that takes over, 0 to every other.
_TAKE_OVER: Final = """
if redis.call('HGET', KEYS[1], 'status') ~= 'completed' then return 0 end
if redis.call('HEXISTS', KEYS[1], 'logged') == 1 then return 0 end
return redis.call('HSETNX', KEYS[1], 'taken', ARGV[1])
"""

# Withdraw a task that no worker has taken: find its entry by task id and delete it only if it is not
# in the group's pending list (delivered entries belong to a worker, which is told to stop instead).
# KEYS[1] queue; ARGV group, task id. Returns {status, entry id, attempt}: 2 removed; 1 delivered
# (running, left alone); 0 no entry for the task (finished, or never queued here).
_CANCEL_QUEUED: Final = """
local rows = redis.call('XRANGE', KEYS[1], '-', '+')
for _, row in ipairs(rows) do
  local flat = row[2]
  local id, attempt = nil, 1
  for i = 1, #flat, 2 do
    if flat[i] == 'id' then id = flat[i + 1]
    elseif flat[i] == 'attempt' then attempt = tonumber(flat[i + 1]) end
  end
  if id == ARGV[2] then
    local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], row[1], row[1], 1)
    if type(p) == 'table' and p.err == nil and #p > 0 then return {1, row[1], attempt} end
    redis.call('XDEL', KEYS[1], row[1])
    return {2, row[1], attempt}
  end
end
return {0, '', 0}
"""

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


def parse_entry(queue: str, entry_id: str, fields: dict[bytes, bytes]) -> QueueEntry:
    """A queue entry's fields as a QueueEntry; raises msgspec errors on a malformed one."""
    raw = fields.get(F_TASK)
    if raw is None:
        raise msgspec.ValidationError(f"queue entry {entry_id} has no task field")
    return QueueEntry(queue, entry_id, int(fields.get(F_ATTEMPT, b"1")), decode_task(raw))


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


class TaskQueues:
    """Operations on the task queues, shared by the submitter, the workers and the reaper."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        ledger: Ledger | None = None,
        *,
        dead_max_entries: int = DEAD_MAX_ENTRIES,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.ledger = ledger or Ledger(redis, keys)
        self.dead_max_entries = dead_max_entries
        self._finish = redis.register_script(_FINISH)
        self._requeue = redis.register_script(_REQUEUE)
        self._result_once = redis.register_script(_RESULT_ONCE)
        self._cancel_queued = redis.register_script(_CANCEL_QUEUED)
        self._take_over = redis.register_script(_TAKE_OVER)
        self._close_run = redis.register_script(_CLOSE_RUN)
        self._groups: set[str] = set()

    async def ensure_group(self, queue: str) -> None:
        """Create the `workers` group on `queue` once per process."""
        if queue not in self._groups:
            await self.ledger.ensure_group(queue, WORKERS_GROUP, "0")
            self._groups.add(queue)

    async def enqueue(self, queue: str, task: TaskMessage, attempt: int = 1) -> str:
        await self.ensure_group(queue)
        raw: Any = await self.redis.xadd(queue, queue_fields(task, attempt))  # type: ignore[arg-type]
        return str(raw.decode())

    async def finish(self, queue: str, entry_id: str) -> int:
        """Acknowledge and delete an entry; 0 means it was no longer pending (someone reclaimed it)."""
        return int(await self._finish(keys=[queue], args=[WORKERS_GROUP, entry_id]))

    async def requeue(
        self,
        queue: str,
        entry_id: str,
        *,
        delivery_limit: int,
        owner: str | None = None,
        min_idle_ms: int | None = None,
        bump: bool = True,
    ) -> Requeue:
        """Put a pending entry back, with the next attempt unless `bump` is False (see _REQUEUE)."""
        reply: Any = await self._requeue(
            keys=[queue],
            args=[
                WORKERS_GROUP,
                entry_id,
                owner or "",
                "" if min_idle_ms is None else str(min_idle_ms),
                str(delivery_limit),
                "1" if bump else "0",
            ],
        )
        status, new, attempt, task_id = reply
        return Requeue(int(status), as_str(new), int(attempt), as_str(task_id))

    async def cancel_queued(self, queue: str, task_id: str) -> tuple[int, str, int]:
        """Delete `task_id`'s entry unless a worker holds it: (status, entry id, attempt); see above."""
        reply: Any = await self._cancel_queued(keys=[queue], args=[WORKERS_GROUP, task_id])
        status, entry_id, attempt = reply
        return int(status), as_str(entry_id), int(attempt)

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

    async def end_output(self, task_id: str, attempt: int, error: str | None = None) -> None:
        """Close a task's output stream (with the error, if it failed) so relays stop waiting."""
        out_key = self.keys.out(task_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(out_key, {b"c": encode_chunk(Chunk(attempt=attempt, done=True, error=error))})
        pipe.pexpire(out_key, OUTPUT_TTL_MS)
        await pipe.execute()

    async def settle_requeue(
        self, queue: str, entry_id: str, moved: Requeue, reason: str, delivery_limit: int
    ) -> bool:
        """After a re-queue: dead-letter a task whose deliveries are spent. True if it was moved or settled.

        The copy in `rl:dead` is written before the queue entry is removed, so that a crash in
        between leaves a duplicate in the dead letters rather than a lost task.
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
        await self.finish(queue, entry_id)
        return True

    async def record_result(self, result: Result, ttl_ms: int = RESULT_TTL_MS) -> bool:
        """Store a task's outcome unless one is stored already; True for the first (the one that counts)."""
        won = await self._result_once(
            keys=[self.keys.result(result.task_id)],
            args=[
                encode_result(result),
                result.status,
                result.worker or "",
                str(result.attempt),
                str(ttl_ms),
            ],
        )
        return bool(won)

    async def close_run(self, result: Result, text: str = "", ttl_ms: int = RESULT_TTL_MS) -> bool:
        """Write the run's last `text` piece and store the outcome unless one is stored already, in
        one round trip; True for the first outcome (the one that counts). The output stream stays
        open: log_run closes it."""
        won = await self._close_run(
            keys=[self.keys.result(result.task_id), self.keys.out(result.task_id)],
            args=[
                encode_result(result),
                result.status,
                result.worker or "",
                str(result.attempt),
                str(ttl_ms),
                encode_chunk(Chunk(attempt=result.attempt, text=text)) if text else b"",
                str(OUTPUT_TTL_MS),
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
            pipe = self.redis.pipeline(transaction=False)
            for event in left:
                pipe.xadd(self.keys.events, encode_fields(event))  # type: ignore[arg-type]
            # After a refusal the mark waits for a round in which no event is outstanding.
            with_rest = rounds == 0 or not left
            if mark and with_rest:
                pipe.hset(self.keys.result(task_id), "logged", "1")
            if close and with_rest:
                out_key = self.keys.out(task_id)
                fields = {b"c": encode_chunk(done)}  # type: ignore[arg-type]
                if carried is not None:
                    fields[b"r"] = encode_result(carried)
                pipe.xadd(out_key, fields)  # type: ignore[arg-type]
                pipe.pexpire(out_key, OUTPUT_TTL_MS)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
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
                    await self.redis.hdel(self.keys.result(task_id), "logged")
                mark = not (marked and not unsent)
            if with_rest and close:
                close = not rest[0]
            left = unsent
            rounds += 1
            await wait_for_room(rounds)

    async def take_over_log(self, task_id: str, attempt: int) -> bool:
        """True if this run must append the counting TaskCompleted its result's writer never did."""
        return bool(await self._take_over(keys=[self.keys.result(task_id)], args=[str(attempt)]))
