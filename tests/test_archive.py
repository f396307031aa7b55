"""The archiver against a real Redis: Parquet segments, trimming, the checkpoint bound, crash safety,
poison entries and damaged segments."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import msgspec
import polars as pl
import pytest
import redis.asyncio as aioredis

from events.codec import DATA, TYPE, VERSION
from events.event import Event, TaskCompleted, Timings
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from replay import segment
from replay.archive import CRASH_POINTS, TEST_CRASH_ENV, ArchiveOptions, archive
from replay.errors import ArchiveError
from replay.history import History
from replay.rebuild import build
from replay.verify import diff_tables
from tests.factories import one_of_each
from tests.helpers import rl
from tests.test_projector import D1, D2, T0

WORKERS = ["w1", "w2", "w3"]

pytestmark = pytest.mark.cluster_tier


def mixed_ledger(n: int, seed: int = 3) -> list[Event]:
    """`n` events of every type, on a few tasks, workers and digests, with varied timings."""
    rnd = random.Random(seed)
    templates = one_of_each()
    out: list[Event] = []
    for i in range(n):
        event = rnd.choice(templates)
        changes: dict[str, object] = {"at": T0 + i * 37 + rnd.randint(-500, 500)}
        fields = type(event).__struct_fields__
        if "task_id" in fields:
            changes["task_id"] = f"t{rnd.randint(0, n // 6)}"
        if "worker" in fields:
            changes["worker"] = rnd.choice(WORKERS)
        if "digest" in fields:
            changes["digest"] = rnd.choice([D1, D2])
        if "attempt" in fields:
            changes["attempt"] = rnd.randint(1, 3)
        if isinstance(event, TaskCompleted):
            changes["duplicate"] = rnd.random() < 0.1
        if "timings" in fields:
            tokens = rnd.randint(1, 400)
            changes["timings"] = Timings(
                eval_count=tokens,
                eval_duration=rnd.randint(1, 20) * 10**8,
                prompt_eval_count=rnd.randint(0, 50),
            )
        out.append(msgspec.structs.replace(event, **changes))  # type: ignore[arg-type]
    return out


async def fold(redis: aioredis.Redis, keys: Keys) -> Projector:
    projector = Projector(redis, keys)
    await projector.start()
    await projector.catch_up()
    return projector


def options(tmp_path: Path, **kw: object) -> ArchiveOptions:
    values: dict[str, object] = {"directory": str(tmp_path / "archive"), "hot_window_s": 0.0, **kw}
    return msgspec.convert(values, ArchiveOptions)


async def stream_ids(redis: aioredis.Redis, keys: Keys) -> list[str]:
    """The stream's ids now: what was appended and what the projector appended while folding it
    (its SpeedShiftDetected notices, after the entries whose samples showed the shift)."""
    return [row[0].decode() for row in await redis.xrange(keys.events)]


async def ids_of(history: History) -> list[bytes]:
    return [row[0] async for rows in history.read_wire() for row in rows]


async def test_an_archived_ledger_rebuilds_to_the_same_tables_as_the_stream_alone(
    redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ledger = Ledger(redis_client, keys)
    ids = await ledger.append_many(mixed_ledger(3000))
    await fold(redis_client, keys)
    middle = ids[1234]
    whole, poison = await build(redis_client, keys)
    until_middle, _ = await build(redis_client, keys, until=middle)

    report = await archive(
        redis_client, keys, options(tmp_path, max_hot_entries=700, hot_window_s=1e9, segment_entries=800)
    )

    assert report.archived == 2300 and len(report.written) == 3
    again, poison_again = await build(redis_client, keys, archive_dir=report.directory)
    assert diff_tables(whole, again) == []
    assert (again.folded, again.checkpoint, poison_again) == (whole.folded, whole.checkpoint, poison)
    again_middle, _ = await build(redis_client, keys, until=middle, archive_dir=report.directory)
    assert diff_tables(until_middle, again_middle) == []
    assert again_middle.checkpoint == middle


async def test_the_stream_keeps_only_the_hot_part_and_the_state_hash_says_what_was_archived(
    redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ledger = Ledger(redis_client, keys)
    appended = await ledger.append_many(mixed_ledger(1000))
    await fold(redis_client, keys)
    ids = await stream_ids(redis_client, keys)
    assert ids[: len(appended)] == appended and len(ids) == await ledger.length() >= 1000
    cold = len(ids) - 250

    report = await archive(redis_client, keys, options(tmp_path, max_hot_entries=250, hot_window_s=1e9))

    assert await ledger.length() == 250 == report.hot
    assert report.trimmed == cold
    first_hot = await redis_client.xrange(keys.events, count=1)
    assert first_hot[0][0].decode() == ids[cold]
    state = {k.decode(): v.decode() for k, v in (await redis_client.hgetall(keys.archive)).items()}
    assert state["last_id"] == ids[cold - 1] and state["segments"] == "1" and state["events"] == str(cold)
    assert state["error"] == "" and state["dir"] == report.directory and int(state["bytes"]) > 0
    manifest = segment.load_manifest(Path(report.directory))
    assert manifest is not None and [s.count for s in manifest.segments] == [cold]
    assert await ids_of(History(redis_client, keys, report.directory)) == [i.encode() for i in ids]


async def test_entries_younger_than_the_hot_window_stay_in_redis(
    redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ledger = Ledger(redis_client, keys)
    ids = await ledger.append_many(mixed_ledger(100))
    await fold(redis_client, keys)
    newest_ms = int(ids[-1].split("-")[0])

    young = await archive(redis_client, keys, options(tmp_path, hot_window_s=3600.0), now_ms=newest_ms + 1000)
    old = await archive(
        redis_client, keys, options(tmp_path, hot_window_s=3600.0), now_ms=newest_ms + 7_200_000
    )

    assert (young.archived, old.archived) == (0, 100)
    assert await ledger.length() == 0


async def test_nothing_past_the_projector_checkpoint_is_archived(
    redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ledger = Ledger(redis_client, keys)
    folded = await ledger.append_many(mixed_ledger(300))
    await fold(redis_client, keys)
    unfolded = await ledger.append_many(mixed_ledger(200, seed=9))

    report = await archive(redis_client, keys, options(tmp_path))

    assert report.archived == 300 and report.last_id == folded[-1] == report.checkpoint
    remaining = [row[0].decode() for row in await redis_client.xrange(keys.events)]
    assert remaining == unfolded


async def test_without_a_projection_nothing_is_archived(
    redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ledger = Ledger(redis_client, keys)
    await ledger.append_many(mixed_ledger(50))

    report = await archive(redis_client, keys, options(tmp_path))

    assert report.archived == 0 and "no projection" in report.note
    assert await ledger.length() == 50


async def test_poison_entries_are_archived_with_their_envelope_only_and_counted_as_poison(
    redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ledger = Ledger(redis_client, keys)
    await ledger.append_many(mixed_ledger(40))
    poison = [
        {TYPE: b"TaskCompleted", VERSION: b"1", DATA: b"\xc1 not msgpack"},
        {TYPE: b"NoSuchEvent", VERSION: b"1", DATA: msgspec.msgpack.encode({"type": "NoSuchEvent"})},
        {TYPE: b"TaskClaimed", VERSION: b"1"},
        {b"data": b"\x80", b"type": b"TaskFailed", b"extra": b"\xff\xfe"},
    ]
    for fields in poison:
        await redis_client.xadd(keys.events, fields)  # type: ignore[arg-type]
    await ledger.append_many(mixed_ledger(40, seed=4))
    await fold(redis_client, keys)
    before = [row async for rows in Ledger(redis_client, keys).read_wire() for row in rows]
    whole, poison_count = await build(redis_client, keys)

    report = await archive(redis_client, keys, options(tmp_path))

    assert report.archived == 84 and await ledger.length() == 0
    frame = pl.read_parquet(Path(report.directory) / report.written[0])
    bad = frame.filter(~pl.col("decoded"))
    assert bad["type"].to_list() == ["TaskCompleted", "NoSuchEvent", "TaskClaimed", "TaskFailed"]
    assert bad.select("task_id", "worker", "eval_count").null_count().row(0) == (4, 4, 4)
    history = History(redis_client, keys, report.directory)
    after = [row async for rows in history.read_wire() for row in rows]
    assert after == before
    again, poison_again = await build(redis_client, keys, archive_dir=report.directory)
    assert poison_again == poison_count == 4
    assert diff_tables(whole, again) == []


@pytest.mark.parametrize("point", CRASH_POINTS)
async def test_a_kill_at_each_step_then_a_rerun_loses_nothing_and_counts_nothing_twice(
    point: str, redis_url: str, redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    ledger = Ledger(redis_client, keys)
    await ledger.append_many(mixed_ledger(900))
    await fold(redis_client, keys)
    ids = await stream_ids(redis_client, keys)
    where = ["--redis-url", redis_url, "--archive-dir", str(tmp_path / "archive")]
    run = ["archive", "--hot-window", "0", "--segment-entries", "300", *where]
    # The killed run's archiver lease outlives it and the rerun waits it out: the shortest lease
    # (3 s, against 10 s by default) keeps that wait short.
    lease = {"ROUTELEDGER_LEASE_MS": "3000"}

    killed = await asyncio.to_thread(rl, *run, env={**lease, TEST_CRASH_ENV: f"{point}@2"})
    assert killed.returncode == -9, killed.stderr
    history = History(redis_client, keys, tmp_path / "archive")
    assert await ids_of(history) == [i.encode() for i in ids]

    rerun = await asyncio.to_thread(rl, *run, "--json", env=lease)
    assert rerun.returncode == 0, rerun.stderr
    assert await ledger.length() == 0
    manifest = segment.load_manifest(tmp_path / "archive")
    segments = [min(300, len(ids) - start) for start in range(0, len(ids), 300)]
    assert manifest is not None and [s.count for s in manifest.segments] == segments
    assert sorted(p.name for p in (tmp_path / "archive").iterdir()) == sorted(
        [segment.MANIFEST, *(s.file for s in manifest.segments)]
    )
    assert await ids_of(History(redis_client, keys, tmp_path / "archive")) == [i.encode() for i in ids]
    verify = await asyncio.to_thread(
        rl, "replay", "verify", *where[:2], env={"ROUTELEDGER_ARCHIVE_DIR": where[3]}
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


async def _archived_to(redis_client: aioredis.Redis, keys: Keys, tmp_path: Path) -> Path:
    await Ledger(redis_client, keys).append_many(mixed_ledger(200))
    await fold(redis_client, keys)
    report = await archive(redis_client, keys, options(tmp_path, segment_entries=100))
    return Path(report.directory)


async def test_a_missing_segment_file_is_one_clear_line_and_exit_2(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    directory = await _archived_to(redis_client, keys, tmp_path)
    manifest = segment.load_manifest(directory)
    assert manifest is not None
    (directory / manifest.segments[1].file).unlink()

    done = await asyncio.to_thread(
        rl, "replay", "verify", "--redis-url", redis_url, env={"ROUTELEDGER_ARCHIVE_DIR": str(directory)}
    )

    assert done.returncode == 2
    assert "is missing" in done.stderr and manifest.segments[1].file in done.stderr
    assert "Traceback" not in done.stderr


async def test_a_corrupt_segment_file_is_one_clear_line_and_exit_2(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    directory = await _archived_to(redis_client, keys, tmp_path)
    manifest = segment.load_manifest(directory)
    assert manifest is not None
    path = directory / manifest.segments[0].file
    path.write_bytes(b"\0" * path.stat().st_size)

    done = await asyncio.to_thread(
        rl, "replay", "rebuild", "--redis-url", redis_url, env={"ROUTELEDGER_ARCHIVE_DIR": str(directory)}
    )

    assert done.returncode == 2
    assert "does not read as Parquet" in done.stderr and "Traceback" not in done.stderr


async def test_an_archive_directory_without_the_manifest_redis_expects_is_refused(
    redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    directory = await _archived_to(redis_client, keys, tmp_path)

    with pytest.raises(ArchiveError, match="has no manifest"):
        await build(redis_client, keys, archive_dir=tmp_path / "elsewhere")
    with pytest.raises(ArchiveError, match="has no archive manifest"):
        await archive(redis_client, keys, options(tmp_path / "elsewhere"))
    await redis_client.hset(keys.archive, "ledger", "another")
    with pytest.raises(ArchiveError, match="belongs to another ledger"):
        await build(redis_client, keys, archive_dir=directory)


def test_a_bad_hot_window_is_one_clear_line_and_exit_2(redis_url: str) -> None:
    done = rl("archive", "--hot-window", "a week", "--redis-url", redis_url)
    assert done.returncode == 2
    assert "not a duration" in done.stderr and "Traceback" not in done.stderr
