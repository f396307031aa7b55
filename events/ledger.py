"""The Ledger: an append-only log of events on a Redis stream, plus consumer-group helpers.

Works on Redis 6.2 and newer: it uses no command newer than 6.2.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from events.cancellation import cancel_and_wait
from events.codec import as_str, decode_rows, encode_batch, encode_fields
from events.errors import LedgerError, UndecodableEntryError
from events.event import Event
from events.keys import WORKERS_GROUP, Keys
from events.scripts import EVENTS_LUA, ScriptDef, read_lua

_APPEND_MANY: Final = read_lua(EVENTS_LUA / "lib_append_blob.lua", EVENTS_LUA / "append_many.lua")
# The scripts above as functions of the routeledger library (events/scripts.py), which a worker
# calls with FCALL; allow_oom for those that free or keep entries (they ran at the memory limit).
_APPEND_MANY_DEF: Final = ScriptDef("append_many", _APPEND_MANY)

# A bounded batch keeps one script from blocking the server for long; append_many splits larger
# inputs (1,000 events take about 3 ms of server time).
MAX_BATCH: Final = 2000


Entry = tuple[str, dict[bytes, bytes]]
# A ledger entry with its id as a string and the flat [field, value, ...] list Redis sends.
RawEntry = tuple[str, list[bytes]]
# A ledger entry exactly as Redis sends it: [id as bytes, [field, value, ...]].
WireEntry = list[Any]
PoisonHandler = Callable[[UndecodableEntryError], None]


class PendingEntry(msgspec.Struct, frozen=True):
    """One delivered-but-unacknowledged entry of a consumer group."""

    entry_id: str
    consumer: str
    idle_ms: int
    deliveries: int


def wire_rows(entries: Iterable[Any]) -> list[WireEntry]:
    """Stream entries as redis-py parses them, (id, {field: value}) each, in Redis's own shape,
    [id, [field, value, ...]], which the ledger's decoders read (fields in the order they were
    written). A deleted entry's fields (None) are empty."""
    return [[row[0], [x for pair in row[1].items() for x in pair] if row[1] else []] for row in entries]


def read_streams(reply: Any) -> list[tuple[str, list[WireEntry]]]:
    """An XREAD or XREADGROUP reply as redis-py parses it: each stream's name and its entries in
    Redis's own shape (`wire_rows`). redis-py gives [[stream, entries], ...], or with its RESP3
    callbacks a map of stream to [entries]."""
    if not reply:
        return []
    out: list[tuple[str, list[WireEntry]]] = []
    if isinstance(reply, dict):
        for name, value in reply.items():
            entries = value[0] if value and isinstance(value[0], list) else value
            out.append((as_str(name), wire_rows(entries)))
        return out
    return [(as_str(name), wire_rows(entries)) for name, entries in reply]


def next_id(entry_id: str) -> str:
    """The smallest stream id strictly after `entry_id` (for exclusive ranges on Redis 6.2)."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


class Ledger:
    """The ledger stream and the stream primitives the other layers use."""

    def __init__(self, redis: aioredis.Redis, keys: Keys | None = None, *, inbox: str | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys.for_client(redis)
        self.stream = self.keys.events
        # Where this process appends: the ledger, or (a worker under its own ACL) its inbox
        # (`Keys.inbox`), which the projector's ingest checks and moves into the ledger.
        self.appends_to = self.keys.inbox(inbox) if inbox else self.stream
        self._append_many = _APPEND_MANY_DEF.bind(redis)

    # -- appending ----------------------------------------------------------------------------
    async def append(self, event: Event) -> str:
        """Append one event; returns its stream id.

        Redis's own error comes out as it is, with a note naming the event: callers that wait out
        an unreachable Redis, or one at its memory limit, catch Redis's errors by type, and any
        other error ends their loop (a worker's heartbeat, which keeps its lease, among them).
        """
        try:
            raw: Any = await self.redis.xadd(self.appends_to, encode_fields(event))  # type: ignore[arg-type]
        except RedisError as exc:
            exc.add_note(f"while appending {type(event).__name__} to the ledger")
            raise
        return as_str(raw)

    async def append_many(self, events: Sequence[Event], ids: Sequence[str] | None = None) -> list[str]:
        """Append events in order, one round trip per batch of up to MAX_BATCH; returns their ids.

        With `ids` (one per event, increasing, after the stream's last) they are written under
        those: a history imported as it happened. Without, Redis gives each the next id."""
        if ids is not None and len(ids) != len(events):
            raise LedgerError(f"{len(ids)} ids for {len(events)} events")
        written: list[str] = []
        for start in range(0, len(events), MAX_BATCH):
            chunk = events[start : start + MAX_BATCH]
            args: list[Any] = [encode_batch(chunk)]
            if ids is not None:
                args.append(" ".join(ids[start : start + MAX_BATCH]))
            try:
                raw = await self._append_many(keys=[self.appends_to], args=args)
            except RedisError as exc:
                exc.add_note(f"while appending a batch of {len(chunk)} events to the ledger")
                raise
            written.extend(as_str(r) for r in raw)
        return written

    # -- reading ------------------------------------------------------------------------------
    async def length(self) -> int:
        """How many entries the ledger holds."""
        return int(await self.redis.xlen(self.stream))

    async def last_id(self) -> str | None:
        """The id of the newest entry, or None when the ledger is empty."""
        raw: Any = await self.redis.xrevrange(self.stream, count=1)
        return as_str(raw[0][0]) if raw else None

    async def _xrange(self, start: str, stop: str, count: int) -> list[Any]:
        rows: Any = await self.redis.xrange(self.stream, start, stop, count=count)
        return wire_rows(rows)

    async def read_wire(
        self, start: str = "-", stop: str = "+", count: int | None = None, chunk: int = 2000
    ) -> AsyncGenerator[list[WireEntry], None]:
        """Entries from `start` to `stop` (both inclusive) as Redis sends them, in chunks of up to
        `chunk`: for a bulk reader that needs few of the ids as strings.

        The next chunk is fetched while the caller works on the current one, so that Redis and the
        decoder run side by side.
        """
        remaining = count
        n = chunk if remaining is None else min(chunk, remaining)
        pending = asyncio.ensure_future(self._xrange(start, stop, n))
        try:
            while True:
                rows: list[WireEntry] = await pending
                if not rows:
                    return
                if remaining is not None:
                    remaining -= len(rows)
                more = len(rows) == n and (remaining is None or remaining > 0)
                if more:
                    n = chunk if remaining is None else min(chunk, remaining)
                    after = next_id(rows[-1][0].decode())
                    pending = asyncio.ensure_future(self._xrange(after, stop, n))
                yield rows
                if not more:
                    return
        finally:
            if not pending.done():
                await cancel_and_wait((pending,))
                with contextlib.suppress(asyncio.CancelledError, RedisError):
                    await pending

    async def read_raw(
        self, start: str = "-", stop: str = "+", count: int | None = None, chunk: int = 2000
    ) -> AsyncIterator[list[RawEntry]]:
        """Undecoded entries from `start` to `stop` (both inclusive), in chunks of up to `chunk`
        (fetched ahead, as `read_wire`)."""
        # Closed with this generator, so that an early exit cancels the chunk fetched ahead.
        async with contextlib.aclosing(self.read_wire(start, stop, count, chunk)) as chunks:
            async for rows in chunks:
                yield [(row[0].decode(), row[1]) for row in rows]

    async def read_batches(
        self,
        start: str = "-",
        stop: str = "+",
        count: int | None = None,
        *,
        on_poison: PoisonHandler | None = None,
        chunk: int = 2000,
    ) -> AsyncIterator[list[tuple[str, Event]]]:
        """Decoded events from `start` to `stop`, inclusive, a chunk at a time (the fast way)."""
        async for batch in self.read_raw(start, stop, count, chunk):
            yield decode_rows(batch, on_poison)

    async def read(
        self,
        start: str = "-",
        stop: str = "+",
        count: int | None = None,
        *,
        on_poison: PoisonHandler | None = None,
        chunk: int = 2000,
    ) -> AsyncIterator[tuple[str, Event]]:
        """Decoded events from `start` to `stop`, inclusive.

        An entry that is not a valid event raises UndecodableEntryError, unless `on_poison` is
        given: then it is handed the error and reading goes on past the entry.
        """
        async for batch in self.read_raw(start, stop, count, chunk):
            for item in _decode_in_order(batch, on_poison):
                yield item

    async def read_after(
        self, after_id: str, count: int = 1000, block_ms: int | None = None
    ) -> list[RawEntry]:
        """Up to `count` undecoded entries strictly after `after_id`, waiting up to `block_ms` for one."""
        reply: Any = await self.redis.xread({self.stream: after_id}, count=count, block=block_ms)
        return [(row[0].decode(), row[1]) for _, rows in read_streams(reply) for row in rows]

    async def tail(
        self,
        from_id: str = "$",
        block_ms: int = 1000,
        *,
        count: int = 1000,
        on_poison: PoisonHandler | None = None,
    ) -> AsyncIterator[tuple[str, Event]]:
        """Follow the ledger after `from_id` (`$`: only what arrives from now on), forever."""
        cursor = from_id
        if cursor == "$":
            cursor = await self.last_id() or "0-0"
        while True:
            batch = await self.read_after(cursor, count, block_ms)
            if not batch:
                continue
            cursor = batch[-1][0]
            for item in _decode_in_order(batch, on_poison):
                yield item

    async def wait_on(self, cursors: Mapping[str, str], block_ms: int) -> set[str]:
        """Block until any stream gets an entry after its cursor (an id, or `$`: after now), reading
        nothing for a consumer group; the streams that did (none on timeout)."""
        if not cursors:
            await asyncio.sleep(block_ms / 1000)
            return set()
        wanted: dict[Any, Any] = dict(cursors)
        reply: Any = await self.redis.xread(wanted, count=1, block=block_ms)
        if not reply:
            return set()
        if isinstance(reply, dict):  # RESP3 shape
            return {as_str(k) for k in reply}
        return {as_str(stream) for stream, _ in reply}

    # -- consumer groups ----------------------------------------------------------------------
    async def ensure_group(self, stream: str, group: str = WORKERS_GROUP, start: str = "0") -> bool:
        """Create `group` on `stream` (and the stream) unless it exists; True when it was created."""
        try:
            await self.redis.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" in str(exc):
                return False
            raise
        return True

    async def group_read(
        self,
        consumer: str,
        streams: Mapping[str, str],
        *,
        group: str = WORKERS_GROUP,
        count: int = 1,
        block_ms: int | None = None,
    ) -> list[tuple[str, list[Entry]]]:
        """New (`>`) or own pending (an id) entries of `streams` for `consumer`, by stream.

        A stream whose group is missing gets it again, from the stream's start, and is read once
        more: a Redis restarted on an AOF that missed its last writes (synced once a second) can
        have lost a queue and its group while every process remembers having made the group, and
        the submitter goes on adding to the queue. Finished entries are deleted from a queue, so
        reading it from its start again delivers only what is still to do.
        """
        wanted: dict[Any, Any] = dict(streams)
        try:
            reply: Any = await self.redis.xreadgroup(group, consumer, wanted, count=count, block=block_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            for stream in wanted:
                await self.ensure_group(as_str(stream), group)
            reply = await self.redis.xreadgroup(group, consumer, wanted, count=count, block=block_ms)
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3 shape
            reply = list(reply.items())
        out: list[tuple[str, list[Entry]]] = []
        for stream, rows in reply:
            # A pending entry deleted meanwhile comes back with no fields (None).
            out.append((as_str(stream), [(as_str(i), f or {}) for i, f in rows]))
        return out

    async def ack(self, stream: str, *entry_ids: str, group: str = WORKERS_GROUP) -> int:
        """Acknowledge entries; returns how many were pending (0 means something is wrong)."""
        return int(await self.redis.xack(stream, group, *entry_ids))

    async def pending(
        self,
        stream: str,
        *,
        group: str = WORKERS_GROUP,
        start: str = "-",
        stop: str = "+",
        count: int = 100,
        consumer: str | None = None,
        min_idle_ms: int | None = None,
    ) -> list[PendingEntry]:
        """Pending entries of `group` on `stream`, oldest first, with owner, idle time and deliveries."""
        rows: Any = await self.redis.xpending_range(
            stream, group, start, stop, count, consumername=consumer, idle=min_idle_ms
        )
        return [
            PendingEntry(
                as_str(row["message_id"]),
                as_str(row["consumer"]),
                int(row["time_since_delivered"]),
                int(row["times_delivered"]),
            )
            for row in rows
        ]

    async def claim(
        self,
        stream: str,
        consumer: str,
        entry_ids: Sequence[str],
        *,
        group: str = WORKERS_GROUP,
        min_idle_ms: int = 0,
        justid: bool = False,
    ) -> list[str]:
        """XCLAIM entries for `consumer`; returns the ids it now owns.

        With `justid` the idle time is reset but the delivery count is not raised: the way a
        worker keeps the lease on an entry it is still running.
        """
        if not entry_ids:
            return []
        if justid:
            raw: list[Any] = await self.redis.xclaim(
                stream, group, consumer, min_idle_ms, list(entry_ids), justid=True
            )
            return [as_str(i) for i in raw]
        rows: Any = await self.redis.xclaim(stream, group, consumer, min_idle_ms, list(entry_ids))
        return [as_str(row[0]) for row in rows if row is not None]


def _decode_in_order(batch: list[RawEntry], on_poison: PoisonHandler | None) -> list[tuple[str, Event]]:
    """Decode a batch for a one-by-one reader: without `on_poison`, the events before the first
    poison entry are still delivered, and the error is raised after them."""
    if on_poison is not None:
        return decode_rows(batch, on_poison)
    errors: list[UndecodableEntryError] = []
    items = decode_rows(batch, errors.append)
    if not errors:
        return items
    poison_at = next(i for i, (entry_id, _) in enumerate(batch) if entry_id == errors[0].entry_id)
    return _Raising(items[:poison_at], errors[0])


class _Raising(list[tuple[str, Event]]):
    """A list that raises its error once iteration has passed its items."""

    def __init__(self, items: list[tuple[str, Event]], error: UndecodableEntryError) -> None:
        super().__init__(items)
        self.error = error

    def __iter__(self) -> Iterator[tuple[str, Event]]:
        yield from super().__iter__()
        raise self.error
