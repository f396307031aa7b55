"""The Redis layout of the projection tables, and the one atomic step that writes them.

A namespace `ns` holds, all under the hash tag `{ns}` (one cluster slot):

    rl:p:{ns}:speed    hash  worker SEP digest -> msgpack SpeedRow
    rl:p:{ns}:length   hash  digest SEP domain -> msgpack LengthRow
    rl:p:{ns}:quality  hash  digest SEP domain -> msgpack QualityRow
    rl:p:{ns}:fleet    hash  worker            -> msgpack FleetRow
    rl:p:{ns}:demand   hash  digest            -> msgpack DemandRow
    rl:p:{ns}:tasks:<yyyymmdd>    hash  task_id -> msgpack TaskRow
    rl:p:{ns}:benched:<yyyymmdd>  hash  bench_id SEP task_id -> stream ms (benchmark results counted)
    rl:p:{ns}:pipelines:<yyyymmdd>  hash  pipeline_id -> msgpack PipelineRow (its entries and tasks)
    rl:p:{ns}:meta     hash  half_life_s, demand_half_life_s, task_retention_days, folded, built_by,
                             created_at
    rl:p:{ns}:checkpoint  string  the last ledger id folded
    rl:p:{ns}:owner       string  token of the projector allowed to write

Every row carries its own per-field statistics and `updated_at`/`at`, so the timestamps are
visible in the stored value itself. `rl:p:current` names the live namespace.

Task rows, benchmark marks and pipeline rows grow with history, so they are never read whole by the projector:
they live in day shards, named by the UTC day of the stream id (its ms part) of the ledger entry
that created them. A shard is dropped once it is `task_retention_days` past its day by *ledger
time*, the ms of the newest entry folded (the checkpoint), not by any clock: the tables stay a
function of the history alone, so a rebuild made at any moment equals the live namespace, and a
history squeezed into minutes keeps the same window a real one would. A lookup reads only the rows
it needs (HMGET), newest shards first (`find_in_shards`).
"""

from __future__ import annotations

import secrets
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain, islice
from pathlib import Path
from typing import Any, Final, NamedTuple

import msgspec
import redis.asyncio as aioredis

from events.codec import as_str
from events.keys import Keys
from events.scripts import read_lua
from projections.errors import ProjectionError
from projections.snapshot import (
    DemandRow,
    FleetRow,
    LengthRow,
    PipelineRow,
    QualityRow,
    SpeedRow,
    TaskRow,
)
from projections.tables import DEFAULT_TASK_RETENTION_DAYS, Tables, pair_key, split_pair

SPEED: Final = "speed"
LENGTH: Final = "length"
QUALITY: Final = "quality"
FLEET: Final = "fleet"
TASKS: Final = "tasks"
DEMAND: Final = "demand"
BENCHED: Final = "benched"
PIPELINES: Final = "pipelines"
META: Final = "meta"
# Bounded by workers x models x domains: read whole when a projector starts.
SMALL_TABLES: Final = (SPEED, LENGTH, QUALITY, FLEET, DEMAND)
# One row per task, benchmark result or pipeline ever: day-sharded, read row by row.
SHARDED_TABLES: Final = (TASKS, BENCHED, PIPELINES)
TABLE_NAMES: Final = (*SMALL_TABLES, *SHARDED_TABLES)

DAY_MS: Final = 86_400_000
# A lookup first reads this many of the newest shards; a task's later events are nearly always
# within a day of its first one.
NEAR_SHARDS: Final = 2

# A namespace replaced by a rebuild stays readable this long, for readers that resolved
# `rl:p:current` just before the switch.
RETIRE_AFTER_MS: Final = 60_000
# Rows per HSET when a whole namespace is written.
WRITE_CHUNK: Final = 1000
# HSETs sent per pipeline while a namespace is written (about a megabyte of fields at most).
WRITE_PIPELINE: Final = 16

_encoder: Final = msgspec.msgpack.Encoder()
_speed_dec: Final = msgspec.msgpack.Decoder(SpeedRow)
_length_dec: Final = msgspec.msgpack.Decoder(LengthRow)
_quality_dec: Final = msgspec.msgpack.Decoder(QualityRow)
_fleet_dec: Final = msgspec.msgpack.Decoder(FleetRow)
_task_dec: Final = msgspec.msgpack.Decoder(TaskRow)
_demand_dec: Final = msgspec.msgpack.Decoder(DemandRow)
_pipeline_dec: Final = msgspec.msgpack.Decoder(PipelineRow)

# The Lua this module runs (projections/lua/*.lua), each file headed by the KEYS and ARGV it takes.
_LUA: Final = Path(__file__).parent / "lua"
# The fenced write of a namespace's changed rows and checkpoint, and the take-over of a namespace.
_APPLY: Final = read_lua(_LUA / "apply.lua")
_ADOPT: Final = read_lua(_LUA / "adopt.lua")

APPLIED: Final = 1
NOT_OWNER: Final = 0
MOVED: Final = -1


def new_namespace() -> str:
    """A fresh namespace name: creation time (for humans) and a random suffix."""
    return f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"


class TableChange(NamedTuple):
    """The changed rows of one table (or day shard) for `NamespaceWriter.apply`."""

    name: str
    fields: Iterable[tuple[str, bytes]]


# -- day shards --------------------------------------------------------------------------------


def shard_day(ms: int) -> int:
    """The UTC day (days since the epoch) of a stream-id ms: the shard it names."""
    return ms // DAY_MS


def shard_name(table: str, day: int) -> str:
    """The table name of one day shard, for `Keys.table` (e.g. `tasks:20251124`)."""
    return f"{table}:{time.strftime('%Y%m%d', time.gmtime(day * 86_400))}"


def ledger_ms(checkpoint: str | None) -> int:
    """Ledger time: the ms part of the newest entry folded (0 before any)."""
    return 0 if not checkpoint else int(checkpoint.partition("-")[0])


def oldest_live_day(retention_days: int, ledger_ms: int) -> int:
    """The oldest day whose shard is kept at ledger time `ledger_ms`."""
    return shard_day(ledger_ms) - retention_days


def shard_alive(day: int, retention_days: int, ledger_ms: int) -> bool:
    """Whether the shard of `day` is still within retention at ledger time `ledger_ms`."""
    return day >= oldest_live_day(retention_days, ledger_ms)


def live_days(newest: int, retention_days: int, ledger_ms: int) -> list[int]:
    """The days from `newest` back whose shards are kept at ledger time `ledger_ms`, newest first."""
    return list(range(newest, oldest_live_day(retention_days, ledger_ms) - 1, -1))


def dropped_days(retention_days: int, before_ms: int, after_ms: int) -> range:
    """The days whose shards fall out of retention as ledger time moves from `before_ms` on."""
    if before_ms <= 0:
        return range(0)
    return range(oldest_live_day(retention_days, before_ms), oldest_live_day(retention_days, after_ms))


def task_day(row: TaskRow, ledger_ms: int) -> int:
    """The day shard of a task row (a row from before shards: the ledger's day)."""
    return shard_day(row.first_ms if row.first_ms is not None else ledger_ms)


def drop_expired(tables: Tables) -> None:
    """Remove the task rows and benchmark marks whose day shard is past retention at the tables'
    ledger time: what a rebuild does not write and the live namespace no longer holds."""
    keep, now = tables.task_retention_days, ledger_ms(tables.checkpoint)
    tables.tasks = {k: r for k, r in tables.tasks.items() if shard_alive(task_day(r, now), keep, now)}
    tables.benched = {k: ms for k, ms in tables.benched.items() if shard_alive(shard_day(ms), keep, now)}
    tables.pipelines = {
        k: r for k, r in tables.pipelines.items() if shard_alive(pipeline_day(r, now), keep, now)
    }


def pipeline_day(row: PipelineRow, ledger_ms: int) -> int:
    """The day shard of a pipeline row."""
    return shard_day(row.first_ms if row.first_ms is not None else ledger_ms)


def table_keys(keys: Keys, ns: str, retention_days: int, ledger_ms: int) -> list[str]:
    """Every key of namespace `ns`, its live day shards at ledger time `ledger_ms` included."""
    shards = [
        keys.table(ns, shard_name(t, d))
        for t in SHARDED_TABLES
        for d in live_days(shard_day(ledger_ms) + 1, retention_days, ledger_ms)
    ]
    return [keys.table(ns, t) for t in (*SMALL_TABLES, META)] + shards + [keys.checkpoint(ns), keys.owner(ns)]


async def current(redis: aioredis.Redis, keys: Keys) -> str | None:
    """The live namespace, or None when no projection exists yet."""
    raw: Any = await redis.get(keys.current)
    return None if raw is None else as_str(raw)


# -- encoding ----------------------------------------------------------------------------------


def encode_row(row: msgspec.Struct) -> bytes:
    return _encoder.encode(row)


def decode_speed(raw: dict[Any, Any]) -> dict[tuple[str, str], SpeedRow]:
    rows = (_speed_dec.decode(v) for v in raw.values())
    return {(r.worker, r.digest): r for r in rows}


def decode_length(raw: dict[Any, Any]) -> dict[tuple[str, str], LengthRow]:
    rows = (_length_dec.decode(v) for v in raw.values())
    return {(r.digest, r.domain): r for r in rows}


def decode_quality(raw: dict[Any, Any]) -> dict[tuple[str, str], QualityRow]:
    rows = (_quality_dec.decode(v) for v in raw.values())
    return {(r.digest, r.domain): r for r in rows}


def decode_fleet(raw: dict[Any, Any]) -> dict[str, FleetRow]:
    rows = (_fleet_dec.decode(v) for v in raw.values())
    return {r.worker: r for r in rows}


def decode_demand(raw: dict[Any, Any]) -> dict[str, DemandRow]:
    rows = (_demand_dec.decode(v) for v in raw.values())
    return {r.digest: r for r in rows}


def decode_task(raw: bytes) -> TaskRow:
    return _task_dec.decode(raw)


def decode_tasks(raw: dict[Any, Any]) -> dict[str, TaskRow]:
    rows = (_task_dec.decode(v) for v in raw.values())
    return {r.task_id: r for r in rows}


def decode_pipeline(raw: bytes) -> PipelineRow:
    return _pipeline_dec.decode(raw)


def decode_pipelines(raw: dict[Any, Any]) -> dict[str, PipelineRow]:
    rows = (_pipeline_dec.decode(v) for v in raw.values())
    return {r.pipeline_id: r for r in rows}


def encode_mark(ms: int) -> bytes:
    """The stored value of a benchmark mark: the stream-id ms of its BenchmarkResult."""
    return str(ms).encode()


def task_changes(rows: Iterable[TaskRow], retention_days: int, now_ms: int) -> list[TableChange]:
    """Task rows grouped into their day shards; shards already past retention at ledger time
    `now_ms` are left out (a rebuild writes none, and the live namespace dropped them)."""
    by_day: dict[int, list[tuple[str, bytes]]] = defaultdict(list)
    for row in rows:
        by_day[task_day(row, now_ms)].append((row.task_id, encode_row(row)))
    return _shard_changes(TASKS, by_day, retention_days, now_ms)


def pipeline_changes(rows: Iterable[PipelineRow], retention_days: int, now_ms: int) -> list[TableChange]:
    """Pipeline rows grouped into their day shards, as `task_changes`."""
    by_day: dict[int, list[tuple[str, bytes]]] = defaultdict(list)
    for row in rows:
        by_day[pipeline_day(row, now_ms)].append((row.pipeline_id, encode_row(row)))
    return _shard_changes(PIPELINES, by_day, retention_days, now_ms)


def bench_changes(
    marks: Iterable[tuple[tuple[str, str], int]], retention_days: int, now_ms: int
) -> list[TableChange]:
    """Benchmark marks grouped into their day shards, as `task_changes`."""
    by_day: dict[int, list[tuple[str, bytes]]] = defaultdict(list)
    for key, ms in marks:
        by_day[shard_day(ms)].append((pair_key(*key), encode_mark(ms)))
    return _shard_changes(BENCHED, by_day, retention_days, now_ms)


def _shard_changes(
    table: str, by_day: Mapping[int, list[tuple[str, bytes]]], retention_days: int, now_ms: int
) -> list[TableChange]:
    return [
        TableChange(shard_name(table, day), fields)
        for day, fields in sorted(by_day.items())
        if shard_alive(day, retention_days, now_ms)
    ]


def _lazy_fields(
    tables: Tables, now_ms: int, tasks: Sequence[TableChange] | None = None
) -> list[TableChange]:
    keep = tables.task_retention_days
    return [
        TableChange(SPEED, ((pair_key(*k), encode_row(r)) for k, r in tables.speed.items())),
        TableChange(LENGTH, ((pair_key(*k), encode_row(r)) for k, r in tables.length.items())),
        TableChange(QUALITY, ((pair_key(*k), encode_row(r)) for k, r in tables.quality.items())),
        TableChange(FLEET, ((k, encode_row(r)) for k, r in tables.fleet.items())),
        TableChange(DEMAND, ((k, encode_row(r)) for k, r in tables.demand.items())),
        *(task_changes(tables.tasks.values(), keep, now_ms) if tasks is None else tasks),
        *bench_changes(tables.benched.items(), keep, now_ms),
        *pipeline_changes(tables.pipelines.values(), keep, now_ms),
    ]


def _meta(tables: Tables, built_by: str) -> dict[str, str]:
    return {
        "half_life_s": repr(tables.half_life_s),
        "demand_half_life_s": repr(tables.demand_half_life_s),
        "task_retention_days": str(tables.task_retention_days),
        "folded": str(tables.folded),
        "built_by": built_by,
        "created_at": str(time.time_ns() // 1_000_000),
    }


# -- reading -----------------------------------------------------------------------------------


async def load(redis: aioredis.Redis, keys: Keys, ns: str, *, with_tasks: bool = True) -> Tables:
    """The tables of namespace `ns`: the small ones in one round trip, and with `with_tasks` every
    live day shard of tasks and benchmark marks too (offline tools only: that grows with history)."""
    pipe = redis.pipeline(transaction=False)
    pipe.get(keys.checkpoint(ns))
    pipe.hgetall(keys.table(ns, META))
    for name in SMALL_TABLES:
        pipe.hgetall(keys.table(ns, name))
    replies: list[Any] = await pipe.execute()
    cp, meta = replies[0], {as_str(k): as_str(v) for k, v in replies[1].items()}
    by_name = dict(zip(SMALL_TABLES, replies[2:], strict=True))
    try:
        tables = Tables(
            half_life_s=float(meta["half_life_s"]),
            demand_half_life_s=float(meta["demand_half_life_s"]),
            task_retention_days=int(meta.get("task_retention_days", DEFAULT_TASK_RETENTION_DAYS)),
            checkpoint=None if cp is None else as_str(cp),
            folded=int(meta.get("folded", "0")),
            speed=decode_speed(by_name[SPEED]),
            length=decode_length(by_name[LENGTH]),
            quality=decode_quality(by_name[QUALITY]),
            fleet=decode_fleet(by_name[FLEET]),
            demand=decode_demand(by_name[DEMAND]),
        )
        if with_tasks:
            await _load_shards(redis, keys, ns, tables)
    except KeyError as exc:
        raise ProjectionError(
            f"namespace {ns!r} has no meta field {exc}: not a projection namespace"
        ) from None
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ProjectionError(f"namespace {ns!r} holds a row that does not decode: {exc}") from None
    return tables


async def _load_shards(redis: aioredis.Redis, keys: Keys, ns: str, tables: Tables) -> None:
    now = ledger_ms(tables.checkpoint)
    days = live_days(shard_day(now), tables.task_retention_days, now)
    pipe = redis.pipeline(transaction=False)
    for day in days:
        pipe.hgetall(keys.table(ns, shard_name(TASKS, day)))
        pipe.hgetall(keys.table(ns, shard_name(BENCHED, day)))
        pipe.hgetall(keys.table(ns, shard_name(PIPELINES, day)))
    replies: list[Any] = await pipe.execute()
    # Oldest first, so that a row somehow present in two shards is the newest one's.
    shards = zip(replies[::3], replies[1::3], replies[2::3], strict=True)
    for tasks, marks, pipelines in reversed(list(shards)):
        tables.tasks.update(decode_tasks(tasks))
        tables.benched.update(decode_marks(marks))
        tables.pipelines.update(decode_pipelines(pipelines))


def decode_marks(raw: Mapping[Any, Any]) -> dict[tuple[str, str], int]:
    """Benchmark marks from a shard's fields and values."""
    return {split_pair(as_str(f)): int(v) if v else 0 for f, v in raw.items()}


class Wanted(NamedTuple):
    """What a lookup of one row needs to know: the newest day its shard may be, and whether only
    the newest shards can hold it."""

    newest_day: int
    near_only: bool = False


# A row of a day-sharded table: (table, field), e.g. (TASKS, task_id).
ShardedField = tuple[str, str]


async def find_in_shards(
    redis: aioredis.Redis,
    keys: Keys,
    ns: str,
    wanted: Mapping[ShardedField, Wanted],
    *,
    retention_days: int | None,
    now_ms: int | None,
) -> dict[ShardedField, bytes]:
    """The stored values of the `wanted` rows of the day-sharded tables, where found.

    The newest NEAR_SHARDS shards of each row come first, all in one pipeline; the rows not found
    there (unless `near_only`) are looked up in every older live shard, in one more. Without
    `retention_days` or ledger time `now_ms`, they are read from the namespace (its meta and its
    checkpoint) in the first round trip.
    """
    if not wanted:
        return {}
    found: dict[ShardedField, bytes] = {}
    near: dict[tuple[str, int], list[str]] = defaultdict(list)
    for (table, field), want in wanted.items():
        for day in range(want.newest_day, want.newest_day - NEAR_SHARDS, -1):
            near[table, day].append(field)
    pipe = redis.pipeline(transaction=False)
    if retention_days is None or now_ms is None:
        pipe.hget(keys.table(ns, META), "task_retention_days")
        pipe.get(keys.checkpoint(ns))
        raw, cp = await _hmget_shards(pipe, keys, ns, near, found, head=2)
        if retention_days is None:
            retention_days = DEFAULT_TASK_RETENTION_DAYS if raw is None else int(raw)
        if now_ms is None:
            now_ms = ledger_ms(None if cp is None else as_str(cp))
    else:
        await _hmget_shards(pipe, keys, ns, near, found)
    far: dict[tuple[str, int], list[str]] = defaultdict(list)
    for (table, field), want in wanted.items():
        if (table, field) in found or want.near_only:
            continue
        for day in live_days(want.newest_day - NEAR_SHARDS, retention_days, now_ms):
            far[table, day].append(field)
    if far:
        await _hmget_shards(redis.pipeline(transaction=False), keys, ns, far, found)
    return found


async def _hmget_shards(
    pipe: Any,
    keys: Keys,
    ns: str,
    shards: Mapping[tuple[str, int], list[str]],
    found: dict[ShardedField, bytes],
    head: int = 0,
) -> list[Any]:
    """HMGET each shard's fields in `pipe` (after its first `head` commands) and run it; newest
    day first, the first value found wins. Returns the replies of the `head` commands."""
    order = sorted(shards, key=lambda shard: -shard[1])
    for table, day in order:
        pipe.hmget(keys.table(ns, shard_name(table, day)), shards[table, day])
    replies: list[Any] = await pipe.execute()
    for (table, day), values in zip(order, replies[head:], strict=True):
        for field, value in zip(shards[table, day], values, strict=True):
            if value is not None and (table, field) not in found:
                found[table, field] = value
    return replies[:head]


# -- writing -----------------------------------------------------------------------------------


def _hset_chunks(key: str, fields: Iterator[tuple[str, bytes]]) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, fields) of HSETs of up to WRITE_CHUNK fields each. Rows are encoded a chunk at a
    time, so that a rebuild never holds a namespace's every field encoded at once."""
    while chunk := list(islice(fields, WRITE_CHUNK)):
        yield key, dict(chunk)


async def _hset_all(redis: aioredis.Redis, writes: Iterable[tuple[str, dict[str, bytes]]]) -> None:
    """Every HSET of `writes`, through non-transactional pipelines of WRITE_PIPELINE commands (on a
    cluster every key of a namespace shares its slot: each pipeline goes to one node)."""
    pipe = redis.pipeline(transaction=False)
    queued = 0
    for key, mapping in writes:
        pipe.hset(key, mapping=mapping)  # type: ignore[arg-type]
        queued += 1
        if queued == WRITE_PIPELINE:
            await pipe.execute()
            pipe, queued = redis.pipeline(transaction=False), 0
    if queued:
        await pipe.execute()


async def create(
    redis: aioredis.Redis,
    keys: Keys,
    tables: Tables,
    *,
    built_by: str,
    owner: str = "",
    tasks: Sequence[TableChange] | None = None,
    now_ms: int | None = None,
) -> str:
    """Write `tables` into a new namespace and return its name; nothing reads it until `switch`.

    `tasks`, when given, are the task rows' day shards, already grouped and encoded as they are
    written (a rebuild makes them from its frame, a batch at a time, without TaskRow objects),
    in place of `tables.tasks`. `now_ms` is the ledger time retention is judged at (default: the
    tables' checkpoint)."""
    ns = new_namespace()
    changes = _lazy_fields(tables, ledger_ms(tables.checkpoint) if now_ms is None else now_ms, tasks)
    await _hset_all(
        redis, chain.from_iterable(_hset_chunks(keys.table(ns, c.name), iter(c.fields)) for c in changes)
    )
    pipe = redis.pipeline(transaction=False)
    pipe.hset(keys.table(ns, META), mapping=_meta(tables, built_by))  # type: ignore[arg-type]
    if tables.checkpoint is not None:
        pipe.set(keys.checkpoint(ns), tables.checkpoint)
    pipe.set(keys.owner(ns), owner)
    await pipe.execute()
    return ns


async def switch(redis: aioredis.Redis, keys: Keys, ns: str) -> str | None:
    """Make `ns` the live namespace in one step; the one it replaces expires a minute later."""
    old_raw: Any = await redis.getset(keys.current, ns)
    old = None if old_raw is None else as_str(old_raw)
    if old is not None and old != ns:
        await retire(redis, keys, old)
    return old


async def switch_if_unset(redis: aioredis.Redis, keys: Keys, ns: str) -> str:
    """Make `ns` live unless a namespace already is; returns the live one."""
    if await redis.set(keys.current, ns, nx=True):
        return ns
    live = await current(redis, keys)
    if live is None:
        raise ProjectionError("rl:p:current vanished while a projector was starting")
    return live


async def retire(redis: aioredis.Redis, keys: Keys, ns: str, after_ms: int = RETIRE_AFTER_MS) -> None:
    """Let every key of namespace `ns` expire after `after_ms`."""
    raw: Any = await redis.hget(keys.table(ns, META), "task_retention_days")
    cp: Any = await redis.get(keys.checkpoint(ns))
    retention_days = DEFAULT_TASK_RETENTION_DAYS if raw is None else int(raw)
    pipe = redis.pipeline(transaction=False)
    for key in table_keys(keys, ns, retention_days, ledger_ms(None if cp is None else as_str(cp))):
        pipe.pexpire(key, after_ms)
    await pipe.execute()


class NamespaceWriter:
    """Writes changed rows and the checkpoint of one namespace in one fenced, atomic step."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, ns: str, token: str) -> None:
        self.redis = redis
        self.keys = keys
        self.ns = ns
        self.token = token
        self._apply = redis.register_script(_APPLY)
        self._adopt = redis.register_script(_ADOPT)

    async def adopt(self) -> str | None:
        """Become the namespace's owner; returns its checkpoint as the previous owner left it."""
        raw: Any = await self._adopt(
            keys=[self.keys.owner(self.ns), self.keys.checkpoint(self.ns)], args=[self.token]
        )
        return None if raw is None else as_str(raw)

    async def apply(
        self,
        expected: str | None,
        checkpoint: str,
        folded: int,
        changes: Sequence[TableChange],
        drop: Sequence[str] = (),
    ) -> int:
        """Delete the `drop` tables (day shards past retention), write `changes` (table name,
        (field, value) pairs) and move the checkpoint from `expected` to `checkpoint`. APPLIED,
        NOT_OWNER (fenced out) or MOVED (someone else wrote)."""
        script_keys = [
            self.keys.owner(self.ns),
            self.keys.checkpoint(self.ns),
            self.keys.table(self.ns, META),
            *(self.keys.table(self.ns, name) for name in drop),
        ]
        args: list[Any] = [self.token, expected or "", checkpoint, folded, len(drop)]
        for name, fields in changes:
            pairs = list(fields)
            if not pairs:
                continue
            script_keys.append(self.keys.table(self.ns, name))
            args.append(len(pairs))
            for field, value in pairs:
                args.append(field)
                args.append(value)
        result: Any = await self._apply(keys=script_keys, args=args)
        return int(result)
