"""The Redis layout of the projection tables, and the one atomic step that writes them.

A namespace `ns` holds, all under the hash tag `{ns}` (one cluster slot):

    rl:p:{ns}:speed    hash  worker SEP digest -> msgpack SpeedRow
    rl:p:{ns}:length   hash  digest SEP domain -> msgpack LengthRow
    rl:p:{ns}:quality  hash  digest SEP domain -> msgpack QualityRow
    rl:p:{ns}:fleet    hash  worker            -> msgpack FleetRow
    rl:p:{ns}:tasks    hash  task_id           -> msgpack TaskRow
    rl:p:{ns}:demand   hash  digest            -> msgpack DemandRow
    rl:p:{ns}:benched  hash  bench_id SEP task_id -> "" (benchmark results already counted)
    rl:p:{ns}:meta     hash  half_life_s, demand_half_life_s, folded, built_by, created_at
    rl:p:{ns}:checkpoint  string  the last ledger id folded
    rl:p:{ns}:owner       string  token of the projector allowed to write

Every row carries its own per-field statistics and `updated_at`/`at`, so the timestamps are
visible in the stored value itself. `rl:p:current` names the live namespace.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice
from typing import Any, Final

import hiredis
import msgspec
import redis.asyncio as aioredis

from events.codec import as_str
from events.keys import Keys
from projections.errors import ProjectionError
from projections.snapshot import DemandRow, FleetRow, LengthRow, QualityRow, SpeedRow, TaskRow
from projections.tables import Tables, pair_key, split_pair

SPEED: Final = "speed"
LENGTH: Final = "length"
QUALITY: Final = "quality"
FLEET: Final = "fleet"
TASKS: Final = "tasks"
DEMAND: Final = "demand"
BENCHED: Final = "benched"
META: Final = "meta"
TABLE_NAMES: Final = (SPEED, LENGTH, QUALITY, FLEET, TASKS, DEMAND, BENCHED)

# A namespace replaced by a rebuild stays readable this long, for readers that resolved
# `rl:p:current` just before the switch.
RETIRE_AFTER_MS: Final = 60_000
# Rows per HSET when a whole namespace is written.
WRITE_CHUNK: Final = 1000

_encoder: Final = msgspec.msgpack.Encoder()
_speed_dec: Final = msgspec.msgpack.Decoder(SpeedRow)
_length_dec: Final = msgspec.msgpack.Decoder(LengthRow)
_quality_dec: Final = msgspec.msgpack.Decoder(QualityRow)
_fleet_dec: Final = msgspec.msgpack.Decoder(FleetRow)
_task_dec: Final = msgspec.msgpack.Decoder(TaskRow)
_demand_dec: Final = msgspec.msgpack.Decoder(DemandRow)

# The table update and the checkpoint in one step, refused unless the caller still owns the
# namespace (fencing) and the checkpoint is where the caller last left it.
# KEYS: owner, checkpoint, meta, then the tables that changed.
# ARGV: token, expected checkpoint ('' for none), new checkpoint, folded count, then per table
# its number of fields followed by field, value pairs.
_APPLY: Final = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local cp = redis.call('GET', KEYS[2]) or ''
if cp ~= ARGV[2] then return -1 end
local pos = 5
for i = 4, #KEYS do
  local n = tonumber(ARGV[pos])
  pos = pos + 1
  for j = 1, n do
    redis.call('HSET', KEYS[i], ARGV[pos], ARGV[pos + 1])
    pos = pos + 2
  end
end
redis.call('SET', KEYS[2], ARGV[3], 'KEEPTTL')
redis.call('HSET', KEYS[3], 'folded', ARGV[4])
return 1
"""

# Takes a namespace over for a new owner: the old owner's next write is refused from here on.
_ADOPT: Final = """
redis.call('SET', KEYS[1], ARGV[1])
return redis.call('GET', KEYS[2])
"""

APPLIED: Final = 1
NOT_OWNER: Final = 0
MOVED: Final = -1


def new_namespace() -> str:
    """A fresh namespace name: creation time (for humans) and a random suffix."""
    return f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"


def table_keys(keys: Keys, ns: str) -> list[str]:
    """Every key of namespace `ns`."""
    return [keys.table(ns, t) for t in (*TABLE_NAMES, META)] + [keys.checkpoint(ns), keys.owner(ns)]


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


def _lazy_fields(tables: Tables) -> dict[str, Iterator[tuple[str, bytes]]]:
    return {
        SPEED: ((pair_key(*k), encode_row(r)) for k, r in tables.speed.items()),
        LENGTH: ((pair_key(*k), encode_row(r)) for k, r in tables.length.items()),
        QUALITY: ((pair_key(*k), encode_row(r)) for k, r in tables.quality.items()),
        FLEET: ((k, encode_row(r)) for k, r in tables.fleet.items()),
        TASKS: ((k, encode_row(r)) for k, r in tables.tasks.items()),
        DEMAND: ((k, encode_row(r)) for k, r in tables.demand.items()),
        BENCHED: ((pair_key(*k), b"") for k in tables.benched),
    }


def _meta(tables: Tables, built_by: str) -> dict[str, str]:
    return {
        "half_life_s": repr(tables.half_life_s),
        "demand_half_life_s": repr(tables.demand_half_life_s),
        "folded": str(tables.folded),
        "built_by": built_by,
        "created_at": str(time.time_ns() // 1_000_000),
    }


# -- reading -----------------------------------------------------------------------------------


async def load(redis: aioredis.Redis, keys: Keys, ns: str, *, with_tasks: bool = True) -> Tables:
    """Every table of namespace `ns`, in one round trip."""
    pipe = redis.pipeline(transaction=False)
    pipe.get(keys.checkpoint(ns))
    pipe.hgetall(keys.table(ns, META))
    for name in TABLE_NAMES:
        if name != TASKS or with_tasks:
            pipe.hgetall(keys.table(ns, name))
    replies: list[Any] = await pipe.execute()
    cp, meta = replies[0], {as_str(k): as_str(v) for k, v in replies[1].items()}
    by_name = dict(zip([n for n in TABLE_NAMES if n != TASKS or with_tasks], replies[2:], strict=True))
    try:
        return Tables(
            half_life_s=float(meta["half_life_s"]),
            demand_half_life_s=float(meta["demand_half_life_s"]),
            checkpoint=None if cp is None else as_str(cp),
            folded=int(meta.get("folded", "0")),
            speed=decode_speed(by_name[SPEED]),
            length=decode_length(by_name[LENGTH]),
            quality=decode_quality(by_name[QUALITY]),
            fleet=decode_fleet(by_name[FLEET]),
            tasks=decode_tasks(by_name[TASKS]) if with_tasks else {},
            demand=decode_demand(by_name[DEMAND]),
            benched={split_pair(as_str(f)) for f in by_name[BENCHED]},
        )
    except KeyError as exc:
        raise ProjectionError(
            f"namespace {ns!r} has no meta field {exc}: not a projection namespace"
        ) from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProjectionError(f"namespace {ns!r} holds a row that does not decode: {exc}") from None


# -- writing -----------------------------------------------------------------------------------


def _hset_commands(key: str, fields: Iterator[tuple[str, bytes]]) -> Iterator[bytes]:
    """HSETs of up to WRITE_CHUNK fields each, packed for the wire by hiredis (in C: redis-py's
    Python packer costs more than Redis takes to run the commands). Rows are encoded a chunk at
    a time, so that Redis runs one HSET while the next is encoded."""
    while chunk := list(islice(fields, WRITE_CHUNK)):
        packed: bytes = hiredis.pack_command((b"HSET", key, *chain.from_iterable(chunk)))  # type: ignore[arg-type]
        yield packed


async def _send_packed(redis: aioredis.Redis, commands: Iterable[bytes]) -> None:
    """Send packed commands on one connection, as a pipeline, then read every reply."""
    pool = redis.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        sent = 0
        for command in commands:
            await conn.send_packed_command(command, check_health=sent == 0)
            sent += 1
        for _ in range(sent):
            await conn.read_response()
    except BaseException:
        # Replies may still be on their way: the connection cannot be reused.
        await conn.disconnect()
        raise
    finally:
        await pool.release(conn)


async def create(redis: aioredis.Redis, keys: Keys, tables: Tables, *, built_by: str, owner: str = "") -> str:
    """Write `tables` into a new namespace and return its name; nothing reads it until `switch`."""
    ns = new_namespace()
    await _send_packed(
        redis,
        chain.from_iterable(
            _hset_commands(keys.table(ns, name), fields) for name, fields in _lazy_fields(tables).items()
        ),
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
    pipe = redis.pipeline(transaction=False)
    for key in table_keys(keys, ns):
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
        changes: Sequence[tuple[str, Iterable[tuple[str, bytes]]]],
    ) -> int:
        """Write `changes` (table name, (field, value) pairs) and move the checkpoint from
        `expected` to `checkpoint`. APPLIED, NOT_OWNER (fenced out) or MOVED (someone else wrote)."""
        script_keys = [
            self.keys.owner(self.ns),
            self.keys.checkpoint(self.ns),
            self.keys.table(self.ns, META),
        ]
        args: list[Any] = [self.token, expected or "", checkpoint, folded]
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
