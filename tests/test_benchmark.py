"""Benchmarks for every holder: on joining, the worker measures itself; answers are graded apart."""

from __future__ import annotations

import redis.asyncio as aioredis

from dispatch.benchmark import benchset, grade, pick, request_benchmark
from dispatch.lease import live_workers
from dispatch.queues import TaskQueues
from dispatch.serving import holdings
from events.event import BenchmarkRequested, BenchmarkResult, QualityScored, TaskCompleted
from events.keys import Keys
from events.ledger import Ledger
from sim.backends.hosts import SimHosts
from tests.helpers import MODEL_DIGEST, events_of, fast_config, make_test_fleet, running_agent, wait_until


def test_the_shipped_prompt_set_covers_every_domain_and_its_answers_pass_their_own_checks() -> None:
    prompts = benchset()
    assert {p.domain for p in prompts} >= {"general", "code", "japanese"}
    for p in prompts:
        assert p.answer is not None and grade(p, f"The answer: {p.answer}.") == 1.0, p.id
        assert grade(p, "I do not know.") == 0.0, p.id
    assert [p.domain for p in pick("japanese", 4)] == ["japanese"] * 4


async def test_a_worker_that_joins_benchmarks_itself_and_its_answers_are_graded_separately(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=5) as sim:
        config = fast_config("a", auto_bench=True, bench_min_samples=3)
        async with running_agent(redis_client, sim.url("a"), config):
            await wait_until(lambda: _count(ledger, QualityScored, 3), timeout=30)
    requested = await events_of(ledger, BenchmarkRequested)
    assert [(r.worker, r.digest, r.prompts, r.reason) for r in requested] == [
        ("a", MODEL_DIGEST, 3, "joined")
    ]
    results = await events_of(ledger, BenchmarkResult)
    assert len(results) == 3 and {r.bench_id for r in results} == {requested[0].bench_id}
    assert all(r.timings.eval_count and r.timings.eval_duration for r in results)
    grades = await events_of(ledger, QualityScored)
    assert {(g.digest, g.grader, g.worker) for g in grades} == {(MODEL_DIGEST, "reference", "a")}
    assert all(g.score in (0.0, 1.0) for g in grades)
    # A benchmark is also a completed task, so the task history shows it; it is pinned, never shared.
    done = await events_of(ledger, TaskCompleted)
    assert {e.bench_id for e in done} == {requested[0].bench_id}


async def test_bench_run_reaches_every_live_holder_not_only_the_fastest(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    queues = TaskQueues(redis_client, Keys(), ledger)
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
    assert "sent 2 general prompts to a" in text and "sent 2 general prompts to b" in text
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

    from dispatch.benchmark import parse_benchset
    from dispatch.errors import BenchSetError

    text = '[[prompt]]\nid = "p1"\ndomain = "general"\nprompt = "?"\nexpect = ["(unclosed"]\n'
    with pytest.raises(BenchSetError, match="prompt p1 has a bad regex"):
        parse_benchset(text)
