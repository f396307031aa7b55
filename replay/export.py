"""The ledger as Parquet: one file per event type, one column per field, for polars or duckdb.

Nested timings and resources become prefixed columns (`timings_eval_count`); lists and maps
(inventory, breakdown) become JSON text. Every file has the stream id in `id` and the ledger order
in `seq`.
"""

from __future__ import annotations

from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import polars as pl
import redis.asyncio as aioredis

from events.codec import decode_rows
from events.errors import UndecodableEntryError
from events.event import EVENT_TYPES, Event
from events.keys import Keys
from replay.errors import ExportError
from replay.history import History
from replay.rebuild import Progress, until_to_stop

_FLUSH_EVERY = 100_000


def _columns(kind: type[Event], events: list[Event]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for name in kind.__struct_fields__:
        values = list(map(attrgetter(name), events))
        sample = next((v for v in values if v is not None), None)
        if isinstance(sample, msgspec.Struct):
            for sub in type(sample).__struct_fields__:
                out[f"{name}_{sub}"] = [None if v is None else getattr(v, sub) for v in values]
        elif isinstance(sample, list | dict):
            out[name] = [None if v is None else msgspec.json.encode(v).decode() for v in values]
        else:
            out[name] = values
    return out


async def ledger_frames(
    redis: aioredis.Redis,
    keys: Keys | None = None,
    *,
    until: str | None = None,
    progress: Progress | None = None,
    archive_dir: str | Path | None = None,
) -> dict[str, pl.DataFrame]:
    """The ledger (up to `until`, archive included) as one frame per event type present."""
    history = History(redis, keys or Keys.for_client(redis), archive_dir)
    by_name = {t.__name__: t for t in EVENT_TYPES}
    buffers: dict[str, tuple[list[str], list[int], list[Event]]] = {}
    frames: dict[str, list[pl.DataFrame]] = {}
    seq = 0
    pending = 0
    poison: list[UndecodableEntryError] = []

    def flush() -> None:
        for name, (ids, seqs, events) in buffers.items():
            data = {"id": ids, "seq": seqs, **_columns(by_name[name], events)}
            frames.setdefault(name, []).append(pl.DataFrame(data, strict=False, infer_schema_length=None))
        buffers.clear()

    async for rows in history.read_raw("-", until_to_stop(until), chunk=5000):
        for entry_id, event in decode_rows(rows, poison.append):
            name = type(event).__name__
            buf = buffers.get(name)
            if buf is None:
                buf = buffers[name] = ([], [], [])
            buf[0].append(entry_id)
            buf[1].append(seq)
            buf[2].append(event)
            seq += 1
        pending += len(rows)
        if pending >= _FLUSH_EVERY:
            flush()
            pending = 0
        if progress is not None:
            progress(len(rows))
    flush()
    return {name: pl.concat(parts, how="diagonal_relaxed") for name, parts in frames.items()}


def write_parquet(frames: dict[str, pl.DataFrame], directory: Path) -> dict[str, int]:
    """Write `directory/<EventType>.parquet` for every frame; returns rows per type."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot create {directory}: {exc.strerror}") from None
    written: dict[str, int] = {}
    for name, frame in frames.items():
        try:
            frame.write_parquet(directory / f"{name}.parquet")
        except OSError as exc:
            raise ExportError(f"cannot write {directory / name}.parquet: {exc.strerror}") from None
        written[name] = frame.height
    return written
