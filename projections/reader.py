"""What readers (the router, the API) call: a snapshot of the tables, one task, and the lag."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import redis.asyncio as aioredis

from events.codec import as_str
from events.connection import redis_clock_ms
from events.event import now_ms as clock_ms
from events.keys import Keys
from events.ledger import next_id
from projections import store
from projections.errors import NoProjectionError, ProjectionError
from projections.snapshot import Snapshot, TaskRow
from projections.tables import DEFAULT_TASK_RETENTION_DAYS

_SNAPSHOT_TABLES = store.SMALL_TABLES


def _ms(entry_id: str) -> int:
    return int(entry_id.partition("-")[0])


async def snapshot(redis: aioredis.Redis, keys: Keys | None = None, *, now_ms: int | None = None) -> Snapshot:
    """Every table but tasks, plus the workers whose lease exists now, in three round trips.

    Before any projector ran there is no namespace: the snapshot is then empty (nothing is known).
    """
    keys = keys or Keys.for_client(redis)
    taken_at = clock_ms() if now_ms is None else now_ms
    ns = await store.current(redis, keys)
    if ns is None:
        return Snapshot(taken_at=taken_at)
    pipe = redis.pipeline(transaction=False)
    pipe.get(keys.checkpoint(ns))
    pipe.hmget(keys.table(ns, store.META), ["half_life_s", "demand_half_life_s"])
    for name in _SNAPSHOT_TABLES:
        pipe.hgetall(keys.table(ns, name))
    replies: list[Any] = await pipe.execute()
    cp, (hl, dhl), speed, length, quality, fleet, demand = replies
    try:
        fleet_rows = store.decode_fleet(fleet)
        snap = Snapshot(
            checkpoint=None if cp is None else as_str(cp),
            taken_at=taken_at,
            speed=store.decode_speed(speed),
            length=store.decode_length(length),
            quality=store.decode_quality(quality),
            fleet=fleet_rows,
            demand=store.decode_demand(demand),
        )
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProjectionError(f"namespace {ns!r} holds a row that does not decode: {exc}") from None
    if hl is not None:
        snap.half_life_s = float(hl)
    if dhl is not None:
        snap.demand_half_life_s = float(dhl)
    workers = sorted(fleet_rows)
    if workers:
        pipe = redis.pipeline(transaction=False)
        for worker in workers:
            pipe.exists(keys.live(worker))
        alive: list[Any] = await pipe.execute()
        snap.live = [w for w, n in zip(workers, alive, strict=True) if n]
    return snap


async def get_task(redis: aioredis.Redis, keys: Keys | None, task_id: str) -> TaskRow | None:
    """The tasks row of `task_id`, or None when the projection has not seen it (or it expired)."""
    return (await get_tasks(redis, keys or Keys.for_client(redis), [task_id])).get(task_id)


async def get_tasks(redis: aioredis.Redis, keys: Keys, task_ids: Sequence[str]) -> dict[str, TaskRow]:
    """The tasks rows of `task_ids` that the projection has seen, from whichever live day shard
    holds them: the newest two in one round trip, older ones in one more for the rest."""
    ns = await store.current(redis, keys)
    if ns is None or not task_ids:
        return {}
    # Which shards exist is a matter of ledger time: the namespace's own checkpoint says it, and no
    # row is in a shard newer than the checkpoint's day.
    pipe = redis.pipeline(transaction=False)
    pipe.get(keys.checkpoint(ns))
    pipe.hget(keys.table(ns, store.META), "task_retention_days")
    cp, retention = await pipe.execute()
    now = store.ledger_ms(None if cp is None else as_str(cp))
    want = store.Wanted(store.shard_day(now))
    wanted = {(store.TASKS, t): want for t in task_ids}
    days = DEFAULT_TASK_RETENTION_DAYS if retention is None else int(retention)
    raw = await store.find_in_shards(redis, keys, ns, wanted, retention_days=days, now_ms=now)
    try:
        return {t: store.decode_task(raw[store.TASKS, t]) for t in task_ids if (store.TASKS, t) in raw}
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProjectionError(f"a task row of {list(task_ids)} does not decode: {exc}") from None


async def lag(redis: aioredis.Redis, keys: Keys | None = None) -> tuple[int, int]:
    """(entries behind, ms behind) of the live namespace: how much of the ledger is not folded yet.

    ms behind is the age, by Redis's clock, of the oldest entry not yet folded (0 when none is).
    Entries behind is what the ledger ever held (the stream's length and what the archive took off
    it) less what the namespace folded; for the moment between an archive run's manifest and its
    trim it counts that segment twice. Raises NoProjectionError before the first projector ran.
    """
    keys = keys or Keys.for_client(redis)
    ns = await store.current(redis, keys)
    if ns is None:
        raise NoProjectionError("no projection yet: no projector has run against this Redis")
    pipe = redis.pipeline(transaction=False)
    pipe.get(keys.checkpoint(ns))
    pipe.hget(keys.table(ns, store.META), "folded")
    pipe.xlen(keys.events)
    pipe.hget(keys.archive, "events")
    cp_raw, folded_raw, length, archived = await pipe.execute()
    server_ms = await redis_clock_ms(redis, keys.events)
    checkpoint = "0-0" if cp_raw is None else as_str(cp_raw)
    rows: Any = await redis.xrange(keys.events, next_id(checkpoint), "+", count=1)
    if not rows:
        return 0, 0
    behind = max(1, int(length) + int(archived or 0) - int(folded_raw or 0))
    return behind, max(0, server_ms - _ms(as_str(rows[0][0])))
