"""Compare two sets of tables field by field: the live projection against a rebuild from the ledger."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from events.keys import Keys
from projections import store
from projections.errors import NoProjectionError
from projections.tables import Tables
from replay.rebuild import Progress, build

REL_TOL: Final = 1e-9
# Decayed sums of very old samples end up near zero by different roundings on the two sides.
ABS_TOL: Final = 1e-12


class Difference(msgspec.Struct, frozen=True, kw_only=True):
    """One field whose live value differs from the rebuilt one (None: the row is missing there)."""

    table: str
    key: str
    field: str
    live: Any
    rebuilt: Any


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        # A window of samples (a speed row's recent ones): each computed as the rebuild computes it,
        # so equal up to rounding, like any other number.
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    numbers = isinstance(a, int | float) and isinstance(b, int | float)
    if numbers and (isinstance(a, float) or isinstance(b, float)):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=ABS_TOL)
    return bool(a == b)


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and prefix.count(".") < 1:
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, value


def _row_fields(row: msgspec.Struct) -> dict[str, Any]:
    return dict(_flatten(msgspec.to_builtins(row)))


def diff_rows(table: str, live: Mapping[Any, Any], rebuilt: Mapping[Any, Any]) -> list[Difference]:
    """Every field of one table that differs beyond float tolerance, and every missing row."""
    out: list[Difference] = []
    for key in sorted(set(live) | set(rebuilt), key=str):
        a, b = live.get(key), rebuilt.get(key)
        name = key if isinstance(key, str) else "/".join(key)
        if a is None or b is None:
            out.append(Difference(table=table, key=name, field="(row)", live=a, rebuilt=b))
            continue
        if a == b:
            continue
        fa, fb = _row_fields(a), _row_fields(b)
        for field in sorted(set(fa) | set(fb)):
            if not _same(fa.get(field), fb.get(field)):
                out.append(
                    Difference(table=table, key=name, field=field, live=fa.get(field), rebuilt=fb.get(field))
                )
    return out


def diff_tables(live: Tables, rebuilt: Tables) -> list[Difference]:
    """Every differing field of every table (the checkpoint included)."""
    out: list[Difference] = []
    if live.checkpoint != rebuilt.checkpoint:
        out.append(
            Difference(
                table="meta", key="", field="checkpoint", live=live.checkpoint, rebuilt=rebuilt.checkpoint
            )
        )
    out += diff_rows("speed", live.speed, rebuilt.speed)
    out += diff_rows("length", live.length, rebuilt.length)
    out += diff_rows("quality", live.quality, rebuilt.quality)
    out += diff_rows("fleet", live.fleet, rebuilt.fleet)
    out += diff_rows("tasks", live.tasks, rebuilt.tasks)
    out += diff_rows("demand", live.demand, rebuilt.demand)
    out += diff_rows("pipelines", live.pipelines, rebuilt.pipelines)
    for key in sorted(live.benched.keys() | rebuilt.benched.keys()):
        a, b = live.benched.get(key), rebuilt.benched.get(key)
        if a != b:
            # A mark's value is the stream ms of its entry (its day shard); None: no mark.
            out.append(Difference(table="benched", key="/".join(key), field="ms", live=a, rebuilt=b))
    return out


async def verify(
    redis: aioredis.Redis,
    keys: Keys | None = None,
    *,
    progress: Progress | None = None,
    archive_dir: str | Path | None = None,
) -> tuple[Tables, list[Difference]]:
    """Rebuild in memory up to the live checkpoint, with the live half-lives and retention, and diff
    the two. The live task rows are every live day shard's (read whole: this is an offline tool);
    the rebuilt ones leave out what is past retention, as a rebuild's write would."""
    keys = keys or Keys.for_client(redis)
    ns = await store.current(redis, keys)
    if ns is None:
        raise NoProjectionError("nothing to verify: no projection is live (no projector has run)")
    live = await store.load(redis, keys, ns)
    if live.checkpoint is None:
        rebuilt = Tables(
            half_life_s=live.half_life_s,
            demand_half_life_s=live.demand_half_life_s,
            task_retention_days=live.task_retention_days,
        )
    else:
        now_ms = store.ledger_ms(live.checkpoint)
        # Rows past retention are left out before they are made (a long history's are most of them).
        rebuilt, _ = await build(
            redis,
            keys,
            until=live.checkpoint,
            half_life_s=live.half_life_s,
            demand_half_life_s=live.demand_half_life_s,
            task_retention_days=live.task_retention_days,
            progress=progress,
            archive_dir=archive_dir,
            now_ms=now_ms,
        )
        store.drop_expired(rebuilt)
    return live, diff_tables(live, rebuilt)
