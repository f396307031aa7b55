"""Network faults between a worker and its backend: a hang, a connection reset, a slow drip.

Each fails its run with the right kind after the configured timeout, is retried up to the delivery
limit and then dead-lettered with the reason; the same worker stays live and serves the next task
once the backend behaves again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from dispatch.submit import submit_task
from events.event import TaskCompleted, TaskDeadLettered, TaskFailed
from events.keys import Keys
from events.ledger import Ledger
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import events_of, fast_config, wait_until
from tests.reliability.faulty_backend import FaultyBackend, Mode
from workers.agent import WorkerAgent
from workers.backend import OllamaBackend

IDLE_TIMEOUT_S = 1.0  # longest silence between two chunks
RUN_TIMEOUT_S = 2.0  # longest whole generation
LIMIT = 3


@pytest.fixture
async def backend() -> AsyncIterator[FaultyBackend]:
    async with FaultyBackend(drip_s=0.25) as server:
        yield server


async def _submit(queues: TaskStore, text: str) -> str:
    task = (
        await submit_task(queues, TaskMessage(model="m", messages=[Message(role="user", content=text)]))
    ).task
    return task.task_id


@pytest.mark.parametrize(
    ("mode", "kind"), [("hang", "timeout"), ("reset", "disconnect"), ("drip", "timeout")]
)
async def test_a_network_fault_times_out_or_fails_retries_to_the_limit_and_the_worker_serves_on(
    redis_client: aioredis.Redis, ledger: Ledger, backend: FaultyBackend, mode: Mode, kind: str
) -> None:
    keys = Keys()
    queues = TaskStore(redis_client, keys, ledger)
    client = OllamaBackend(backend.url, timeout_s=RUN_TIMEOUT_S, idle_timeout_s=IDLE_TIMEOUT_S)
    config = fast_config("a", delivery_limit=LIMIT, cooldown_s=0.05)
    agent = WorkerAgent(redis_client, keys, client, config)
    running = asyncio.create_task(agent.run())
    try:
        await wait_until(lambda: _exists(redis_client, keys.live("a")), timeout=15)
        backend.mode = mode
        bad = await _submit(queues, "faulty")
        await wait_until(lambda: _dead(ledger, bad), timeout=60)
        streamed = await redis_client.xlen(keys.out(bad))
        backend.mode = "ok"
        good = await _submit(queues, "healthy")
        await wait_until(lambda: _completed(ledger, good), timeout=30)
        assert await redis_client.exists(keys.live("a")) and not running.done()
    finally:
        agent.stopping.set()
        await asyncio.wait_for(running, 30)
        await client.aclose()
    failures = [f for f in await events_of(ledger, TaskFailed) if f.task_id == bad]
    assert [(f.kind, f.retryable, f.attempt) for f in failures] == [(kind, True, n) for n in (1, 2, 3)]
    dead = [d for d in await events_of(ledger, TaskDeadLettered) if d.task_id == bad]
    assert len(dead) == 1 and f"delivery limit {LIMIT}" in dead[0].reason and kind in dead[0].reason
    assert backend.chats == LIMIT + 1
    if mode == "drip":
        # Tokens kept coming (no idle timeout could fire); the whole-run timeout ended it.
        assert streamed > 3
    done = [e for e in await events_of(ledger, TaskCompleted) if e.task_id == good]
    assert [(e.worker, e.duplicate) for e in done] == [("a", False)]


async def _exists(redis: aioredis.Redis, key: str) -> bool:
    return bool(await redis.exists(key))


async def _dead(ledger: Ledger, task_id: str) -> bool:
    return any(d.task_id == task_id for d in await events_of(ledger, TaskDeadLettered))


async def _completed(ledger: Ledger, task_id: str) -> bool:
    return any(e.task_id == task_id for e in await events_of(ledger, TaskCompleted))
