"""The Ledger against a real Redis (the current server and 6.2)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from events.errors import LedgerError, UndecodableEntryError
from events.event import Event, TaskStalled
from events.keys import WORKERS_GROUP, Keys
from events.ledger import Ledger
from routeledger.embedded import EmbeddedRedis
from tests.factories import one_of_each

pytestmark = pytest.mark.cluster_tier


@pytest.fixture
async def any_ledger(any_redis_url: str) -> AsyncIterator[Ledger]:
    client = aioredis.Redis.from_url(any_redis_url)
    yield Ledger(client, Keys())
    await client.aclose()


def _stalled(i: int) -> TaskStalled:
    return TaskStalled(at=i, task_id=f"t{i}", queue="q", entry_id="0-1", waited_ms=i)


async def test_every_event_type_round_trips_through_the_ledger(any_ledger: Ledger) -> None:
    events = one_of_each()
    ids = [await any_ledger.append(e) for e in events]
    read = [item async for item in any_ledger.read()]
    assert read == list(zip(ids, events, strict=True))
    assert await any_ledger.length() == len(events)


async def test_append_many_keeps_order_and_returns_the_ids_across_batches(any_ledger: Ledger) -> None:
    events: list[Event] = [_stalled(i) for i in range(4500)]  # more than two MAX_BATCH batches
    ids = await any_ledger.append_many(events)
    assert len(ids) == 4500 and len(set(ids)) == 4500
    read = [item async for item in any_ledger.read(chunk=1000)]
    assert [i for i, _ in read] == ids
    assert [e for _, e in read] == events


async def test_read_honours_start_stop_and_count(ledger: Ledger) -> None:
    ids = await ledger.append_many([_stalled(i) for i in range(10)])
    window = [i async for i, _ in ledger.read(ids[2], ids[6])]
    assert window == ids[2:7]
    limited = [i async for i, _ in ledger.read(ids[3], count=4, chunk=3)]
    assert limited == ids[3:7]


async def _write_poison(redis_client: aioredis.Redis, keys: Keys) -> str:
    raw = await redis_client.xadd(
        keys.events, {b"type": b"TaskStalled", b"v": b"1", b"data": b"\x00\xff junk"}
    )
    return str(raw.decode())


async def test_a_poison_entry_raises_the_named_error_with_its_id(
    ledger: Ledger, redis_client: aioredis.Redis, keys: Keys
) -> None:
    await ledger.append(_stalled(1))
    poison_id = await _write_poison(redis_client, keys)
    await ledger.append(_stalled(2))
    seen: list[str] = []

    async def read_all() -> None:
        async for entry_id, _ in ledger.read():
            seen.append(entry_id)

    with pytest.raises(UndecodableEntryError) as info:
        await read_all()
    assert info.value.entry_id == poison_id
    assert len(seen) == 1


async def test_reading_continues_past_a_poison_entry_when_the_caller_asks(
    ledger: Ledger, redis_client: aioredis.Redis, keys: Keys
) -> None:
    await ledger.append(_stalled(1))
    poison_id = await _write_poison(redis_client, keys)
    await redis_client.xadd(keys.events, {b"type": b"Nope", b"v": b"1", b"data": b"\x81\xa4type\xa4Nope"})
    await ledger.append(_stalled(2))
    poisoned: list[UndecodableEntryError] = []
    events = [e async for _, e in ledger.read(on_poison=poisoned.append)]
    assert events == [_stalled(1), _stalled(2)]
    assert len(poisoned) == 2
    assert poisoned[0].entry_id == poison_id


async def test_tail_follows_new_events_and_skips_poison_when_asked(
    ledger: Ledger, redis_client: aioredis.Redis, keys: Keys
) -> None:
    await ledger.append(_stalled(0))  # before the tail starts: not seen with from_id="$"
    got: list[Event] = []
    poisoned: list[UndecodableEntryError] = []

    async def follow() -> None:
        async for _, event in ledger.tail("$", block_ms=100, on_poison=poisoned.append):
            got.append(event)
            if len(got) == 2:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    await ledger.append(_stalled(1))
    await _write_poison(redis_client, keys)
    await ledger.append(_stalled(2))
    await asyncio.wait_for(task, 5)
    assert got == [_stalled(1), _stalled(2)]
    assert len(poisoned) == 1


async def test_tail_from_the_beginning_replays_history(ledger: Ledger) -> None:
    await ledger.append_many([_stalled(i) for i in range(3)])
    got: list[Event] = []
    async for _, event in ledger.tail("0", block_ms=50):
        got.append(event)
        if len(got) == 3:
            break
    assert got == [_stalled(i) for i in range(3)]


async def test_consumer_group_helpers_cover_read_pending_claim_and_ack(any_ledger: Ledger) -> None:
    stream = any_ledger.keys.queue("abcdef0123456789")
    assert await any_ledger.ensure_group(stream) is True
    assert await any_ledger.ensure_group(stream) is False
    redis = any_ledger.redis
    first = (await redis.xadd(stream, {b"t": b"1"})).decode()
    second = (await redis.xadd(stream, {b"t": b"2"})).decode()

    got = await any_ledger.group_read("w1", {stream: ">"}, count=1)
    assert got == [(stream, [(first, {b"t": b"1"})])]
    pending = await any_ledger.pending(stream)
    assert [(p.entry_id, p.consumer, p.deliveries) for p in pending] == [(first, "w1", 1)]

    # Keeping a lease alive: JUSTID resets idle time without counting a delivery.
    await asyncio.sleep(0.05)
    assert await any_ledger.claim(stream, "w1", [first], justid=True) == [first]
    again = await any_ledger.pending(stream)
    assert again[0].deliveries == 1 and again[0].idle_ms < 50

    # Idle filter: nothing has been idle for an hour.
    assert await any_ledger.pending(stream, min_idle_ms=3_600_000) == []

    # Autoclaim (counts a delivery) moves the entry to another consumer.
    cursor, entries, deleted = await _autoclaim(any_ledger.redis, stream, "w2")
    assert [e[0] for e in entries] == [first] and deleted == []
    assert cursor == "0-0"
    moved = await any_ledger.pending(stream)
    assert [(p.consumer, p.deliveries) for p in moved] == [("w2", 2)]

    assert await any_ledger.claim(stream, "w3", [first]) == [first]
    assert await any_ledger.ack(stream, first) == 1
    assert await any_ledger.ack(stream, first) == 0  # already acknowledged: the caller must log this
    rest = await any_ledger.group_read("w1", {stream: ">"}, count=10)
    assert rest == [(stream, [(second, {b"t": b"2"})])]


async def test_waiting_for_entries_wakes_on_a_new_entry_and_reads_none(ledger: Ledger) -> None:
    stream = ledger.keys.queue("ab" * 32)
    await ledger.ensure_group(stream)
    cursor = {stream: "$"}
    assert await ledger.wait_on(cursor, 50) == set()

    async def add_soon() -> None:
        await asyncio.sleep(0.1)
        await ledger.redis.xadd(stream, {b"t": b"1"})

    adder = asyncio.create_task(add_soon())
    assert await ledger.wait_on(cursor, 5000) == {stream}
    await adder
    # Nothing was consumed: the group still has the entry to deliver.
    got = await ledger.group_read("w", {stream: ">"}, count=5)
    assert len(got[0][1]) == 1


async def _autoclaim(redis: Any, stream: str, consumer: str) -> tuple[str, list[Any], list[str]]:
    """XAUTOCLAIM of every idle entry for `consumer`: (next cursor, entries, deleted ids). Redis 6.2
    replies with two elements, 7.0 with three (the ids deleted while pending)."""
    reply: Any = await redis.xautoclaim(stream, WORKERS_GROUP, consumer, 0, "0-0", count=100)
    entries = [(row[0].decode(), row[1] or {}) for row in reply[1] if row is not None and row[0] is not None]
    deleted = [i.decode() for i in reply[2]] if len(reply) > 2 else []
    return reply[0].decode(), entries, deleted


async def test_a_history_imported_with_its_own_ids_keeps_them_and_reads_back_in_order(
    any_ledger: Ledger,
) -> None:
    events = one_of_each()
    ids = [f"{1_700_000_000_000 + i // 2}-{i % 2}" for i in range(len(events))]
    assert await any_ledger.append_many(events, ids) == ids
    assert [(i, e) async for i, e in any_ledger.read()] == list(zip(ids, events, strict=True))
    # The stream goes on after them with ids Redis makes.
    later = await any_ledger.append_many(events[:1])
    assert later[0] > ids[-1]
    with pytest.raises(LedgerError, match="2 ids for 1 events"):
        await any_ledger.append_many(events[:1], ids[:2])


async def test_an_append_to_a_redis_that_went_away_raises_the_connection_error_naming_the_event(
    fresh_server: EmbeddedRedis,
) -> None:
    # Callers that wait an outage out (a worker's heartbeat, the reaper's sweep) catch Redis's own
    # errors: an append must fail with one of those, not with an error of the ledger's.
    client = aioredis.Redis.from_url(fresh_server.url)
    ledger = Ledger(client, Keys())
    try:
        await ledger.append(_stalled(1))
        fresh_server.kill()
        with pytest.raises(RedisConnectionError) as one:
            await ledger.append(_stalled(2))
        with pytest.raises(RedisConnectionError) as batch:
            await ledger.append_many([_stalled(3), _stalled(4)])
    finally:
        await client.aclose()
    assert "TaskStalled" in " ".join(getattr(one.value, "__notes__", []))
    assert "2 events" in " ".join(getattr(batch.value, "__notes__", []))


async def test_a_group_read_on_a_queue_whose_group_was_lost_makes_it_again_and_delivers_what_is_queued(
    any_ledger: Ledger,
) -> None:
    stream = any_ledger.keys.queue("abcdef0123456789")
    redis = any_ledger.redis
    await any_ledger.ensure_group(stream)
    # A Redis restarted without its last second of writes: the queue and its group are gone, while
    # the submitter, which made the group once per process, adds to the queue as before.
    await redis.delete(stream)
    entry = (await redis.xadd(stream, {b"t": b"1"})).decode()
    assert await any_ledger.group_read("w1", {stream: ">"}, count=5) == [(stream, [(entry, {b"t": b"1"})])]
    assert [p.entry_id for p in await any_ledger.pending(stream)] == [entry]
