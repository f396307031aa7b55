"""Replay against a real Redis: the polars rebuild equals the live fold, hand-over, verify, export, stats."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import polars as pl
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.connection import redis_client as redis_client_for
from events.event import (
    BenchmarkResult,
    Event,
    ModelEntry,
    QualityScored,
    Resources,
    TaskCancelled,
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskFailed,
    TaskReclaimed,
    TaskStalled,
    TaskSubmitted,
    Timings,
    WakeFailed,
    WakeRequested,
    WorkerChanged,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
)
from events.keys import Keys
from events.ledger import Ledger
from projections import store
from projections.projector import Projector
from projections.reader import snapshot
from projections.snapshot import TaskRow
from projections.tables import Tables
from replay.errors import BadUntilError
from replay.fold import encoded_task_rows, fold_frames, fold_tables
from replay.frames import Frames
from replay.rebuild import build, rebuild, until_to_stop
from replay.verify import diff_tables
from sim.synthetic import HistoryMaker
from tests.helpers import rl
from tests.test_projector import D1, D2, T0, completed, fold_all, timings

DAY = 86_400_000
WORKERS = st.sampled_from(["w1", "w2"])
DIGESTS = st.sampled_from([D1, D2])
DOMAINS = st.sampled_from(["general", "ja"])
TASKS = st.sampled_from([f"t{i}" for i in range(6)])
# Producer clocks disagree: events carry times up to ten days either side, in any order.
AT = st.integers(T0 - 10 * DAY, T0 + 10 * DAY)
# A worker's clock may also run ahead of the ledger's (Redis's) clock: samples then take the ledger's.
AHEAD = st.integers(4_000_000_000_000, 4_000_000_000_000 + 10 * DAY)
AT_SKEWED = st.one_of(AT, AHEAD)
COLD = st.one_of(st.none(), st.booleans())
MAYBE_INT = st.one_of(st.none(), st.integers(-5, 2000))
MAYBE_NS = st.one_of(st.none(), st.integers(-10, 5 * 10**9))
TIMINGS = st.builds(
    Timings,
    prompt_eval_count=MAYBE_INT,
    prompt_eval_duration=MAYBE_NS,
    prompt_eval_cached_count=MAYBE_INT,
    eval_count=MAYBE_INT,
    eval_duration=MAYBE_NS,
    load_duration=MAYBE_NS,
    counted=st.one_of(st.none(), st.just("stream")),
)
TTFT = st.one_of(st.none(), st.floats(-10, 5000), st.just(float("nan")))
ATTEMPT = st.integers(1, 3)

EVENTS: st.SearchStrategy[Event] = st.one_of(
    st.builds(
        TaskSubmitted,
        at=AT,
        task_id=TASKS,
        model=st.just("m"),
        digest=DIGESTS,
        queue=st.just("q"),
        domain=DOMAINS,
        runtime_options=st.booleans(),
    ),
    st.builds(TaskClaimed, at=AT_SKEWED, task_id=TASKS, worker=WORKERS, digest=DIGESTS, attempt=ATTEMPT),
    st.builds(
        TaskCompleted,
        at=AT_SKEWED,
        task_id=TASKS,
        worker=WORKERS,
        digest=DIGESTS,
        domain=DOMAINS,
        attempt=ATTEMPT,
        timings=TIMINGS,
        ttft_ms=TTFT,
        in_flight=st.integers(0, 3),
        duplicate=st.booleans(),
        cold=COLD,
        # An embedding's prompt rate is an embedding-rate sample, with no decode, prompt or TTFT one.
        kind=st.sampled_from(["chat", "embed"]),
        # Prompt bytes against prompt_eval_count: a bytes-per-token sample, or one out of bounds.
        prompt_bytes=st.one_of(st.none(), st.integers(0, 8000)),
    ),
    st.builds(
        TaskFailed,
        at=AT,
        task_id=TASKS,
        worker=WORKERS,
        digest=DIGESTS,
        attempt=ATTEMPT,
        kind=st.sampled_from(["timeout", "backend"]),
        retryable=st.booleans(),
        message=st.sampled_from(["", "boom"]),
    ),
    st.builds(
        TaskReclaimed,
        at=AT,
        task_id=TASKS,
        queue=st.just("q"),
        old_entry=st.just("1-0"),
        new_entry=st.just("2-0"),
        owner=WORKERS,
        attempt=ATTEMPT,
    ),
    st.builds(
        TaskStalled, at=AT, task_id=TASKS, queue=st.just("q"), entry_id=st.just("1-0"), waited_ms=st.just(1)
    ),
    st.builds(
        TaskDeadLettered, at=AT, task_id=TASKS, queue=st.just("q"), reason=st.just("limit"), attempts=ATTEMPT
    ),
    st.builds(TaskCancelled, at=AT, task_id=TASKS),
    st.builds(WorkerOnline, at=AT, worker=WORKERS, slots=st.integers(1, 4)),
    st.builds(
        WorkerHeartbeat,
        at=AT,
        worker=WORKERS,
        slots=st.integers(1, 4),
        loaded=st.lists(DIGESTS, max_size=2),
        resources=st.builds(Resources, cpu_percent=st.one_of(st.none(), st.sampled_from([5.0, 90.0]))),
    ),
    st.builds(
        WorkerChanged,
        at=AT,
        worker=WORKERS,
        slots=st.integers(1, 4),
        inventory=st.lists(
            st.builds(ModelEntry, name=st.sampled_from(["m", "n"]), digest=DIGESTS), max_size=2
        ),
        loaded=st.lists(DIGESTS, max_size=2),
        serves=st.one_of(st.none(), st.just(["m"])),
    ),
    st.builds(
        WorkerOffline,
        at=AT,
        worker=WORKERS,
        reason=st.sampled_from(["lease expired", "shutdown", "forgotten"]),
    ),
    st.builds(
        BenchmarkResult,
        at=AT_SKEWED,
        bench_id=st.sampled_from(["b1", "b2"]),
        task_id=st.sampled_from(["", "x", "y"]),
        worker=WORKERS,
        digest=DIGESTS,
        timings=TIMINGS,
        ttft_ms=TTFT,
        cold=COLD,
        kind=st.sampled_from(["chat", "embed"]),
    ),
    st.builds(
        QualityScored,
        at=AT,
        digest=DIGESTS,
        domain=DOMAINS,
        score=st.one_of(st.floats(-0.5, 1.5), st.just(float("nan")), st.sampled_from([0.0, 1.0])),
        worker=WORKERS,
        grader=st.sampled_from(["reference", "judge:m"]),
        # Repeated prompts (one grade each counts), none (every grade counts), cut-off answers.
        prompt_id=st.sampled_from(["", "p1", "p2"]),
        truncated=st.booleans(),
    ),
    # Wakes: a request, a give-up, and WorkerOnline (above) measuring the span between.
    st.builds(WakeRequested, at=AT_SKEWED, worker=WORKERS, why=st.sampled_from(["plan", "manual"])),
    st.builds(WakeFailed, at=AT, worker=WORKERS, waited_s=st.just(30.0)),
)
# What happens between two batches of the live projector.
ACTIONS = st.lists(st.tuples(st.integers(1, 8), st.sampled_from(["go", "go", "go", "restart", "rebuild"])))

pytestmark = pytest.mark.cluster_tier


async def _live_against_rebuild(url: str, events: list[Event], actions: list[tuple[int, str]]) -> None:
    redis = redis_client_for(url)
    keys = Keys.for_client(redis)
    try:
        await redis.flushall()
        await Ledger(redis, keys).append_many(events)
        projector = Projector(redis, keys)
        await projector.start()
        for count, action in actions:
            if action == "restart":
                projector = Projector(redis, keys)
                await projector.start()
            elif action == "rebuild":
                await rebuild(redis, keys)
            await projector.step(count=count)
        await projector.catch_up()
        ns = await store.current(redis, keys)
        assert ns is not None
        live = await store.load(redis, keys, ns)
        rebuilt, _ = await build(redis, keys)
        assert diff_tables(live, rebuilt) == []
    finally:
        await redis.aclose()


# On one Redis the property searches the inputs; on the cluster it runs again to prove that the
# key layout holds under it (every event type, restarts and rebuilds), which takes fewer draws.
LIVE_AGAINST_REBUILD_EXAMPLES = {"single": 150, "cluster": 25}


def test_the_live_projector_and_the_polars_rebuild_give_the_same_tables(
    redis_url: str, redis_backend: str
) -> None:
    @settings(
        max_examples=LIVE_AGAINST_REBUILD_EXAMPLES[redis_backend],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(events=st.lists(EVENTS, max_size=40), actions=ACTIONS)
    def live_equals_rebuild(events: list[Event], actions: list[tuple[int, str]]) -> None:
        asyncio.run(_live_against_rebuild(redis_url, events, actions))

    live_equals_rebuild()


def test_a_completion_the_ledger_holds_before_its_runtime_options_submission_counts_in_both_folds(
    redis_url: str,
) -> None:
    # The live fold cannot know what a later submission will say: the rebuild must not either.
    timings = Timings(
        eval_count=100, eval_duration=2 * 10**9, prompt_eval_count=50, prompt_eval_duration=10**8
    )
    completed = TaskCompleted(
        at=T0, task_id="t0", worker="w1", digest=D1, domain="general", attempt=1, timings=timings
    )
    submitted = TaskSubmitted(
        at=T0 + 1, task_id="t0", model="m", digest=D1, domain="general", queue="q", runtime_options=True
    )
    asyncio.run(_live_against_rebuild(redis_url, [completed, submitted], [(2, "go")]))


# Events with where in the last 30 days each lands (ledger order is by that time), so that a
# task's entries fall on both sides of the retention cutoff.
DATED = st.lists(st.tuples(st.integers(0, 30 * DAY), EVENTS), min_size=5, max_size=40)


@settings(max_examples=100, deadline=None)
@given(dated=DATED, retention=st.integers(0, 25))
def test_a_fold_that_leaves_out_rows_past_retention_keeps_exactly_the_rows_a_write_would_keep(
    dated: list[tuple[int, Event]], retention: int
) -> None:
    now = T0 + 5 * DAY
    dated = sorted(dated, key=lambda item: item[0])
    ids = [f"{now - 30 * DAY + ms}-{i}" for i, (ms, _) in enumerate(dated)]
    events = [event for _, event in dated]
    batch = list(zip(ids, events, strict=True))

    def folded(now_ms: int | None) -> Tables:
        frames = Frames()
        frames.add(batch)
        return fold_frames(frames, 3600.0, 300.0, retention, now_ms=now_ms)

    every, kept = folded(None), folded(now)
    # Retention is judged at ledger time: the checkpoint's.
    every.checkpoint = kept.checkpoint = f"{now}-0"
    store.drop_expired(every)
    assert diff_tables(every, kept) == []
    # Rows compared encoded: a NaN first-token time (a backend's nonsense, kept as reported) is
    # never equal to itself, but encodes to the same bytes.
    assert _encoded(kept.tasks) == _encoded(every.tasks) and kept.benched == every.benched


def _encoded(rows: dict[str, TaskRow]) -> dict[str, bytes]:
    return {task_id: msgspec.msgpack.encode(row) for task_id, row in rows.items()}


def test_task_rows_encoded_from_the_frame_are_byte_for_byte_the_encoded_task_rows() -> None:
    history = [e for batch in HistoryMaker(300, holders=3).batches(100) for e in batch]
    frames = Frames()
    frames.add([(f"{T0 + i}-0", e) for i, e in enumerate(history)])
    _, table = fold_tables(frames, 3600.0, 300.0)
    encoded = dict(encoded_task_rows(table))
    assert len(encoded) == 300
    rows = {task_id: store.decode_task(raw) for task_id, raw in encoded.items()}
    assert {task_id: store.encode_row(row) for task_id, row in rows.items()} == encoded
    assert {row.status for row in rows.values()} >= {"completed", "cancelled", "dead"}


async def test_a_rebuild_switches_atomically_and_the_live_projector_continues_in_the_new_namespace(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    projector = await fold_all(redis_client, keys, [completed("t1", "w1"), completed("t2", "w1")])
    old = projector.ns
    result = await rebuild(redis_client, keys)
    assert result.switched and result.previous == old and result.namespace != old
    assert await store.current(redis_client, keys) == result.namespace
    # The replaced namespace stays readable for a while, then expires.
    assert 0 < await redis_client.pttl(keys.table(old or "", store.SPEED)) <= store.RETIRE_AFTER_MS
    await ledger.append(completed("t3", "w1"))
    assert await projector.catch_up() == 1
    assert projector.ns == result.namespace
    snap = await snapshot(redis_client, keys)
    assert snap.speed["w1", D1].decode_tps.n == 3
    assert snap.checkpoint == await ledger.last_id()


async def test_a_rebuild_with_no_switch_leaves_the_live_namespace_alone(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    projector = await fold_all(redis_client, keys, [completed("t1", "w1")])
    result = await rebuild(redis_client, keys, switch=False)
    assert not result.switched
    assert await store.current(redis_client, keys) == projector.ns


async def test_until_shows_the_tables_as_they_were_then(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    first = await ledger.append(completed("t1", "w1", timings=timings(tps=10.0)))
    await ledger.append(completed("t2", "w1", timings=timings(tps=30.0)))
    tables, _ = await build(redis_client, keys, until=first)
    assert tables.checkpoint == first
    assert tables.speed["w1", D1].decode_tps.mean == pytest.approx(10.0)


async def test_a_rebuild_skips_what_the_projector_dead_letters_and_folds_the_rest_of_each_chunk(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await ledger.append_many(
        [completed("t1", "w1"), TaskClaimed(at=T0, task_id="t2", worker="w1", digest=D1, attempt=1)]
    )
    # The standard layout with data that does not decode, or decodes to another type than the envelope's.
    await redis_client.xadd(keys.events, {"type": "TaskCompleted", "v": "1", "data": b"\xc1\xff"})
    mislabelled = msgspec.msgpack.encode(completed("x", "w1"))
    await redis_client.xadd(keys.events, {"type": "TaskClaimed", "v": "1", "data": mislabelled})
    await ledger.append_many([completed("t2", "w1", timings=timings(tps=30.0)), completed("t3", "w2")])
    # Not the standard layout: no data, or fields in another order.
    await redis_client.xadd(keys.events, {"type": "TaskCompleted"})
    reordered = msgspec.msgpack.encode(completed("t4", "w1", timings=timings(tps=70.0)))
    await redis_client.xadd(keys.events, {"data": reordered, "v": "1", "type": "TaskCompleted"})
    await ledger.append_many(
        [completed("t5", "w1"), WorkerHeartbeat(at=T0, worker="w1", slots=2, loaded=[D1])]
    )
    projector = Projector(redis_client, keys)
    await projector.start()
    await projector.catch_up()
    ns = await store.current(redis_client, keys)
    assert ns is not None
    live = await store.load(redis_client, keys, ns)
    assert live.speed["w1", D1].decode_tps.n == 4
    # Whatever the chunking, the poison lands alone or among good entries, first or last.
    for chunk in (1, 2, 3, 4, 1000):
        rebuilt, poison = await build(redis_client, keys, chunk=chunk)
        assert poison == 3
        assert diff_tables(live, rebuilt) == []
        assert rebuilt.tasks["t2"].status == "completed" and rebuilt.tasks["t4"].worker == "w1"


async def test_numbers_no_column_can_hold_are_poison_and_never_break_a_rebuild_verify_or_export(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    huge = 2**64 - 1
    await fold_all(
        redis_client,
        keys,
        [
            completed("ok", "w1"),
            completed("u64", "w1", timings=Timings(eval_count=huge, eval_duration=10**9)),
            completed("big-float", "w1", ttft_ms=1e20),
            completed("nan", "w1", wall_ms=float("nan")),
            QualityScored(at=T0, digest=D1, domain="general", score=float("inf")),
            TaskClaimed(at=T0, task_id="neg-attempt", worker="w1", digest=D1, attempt=-1),
            # Representable nonsense decodes: the fold skips the field and keeps the event.
            completed("negative", "w1", timings=Timings(eval_count=10, eval_duration=-(10**9))),
        ],
    )
    dead = await redis_client.xrange(keys.dead)
    assert len(dead) == 5
    assert all(b"Expected" in fields[b"reason"] for _, fields in dead)
    rebuilt, poison = await build(redis_client, keys)
    assert poison == 5
    assert set(rebuilt.tasks) == {"ok", "negative"}
    assert rebuilt.tasks["negative"].status == "completed"
    assert rebuilt.speed["w1", D1].decode_tps.n == 1
    verified = await asyncio.to_thread(rl, "replay", "verify", "--redis-url", redis_url)
    assert verified.returncode == 0, verified.stderr
    exported = await asyncio.to_thread(
        rl, "replay", "export", "--parquet", str(tmp_path), "--redis-url", redis_url
    )
    assert exported.returncode == 0, exported.stderr
    assert "Traceback" not in exported.stderr
    frame = pl.read_parquet(tmp_path / "TaskCompleted.parquet")
    assert sorted(frame["task_id"].to_list()) == ["negative", "ok"]


def test_until_accepts_a_stream_id_or_a_time_and_refuses_anything_else() -> None:
    assert until_to_stop(None) == "+"
    assert until_to_stop("1764000000000-3") == "1764000000000-3"
    assert until_to_stop("2025-11-24T16:00:00+00:00") == "1764000000000"
    with pytest.raises(BadUntilError, match="neither a stream id"):
        until_to_stop("yesterday")


async def test_verify_exits_0_on_matching_tables_and_1_on_a_tampered_table(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys
) -> None:
    projector = await fold_all(
        redis_client,
        keys,
        [completed("t1", "w1"), QualityScored(at=T0, digest=D2, domain="ja", score=0.5)],
    )
    ok = await asyncio.to_thread(rl, "replay", "verify", "--redis-url", redis_url)
    assert ok.returncode == 0, ok.stderr
    assert "match" in ok.stdout
    ns = projector.ns or ""
    row = store.decode_quality(await redis_client.hgetall(keys.table(ns, store.QUALITY)))[D2, "ja"]
    row.score.sum = 0.9
    await redis_client.hset(keys.table(ns, store.QUALITY), f"{D2}\x1fja", store.encode_row(row))
    bad = await asyncio.to_thread(rl, "replay", "verify", "--redis-url", redis_url, "--json")
    assert bad.returncode == 1, bad.stderr
    diffs = json.loads(bad.stdout)["differences"]
    assert [(d["table"], d["field"], d["live"], d["rebuilt"]) for d in diffs] == [
        ("quality", "score.sum", 0.9, 0.5)
    ]


async def test_rebuild_command_prints_the_new_namespace_and_verify_then_passes(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys
) -> None:
    await fold_all(redis_client, keys, [completed("t1", "w1")])
    done = await asyncio.to_thread(rl, "replay", "rebuild", "--redis-url", redis_url, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["events"] == 1 and result["switched"]
    assert await store.current(redis_client, keys) == result["namespace"]
    assert (await asyncio.to_thread(rl, "replay", "verify", "--redis-url", redis_url)).returncode == 0


def test_a_bad_until_is_one_clear_line_and_exit_2(redis_url: str) -> None:
    done = rl("replay", "rebuild", "--until", "yesterday", "--redis-url", redis_url)
    assert done.returncode == 2
    assert "neither a stream id" in done.stderr and "Traceback" not in done.stderr


def test_verify_without_a_projection_is_one_clear_line_and_exit_2(redis_url: str) -> None:
    done = rl("replay", "verify", "--redis-url", redis_url)
    assert done.returncode == 2
    assert "no projection" in done.stderr and "Traceback" not in done.stderr


async def test_export_writes_one_parquet_file_per_event_type(
    redis_url: str, ledger: Ledger, tmp_path: Path
) -> None:
    await ledger.append_many(
        [
            completed("t1", "w1"),
            completed("t2", "w2", timings=Timings()),
            WorkerHeartbeat(at=T0, worker="w1", slots=1, loaded=[D1]),
        ]
    )
    done = await asyncio.to_thread(
        rl, "replay", "export", "--parquet", str(tmp_path), "--redis-url", redis_url
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in await asyncio.to_thread(lambda: list(tmp_path.iterdir()))) == [
        "TaskCompleted.parquet",
        "WorkerHeartbeat.parquet",
    ]
    frame = pl.read_parquet(tmp_path / "TaskCompleted.parquet")
    assert frame["worker"].to_list() == ["w1", "w2"]
    assert frame["timings_eval_count"].to_list() == [100, None]
    beats = pl.read_parquet(tmp_path / "WorkerHeartbeat.parquet")
    assert json.loads(beats["loaded"][0]) == [D1]


async def test_stats_shows_each_field_with_its_count_and_filters_by_worker(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys
) -> None:
    await fold_all(
        redis_client, keys, [completed("t1", "w1"), completed("t2", "w2", timings=timings(tps=20.0))]
    )
    done = await asyncio.to_thread(
        rl, "replay", "stats", "--worker", "w2", "--json", "--redis-url", redis_url
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["rows"]
    decode = [r for r in rows if r["field"] == "decode_tps"]
    assert [(r["key"], r["n"], r["value"]) for r in decode] == [(f"w2 / {D1[:12]}", 1, pytest.approx(20.0))]
    assert all("w1" not in r["key"] for r in rows)
    table = await asyncio.to_thread(rl, "replay", "stats", "--redis-url", redis_url)
    assert table.returncode == 0 and "decode_tps" in table.stdout and "updated_at" in table.stdout
