"""Benchmarks and grading never delay a user: they run from the worker's background stream, only
while no user work waits for it, one at a time, and give their slot up at once when user work
comes. Real Redis, a simulated Ollama host, the worker agent."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from dispatch.benchmark import request_benchmark
from dispatch.submit import submit_task
from dispatch.view import worker_views
from events.event import ModelEntry, TaskClaimed, TaskCompleted, TaskFailed, TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from sim.backends.hosts import SimHosts
from sim.fleetspec import parse_fleet
from tasks.lease import LeaseInfo, RunningInfo
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import MODEL_DIGEST, events_of, fast_config, running_agent, wait_until

# One machine, one slot; a benchmark's 128-token answer takes 6.4 s there, a user task's 40 tokens 2 s.
FLEET = f"""
name = "one"
[model."m"]
digest = "{MODEL_DIGEST}"
output = {{ dist = "fixed", mean = 40 }}
[[worker]]
name = "a"
slots = 1
[worker.models."m"]
decode_tps = 20.0
prompt_tps = 5000.0
load_s = 0.0
"""


@contextlib.asynccontextmanager
async def one_machine(redis_client: aioredis.Redis, ledger: Ledger) -> AsyncIterator[TaskStore]:
    """The one-slot machine with its worker online; the queues to submit to."""
    async with (
        SimHosts(parse_fleet(FLEET, "one.toml"), time_scale=1.0, seed=1) as sim,
        running_agent(redis_client, sim.url("a"), fast_config("a")),
    ):
        yield TaskStore(redis_client, Keys(), ledger)


async def _user_task(queues: TaskStore) -> str:
    req = TaskMessage(model="m", messages=[Message(role="user", content="hello there")], max_tokens=40)
    return (await submit_task(queues, req)).task_id


async def test_a_user_task_takes_the_slot_of_a_running_benchmark_at_once_and_the_benchmark_runs_later(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with one_machine(redis_client, ledger) as queues:
        await request_benchmark(queues, worker="a", model="m:latest", digest=MODEL_DIGEST, count=1)

        async def bench_running() -> bool:
            return any(e.task_id.startswith("bench-") for e in await events_of(ledger, TaskClaimed))

        await wait_until(bench_running, timeout=10)
        user = await _user_task(queues)

        async def all_done() -> bool:
            return len(await events_of(ledger, TaskCompleted)) >= 2

        await wait_until(all_done, timeout=30)
    claims = await events_of(ledger, TaskClaimed)
    done = {e.task_id: e for e in await events_of(ledger, TaskCompleted)}
    bench = next(e.task_id for e in claims if e.task_id.startswith("bench-"))
    failed = await events_of(ledger, TaskFailed)
    # The benchmark gave way, said why, and ran again (a second attempt) once the user was served.
    assert [(e.task_id, e.kind, e.retryable) for e in failed] == [(bench, "preempted", True)]
    user_claim = next(e for e in claims if e.task_id == user)
    bench_claims = [e for e in claims if e.task_id == bench]
    assert [e.attempt for e in bench_claims] == [1, 2]
    assert user_claim.at < bench_claims[1].at
    assert done[bench].attempt == 2 and done[user].attempt == 1
    # The user task started within moments of its submission, not after the 6.4 s answer.
    submitted = next(e.at for e in await events_of(ledger, TaskSubmitted) if e.task_id == user)
    assert user_claim.at - submitted < 1500


async def test_a_benchmark_waits_until_no_user_work_waits_for_its_worker(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with one_machine(redis_client, ledger) as queues:
        first = await _user_task(queues)

        async def running() -> bool:
            return any(e.task_id == first for e in await events_of(ledger, TaskClaimed))

        await wait_until(running, timeout=10)
        # While it runs: a benchmark first, then two more user tasks.
        await request_benchmark(queues, worker="a", model="m:latest", digest=MODEL_DIGEST, count=1)
        users = [first, await _user_task(queues), await _user_task(queues)]

        async def all_done() -> bool:
            return len(await events_of(ledger, TaskCompleted)) >= 4

        await wait_until(all_done, timeout=40)
    order = [e.task_id for e in await events_of(ledger, TaskClaimed)]
    assert order[:3] == users and order[3].startswith("bench-")
    assert not await events_of(ledger, TaskFailed)


def test_every_plan_counts_the_slot_of_a_benchmark_as_free() -> None:
    def lease(background: bool) -> LeaseInfo:
        return LeaseInfo(
            worker="a",
            token="t",
            slots=1,
            inventory=[ModelEntry(name="m", digest=MODEL_DIGEST)],
            running=[RunningInfo(task_id="x", digest=MODEL_DIGEST, started_at=1, background=background)],
        )

    assert [len(v.running) for v in worker_views({"a": lease(background=True)})] == [0]
    assert [len(v.running) for v in worker_views({"a": lease(background=False)})] == [1]
