"""The native task API: submit, look up, history, cancel (queued and running), disconnects."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from events.event import TaskCancelled, TaskCompleted, TaskRouted, TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from tests.helpers import MODEL_DIGEST, events_of, wait_until
from tests.test_api_support import fleet_and_api, ghost_worker, serving, stored_result, stored_results

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}

pytestmark = pytest.mark.cluster_tier


async def result_status(redis: aioredis.Redis, task_id: str) -> str | None:
    result = await stored_result(redis, task_id)
    return None if result is None else result.status


async def has_output(redis: aioredis.Redis, task_id: str) -> bool:
    return bool(await redis.exists(Keys.for_client(redis).out(task_id)))


async def test_a_waited_task_reports_its_result_worker_timings_and_routing(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _), httpx.AsyncClient(base_url=base) as http:
        done = (await http.post("/v1/tasks", json={**CHAT, "wait": True}, timeout=30)).json()
        looked_up = (await http.get(f"/v1/tasks/{done['task_id']}")).json()
        history = (await http.get(f"/v1/tasks/{done['task_id']}/events")).json()
    assert done["status"] == "completed" and done["worker"] == "a" and done["attempts"] == 1
    assert done["result"]["text"] and done["timings"]["eval_count"] == 40
    assert done["routing"]["candidates"][0]["worker"] == "a"
    assert looked_up == done
    types = [e["type"] for e in history["events"]]
    assert types[:2] == ["TaskSubmitted", "TaskRouted"] and types[-1] == "TaskCompleted"
    # The ledger holds sizes and digests, never the text.
    assert done["result"]["text"] not in str(history)
    assert len(await events_of(ledger, TaskCompleted)) == 1


async def test_a_queued_task_is_removed_when_cancelled_and_never_runs(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    await ghost_worker(redis_client)
    async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as http:
        accepted = await http.post("/v1/tasks", json=CHAT)
        task_id = accepted.json()["task_id"]
        queued = (await http.get(f"/v1/tasks/{task_id}")).json()
        cancelled = await http.delete(f"/v1/tasks/{task_id}")
        again = await http.delete(f"/v1/tasks/{task_id}")
        after = (await http.get(f"/v1/tasks/{task_id}")).json()
        missing = await http.delete("/v1/tasks/nope")
    assert accepted.status_code == 202 and queued["status"] == "submitted"
    assert cancelled.status_code == 200 and cancelled.json()["was_running"] is False
    assert again.status_code == 409 and again.json()["error"]["type"] == "conflict"
    assert after["status"] == "cancelled"
    assert missing.status_code == 404
    assert await redis_client.xlen(Keys.for_client(redis_client).queue(MODEL_DIGEST)) == 0
    (event,) = await events_of(ledger, TaskCancelled)
    assert event.task_id == task_id and not event.was_running


async def test_a_running_task_stops_when_cancelled(redis_client: aioredis.Redis, redis_url: str) -> None:
    # time_scale 20: a 4 s generation, so the cancel lands mid-run.
    async with fleet_and_api(redis_client, redis_url, time_scale=20.0) as (base, _):
        async with httpx.AsyncClient(base_url=base) as http:
            task_id = (await http.post("/v1/tasks", json=CHAT)).json()["task_id"]
            await wait_until(lambda: has_output(redis_client, task_id), timeout=10)
            cancelled = await http.delete(f"/v1/tasks/{task_id}")
            await wait_until(lambda: _is(redis_client, task_id, "cancelled"), timeout=5)
    assert cancelled.status_code == 202 and cancelled.json()["was_running"] is True


async def _is(redis: aioredis.Redis, task_id: str, status: str) -> bool:
    return await result_status(redis, task_id) == status


async def test_a_client_that_disconnects_mid_stream_cancels_its_task(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    # time_scale 60: a 12 s generation, so that the cancel lands mid-run on a busy machine too (at
    # 20, 4 s, the run could end before the hang-up was noticed); a cancelled run ends at once.
    async with fleet_and_api(redis_client, redis_url, time_scale=60.0) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            body = {**CHAT, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                task_id = response.headers["x-routeledger-task"]
                async for line in response.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        break  # the first real piece: now hang up
        await wait_until(lambda: _is(redis_client, task_id, "cancelled"), timeout=15)
    (event,) = await events_of(ledger, TaskCancelled)
    assert event.task_id == task_id and event.was_running


async def test_a_native_stream_relays_chunks_then_the_whole_result(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _), httpx.AsyncClient(base_url=base) as http:
        async with http.stream("POST", "/v1/tasks", json={**CHAT, "stream": True}, timeout=30) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("event:")]
    assert lines[0] == "event: accepted" and lines[-1] == "event: result"
    assert "event: chunk" in lines


async def test_a_hundred_concurrent_streams_all_complete_each_with_its_own_text(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    async with (
        fleet_and_api(
            redis_client, redis_url, workers=("a", "b"), time_scale=0.0, slots=8, lease_ms=10_000
        ) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=100)) as http,
    ):

        async def one(i: int) -> tuple[str, str]:
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": f"request {i}"}]}
            text = ""
            async with http.stream("POST", "/v1/tasks", json=body) as response:
                task_id = response.headers["x-routeledger-task"]
                async for line in response.aiter_lines():
                    if line.startswith('data: {"text"'):
                        text += json.loads(line[len("data: ") :])["text"]
            return task_id, text

        got = await asyncio.gather(*(one(i) for i in range(100)))
        stored = {r.task_id: r.text for r in await stored_results(redis_client)}
    assert len({tid for tid, _ in got}) == 100
    bad = [(text, stored[tid]) for tid, text in got if text != stored[tid]]
    assert not bad, bad[:2]
    # Each stream is its own task's text (above), and the texts differ: a sim answer of a word or
    # two can come out twice (one run of five had a pair), a relay that mixes streams far more often.
    assert len({text for _, text in got}) >= 95
    submitted = await events_of(ledger, TaskSubmitted)
    assert len(submitted) == 100 and len(await events_of(ledger, TaskRouted)) == 100


async def test_a_waiting_client_whose_accepted_task_redis_lost_is_answered_503_and_the_loss_is_counted(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    await ghost_worker(redis_client)
    keys = Keys.for_client(redis_client)
    async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as http:
        waiting = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT, timeout=30))

        async def submitted() -> bool:
            return bool(await events_of(ledger, TaskSubmitted))

        await wait_until(submitted, timeout=10)
        (task,) = await events_of(ledger, TaskSubmitted)
        # What a failover leaves of a task whose writes never reached the promoted replica: nothing.
        await redis_client.delete(keys.task(task.task_id), keys.queue(MODEL_DIGEST), keys.events)
        answer = await asyncio.wait_for(waiting, 10)
        metrics = (await http.get("/metrics")).text
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "task_lost"
    assert answer.headers["retry-after"] == "1"
    assert "routeledger_tasks_lost_total 1.0" in metrics
