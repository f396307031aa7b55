"""Cancel means cancel: a task whose client cancelled it, hung up, or was told to retry never runs
again, and a run of it in progress stops on its machine (its backend request closed) within a second.

The runs here are slow on purpose (simulated machines at a slow time scale, a long prompt): a
backend evaluating a prompt sends nothing for seconds, which is where a cancel used to go unseen
until a timeout re-queued the task for another attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from events.event import TaskCancelled, TaskClaimed, TaskCompleted, TaskFailed
from events.keys import WORKERS_GROUP, Keys
from events.ledger import Ledger
from sim.backends.hosts import SimHosts
from tests.helpers import MODEL_DIGEST, events_of, fast_config, make_test_fleet, running_agent, wait_until
from tests.reliability.faulty_backend import DIGEST as FAULTY_DIGEST
from tests.reliability.faulty_backend import FaultyBackend
from tests.test_api_support import serving
from workers.agent import WorkerAgent

# The test fleet evaluates 5000 prompt tokens a second; at this time scale a prompt of 8,000 bytes
# (2,000 tokens, as the simulator counts them) takes PROMPT_S seconds, with no byte sent meanwhile.
TIME_SCALE = 20.0
PROMPT_S = 8.0
LONG = {"model": "m", "messages": [{"role": "user", "content": "word " * 1600}]}


@contextlib.asynccontextmanager
async def slow_fleet(
    redis: aioredis.Redis, redis_url: str, names: Sequence[str] = ("a", "b"), **config: object
) -> AsyncIterator[tuple[str, SimHosts, list[WorkerAgent]]]:
    """Two slow simulated machines that hold model `m`, a worker agent for each, and the API."""
    async with (
        SimHosts(make_test_fleet(), time_scale=TIME_SCALE, seed=5) as hosts,
        contextlib.AsyncExitStack() as stack,
    ):
        agents = [
            await stack.enter_async_context(running_agent(redis, hosts.url(n), fast_config(n, **config)))
            for n in names
        ]
        async with serving(AppConfig(redis_url=redis_url)) as base:
            yield base, hosts, agents


async def claimed(ledger: Ledger, task_id: str) -> bool:
    return any(c.task_id == task_id for c in await events_of(ledger, TaskClaimed))


def idle(agents: Sequence[WorkerAgent]) -> bool:
    return all(not agent.runs.running for agent in agents)


async def until_idle(agents: Sequence[WorkerAgent]) -> float:
    """Seconds until no agent runs anything (polled every 20 ms)."""
    began = time.monotonic()

    async def check() -> bool:
        return idle(agents)

    await wait_until(check, timeout=10, every=0.02)
    return time.monotonic() - began


async def never_ran_again(redis: aioredis.Redis, ledger: Ledger, task_id: str, digest: str) -> None:
    """Its only claim is attempt 1, it has no completion, and its queue holds nothing of it."""
    claims = [c.attempt for c in await events_of(ledger, TaskClaimed) if c.task_id == task_id]
    assert claims == [1]
    assert not [e for e in await events_of(ledger, TaskCompleted) if e.task_id == task_id]
    queue = Keys.for_client(redis).queue(digest)
    assert await redis.xlen(queue) == 0
    groups = await redis.xinfo_groups(queue)
    assert all(g["pending"] == 0 for g in groups if g["name"] in (WORKERS_GROUP, WORKERS_GROUP.encode()))


async def test_a_task_cancelled_while_its_long_prompt_is_evaluated_stops_within_a_second_and_never_runs_again(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    async with (
        slow_fleet(redis_client, redis_url) as (base, hosts, agents),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        task_id = (await http.post("/v1/tasks", json=LONG)).json()["task_id"]
        await wait_until(lambda: claimed(ledger, task_id), timeout=10)
        await asyncio.sleep(0.5)  # well into the prompt's evaluation: no token has come
        asked = time.monotonic()
        cancelled = await http.delete(f"/v1/tasks/{task_id}")
        await until_idle(agents)
        stopped_s = time.monotonic() - asked
        # Past the end of the prompt's evaluation: the machine has noticed its client left, and a
        # re-run (its retry, or the other machine's) would have been claimed by now.
        await asyncio.sleep(PROMPT_S)
        machines = [hosts.state(n).counters for n in ("a", "b")]
    assert cancelled.status_code == 202 and cancelled.json()["was_running"] is True
    assert stopped_s < 1.0, f"the run stopped {stopped_s:.2f}s after the cancel"
    failures = [(f.kind, f.retryable) for f in await events_of(ledger, TaskFailed) if f.task_id == task_id]
    assert failures == [("cancelled", False)]
    assert [e.was_running for e in await events_of(ledger, TaskCancelled) if e.task_id == task_id] == [True]
    await never_ran_again(redis_client, ledger, task_id, MODEL_DIGEST)
    # The backend request was closed: the machine counts a client that went away, no generation.
    assert sum(c.completed for c in machines) == 0 and sum(c.cancelled for c in machines) == 1


async def test_a_client_that_hangs_up_while_its_long_prompt_is_evaluated_stops_the_run_within_a_second(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    async with (
        slow_fleet(redis_client, redis_url) as (base, _, agents),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        async with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as response:
            task_id = response.headers["x-routeledger-task"]
            await wait_until(lambda: claimed(ledger, task_id), timeout=10)
            await asyncio.sleep(0.5)
            hung_up = time.monotonic()
        await until_idle(agents)
        stopped_s = time.monotonic() - hung_up
        await asyncio.sleep(PROMPT_S)
    assert stopped_s < 1.0, f"the run stopped {stopped_s:.2f}s after the hang-up"
    assert [e.was_running for e in await events_of(ledger, TaskCancelled) if e.task_id == task_id] == [True]
    failures = [(f.kind, f.retryable) for f in await events_of(ledger, TaskFailed) if f.task_id == task_id]
    assert failures == [("cancelled", False)]
    await never_ran_again(redis_client, ledger, task_id, MODEL_DIGEST)


async def test_a_cancelled_run_that_times_out_before_it_sees_the_cancel_ends_cancelled_and_is_not_re_queued(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    # The probe's ledger, made on purpose: a worker that looks at the cancel key too seldom to see
    # it, and a backend silent for longer than the worker's idle timeout. The timeout is retryable;
    # the task was withdrawn, so the run ends cancelled and its entry is finished.
    async with (
        SimHosts(make_test_fleet(), time_scale=TIME_SCALE, seed=5) as hosts,
        running_agent(
            redis_client, hosts.url("a"), fast_config("a", cancel_check_ms=600_000.0), idle_timeout_s=1.5
        ),
        serving(AppConfig(redis_url=redis_url)) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        task_id = (await http.post("/v1/tasks", json=LONG)).json()["task_id"]
        await wait_until(lambda: claimed(ledger, task_id), timeout=10)
        cancelled = await http.delete(f"/v1/tasks/{task_id}")
        await wait_until(lambda: _failed(ledger, task_id), timeout=10)
        await asyncio.sleep(2.0)  # the worker's cooldown is 0.3 s: a re-queued task would be claimed again
    assert cancelled.status_code == 202
    failures = [f for f in await events_of(ledger, TaskFailed) if f.task_id == task_id]
    assert [(f.kind, f.retryable) for f in failures] == [("cancelled", False)]
    assert "timeout" in failures[0].message
    await never_ran_again(redis_client, ledger, task_id, MODEL_DIGEST)


async def _failed(ledger: Ledger, task_id: str) -> bool:
    return any(f.task_id == task_id for f in await events_of(ledger, TaskFailed))


@pytest.fixture
async def breaking() -> AsyncIterator[FaultyBackend]:
    async with FaultyBackend(drip_s=0.05) as server:
        server.mode = "reset"
        yield server


async def test_a_stream_whose_backend_broke_off_tells_its_client_to_retry_and_the_task_is_not_run_again(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger, breaking: FaultyBackend
) -> None:
    # Its backend sends two pieces and resets the connection (retryable); any later request of the
    # task would drip for ever. The client has some text already, so it is told to retry, and the
    # task it would have re-run for nobody is withdrawn.
    async with (
        running_agent(redis_client, breaking.url, fast_config("a")),
        serving(AppConfig(redis_url=redis_url)) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hello"}]}
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            task_id = response.headers["x-routeledger-task"]

            async def asked() -> bool:
                return breaking.chats >= 1

            # A request reads the mode as it arrives: the first one breaks off, any later one
            # would drip for ever.
            await wait_until(asked, timeout=10, every=0.001)
            breaking.mode = "drip"
            lines = [line async for line in response.aiter_lines() if line]
        await asyncio.sleep(2.0)  # the worker's cooldown is 0.3 s: a re-queued task would be claimed again
        chats = breaking.chats
    assert any('"t0 "' in line for line in lines), lines
    assert "retry the request" in lines[-1], lines[-1]
    assert chats == 1
    failures = [(f.kind, f.retryable) for f in await events_of(ledger, TaskFailed) if f.task_id == task_id]
    assert failures[0] == ("disconnect", True)
    assert [e.task_id for e in await events_of(ledger, TaskCancelled)] == [task_id]
    await never_ran_again(redis_client, ledger, task_id, FAULTY_DIGEST)
