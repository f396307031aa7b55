"""Task rows in day shards: the projector starts and folds without reading history whole, finds a
task's row in whichever live shard holds it, and keeps writing only while its lease surely holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from events.codec import encode_fields
from events.event import BenchmarkResult, Event, TaskClaimed, TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from projections import store
from projections.errors import LeaseLostError
from projections.mention import Mention
from projections.projector import Projector
from projections.reader import get_task, get_tasks, snapshot
from projections.snapshot import TaskRow
from projections.tables import DEFAULT_TASK_RETENTION_DAYS, Tables
from replay.rebuild import rebuild
from replay.verify import verify
from tests.test_projector import D1, T0, completed, timings

DAY_MS = store.DAY_MS


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def submitted(task_id: str, pipeline_id: str | None = None) -> TaskSubmitted:
    return TaskSubmitted(at=T0, task_id=task_id, model="m", digest=D1, queue="q", pipeline_id=pipeline_id)


async def append_at(redis: aioredis.Redis, keys: Keys, ms: int, event: Event) -> str:
    """Append `event` with a stream id of time `ms`, as if it had been appended then."""
    raw: Any = await redis.xadd(keys.events, encode_fields(event), id=f"{ms}-0")  # type: ignore[arg-type]
    return str(raw.decode())


async def fresh_projector(redis: aioredis.Redis, keys: Keys) -> Projector:
    projector = Projector(redis, keys)
    await projector.start()
    return projector


async def shard_fields(redis: aioredis.Redis, keys: Keys, table: str, ms: int) -> list[str]:
    ns = await store.current(redis, keys)
    assert ns is not None
    raw: Any = await redis.hkeys(keys.table(ns, store.shard_name(table, store.shard_day(ms))))
    return sorted(f.decode() for f in raw)


async def command_calls(redis: aioredis.Redis) -> dict[str, int]:
    stats: Any = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}


async def test_start_reads_no_task_row_however_many_there_are_and_a_batch_reads_only_its_own(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    now = now_ms()
    rows = 200_000
    tables = Tables(
        tasks={
            f"t{i}": TaskRow(
                task_id=f"t{i}", model="m", digest=D1, submitted_at=T0, first_ms=now - (i % 3) * DAY_MS
            )
            for i in range(rows)
        },
        benched={(f"b{i}", f"x{i}"): now for i in range(rows // 10)},
    )
    await store.switch(redis_client, keys, await store.create(redis_client, keys, tables, built_by="test"))
    await ledger.append(completed("t8", "w1"))

    await redis_client.config_resetstat()
    projector = await fresh_projector(redis_client, keys)
    calls = await command_calls(redis_client)
    # The meta and the five small tables; no HMGET, HSCAN or HKEYS of a shard either.
    assert calls.get("hgetall") == 1 + len(store.SMALL_TABLES)
    assert not {"hmget", "hget", "hscan", "hkeys", "hvals"} & calls.keys()
    assert projector.tables is not None and projector.tables.tasks == {}

    await redis_client.config_resetstat()
    assert await projector.step() == 1
    calls = await command_calls(redis_client)
    assert "hgetall" not in calls
    # t8 was created two days ago: the newest two shards first, then the older ones.
    assert calls["hmget"] <= 2 + DEFAULT_TASK_RETENTION_DAYS
    assert projector.tables.tasks == {} and projector.tables.benched == {}
    row = await get_task(redis_client, keys, "t8")
    assert row is not None
    assert (row.status, row.submitted_at, row.model, row.first_ms) == ("completed", T0, "m", now - 2 * DAY_MS)


async def test_a_completion_of_a_task_submitted_days_ago_finds_its_row_and_counts_once(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    now = now_ms()
    submitted_ms = now - 3 * DAY_MS
    await append_at(redis_client, keys, submitted_ms, submitted("t1"))
    projector = await fresh_projector(redis_client, keys)
    assert await projector.step() == 1
    ledger = Ledger(redis_client, keys)
    await ledger.append(TaskClaimed(at=T0 + 1, task_id="t1", worker="w1", digest=D1, attempt=1))
    await ledger.append(completed("t1", "w1", at=T0 + 2))
    assert await projector.step(count=1) == 1
    assert await projector.step(count=1) == 1
    # The same completion again, in a later batch: a duplicate, found in the same old shard.
    await ledger.append(completed("t1", "w1", at=T0 + 3))
    assert await projector.catch_up() == 1

    row = await get_task(redis_client, keys, "t1")
    assert row is not None
    assert (row.status, row.submitted_at, row.worker, row.duplicates) == ("completed", T0, "w1", 1)
    assert row.first_ms == submitted_ms
    assert await shard_fields(redis_client, keys, store.TASKS, submitted_ms) == ["t1"]
    assert await shard_fields(redis_client, keys, store.TASKS, now) == []
    snap = await snapshot(redis_client, keys)
    assert snap.speed["w1", D1].decode_tps.n == 1
    assert snap.demand[D1].arrivals.n == 1
    _, differences = await verify(redis_client, keys)
    assert differences == []


async def test_a_submission_repeated_the_next_day_counts_demand_once(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    submit = submitted("t1")
    await append_at(redis_client, keys, now_ms() - DAY_MS, submit)
    projector = await fresh_projector(redis_client, keys)
    await projector.catch_up()
    await ledger.append(submit)
    await ledger.append(submitted("t2"))
    await projector.catch_up()
    snap = await snapshot(redis_client, keys)
    assert snap.demand[D1].arrivals.n == 2
    rows = await get_tasks(redis_client, keys, ["t1", "t2"])
    assert rows["t1"].first_ms is not None and rows["t1"].first_ms < now_ms() - DAY_MS / 2
    _, differences = await verify(redis_client, keys)
    assert differences == []


async def test_shards_past_retention_by_ledger_time_are_dropped_and_written_by_neither_side(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    now = now_ms()
    expired_ms = now - (DEFAULT_TASK_RETENTION_DAYS + 2) * DAY_MS
    kept_ms = now - 5 * DAY_MS
    await append_at(redis_client, keys, expired_ms, submitted("old", "p-old"))
    await append_at(redis_client, keys, kept_ms, submitted("kept", "p-kept"))
    bench = BenchmarkResult(at=T0, bench_id="b1", task_id="x", worker="w1", digest=D1, timings=timings())
    await append_at(redis_client, keys, kept_ms + 1, bench)
    await ledger.append(bench)  # a repeat days later: already counted
    projector = await fresh_projector(redis_client, keys)
    await projector.catch_up()

    assert (await snapshot(redis_client, keys)).speed["w1", D1].decode_tps.n == 1
    assert await get_task(redis_client, keys, "old") is None
    assert await get_task(redis_client, keys, "kept") is not None
    ns = await store.current(redis_client, keys)
    assert ns is not None
    kept_day, old_day = store.shard_day(kept_ms), store.shard_day(expired_ms)
    for table in store.SHARDED_TABLES:
        # No clock expires a shard: only ledger time moving past its retention drops it.
        assert await redis_client.ttl(keys.table(ns, store.shard_name(table, kept_day))) == -1, table
        assert await redis_client.exists(keys.table(ns, store.shard_name(table, old_day))) == 0, table

    # A rebuild writes the same shards, and verify compares like with like.
    result = await rebuild(redis_client, keys)
    assert result.namespace is not None
    assert (
        await redis_client.exists(keys.table(result.namespace, store.shard_name(store.TASKS, kept_day))) == 1
    )
    assert await get_task(redis_client, keys, "old") is None
    _, differences = await verify(redis_client, keys)
    assert differences == []

    # The ledger moves on a month: the kept day falls out of retention and its shards are dropped.
    await append_at(redis_client, keys, now + (DEFAULT_TASK_RETENTION_DAYS - 3) * DAY_MS, submitted("later"))
    await projector.catch_up()
    ns = await store.current(redis_client, keys)
    assert ns is not None
    for table in store.SHARDED_TABLES:
        assert await redis_client.exists(keys.table(ns, store.shard_name(table, kept_day))) == 0, table
    assert await get_task(redis_client, keys, "kept") is None
    assert await get_task(redis_client, keys, "later") is not None
    _, differences = await verify(redis_client, keys)
    assert differences == []


async def test_verify_reads_every_live_shard_and_reports_a_tampered_task_row(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await append_at(redis_client, keys, now_ms() - 10 * DAY_MS, submitted("t1"))
    await ledger.append(completed("t1", "w1"))
    await (await fresh_projector(redis_client, keys)).catch_up()
    _, differences = await verify(redis_client, keys)
    assert differences == []
    ns = await store.current(redis_client, keys)
    assert ns is not None
    row = await get_task(redis_client, keys, "t1")
    assert row is not None and row.first_ms is not None
    row.duplicates = 5
    shard = keys.table(ns, store.shard_name(store.TASKS, store.shard_day(row.first_ms)))
    await redis_client.hset(shard, "t1", store.encode_row(row))
    _, differences = await verify(redis_client, keys)
    assert [(d.table, d.key, d.field, d.live, d.rebuilt) for d in differences] == [
        ("tasks", "t1", "duplicates", 5, 0)
    ]


async def test_get_tasks_finds_rows_in_any_live_shard(redis_client: aioredis.Redis, keys: Keys) -> None:
    now = now_ms()
    ages = {"today": 0, "yesterday": 1, "weeks": 20, "gone": DEFAULT_TASK_RETENTION_DAYS + 2}
    tables = Tables(
        checkpoint=f"{now}-0",
        tasks={t: TaskRow(task_id=t, model="m", first_ms=now - age * DAY_MS) for t, age in ages.items()},
    )
    await store.switch(redis_client, keys, await store.create(redis_client, keys, tables, built_by="test"))
    rows = await get_tasks(redis_client, keys, [*ages, "never"])
    assert sorted(rows) == ["today", "weeks", "yesterday"]
    assert rows["weeks"].first_ms == now - 20 * DAY_MS


class SlowProjector(Projector):
    """A projector whose batches take `pause_s` to read their rows (long work inside a step)."""

    pause_s = 0.0
    on_pause: Any = None

    async def _load_rows(
        self, tables: Tables, batch: Sequence[tuple[str, Event]], mentions: Mapping[str, Mention], now: int
    ) -> None:
        await super()._load_rows(tables, batch, mentions, now)
        if self.on_pause is not None:
            await self.on_pause()
        await asyncio.sleep(self.pause_s)


async def _run_for(projector: Projector, seconds: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_the_lease_is_renewed_during_a_step_longer_than_the_lease_and_the_projector_writes(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    last = (await ledger.append_many([completed("t1", "w1"), completed("t2", "w1")]))[-1]
    projector = SlowProjector(redis_client, keys, lease_ms=300)
    projector.pause_s = 1.0  # more than three leases
    rival = Projector(redis_client, keys, lease_ms=300)
    rival_got_it: list[bool] = []

    async def rival_tries() -> None:
        rival_got_it.append(await rival.acquire())

    projector.on_pause = rival_tries
    await _run_for(projector, 2.0)
    assert rival_got_it and not any(rival_got_it)
    snap = await snapshot(redis_client, keys)
    assert snap.checkpoint == last
    assert snap.speed["w1", D1].decode_tps.n == 2


async def test_a_projector_whose_lease_renewal_fails_writes_nothing_though_it_still_owns_the_namespace(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await ledger.append(completed("t1", "w1"))
    projector = SlowProjector(redis_client, keys, lease_ms=300)
    projector.pause_s = 0.5

    async def lease_taken() -> None:
        # As if the lease had expired and another instance had taken it: renewals now fail.
        await redis_client.set(keys.singleton("projector"), "another")

    projector.on_pause = lease_taken
    await _run_for(projector, 1.5)
    ns = await store.current(redis_client, keys)
    assert ns is not None
    assert await redis_client.get(keys.owner(ns)) == projector.token.encode()  # the fence would let it
    assert await redis_client.get(keys.checkpoint(ns)) is None
    assert await get_task(redis_client, keys, "t1") is None
    assert (await snapshot(redis_client, keys)).speed == {}


async def test_a_projector_paused_past_its_lease_drops_its_batch_instead_of_writing(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await ledger.append(completed("t1", "w1"))
    projector = SlowProjector(redis_client, keys, lease_ms=200)
    assert await projector.acquire()
    await projector.start()

    async def blocked() -> None:
        # The whole process stalls (a long GC pause, a blocked loop): no renewal can run meanwhile.
        time.sleep(0.2)  # noqa: ASYNC251

    projector.on_pause = blocked
    with pytest.raises(LeaseLostError, match="may have expired"):
        await projector.step()
    assert projector.tables is None
    assert await get_task(redis_client, keys, "t1") is None
    # Taking the lease again, it folds the batch from Redis's state.
    projector.on_pause = None
    assert await projector.acquire()
    assert await projector.catch_up() == 1
    assert (await snapshot(redis_client, keys)).speed["w1", D1].decode_tps.n == 1
