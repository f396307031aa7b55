"""Rebuild the projection tables from the ledger, in memory or into a new live namespace.

The ledger's history is read in order (replay/history.py: the archive's segments through their
typed columns, then the stream in chunks of raw rows), turned into polars frames, and folded with
group_by (replay/fold.py). `rebuild` writes the result into a new
namespace and switches `rl:p:current` to it in one SET: readers see the old tables or the new
ones, never a half-built one, and the live projector adopts the new namespace and goes on from its
checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import polars as pl
import redis.asyncio as aioredis

from events.errors import UndecodableEntryError
from events.keys import Keys
from projections import store
from projections.snapshot import DEFAULT_DEMAND_HALF_LIFE_S, DEFAULT_HALF_LIFE_S
from projections.tables import DEFAULT_TASK_RETENTION_DAYS, Tables
from replay.errors import BadUntilError
from replay.fold import encoded_task_rows, fold_frames, fold_tables
from replay.frames import Frames
from replay.history import History

READ_CHUNK = 5000
_STREAM_ID = re.compile(r"^\d+(-\d+)?$")

Progress = Callable[[int], None]


class RebuildResult(msgspec.Struct, kw_only=True):
    """What a rebuild did."""

    namespace: str | None
    previous: str | None
    checkpoint: str | None
    events: int
    poison: int
    switched: bool


def until_to_stop(until: str | None) -> str:
    """The XRANGE end for `--until`: a stream id as is, a time (ISO 8601, local time unless it says
    otherwise, or epoch ms) as the last id of that millisecond."""
    if until is None or until == "":
        return "+"
    if _STREAM_ID.match(until):
        return until
    try:
        when = dt.datetime.fromisoformat(until)
    except ValueError:
        raise BadUntilError(
            f"--until {until!r} is neither a stream id (1764000000000-0) nor a time (2025-11-24T10:00)"
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()
    return str(int(when.timestamp() * 1000))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while millions of short-lived objects are made: the events hold
    no cycles, and the collector's rescans would cost more than the fold."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


async def _read(
    redis: aioredis.Redis,
    keys: Keys,
    until: str | None,
    progress: Progress | None,
    chunk: int,
    archive_dir: str | Path | None,
) -> tuple[Frames, int, str | None, int]:
    """The history up to `until` as frames; with the entries read, the last id and the poison count."""
    history = History(redis, keys, archive_dir)
    frames = Frames()
    poison: list[UndecodableEntryError] = []
    read, last_id = await history.fold_into(
        frames, until_to_stop(until), on_poison=poison.append, progress=progress, chunk=chunk
    )
    return frames, read, last_id, len(poison)


async def build(
    redis: aioredis.Redis,
    keys: Keys | None = None,
    *,
    until: str | None = None,
    half_life_s: float = DEFAULT_HALF_LIFE_S,
    demand_half_life_s: float = DEFAULT_DEMAND_HALF_LIFE_S,
    task_retention_days: int = DEFAULT_TASK_RETENTION_DAYS,
    progress: Progress | None = None,
    chunk: int = READ_CHUNK,
    archive_dir: str | Path | None = None,
    now_ms: int | None = None,
) -> tuple[Tables, int]:
    """The tables as of `until` (default: the whole ledger, archive included), in memory; with the
    poison count. Task rows and marks of every day are there, those past retention included,
    unless `now_ms` is given: then those past retention at `now_ms` are left out before any row is
    made."""
    frames, read, last_id, poison = await _read(
        redis, keys or Keys.for_client(redis), until, progress, chunk, archive_dir
    )
    tables = fold_frames(frames, half_life_s, demand_half_life_s, task_retention_days, now_ms=now_ms)
    tables.checkpoint = last_id
    tables.folded = read
    return tables, poison


def task_shards(table: pl.DataFrame, retention_days: int, now_ms: int) -> list[store.TableChange]:
    """The rows of a task frame (replay/fold.py `task_frame`) grouped into their day shards and
    encoded only as the write reads them; shards past retention at ledger time `now_ms` left out."""
    day = (pl.col("first_ms").fill_null(now_ms) // store.DAY_MS).alias("_day")
    by_day = table.with_columns(day).partition_by("_day", as_dict=True, include_key=False)
    return [
        store.TableChange(store.shard_name(store.TASKS, d), encoded_task_rows(part))
        for (d,), part in sorted(by_day.items(), key=lambda item: int(item[0][0]))
        if store.shard_alive(int(d), retention_days, now_ms)
    ]


async def rebuild(
    redis: aioredis.Redis,
    keys: Keys | None = None,
    *,
    until: str | None = None,
    half_life_s: float = DEFAULT_HALF_LIFE_S,
    demand_half_life_s: float = DEFAULT_DEMAND_HALF_LIFE_S,
    task_retention_days: int = DEFAULT_TASK_RETENTION_DAYS,
    switch: bool = True,
    progress: Progress | None = None,
    archive_dir: str | Path | None = None,
) -> RebuildResult:
    """Rebuild every table into a new namespace and (unless `switch` is False) make it live.
    Task rows and marks go into their day shards, as the projector writes them; shards already
    past retention are not written (nor their rows made)."""
    keys = keys or Keys.for_client(redis)
    frames, read, last_id, poison = await _read(redis, keys, until, progress, READ_CHUNK, archive_dir)
    # Retention is judged at ledger time, as the projector judges it: the newest entry's ms.
    now_ms = store.ledger_ms(last_id)
    tables, tasks = fold_tables(frames, half_life_s, demand_half_life_s, task_retention_days, now_ms=now_ms)
    # The events' frames are the bulk of the memory: gone before the rows are encoded.
    del frames
    tables.checkpoint = last_id
    tables.folded = read
    shards = task_shards(tasks, task_retention_days, now_ms)
    del tasks
    ns = await store.create(redis, keys, tables, built_by="rebuild", tasks=shards, now_ms=now_ms)
    previous = await store.switch(redis, keys, ns) if switch else await store.current(redis, keys)
    return RebuildResult(
        namespace=ns,
        previous=previous,
        checkpoint=tables.checkpoint,
        events=tables.folded,
        poison=poison,
        switched=switch,
    )
