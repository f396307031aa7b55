"""A task's (or a pipeline's) events without reading the ledger: the entry index.

The projector lists on each task row the ledger entry ids of the task's events (TaskRow.entries),
and on each pipeline row its own events' ids and its tasks (PipelineRow). A lookup finds the
row(s) in the day shards (projections/store.py `find_in_shards`), then reads each listed entry by
its id (XRANGE id id, all in one pipeline) together with the unfolded tail: the entries after the
live namespace's checkpoint, which no row lists yet, filtered for the id. Its cost is the task's
events plus the tail, whatever the ledger's length.

What it does not find:
- entries the archive already trimmed off the stream: their ids are listed, but XRANGE returns
  nothing for them (the whole-ledger scan this replaces did not read the archive either);
- events of a task whose row's day shard fell out of retention (`task_retention_days`).

The tail is short while the projector keeps up. A stopped or lagging projector makes it long, so
at most `TAIL_MAX` entries of it are read: the answer then lacks what lies beyond, `tail_cut` says
so and a warning is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from events.codec import as_str, decode_rows
from events.compression import unpack
from events.event import (
    Event,
    PipelineChildAdded,
    PipelineCompleted,
    PipelineStarted,
    TaskSubmitted,
)
from events.keys import Keys
from events.ledger import next_id
from projections import store
from projections.errors import ProjectionError
from projections.snapshot import entry_ids
from projections.tables import DEFAULT_TASK_RETENTION_DAYS

log = logging.getLogger("routeledger.index")

# The most unfolded entries one lookup reads after the checkpoint: with the projector live the tail
# is a batch or less; past this the projector is stopped or far behind, and the answer is cut.
TAIL_MAX: Final = 10_000

_PIPELINE_EVENTS: Final = (PipelineStarted, PipelineChildAdded, PipelineCompleted)


@dataclass
class Found:
    """What a lookup found, and what it read to find it."""

    # (entry id, event), in ledger order.
    events: list[tuple[str, Event]] = field(default_factory=list)
    # Entries read by their listed ids, and ledger entries read after the checkpoint.
    indexed: int = 0
    tail_read: int = 0
    # True when the tail was longer than the lookup may read: events beyond it are missing.
    tail_cut: bool = False


@dataclass
class _Target:
    """What a lookup looks for in the tail: events of these tasks, and of this pipeline (whose
    tasks submitted in the tail join `task_ids` as they are met)."""

    task_ids: set[str]
    pipeline_id: str | None = None

    def needles(self) -> list[bytes]:
        out = [t.encode() for t in self.task_ids]
        return [*out, self.pipeline_id.encode()] if self.pipeline_id else out

    def takes(self, event: Event) -> bool:
        pid = self.pipeline_id
        if pid is not None:
            if isinstance(event, _PIPELINE_EVENTS) and event.pipeline_id == pid:
                return True
            if isinstance(event, TaskSubmitted) and event.pipeline_id == pid:
                self.task_ids.add(event.task_id)
                return True
        return getattr(event, "task_id", None) in self.task_ids


async def task_events(redis: aioredis.Redis, keys: Keys, task_id: str, *, tail_max: int = TAIL_MAX) -> Found:
    """Every event of `task_id` in the ledger's stream, in order (none for an unknown id)."""
    position = await _position(redis, keys)
    rows = await _rows(redis, keys, position, [(store.TASKS, task_id)])
    ids = _ids(rows.get((store.TASKS, task_id)), store.decode_task)
    return await _read(redis, keys, position, ids, _Target({task_id}), tail_max)


async def pipeline_events(
    redis: aioredis.Redis, keys: Keys, pipeline_id: str, *, tail_max: int = TAIL_MAX
) -> Found:
    """A pipeline's own events and every event of its tasks, in order (none for an unknown id)."""
    position = await _position(redis, keys)
    found = await _rows(redis, keys, position, [(store.PIPELINES, pipeline_id)])
    raw = found.get((store.PIPELINES, pipeline_id))
    ids: list[str] = []
    tasks: list[str] = []
    if raw is not None:
        row = _decode(raw, store.decode_pipeline)
        ids, tasks = entry_ids(row.entries), row.tasks
        by_task = await _rows(redis, keys, position, [(store.TASKS, t) for t in tasks])
        for t in tasks:
            ids += _ids(by_task.get((store.TASKS, t)), store.decode_task)
    return await _read(redis, keys, position, ids, _Target(set(tasks), pipeline_id), tail_max)


@dataclass(frozen=True)
class _Position:
    """The live namespace and how far it folded, read before any row (see `_read`)."""

    ns: str | None
    checkpoint: str | None
    retention_days: int


async def _position(redis: aioredis.Redis, keys: Keys) -> _Position:
    ns = await store.current(redis, keys)
    if ns is None:
        return _Position(None, None, DEFAULT_TASK_RETENTION_DAYS)
    pipe = redis.pipeline(transaction=False)
    pipe.get(keys.checkpoint(ns))
    pipe.hget(keys.table(ns, store.META), "task_retention_days")
    cp, retention = await pipe.execute()
    return _Position(
        ns,
        None if cp is None else as_str(cp),
        DEFAULT_TASK_RETENTION_DAYS if retention is None else int(retention),
    )


async def _rows(
    redis: aioredis.Redis, keys: Keys, position: _Position, fields: Sequence[store.ShardedField]
) -> dict[store.ShardedField, bytes]:
    if position.ns is None or not fields:
        return {}
    now = store.ledger_ms(position.checkpoint)
    # No row lives in a shard newer than the checkpoint's day.
    want = store.Wanted(store.shard_day(now))
    return await store.find_in_shards(
        redis,
        keys,
        position.ns,
        dict.fromkeys(fields, want),
        retention_days=position.retention_days,
        now_ms=now,
    )


def _decode(raw: bytes, decode: Any) -> Any:
    try:
        return decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProjectionError(f"an index row does not decode: {exc}") from None


def _ids(raw: bytes | None, decode: Any) -> list[str]:
    return [] if raw is None else entry_ids(_decode(raw, decode).entries)


async def _read(
    redis: aioredis.Redis,
    keys: Keys,
    position: _Position,
    ids: list[str],
    target: _Target,
    tail_max: int,
) -> Found:
    """The listed entries and the tail after `position`'s checkpoint, in one round trip.

    The checkpoint was read before the rows: a batch folded meanwhile lists entries the tail also
    holds (kept once), and nothing folded after the checkpoint can be missing from the tail.
    """
    pipe = redis.pipeline(transaction=False)
    # A pipeline's step is listed on its row and on its task's: read once.
    for entry_id in dict.fromkeys(ids):
        pipe.xrange(keys.events, entry_id, entry_id)
    start = "0-0" if position.checkpoint is None else next_id(position.checkpoint)
    pipe.xrange(keys.events, start, "+", count=tail_max + 1)
    replies: list[Any] = await pipe.execute()
    listed = [(as_str(i), flat) for reply in replies[:-1] for i, flat in reply]
    tail = [(as_str(i), flat) for i, flat in replies[-1]]
    cut = len(tail) > tail_max
    if cut:
        tail = tail[:tail_max]
        log.warning(
            "the lookup of %s read %d unfolded entries and stopped there: the projector is stopped or "
            "far behind, and later events are left out",
            target.pipeline_id or next(iter(target.task_ids), "?"),
            tail_max,
        )
    found: dict[str, Event] = {}
    for entry_id, event in decode_rows(_flat(listed), lambda exc: None):
        found[entry_id] = event
    hits = _hits(tail, target)
    for entry_id, event in hits:
        found.setdefault(entry_id, event)
    events = sorted(found.items(), key=lambda item: _key(item[0]))
    return Found(events=events, indexed=len(listed), tail_read=len(tail), tail_cut=cut)


def _hits(tail: list[tuple[str, Any]], target: _Target) -> list[tuple[str, Event]]:
    """The tail's events of `target`, in order. Filtered on the bytes first (decompressed: a name
    is not visible in zstd's output); decoding every entry is the expensive part."""
    out: list[tuple[str, Event]] = []
    needles = target.needles()
    for entry_id, flat in _flat(tail):
        if not any(n in _plain(part) for part in flat[1::2] for n in needles):
            continue
        for decoded_id, event in decode_rows([(entry_id, flat)], lambda exc: None):
            if target.takes(event):
                out.append((decoded_id, event))
                needles = target.needles()
    return out


def _flat(rows: list[tuple[str, Any]]) -> list[tuple[str, Sequence[bytes]]]:
    """Rows with their fields as Redis's flat list (a client may hand them over as a dict)."""
    out: list[tuple[str, Sequence[bytes]]] = []
    for entry_id, fields in rows:
        if isinstance(fields, dict):
            out.append((entry_id, [x for kv in fields.items() for x in kv]))
        else:
            out.append((entry_id, fields))
    return out


def _plain(value: bytes) -> bytes:
    """A field's value with a compressed event's data decompressed (anything unreadable as is)."""
    try:
        return unpack(value)
    except ValueError:
        return value


def _key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
