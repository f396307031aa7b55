"""One history over archive and stream: ranges, the consumers that read it, and old segments."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import redis.asyncio as aioredis

from events.keys import Keys
from events.ledger import Ledger
from replay import segment
from replay.archive import archive
from replay.history import History
from replay.rebuild import build
from replay.verify import diff_tables
from tests.test_archive import fold, mixed_ledger, options, rl


async def _half_archived(redis_client: aioredis.Redis, keys: Keys, tmp_path: Path, n: int = 600) -> list[str]:
    """`n` events, the older half archived in segments of 100, the rest in the stream."""
    ids = await Ledger(redis_client, keys).append_many(mixed_ledger(n))
    await fold(redis_client, keys)
    await archive(
        redis_client, keys, options(tmp_path, segment_entries=100, max_hot_entries=n // 2, hot_window_s=1e9)
    )
    assert await Ledger(redis_client, keys).length() == n // 2
    return ids


async def test_a_range_reads_across_archive_and_stream_with_both_ends_included(
    redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ids = await _half_archived(redis_client, keys, tmp_path)
    history = History(redis_client, keys, tmp_path / "archive")

    got = [row[0].decode() async for rows in history.read_wire(ids[150], ids[449], chunk=64) for row in rows]
    until = [row[0].decode() async for rows in history.read_wire("-", ids[99]) for row in rows]

    assert got == ids[150:450]
    assert until == ids[:100]
    assert await history.count() == 600


async def test_export_sees_archived_events(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ids = await _half_archived(redis_client, keys, tmp_path)
    out = tmp_path / "export"

    done = await asyncio.to_thread(
        rl,
        "replay",
        "export",
        "--parquet",
        str(out),
        "--redis-url",
        redis_url,
        env={"ROUTELEDGER_ARCHIVE_DIR": str(tmp_path / "archive")},
    )

    assert done.returncode == 0, done.stderr
    exported = pl.concat([pl.read_parquet(p).select("id", "seq") for p in out.iterdir()]).sort("seq")
    assert exported["id"].to_list() == ids


async def test_events_tail_from_0_prints_archived_events_then_the_stream(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ids = await _half_archived(redis_client, keys, tmp_path, n=300)
    env = {**os.environ, "ROUTELEDGER_ARCHIVE_DIR": str(tmp_path / "archive")}
    argv = ["events", "tail", "--from", "0", "--json", "--redis-url", redis_url]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "routeledger", *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None
        seen = [json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))["id"] for _ in ids]
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert seen == ids


async def test_stats_until_reads_the_archive(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ids = await Ledger(redis_client, keys).append_many(mixed_ledger(400))
    await fold(redis_client, keys)
    before = await asyncio.to_thread(
        rl, "replay", "stats", "--until", ids[199], "--json", "--redis-url", redis_url
    )
    await archive(redis_client, keys, options(tmp_path))
    after = await asyncio.to_thread(
        rl,
        "replay",
        "stats",
        "--until",
        ids[199],
        "--json",
        "--redis-url",
        redis_url,
        env={"ROUTELEDGER_ARCHIVE_DIR": str(tmp_path / "archive")},
    )
    assert before.returncode == 0 == after.returncode, after.stderr
    a, b = json.loads(after.stdout), json.loads(before.stdout)
    assert a["checkpoint"] == b["checkpoint"] == ids[199]
    # The same sums, added up in another order by the vectorised fold: equal to rounding.
    for x, y in zip(a["rows"], b["rows"], strict=True):
        assert x.keys() == y.keys()
        for k in x:
            same = x[k] == pytest.approx(y[k], rel=1e-12) if isinstance(x[k], float) else x[k] == y[k]
            assert same, (k, x, y)


async def test_a_segment_without_a_kinds_typed_columns_is_folded_from_its_data(
    redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    await _half_archived(redis_client, keys, tmp_path)
    whole, _ = await build(redis_client, keys, archive_dir=tmp_path / "archive")
    # As a segment written before the fold read `score` and `eval_count` would be.
    directory = tmp_path / "archive"
    manifest = segment.load_manifest(directory)
    assert manifest is not None
    first = manifest.segments[0]
    path = directory / first.file
    pl.read_parquet(path).drop("score", "eval_count").write_parquet(path, compression="zstd")
    manifest.segments[0] = segment.Segment(
        file=first.file,
        first_id=first.first_id,
        last_id=first.last_id,
        count=first.count,
        bytes=path.stat().st_size,
        sha256=segment.sha256_of(path),
    )
    segment.save_manifest(directory, manifest)

    again, _ = await build(redis_client, keys, archive_dir=directory)

    assert diff_tables(whole, again) == []
