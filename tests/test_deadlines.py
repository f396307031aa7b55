"""Every task has a deadline: a task whose client gave up never runs, and a queue left overnight does
not run last night's abandoned requests first in the morning."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from events.event import TaskCancelled, TaskClaimed, TaskExpired
from events.keys import Keys
from events.ledger import Ledger
from sim.backends.hosts import SimHosts
from tests.helpers import events_of, fast_config, make_test_fleet, running_agent, wait_until
from tests.test_api_support import ghost_worker, serving, stored_result

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def _claimed(ledger: Ledger) -> set[str]:
    return {e.task_id for e in await events_of(ledger, TaskClaimed)}


async def test_a_task_whose_client_disconnected_or_timed_out_is_cancelled_and_never_runs(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    # A holder whose lease is there but which takes nothing yet: the tasks wait in the queue.
    await ghost_worker(redis_client)
    async with serving(AppConfig(redis_url=redis_url, wait_timeout_s=0.6)) as base:
        async with httpx.AsyncClient(base_url=base, timeout=0.3) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post("/v1/chat/completions", json=CHAT)
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            timed_out = await http.post("/api/chat", json={**CHAT, "stream": False})

        async def both_cancelled() -> bool:
            return len(await events_of(ledger, TaskCancelled)) == 2

        await wait_until(both_cancelled, timeout=10)
    cancelled = [e.task_id for e in await events_of(ledger, TaskCancelled)]
    assert timed_out.status_code == 504
    for task_id in cancelled:
        result = await stored_result(redis_client, task_id)
        assert result is not None and result.status == "cancelled"
    # A worker that comes later finds nothing of theirs to run.
    async with (
        SimHosts(make_test_fleet(), time_scale=0.0, seed=3) as hosts,
        running_agent(redis_client, hosts.url("a"), fast_config("a")),
    ):
        await redis_client.delete(Keys().live("ghost"))
        async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as http:
            fresh = await http.post("/v1/chat/completions", json=CHAT)
    assert fresh.status_code == 200
    assert not set(cancelled) & await _claimed(ledger)


async def test_a_queue_left_overnight_expires_its_abandoned_tasks_unrun_and_serves_the_morning_at_once(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    await ghost_worker(redis_client)
    # The evening: tasks submitted for later (nobody waits on the line), then the holder is gone.
    async with serving(AppConfig(redis_url=redis_url, max_queue_s=0.5)) as base:
        async with httpx.AsyncClient(base_url=base) as http:
            evening = [(await http.post("/v1/tasks", json=CHAT)).json()["task_id"] for _ in range(5)]
    await redis_client.delete(Keys().live("ghost"))
    await asyncio.sleep(1.0)
    # The morning, well past every deadline: the holder comes back, and a user asks.
    async with (
        SimHosts(make_test_fleet(), time_scale=0.0, seed=3) as hosts,
        running_agent(redis_client, hosts.url("a"), fast_config("a")),
        serving(AppConfig(redis_url=redis_url)) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        morning = await http.post("/v1/chat/completions", json=CHAT)

        async def all_expired() -> bool:
            return {e.task_id for e in await events_of(ledger, TaskExpired)} == set(evening)

        await wait_until(all_expired, timeout=15)
    assert morning.status_code == 200
    assert not set(evening) & await _claimed(ledger)
    for task_id in evening:
        result = await stored_result(redis_client, task_id)
        assert result is not None and result.status == "cancelled" and "expired" in (result.error or "")
        view = await _view(redis_url, task_id)
        assert view["status"] == "cancelled"


async def _view(redis_url: str, task_id: str) -> dict[str, object]:
    async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as http:
        response = await http.get(f"/v1/tasks/{task_id}")
        body: dict[str, object] = response.json()
        return body
