"""The ingest: moves what workers append to their own inboxes into the ledger, checked.

A worker on another machine appends its events to `rl:events:w:{name}` (`Keys.inbox`), the only
stream its Redis ACL lets it append to, so the stream an entry comes from names its writer, and no
worker can speak for another. The ingest (run by the active projector) reads every inbox listed in
`rl:inboxes`, checks each event against its writer and against what the writer holds, and moves it
into the ledger; an event that fails a check goes to the dead letters (`rl:dead`, source `inbox`)
with the reason, and the ingest goes on. So the ledger holds only checked events, and the fold and
replay need no rule of their own for them: both fold the same ledger.

The checks (`Ingest.check`):
- an event that names a worker names its writer, and a worker appends only the types a worker
  writes (no submissions, routing, cancellations, reclaims, pipelines or shift notices);
- a claim names a queue entry the writer holds (the consumer group's pending list says who does),
  or one already gone (finished since), and that entry's task;
- a completion matches an open claim of the same task and attempt by the writer, for the same
  model, and counts once (a second completion of one claimed run is refused);
- a failure or a dead letter follows a claim of the task by the writer (a retryable "model
  missing" refusal, which comes before any claim, excepted);
- a benchmark result or grade is of a benchmark task (`bench-{bench_id}-{i}`, sent to the writer's
  background queue, or its pinned one in older history) the writer claimed, for the model it
  claimed it for; a grade is the reference check of a shipped prompt of its domain, once per (task, grader).

Claims are kept in `rl:claims` (task -> the claimed runs), so that they outlive a restart of the
projector; a task's field goes once each of its claimed runs has completed, or after CLAIM_TTL_MS.

The ingest also finishes the queue entry of a run its worker closed (acknowledges and deletes it,
in the same script that moves the closing event): a worker under its ACL may not XACK or XDEL a
task queue, so that no task it can read vanishes without an event. An accepted completion, a final
(not retryable) failure or a dead letter of a claimed run, and an expiry of an entry the writer
holds, each finish the entry their run came from, and only while the writer still holds it (a run
the reaper took back is left to its new one). The entry is acknowledged as the event enters the
ledger, never before: until then the reaper leaves a run whose result says it closed alone
(workers/reaper.py), so that the ingest's lag does not make it run again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from events.codec import DATA, TYPE, VERSION, as_str, decode_rows, flat_to_dict
from events.errors import UndecodableEntryError
from events.event import (
    BenchmarkRequested,
    BenchmarkResult,
    Event,
    QualityScored,
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskExpired,
    TaskFailed,
    WorkerChanged,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
)
from events.keys import DEAD_MAX_ENTRIES, REQUEUED_CONSUMER, WORKERS_GROUP, Keys
from events.ledger import read_streams
from events.scripts import read_lua
from projections.benchset import REFERENCE, prompt_by_id
from tasks.payload import F_TASK, decode_task
from tasks.store import RESULT_TTL_MS

log = logging.getLogger("routeledger.ingest")

# The event types a worker appends (workers/agent.py, workers/closing.py, dispatch/benchmark.py).
WORKER_TYPES: Final[tuple[type[Event], ...]] = (
    TaskClaimed,
    TaskCompleted,
    TaskFailed,
    TaskExpired,
    TaskDeadLettered,
    WorkerOnline,
    WorkerChanged,
    WorkerHeartbeat,
    WorkerOffline,
    BenchmarkRequested,
    BenchmarkResult,
    QualityScored,
)
# A claim no completion closed (its run failed, or its worker died) is forgotten after a day.
CLAIM_TTL_MS: Final = 24 * 3600 * 1000

# The Lua this module runs (projections/lua/move_inbox.lua), headed by the KEYS and ARGV it takes:
# moves one inbox's checked entries into the ledger (or the dead letters) and finishes the runs they
# close.
_LUA: Final = Path(__file__).parent / "lua"
_MOVE: Final = read_lua(_LUA / "move_inbox.lua")


class Claim(msgspec.Struct, array_like=True):
    """One run of a task that a worker claimed and the ingest accepted."""

    attempt: int
    worker: str
    digest: str
    queue: str
    at: int
    completed: bool = False
    # The queue entry the run came from ('' in claims kept before the ingest finished entries).
    entry_id: str = ""


_claims_encoder: Final = msgspec.msgpack.Encoder()
_claims_decoder: Final = msgspec.msgpack.Decoder(list[Claim])


def decode_claims(raw: bytes) -> list[Claim]:
    """A task's claimed runs, as `rl:claims` holds them."""
    return _claims_decoder.decode(raw)


class Held(msgspec.Struct, frozen=True):
    """What Redis says of the queue entry a claim names: who holds it, and whose task it is."""

    consumer: str | None
    exists: bool
    task_id: str = ""
    digest: str = ""


class Ingest:
    """Moves workers' inbox entries into the ledger, checked (see the module docstring)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys | None = None,
        *,
        batch: int = 1000,
        dead_max_entries: int = DEAD_MAX_ENTRIES,
    ) -> None:
        self.redis = redis
        self.keys = keys or Keys.for_client(redis)
        self.batch = batch
        self.dead_max_entries = dead_max_entries
        self._move = redis.register_script(_MOVE)
        # Inbox -> the id of the last entry read (moved entries are deleted, so "0-0" after a restart
        # reads exactly what is left).
        self._cursors: dict[str, str] = {}
        self.moved = 0
        self.refused = 0
        self.finished = 0

    async def inboxes(self) -> list[str]:
        """The names of the workers that write to an inbox."""
        raw: Any = await self.redis.smembers(self.keys.inboxes)
        return sorted(as_str(n) for n in raw)

    async def step(self, block_ms: int | None = None, before_write: Callable[[], None] | None = None) -> int:
        """Read what the inboxes hold after their cursors (waiting up to `block_ms`), check it and move
        it; returns how many entries were handled (moved or refused). `before_write` is called before
        each write (the projector's check that its lease still holds)."""
        names = await self.inboxes()
        if not names:
            return 0
        streams = {self.keys.inbox(n): self._cursors.get(n, "0-0") for n in names}
        reply: Any = await self.redis.xread(streams, count=self.batch, block=block_ms or None)  # type: ignore[arg-type]
        by_stream = dict(read_streams(reply))
        if not by_stream:
            return 0
        handled = 0
        for name in names:
            rows = by_stream.get(self.keys.inbox(name))
            if not rows:
                continue
            entries = [(as_str(row[0]), row[1]) for row in rows]
            try:
                if before_write is not None:
                    before_write()
                handled += await self._ingest(name, entries)
            except BaseException:
                # Read again next time: nothing of this batch was moved unless the script ran.
                self._cursors.pop(name, None)
                raise
            self._cursors[name] = entries[-1][0]
        return handled

    async def prune(self, now_ms: int, count: int = 1000) -> int:
        """Forget the claims of tasks whose every claimed run is older than CLAIM_TTL_MS (their runs
        failed, or their workers died, and no completion closed them); returns how many tasks.

        The runs that are kept are never rewritten here: a claim accepted meanwhile (the ingest
        writes it in its own script) is not lost; one whose task is pruned as it arrives is its run's
        only, and the run is at least a day old."""
        dropped = 0
        async for task_id, value in self.redis.hscan_iter(self.keys.claims, count=count):
            try:
                runs = decode_claims(value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                runs = []
            if all(now_ms - c.at >= CLAIM_TTL_MS for c in runs):
                dropped += int(await self.redis.hdel(self.keys.claims, task_id))
        return dropped

    async def catch_up(self) -> int:
        """Move everything the inboxes hold now (tests and tools); returns entries handled."""
        total = 0
        while n := await self.step():
            total += n
        return total

    async def _ingest(self, worker: str, entries: list[tuple[str, Any]]) -> int:
        reasons: dict[str, str] = {}

        def poison(exc: UndecodableEntryError) -> None:
            reasons[exc.entry_id] = f"undecodable: {exc.reason}"

        events = decode_rows(entries, poison)
        claims = await self._read_claims([e for _, e in events])
        held = await self._read_held(
            worker, [e for _, e in events if isinstance(e, TaskClaimed | TaskExpired)]
        )
        grades = [f"{e.task_id} {e.grader}" for _, e in events if isinstance(e, QualityScored)]
        graded = await self._read_graded(grades)
        touched: set[str] = set()
        claimed: set[str] = set()
        new_grades: list[str] = []
        # Inbox entry -> the queue entries its event closes (finished as it is moved).
        closes: dict[str, list[tuple[str, str]]] = {}
        for entry_id, event in events:
            reason = self.check(worker, event, claims, held, graded, int(entry_id.partition("-")[0]))
            if reason is not None:
                reasons[entry_id] = reason
                continue
            if ends := _closed_entries(worker, event, claims):
                closes[entry_id] = ends
            task_id = getattr(event, "task_id", "")
            if isinstance(event, TaskClaimed | TaskCompleted):
                touched.add(task_id)
            if isinstance(event, TaskClaimed):
                claimed.add(task_id)
            if isinstance(event, QualityScored):
                mark = f"{event.task_id} {event.grader}"
                graded.add(mark)
                new_grades.append(mark)
        keys = [self.keys.events, self.keys.inbox(worker), self.keys.dead, self.keys.claims, self.keys.graded]
        queue_index: dict[str, int] = {}
        args: list[Any] = [str(self.dead_max_entries), worker, WORKERS_GROUP, str(len(entries))]
        for entry_id, flat in entries:
            fields = flat_to_dict(flat)
            reason = reasons.get(entry_id, "")
            ends = [] if reason else closes.get(entry_id, [])
            args += [
                entry_id,
                reason,
                fields.get(TYPE, b""),
                fields.get(VERSION, b"1"),
                fields.get(DATA, b""),
                str(len(ends)),
            ]
            for queue, queue_entry in ends:
                if queue not in queue_index:
                    keys.append(queue)
                    queue_index[queue] = len(keys)
                args += [str(queue_index[queue]), queue_entry]
        updates: list[Any] = []
        for task_id in sorted(touched):
            runs = claims.get(task_id, [])
            done = not runs or all(c.completed for c in runs)
            updates += [task_id, "" if done else _claims_encoder.encode(runs)]
        args += [str(len(updates) // 2), *updates, str(len(claimed)), str(RESULT_TTL_MS)]
        for task_id in sorted(claimed):
            keys.append(self.keys.ran(task_id))
            args.append(str(len(keys)))
        args += new_grades
        moved, finished = await self._move(keys=keys, args=args)
        self.moved += int(moved)
        self.finished += int(finished)
        self.refused += len(reasons)
        for entry_id, reason in reasons.items():
            log.warning("refused inbox entry %s of worker %s: %s", entry_id, worker, reason)
        return len(entries)

    async def _read_claims(self, events: Sequence[Event]) -> dict[str, list[Claim]]:
        """The claimed runs of every task the batch names."""
        tasks = sorted({t for e in events if (t := getattr(e, "task_id", ""))})
        if not tasks:
            return {}
        raw: list[Any] = await self.redis.hmget(self.keys.claims, tasks)
        out: dict[str, list[Claim]] = {}
        for task_id, value in zip(tasks, raw, strict=True):
            if value is None:
                continue
            try:
                out[task_id] = decode_claims(value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("claims of task %s are unreadable; starting them again", task_id)
        return out

    async def _read_held(
        self, worker: str, claims: Sequence[TaskClaimed | TaskExpired]
    ) -> dict[tuple[str, str], Held]:
        """Who holds each queue entry the batch's claims (and expiries) name, and whose task it is."""
        wanted = sorted({(c.queue, c.entry_id) for c in claims if c.queue and c.entry_id})
        if not wanted:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for queue, entry_id in wanted:
            pipe.xpending_range(queue, WORKERS_GROUP, entry_id, entry_id, 1)
            pipe.xrange(queue, entry_id, entry_id)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        out: dict[tuple[str, str], Held] = {}
        for i, key in enumerate(wanted):
            pending, rows = replies[2 * i], replies[2 * i + 1]
            consumer = None
            if isinstance(pending, list) and pending:
                consumer = as_str(pending[0]["consumer"])
            if not isinstance(rows, list) or not rows:
                out[key] = Held(consumer, exists=False)
                continue
            try:
                task = decode_task(rows[0][1][F_TASK])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                out[key] = Held(consumer, exists=True)
                continue
            out[key] = Held(consumer, exists=True, task_id=task.task_id, digest=task.digest)
        return out

    async def _read_graded(self, marks: Sequence[str]) -> set[str]:
        if not marks:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for mark in marks:
            pipe.sismember(self.keys.graded, mark)
        found: list[Any] = await pipe.execute()
        return {mark for mark, hit in zip(marks, found, strict=True) if hit}

    def check(
        self,
        worker: str,
        event: Event,
        claims: dict[str, list[Claim]],
        held: dict[tuple[str, str], Held],
        graded: set[str],
        now_ms: int,
    ) -> str | None:
        """Why `worker` may not have appended `event` (None: it may), given the claims so far (updated
        in place by an accepted claim or completion)."""
        kind = type(event).__name__
        if not isinstance(event, WORKER_TYPES):
            return f"a worker may not append {kind}"
        named = getattr(event, "worker", worker)
        if named != worker:
            return f"{kind} names worker {named!r} but came from the inbox of {worker!r}"
        match event:
            case TaskClaimed():
                return _claim(worker, event, claims, held, now_ms)
            case TaskCompleted():
                run = _open_run(claims, event.task_id, worker, event.attempt)
                if run is None:
                    return (
                        f"no open claim by {worker} of task {event.task_id} attempt {event.attempt} "
                        "(never claimed, or its completion already counted)"
                    )
                if run.digest != event.digest:
                    return (
                        f"completes task {event.task_id} for model {event.digest[:12]}, "
                        f"claimed for {run.digest[:12]}"
                    )
                run.completed = True
            case TaskFailed():
                if event.kind == "model_missing" and event.retryable:
                    return None  # refused before any claim: the task goes back as it was
                if _runs_of(claims, event.task_id, worker, event.attempt) is None:
                    return f"no claim by {worker} of task {event.task_id} attempt {event.attempt}"
            case TaskDeadLettered():
                if _runs_of(claims, event.task_id, worker) is None:
                    return f"no claim by {worker} of task {event.task_id}"
            case TaskExpired():
                return _expired(worker, event, held)
            case BenchmarkResult() | QualityScored():
                own = (self.keys.background(worker), self.keys.pinned(worker))
                return _graded_run(worker, own, event, claims, graded)
        return None


def _claim(
    worker: str,
    e: TaskClaimed,
    claims: dict[str, list[Claim]],
    held: dict[tuple[str, str], Held],
    now_ms: int,
) -> str | None:
    if not e.queue or not e.entry_id:
        return "the claim names no queue entry"
    entry = held.get((e.queue, e.entry_id))
    if entry is not None and entry.consumer not in (None, worker, REQUEUED_CONSUMER):
        return f"claims entry {e.entry_id} of {e.queue}, which {entry.consumer} holds"
    if entry is not None and entry.exists:
        if entry.consumer is None:
            return f"claims entry {e.entry_id} of {e.queue}, which was never delivered to it"
        if entry.task_id and entry.task_id != e.task_id:
            return f"claims task {e.task_id} with entry {e.entry_id}, which holds task {entry.task_id}"
        if entry.digest and entry.digest != e.digest:
            return f"claims task {e.task_id} for model {e.digest[:12]}, queued for {entry.digest[:12]}"
    runs = [c for c in claims.get(e.task_id, []) if now_ms - c.at < CLAIM_TTL_MS]
    runs = [c for c in runs if not (c.worker == worker and c.attempt == e.attempt)]
    runs.append(Claim(e.attempt, worker, e.digest, e.queue, now_ms, entry_id=e.entry_id))
    claims[e.task_id] = runs
    return None


def _expired(worker: str, e: TaskExpired, held: dict[tuple[str, str], Held]) -> str | None:
    """An expiry that names its entry (so that the ingest finishes it) names one the writer holds,
    of the task it names; one that names none (a worker of an older version) finishes nothing."""
    if not e.entry_id:
        return None
    entry = held.get((e.queue, e.entry_id))
    if entry is None or not entry.exists:
        return None  # gone already: nothing to finish
    if entry.consumer != worker:
        return f"expires entry {e.entry_id} of {e.queue}, which {entry.consumer or 'nobody'} holds"
    if entry.task_id != e.task_id:
        return f"expires task {e.task_id} with entry {e.entry_id}, which holds task {entry.task_id}"
    return None


def _closed_entries(worker: str, event: Event, claims: dict[str, list[Claim]]) -> list[tuple[str, str]]:
    """The queue entries (queue, entry id) that an accepted `event` of `worker` closes: a completion
    the entry of its run, a final failure or a dead letter those of the worker's runs of the task,
    an expiry the entry it names. The move finishes each only while the worker holds it."""
    match event:
        case TaskCompleted():
            runs = [c for c in _runs_of(claims, event.task_id, worker, event.attempt) or [] if c.completed]
        case TaskFailed() if not event.retryable:
            runs = _runs_of(claims, event.task_id, worker, event.attempt) or []
        case TaskDeadLettered():
            runs = [c for c in _runs_of(claims, event.task_id, worker) or [] if c.queue == event.queue]
        case TaskExpired() if event.entry_id and event.queue:
            return [(event.queue, event.entry_id)]
        case _:
            return []
    return sorted({(c.queue, c.entry_id) for c in runs if c.queue and c.entry_id})


def _runs_of(
    claims: dict[str, list[Claim]], task_id: str, worker: str, attempt: int | None = None
) -> list[Claim] | None:
    runs = [c for c in claims.get(task_id, []) if c.worker == worker and attempt in (None, c.attempt)]
    return runs or None


def _open_run(claims: dict[str, list[Claim]], task_id: str, worker: str, attempt: int) -> Claim | None:
    return next((c for c in _runs_of(claims, task_id, worker, attempt) or [] if not c.completed), None)


def _graded_run(
    worker: str,
    own: tuple[str, ...],
    e: BenchmarkResult | QualityScored,
    claims: dict[str, list[Claim]],
    graded: set[str],
) -> str | None:
    kind = type(e).__name__
    if not e.bench_id or not e.task_id.startswith(f"bench-{e.bench_id}-"):
        return f"{kind} of task {e.task_id!r} is not of a benchmark task of bench {e.bench_id!r}"
    runs = _runs_of(claims, e.task_id, worker)
    if runs is None:
        return f"{kind}: no claim by {worker} of benchmark task {e.task_id}"
    if all(c.digest != e.digest for c in runs):
        return f"{kind} for model {e.digest[:12]}, but {worker} claimed {e.task_id} for another model"
    if all(c.queue not in own for c in runs):
        # Its own background stream (its pinned one, before benchmarks had a stream of their own).
        return f"{kind}: benchmark task {e.task_id} did not come from {worker}'s own queues"
    if isinstance(e, QualityScored):
        if e.grader != REFERENCE:
            return f"a worker grades only with the reference check, not {e.grader!r}"
        prompt = prompt_by_id(e.prompt_id)
        if prompt is None or prompt.domain != e.domain:
            return f"grade of prompt {e.prompt_id!r} in domain {e.domain!r}: no such shipped prompt"
        if f"{e.task_id} {e.grader}" in graded:
            return f"task {e.task_id} was graded by {e.grader} already"
    return None
