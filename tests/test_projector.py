"""The live projector against a real Redis: folding, idempotence, fencing, poison, crash safety."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import redis.asyncio as aioredis

from dispatch.submit import submit_task
from events.event import (
    BenchmarkResult,
    Event,
    QualityScored,
    TaskClaimed,
    TaskCompleted,
    TaskFailed,
    TaskSubmitted,
    Timings,
    WakeRequested,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
    now_ms,
)
from events.keys import Keys
from events.ledger import Ledger
from projections import store
from projections.errors import LeaseLostError, NoProjectionError
from projections.projector import Projector
from projections.reader import get_task, lag, snapshot
from replay.rebuild import build
from replay.verify import diff_tables
from tasks.payload import Message, TaskMessage
from tasks.quota import ApiKey, Quotas
from tasks.store import TaskStore

D1 = "a" * 64
D2 = "b" * 64
T0 = 1_764_000_000_000

pytestmark = pytest.mark.cluster_tier


def timings(tokens: int = 100, tps: float = 50.0, **extra: int | None) -> Timings:
    return Timings(eval_count=tokens, eval_duration=int(tokens / tps * 1e9), **extra)


def completed(task: str, worker: str, digest: str = D1, at: int = T0, **kw: object) -> TaskCompleted:
    fields: dict[str, object] = {"attempt": 1, "timings": timings(), **kw}
    return TaskCompleted(at=at, task_id=task, worker=worker, digest=digest, **fields)  # type: ignore[arg-type]


async def fold_all(redis: aioredis.Redis, keys: Keys, events: list[Event]) -> Projector:
    await Ledger(redis, keys).append_many(events)
    projector = Projector(redis, keys)
    await projector.start()
    await projector.catch_up()
    return projector


async def test_speed_measured_on_one_worker_never_appears_in_another_workers_row(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await fold_all(
        redis_client,
        keys,
        [
            completed("t1", "macbookair", timings=timings(tps=11.4)),
            completed("t2", "rtx3070ti", timings=timings(tps=83.0)),
            WorkerOnline(at=T0, worker="homeserver", slots=1),
        ],
    )
    snap = await snapshot(redis_client, keys)
    assert set(snap.speed) == {("macbookair", D1), ("rtx3070ti", D1)}
    assert snap.speed["macbookair", D1].decode_tps.mean == pytest.approx(11.4)
    assert snap.speed["rtx3070ti", D1].decode_tps.mean == pytest.approx(83.0)
    assert snap.speed["macbookair", D1].decode_tps.n == 1


async def test_quality_for_a_digest_is_one_row_whichever_worker_produced_it(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await fold_all(
        redis_client,
        keys,
        [
            QualityScored(at=T0, digest=D1, domain="japanese", score=0.9, worker="macbookair"),
            QualityScored(at=T0 + 1, digest=D1, domain="japanese", score=0.7, worker="rtx3070ti"),
            QualityScored(at=T0 + 2, digest=D2, domain="japanese", score=0.1, worker="rtx3070ti"),
        ],
    )
    snap = await snapshot(redis_client, keys)
    assert set(snap.quality) == {(D1, "japanese"), (D2, "japanese")}
    assert snap.quality[D1, "japanese"].score.n == 2
    assert snap.quality[D1, "japanese"].score.mean == pytest.approx(0.8)


async def test_a_prompt_graded_again_and_a_failed_answer_cut_off_at_its_budget_are_not_new_grades(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    def grade(at: int, score: float, prompt: str, **kw: object) -> QualityScored:
        return QualityScored(at=at, digest=D1, domain="general", score=score, prompt_id=prompt, **kw)  # type: ignore[arg-type]

    await fold_all(
        redis_client,
        keys,
        [
            grade(T0, 1.0, "p1"),
            # The same prompt at temperature 0 again (a speed re-benchmark, another holder).
            grade(T0 + 1, 0.0, "p1", worker="macbookair"),
            # A thinking model cut off at 32 tokens: the budget failed, not the model.
            grade(T0 + 2, 0.0, "p2", max_tokens=32, truncated=True),
            grade(T0 + 3, 1.0, "p3", max_tokens=1024, truncated=True),  # its answer came in time
            grade(T0 + 4, 0.0, "p4"),
            grade(T0 + 5, 0.5, "p1", grader="judge:m"),  # another grader's view of the same answer
            grade(T0 + 6, 1.0, ""),  # an older event without a prompt: every one counts
            grade(T0 + 7, 1.0, ""),
        ],
    )
    snap = await snapshot(redis_client, keys)
    row = snap.quality[D1, "general"]
    assert row.graded == ["judge:m/p1", "reference/p1", "reference/p3", "reference/p4"]
    assert (row.score.n, row.score.sum) == (6, 4.5)
    rebuilt, _ = await build(redis_client, keys)
    assert rebuilt.quality[D1, "general"] == row


async def test_a_stale_speed_field_and_a_fresh_quality_field_keep_their_own_timestamps(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    day = 86_400_000
    await fold_all(
        redis_client,
        keys,
        [
            BenchmarkResult(
                at=T0, bench_id="b1", task_id="x", worker="rtx3070ti", digest=D1, timings=timings()
            ),
            # Only a TTFT, days later: the decode field keeps its old time.
            completed("t1", "rtx3070ti", at=T0 + 3 * day, timings=Timings(), ttft_ms=400.0),
            QualityScored(at=T0 + 4 * day, digest=D1, domain="general", score=0.8),
        ],
    )
    snap = await snapshot(redis_client, keys, now_ms=T0 + 5 * day)
    speed = snap.speed["rtx3070ti", D1]
    assert speed.decode_tps.updated_at == T0
    assert speed.ttft_s.updated_at == T0 + 3 * day
    assert speed.prompt_tps.updated_at is None
    assert snap.quality[D1, "general"].score.updated_at == T0 + 4 * day
    assert speed.decode_tps.age_s(snap.taken_at) == pytest.approx(5 * 86_400)


async def test_a_repeated_completion_counts_once_and_is_recorded_as_a_duplicate(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await fold_all(
        redis_client,
        keys,
        [
            TaskSubmitted(at=T0, task_id="t1", model="m", digest=D1, queue="q"),
            TaskClaimed(at=T0, task_id="t1", worker="w1", digest=D1, attempt=1),
            completed("t1", "w1", at=T0 + 1),
            completed("t1", "w2", at=T0 + 2, attempt=2),
            completed("t2", "w1", at=T0 + 3, duplicate=True),
        ],
    )
    snap = await snapshot(redis_client, keys)
    assert snap.speed["w1", D1].decode_tps.n == 1
    assert ("w2", D1) not in snap.speed
    assert snap.length[D1, "general"].output_tokens.n == 1
    task = await get_task(redis_client, keys, "t1")
    assert task is not None
    assert (task.status, task.worker, task.duplicates, task.attempts) == ("completed", "w1", 1, 2)
    flagged = await get_task(redis_client, keys, "t2")
    assert flagged is not None and flagged.duplicates == 1 and flagged.status == "queued"
    assert await get_task(redis_client, keys, "nope") is None


async def test_a_benchmark_result_counts_once_per_bench_and_task(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    bench = BenchmarkResult(at=T0, bench_id="b1", task_id="x", worker="w1", digest=D1, timings=timings())
    await fold_all(
        redis_client,
        keys,
        [
            bench,
            bench,
            BenchmarkResult(at=T0, bench_id="b1", task_id="y", worker="w1", digest=D1, timings=timings()),
        ],
    )
    snap = await snapshot(redis_client, keys)
    assert snap.speed["w1", D1].decode_tps.n == 2


async def test_a_benchmark_run_counts_once_though_it_is_also_a_completed_task(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    events: list[Event] = [
        BenchmarkResult(
            at=T0, bench_id="b1", task_id="x", worker="w1", digest=D1, timings=timings(tokens=128)
        ),
        completed("x", "w1", bench_id="b1", timings=timings(tokens=128)),
    ]
    await fold_all(redis_client, keys, events)
    snap = await snapshot(redis_client, keys)
    assert snap.speed["w1", D1].decode_tps.n == 1
    assert snap.length == {}  # benchmark answers are cut where the benchmark says: no output length
    row = await get_task(redis_client, keys, "x")
    assert row is not None and row.status == "completed"
    rebuilt, _ = await build(redis_client, keys)
    assert rebuilt.speed["w1", D1].decode_tps.n == 1 and rebuilt.length == {}


async def test_a_run_too_short_to_measure_is_no_speed_sample_live_or_rebuilt(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    # A burst of 8 tokens reads 46 tok/s on a machine that makes 11 over 128 (a quarter of a
    # core); a prompt whose cache held all but 1 of its 41 tokens says nothing of prompt speed.
    short = timings(tokens=8, tps=46.0, prompt_eval_count=41, prompt_eval_cached_count=40)
    short = Timings(**{**msgspec.structs.asdict(short), "prompt_eval_duration": 25_000_000})
    long = Timings(
        eval_count=128, eval_duration=int(128 / 11.0 * 1e9), prompt_eval_count=110, prompt_eval_duration=10**9
    )
    events: list[Event] = [
        completed("a", "w1", timings=short),
        completed("b", "w1", timings=long),
        BenchmarkResult(at=T0, bench_id="b1", task_id="bench-b1-0", worker="w1", digest=D1, timings=short),
        completed("bench-b1-0", "w1", bench_id="b1", timings=short),
    ]
    await fold_all(redis_client, keys, events)
    live = (await snapshot(redis_client, keys)).speed["w1", D1]
    rebuilt, _ = await build(redis_client, keys)
    for row in (live, rebuilt.speed["w1", D1]):
        assert row.decode_tps.n == 1 and row.decode_tps.mean == pytest.approx(11.0)
        assert row.prompt_tps.n == 1 and row.prompt_tps.mean == pytest.approx(110.0)
    # The short task's own record still says what it did.
    task = await get_task(redis_client, keys, "a")
    assert task is not None and task.eval_count == 8


async def test_an_absurd_value_skips_its_field_and_the_rest_of_the_event_still_counts(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await fold_all(
        redis_client,
        keys,
        [
            completed(
                "t1",
                "w1",
                timings=Timings(
                    eval_count=100, eval_duration=1000, prompt_eval_count=50, prompt_eval_duration=10**8
                ),
                ttft_ms=-5.0,
            ),
            completed("t2", "w1", timings=Timings(eval_count=-3, eval_duration=10**9, load_duration=0)),
            QualityScored(at=T0, digest=D1, domain="general", score=1.5),
        ],
    )
    snap = await snapshot(redis_client, keys)
    row = snap.speed["w1", D1]
    assert row.decode_tps.n == 0  # 100 tokens in 1 µs is not a machine
    assert row.prompt_tps.n == 1 and row.prompt_tps.mean == pytest.approx(500.0)
    assert row.ttft_s.n == 0 and row.load_s.n == 0
    assert snap.length[D1, "general"].output_tokens.n == 1  # t1's 100 tokens; t2's -3 is absurd
    assert snap.quality == {}
    task = await get_task(redis_client, keys, "t2")
    assert task is not None and task.status == "completed" and task.decode_tps is None


async def test_fleet_fields_keep_their_own_times_and_in_flight_follows_claims(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await fold_all(
        redis_client,
        keys,
        [
            WorkerOnline(at=T0, worker="w1", slots=2),
            WorkerHeartbeat(at=T0 + 2000, worker="w1", slots=2, loaded=[D1]),
            # A report with an older producer clock arrives late: it changes nothing.
            WorkerHeartbeat(at=T0 + 1000, worker="w1", slots=1, loaded=[D2]),
            TaskClaimed(at=T0, task_id="t1", worker="w1", digest=D1, attempt=1),
            TaskClaimed(at=T0, task_id="t2", worker="w1", digest=D1, attempt=1),
            TaskClaimed(at=T0, task_id="t3", worker="w1", digest=D1, attempt=1),
            completed("t1", "w1"),
            TaskFailed(
                at=T0, task_id="t2", worker="w1", digest=D1, attempt=1, kind="timeout", retryable=True
            ),
        ],
    )
    await redis_client.set(keys.live("w1"), b"x", px=5000)
    snap = await snapshot(redis_client, keys)
    row = snap.fleet["w1"]
    assert (row.status, row.status_since, row.last_heartbeat) == ("online", T0, T0 + 2000)
    assert (row.slots.value, row.slots.at, row.loaded.value) == (2, T0 + 2000, [D1])
    assert row.in_flight == ["t3"]
    assert snap.live == ["w1"]
    task = await get_task(redis_client, keys, "t2")
    assert task is not None and task.status == "queued" and task.error == "timeout"


async def test_demand_counts_each_submission_once_with_its_own_half_life(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    submit = TaskSubmitted(at=T0, task_id="t1", model="m", digest=D1, queue="q")
    await fold_all(
        redis_client,
        keys,
        [submit, submit, TaskSubmitted(at=T0 + 300_000, task_id="t2", model="m", digest=D1, queue="q")],
    )
    snap = await snapshot(redis_client, keys)
    arrivals = snap.demand[D1].arrivals
    assert snap.demand_half_life_s == 300.0
    assert arrivals.n == 2
    assert arrivals.dn == pytest.approx(1.5)  # the first arrival is one half-life old


async def test_a_poison_entry_is_dead_lettered_and_lag_returns_to_zero(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await ledger.append(completed("t1", "w1"))
    poison_id = (
        await redis_client.xadd(keys.events, {"type": "TaskCompleted", "v": "1", "data": b"\xc1garbage"})
    ).decode()
    await ledger.append(completed("t2", "w1"))
    projector = Projector(redis_client, keys)
    await projector.start()
    assert (await lag(redis_client, keys))[0] == 3
    await projector.catch_up()
    assert await lag(redis_client, keys) == (0, 0)
    dead = await redis_client.xrange(keys.dead)
    assert [fields[b"entry_id"].decode() for _, fields in dead] == [poison_id]
    snap = await snapshot(redis_client, keys)
    assert snap.speed["w1", D1].decode_tps.n == 2


async def test_lag_without_a_projection_says_so(redis_client: aioredis.Redis, keys: Keys) -> None:
    with pytest.raises(NoProjectionError):
        await lag(redis_client, keys)
    assert (await snapshot(redis_client, keys)).speed == {}


async def test_a_projector_fenced_out_of_its_namespace_cannot_write(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await ledger.append(completed("t1", "w1"))
    old = Projector(redis_client, keys)
    await old.start()
    new = Projector(redis_client, keys)
    await new.start()  # takes the namespace over while `old` still thinks it is active
    with pytest.raises(LeaseLostError):
        await old.step()
    assert await new.catch_up() == 1
    assert (await snapshot(redis_client, keys)).speed["w1", D1].decode_tps.n == 1


async def test_a_second_projector_waits_while_the_first_holds_the_lease(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    first = Projector(redis_client, keys, lease_ms=500)
    second = Projector(redis_client, keys, lease_ms=500)
    assert await first.acquire()
    assert not await second.acquire()
    await first.release()
    assert await second.acquire()
    first._renewed_at = -1e9  # due for renewal now
    with pytest.raises(LeaseLostError):
        await first.keep_lease()


async def test_the_projector_loop_follows_the_ledger_live(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    projector = Projector(redis_client, keys, lease_ms=1000)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    try:
        await ledger.append(completed("t1", "w1"))
        for _ in range(100):
            if await store.current(redis_client, keys) and await lag(redis_client, keys) == (0, 0):
                break
            await asyncio.sleep(0.05)
        assert (await snapshot(redis_client, keys)).speed["w1", D1].decode_tps.n == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    assert await redis_client.get(keys.singleton("projector")) is None


def _many(n: int) -> list[Event]:
    out: list[Event] = []
    for i in range(n):
        worker = f"w{i % 3}"
        out.append(TaskSubmitted(at=T0 + i, task_id=f"t{i}", model="m", digest=D1, queue="q"))
        out.append(TaskClaimed(at=T0 + i, task_id=f"t{i}", worker=worker, digest=D1, attempt=1))
        out.append(completed(f"t{i}", worker, at=T0 + i, timings=timings(tps=10.0 + i % 50)))
    return out


async def _wait_caught_up(redis: aioredis.Redis, keys: Keys, stalled_after: float) -> None:
    """Until the projector has caught up; it fails once the lag has not shrunk for `stalled_after`
    seconds (a projector that stopped), not after a fixed time (on a busy machine folding the
    ledger takes minutes where it takes seconds on a quiet one)."""
    least = await lag(redis, keys)
    deadline = time.monotonic() + stalled_after
    while time.monotonic() < deadline:
        now = await lag(redis, keys)
        if now == (0, 0):
            return
        if now[0] < least[0]:
            least, deadline = now, time.monotonic() + stalled_after
        await asyncio.sleep(0.05)
    raise AssertionError(f"the projector made no progress in {stalled_after} s: lag {least}")


async def _checkpoint(redis: aioredis.Redis, keys: Keys) -> bytes | None:
    ns = await store.current(redis, keys)
    return None if ns is None else await redis.get(keys.checkpoint(ns))


@pytest.mark.slow
async def test_a_projector_killed_mid_batch_and_restarted_counts_nothing_twice_and_misses_nothing(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    n = 20_000
    await ledger.append_many(_many(n))
    env = {**os.environ, "ROUTELEDGER_LEASE_MS": "300", "ROUTELEDGER_HEARTBEAT_MS": "100"}
    argv = ["-m", "routeledger", "projector", "--redis-url", redis_url]
    killed_behind = []
    for round_ in range(3):
        before = await _checkpoint(redis_client, keys)
        proc = await asyncio.create_subprocess_exec(sys.executable, *argv, env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        # Kill it once it has written a batch of this round, while entries are still left to fold.
        while time.monotonic() < deadline:
            if await _checkpoint(redis_client, keys) != before:
                break
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.01 * round_)
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        killed_behind.append((await lag(redis_client, keys))[0])
        await ledger.append_many(_many(100))
    assert any(behind > 0 for behind in killed_behind), "every kill came after the projector had caught up"
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv, env=env, stderr=subprocess.DEVNULL)
    try:
        await _wait_caught_up(redis_client, keys, stalled_after=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            # A projector that ignores SIGTERM fails here rather than holding the suite for ever.
            await asyncio.wait_for(proc.wait(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    ns = await store.current(redis_client, keys)
    assert ns is not None
    live = await store.load(redis_client, keys, ns)
    rebuilt, _ = await build(redis_client, keys)
    assert diff_tables(live, rebuilt) == []
    # t0..t99 were appended four times over: the repeats are duplicate completions.
    assert sum(r.decode_tps.n for r in live.speed.values()) == n
    assert sum(t.duplicates for t in live.tasks.values()) == 300


async def test_only_cold_runs_are_load_samples_and_an_old_run_that_does_not_say_counts_only_a_real_load(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    warm = timings(load_duration=4_000_000)  # the few ms Ollama reports on a warm call
    cold = timings(load_duration=8_000_000_000)
    await fold_all(
        redis_client,
        keys,
        [
            completed("t1", "w1", timings=cold, cold=True),
            *[completed(f"w{i}", "w1", timings=warm, cold=False) for i in range(5)],
            # Written before completions said: a warm call's milliseconds are dropped, a load kept.
            completed("o1", "w1", timings=warm),
            completed("o2", "w1", timings=timings(load_duration=12_000_000_000)),
        ],
    )
    load = (await snapshot(redis_client, keys)).speed["w1", D1].load_s
    assert load.n == 2 and load.mean == pytest.approx(10.0)


async def test_a_worker_whose_clock_runs_ahead_has_its_samples_timed_by_the_ledger(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    ahead = now_ms() + 86_400_000
    await fold_all(
        redis_client,
        keys,
        [
            TaskClaimed(at=ahead, task_id="t1", worker="w1", digest=D1, attempt=1),
            completed("t1", "w1", at=ahead),
        ],
    )
    snap = await snapshot(redis_client, keys)
    decode = snap.speed["w1", D1].decode_tps
    assert decode.updated_at is not None and decode.updated_at <= now_ms()
    # A day later by the reader's clock the sample is a day old, not still "fresh".
    age = decode.age_s(now_ms() + 86_400_000)
    assert age is not None and age > 86_000
    offset = snap.fleet["w1"].clock_offset_ms
    assert offset is not None and abs(offset - 86_400_000) < 60_000


async def test_one_odd_event_leaves_a_workers_clock_skew_alone_and_a_stepped_clock_shows_within_five(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    def claim(i: int, ahead_ms: int) -> TaskClaimed:
        return TaskClaimed(at=now_ms() + ahead_ms, task_id=f"t{i}", worker="w1", digest=D1, attempt=1)

    # One claim stamped a minute off (a stalled write, a late retry) among true ones.
    projector = await fold_all(redis_client, keys, [claim(i, 60_000 if i == 3 else 0) for i in range(6)])
    skew = (await snapshot(redis_client, keys)).fleet["w1"].clock_skew
    assert isinstance(skew.value, int) and abs(skew.value) < 5_000
    assert skew.at is not None and skew.at <= now_ms()
    # The machine's clock is stepped 90 s ahead: five events later the estimate says so.
    await Ledger(redis_client, keys).append_many([claim(i, 90_000) for i in range(6, 11)])
    await projector.catch_up()
    skew = (await snapshot(redis_client, keys)).fleet["w1"].clock_skew
    assert isinstance(skew.value, int) and abs(skew.value - 90_000) < 5_000


async def test_a_wake_is_measured_on_the_ledgers_clock_not_across_two_machines_clocks(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    # The waker asks on one machine's clock; the woken machine, 90 s ahead, answers on its own.
    await fold_all(
        redis_client,
        keys,
        [
            WakeRequested(at=now_ms(), worker="gpu", why="plan"),
            WorkerOnline(at=now_ms() + 90_000, worker="gpu", slots=1),
        ],
    )
    row = (await snapshot(redis_client, keys)).fleet["gpu"]
    assert isinstance(row.wake_s.value, float) and 0 <= row.wake_s.value < 5


async def test_a_worker_90_s_ahead_that_dies_is_offline_when_the_reaper_says_so_by_its_own_clock(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await Ledger(redis_client, keys).append(WorkerOnline(at=now_ms() + 90_000, worker="w1", slots=1))
    # Its lease expires later; the reaper dates the death by its own (true) clock.
    await asyncio.sleep(0.01)
    await fold_all(redis_client, keys, [WorkerOffline(at=now_ms(), worker="w1", reason="lease expired")])
    row = (await snapshot(redis_client, keys)).fleet["w1"]
    assert row.status == "offline"
    assert row.status_since is not None and row.status_since <= now_ms()


async def test_demand_and_quality_from_a_clock_ahead_are_timed_by_the_ledger(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    ahead = now_ms() + 86_400_000
    await fold_all(
        redis_client,
        keys,
        [
            TaskSubmitted(at=ahead, task_id="t1", model="m", digest=D1, domain="code", queue="q"),
            QualityScored(at=ahead, task_id="t1", digest=D1, domain="code", score=0.5, grader="ref"),
        ],
    )
    snap = await snapshot(redis_client, keys)
    for stat in (snap.demand[D1].arrivals, snap.quality[D1, "code"].score):
        assert stat.n == 1 and stat.updated_at is not None and stat.updated_at <= now_ms()


async def test_completions_are_charged_to_their_keys_once_whoever_settles_them_first(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    quotas = Quotas(redis_client, keys, open_ttl_s=3600)
    ann, bob = ApiKey(name="ann", key="a"), ApiKey(name="bob", key="b")
    queues = TaskStore(redis_client, keys, Ledger(redis_client, keys))
    for task_id, key in [("t1", ann), ("t2", ann), ("t3", bob), ("t4", None)]:
        if key is not None:
            await quotas.admit(key, task_id, 0)
        req = TaskMessage(
            model="m",
            messages=[Message(role="user", content=task_id)],
            task_id=task_id,
            key=key.name if key is not None else None,
        )
        await submit_task(queues, req, digest=D1)
    # The API handed t1's outcome to its client before the projector folded it: charged there.
    assert await quotas.settle("ann", "t1", 40)
    tokens = {"t1": 40, "t2": 60, "t3": 25, "t4": 10}
    await fold_all(redis_client, keys, [completed(t, "w1", timings=timings(n)) for t, n in tokens.items()])
    usage = {u.name: u for u in await quotas.usage([ann, bob])}
    assert (usage["ann"].tokens_today, usage["ann"].tokens_total, usage["ann"].queued) == (100, 100, 0)
    assert (usage["bob"].tokens_today, usage["bob"].queued) == (25, 0)
    # A projector that takes over folds the same completions again: each is charged once all the same.
    ns = await store.current(redis_client, keys)
    assert ns is not None
    await redis_client.delete(keys.checkpoint(ns))
    projector = Projector(redis_client, keys)
    await projector.start()
    await projector.catch_up()
    again = {u.name: u.tokens_total for u in await quotas.usage([ann, bob])}
    assert again == {"ann": 100, "bob": 25}
