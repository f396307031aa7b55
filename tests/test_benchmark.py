"""Benchmarks for every holder: on joining, the worker measures itself; answers are graded apart."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from dispatch.benchmark import grader_for, on_demand, pick, request_benchmark, ungraded
from dispatch.serving import holdings
from events.event import BenchmarkRequested, BenchmarkResult, QualityScored, TaskClaimed, TaskCompleted
from events.keys import Keys
from events.ledger import Ledger
from projections.benchset import (
    GRADE_MAX_TOKENS,
    SPEED_MAX_TOKENS,
    benchset,
    domains,
    grade,
    prompt_by_id,
    speed_prompts,
)
from projections.folder import decode_sample
from projections.projector import Projector
from projections.reader import snapshot
from projections.snapshot import FleetRow, QualityRow, Snapshot, SpeedRow, Stamped, grade_mark
from sim.backends.hosts import SimHosts
from tasks.lease import live_workers
from tasks.store import TaskStore
from tests.helpers import (
    MODEL_DIGEST,
    events_of,
    fast_config,
    make_test_fleet,
    running_agent,
    running_projector,
    wait_until,
)
from tests.router_helpers import stat


def test_the_shipped_prompt_set_covers_every_domain_and_its_answers_pass_their_own_checks() -> None:
    prompts = benchset()
    assert {p.domain for p in prompts} >= {"general", "code", "japanese"}
    for p in prompts:
        assert p.answer is not None and grade(p, f"The answer: {p.answer}.") == 1.0, p.id
        assert grade(p, "I do not know.") == 0.0, p.id
    assert [p.domain for p in pick("japanese", 4)] == ["japanese"] * 4


async def test_a_worker_that_joins_measures_its_speed_with_long_answers_and_grades_apart(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=5) as sim:
        config = fast_config("a", auto_bench=True, bench_min_samples=3, bench_check_s=0.5, grade_quiet_s=0.2)
        # The grader is chosen from the projected fleet: the projector runs.
        async with running_projector(redis_client), running_agent(redis_client, sim.url("a"), config):
            await wait_until(lambda: _count(ledger, QualityScored, 3), timeout=30)
    requested = await events_of(ledger, BenchmarkRequested)
    joined = [r for r in requested if r.reason == "joined"]
    assert [(r.worker, r.digest, r.prompts) for r in joined] == [("a", MODEL_DIGEST, 3)]
    results = await events_of(ledger, BenchmarkResult)
    speed = [r for r in results if r.bench_id == joined[0].bench_id]
    # The speed prompts' answers run to the benchmark's cap: each is a speed sample.
    assert len(speed) == 3 and {r.prompt_id for r in speed} <= {p.id for p in speed_prompts()}
    assert all(decode_sample(r.timings) is not None for r in speed)
    assert {r.timings.eval_count for r in speed} == {SPEED_MAX_TOKENS}
    # Grades come from the graded prompts, sent apart once the worker was quiet; never from speed.
    grades = await events_of(ledger, QualityScored)
    assert {(g.digest, g.grader, g.worker) for g in grades} == {(MODEL_DIGEST, "reference", "a")}
    assert all(g.score in (0.0, 1.0) for g in grades)
    assert not {g.bench_id for g in grades} & {joined[0].bench_id}
    assert all(prompt_by_id(g.prompt_id) is not None for g in grades)
    # A benchmark is also a completed task, so the task history shows it; it came from the
    # worker's background stream, never a shared one.
    done = await events_of(ledger, TaskCompleted)
    assert {e.bench_id for e in done} >= {joined[0].bench_id}
    assert all(e.bench_id for e in done)
    claims = await events_of(ledger, TaskClaimed)
    assert {c.queue for c in claims} == {Keys().background("a")}


async def test_bench_run_reaches_every_live_holder_not_only_the_fastest(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, Keys(), ledger)
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=5) as sim:
        async with (
            running_agent(redis_client, sim.url("a"), fast_config("a")),
            running_agent(redis_client, sim.url("b"), fast_config("b")),
            running_agent(redis_client, sim.url("c"), fast_config("c")),
        ):
            targets = holdings(await live_workers(redis_client, Keys()), "m")
            assert [(w, d) for w, _, d in targets] == [("a", MODEL_DIGEST), ("b", MODEL_DIGEST)]
            for worker, name, digest in targets:
                await request_benchmark(queues, worker=worker, model=name, digest=digest, count=2)
            await wait_until(lambda: _count(ledger, BenchmarkResult, 4), timeout=30)
    results = await events_of(ledger, BenchmarkResult)
    assert sorted(r.worker for r in results) == ["a", "a", "b", "b"]


async def _count(ledger: Ledger, kind: type, n: int) -> bool:
    return len(await events_of(ledger, kind)) >= n


async def test_the_bench_run_command_prints_every_holders_speed(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    import asyncio
    import sys

    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=5) as sim:
        async with (
            running_agent(redis_client, sim.url("a"), fast_config("a")),
            running_agent(redis_client, sim.url("b"), fast_config("b")),
        ):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "routeledger",
                "bench",
                "run",
                "--model",
                "m",
                "--count",
                "2",
                "--timeout",
                "60",
                "--redis-url",
                redis_url,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 90)
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    assert "sent 2 speed and 2 general prompts to a" in text
    assert "sent 2 speed and 2 general prompts to b" in text
    assert "200.0" in text  # the simulated decode speed of both machines, measured


def test_bench_run_without_a_holder_is_a_clear_error(redis_url: str) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "routeledger", "bench", "run", "--model", "nope", "--redis-url", redis_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "no live worker serves model 'nope'" in result.stderr


def test_a_prompt_set_with_a_bad_pattern_is_refused_naming_the_prompt() -> None:
    import pytest

    from projections.benchset import parse_benchset
    from projections.errors import BenchSetError

    text = '[[prompt]]\nid = "p1"\ndomain = "general"\nprompt = "?"\nexpect = ["(unclosed"]\n'
    with pytest.raises(BenchSetError, match="prompt p1 has a bad regex"):
        parse_benchset(text)


def test_a_thinking_model_is_graded_on_its_final_answer_within_a_budget_it_can_answer_in() -> None:
    paris = prompt_by_id("general-capital-france")
    assert paris is not None
    assert all(p.max_tokens == GRADE_MAX_TOKENS >= 1024 for p in benchset())
    assert grade(paris, "<think>France... its capital is Paris.</think>\nParis") == 1.0
    # What it only considered while thinking is not its answer.
    assert grade(paris, "<think>Paris? No, I recall Lyon.</think>\nLyon") == 0.0
    # Cut off while still thinking: no answer at all.
    assert grade(paris, "<think>The capital of France is Paris, but let me") == 0.0


def _fleet_snapshot(measured: dict[str, float | None]) -> Snapshot:
    snap = Snapshot(live=sorted(measured))
    for worker, tps in measured.items():
        snap.fleet[worker] = FleetRow(worker=worker, inventory=Stamped(value={"m": MODEL_DIGEST}, at=1))
        if tps is not None:
            snap.speed[worker, MODEL_DIGEST] = SpeedRow(
                worker=worker, digest=MODEL_DIGEST, decode_tps=stat([tps] * 3)
            )
    return snap


def test_one_live_holder_grades_a_digest_the_fastest_measured_and_every_holder_agrees_which() -> None:
    assert (
        grader_for(_fleet_snapshot({"laptop": 11.4, "gpu-pc": 83.0, "new": None}), MODEL_DIGEST) == "gpu-pc"
    )
    assert grader_for(_fleet_snapshot({"b": None, "a": None}), MODEL_DIGEST) == "a"
    gone = _fleet_snapshot({"laptop": 11.4, "gpu-pc": 83.0})
    gone.live = ["laptop"]  # the GPU PC is switched off: the laptop grades
    assert grader_for(gone, MODEL_DIGEST) == "laptop"
    assert grader_for(Snapshot(), MODEL_DIGEST) is None


def test_the_schedule_asks_only_for_the_prompts_the_reference_check_has_not_graded() -> None:
    snap = Snapshot()
    general = [p.id for p in benchset() if p.domain == "general"]
    snap.quality[MODEL_DIGEST, "general"] = QualityRow(
        digest=MODEL_DIGEST,
        domain="general",
        graded=sorted([grade_mark("reference", general[0]), grade_mark("judge:x", general[1])]),
    )
    assert [p.id for p in ungraded(snap, MODEL_DIGEST, "general")] == general[1:]
    assert len(ungraded(snap, MODEL_DIGEST, "code")) == sum(p.domain == "code" for p in benchset())


async def test_a_worker_grades_every_prompt_of_every_domain_once_for_its_model(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    keys = Keys()
    projector = Projector(redis_client, keys)
    await projector.start()
    stop = asyncio.Event()
    folding = asyncio.create_task(projector.run(stop))
    try:
        async with SimHosts(make_test_fleet(), time_scale=1.0, seed=5) as sim:
            config = fast_config("a", auto_bench=True, bench_check_s=0.2)
            async with running_agent(redis_client, sim.url("a"), config):

                async def all_graded() -> bool:
                    snap = await snapshot(redis_client, keys)
                    return all(not ungraded(snap, MODEL_DIGEST, d) for d in domains())

                await wait_until(all_graded, timeout=60)
    finally:
        stop.set()
        await folding
    grades = [g for g in await events_of(ledger, QualityScored) if g.digest == MODEL_DIGEST]
    by_domain = {d: sorted(g.prompt_id for g in grades if g.domain == d) for d in domains()}
    for d in domains():
        assert set(by_domain[d]) == {p.id for p in benchset() if p.domain == d}
    # Each prompt once, but the speed benchmark's and the schedule's may have crossed once.
    assert len(grades) <= len(benchset()) + 3
    requested = await events_of(ledger, BenchmarkRequested)
    assert {r.reason.split(":")[0] for r in requested} == {"joined", "grading"}
    assert all(r.prompts <= config.grade_batch for r in requested)


def test_a_benchmark_asked_for_sends_the_prompts_the_model_was_not_graded_on_first() -> None:
    snap = Snapshot()
    code = [p.id for p in benchset() if p.domain == "code"]
    snap.quality[MODEL_DIGEST, "code"] = QualityRow(
        digest=MODEL_DIGEST, domain="code", graded=sorted(grade_mark("reference", i) for i in code[:3])
    )
    assert [p.id for p in on_demand(snap, MODEL_DIGEST, "code", 5)] == code[3:] + code[:1]
    assert [p.id for p in on_demand(Snapshot(), MODEL_DIGEST, "code", 2)] == code[:2]
