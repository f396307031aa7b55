"""Submission with a routing decision, and the preview of it."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
import redis.asyncio as aioredis

from dispatch.submit import preview_request, route_and_submit
from dispatch.view import LiveView
from events.event import TaskRouted, TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from router.choose import RouteQuery
from sim.backends.hosts import SimHosts
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import MODEL_DIGEST, events_of, fast_config, make_test_fleet, running_agent

pytestmark = pytest.mark.cluster_tier


async def test_a_routed_submission_records_the_whole_decision_before_the_task_is_queued(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    keys = Keys.for_client(redis_client)
    queues = TaskStore(redis_client, keys, ledger)
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a")):
            req = TaskMessage(model="m", messages=[Message(role="user", content="hi")])
            sub = await route_and_submit(queues, LiveView(redis_client, keys), req)
            task, queue, decision = sub.task, sub.queue, sub.decision
    submitted = await events_of(ledger, TaskSubmitted)
    routed = await events_of(ledger, TaskRouted)
    assert [s.task_id for s in submitted] == [task.task_id] and [r.task_id for r in routed] == [task.task_id]
    r = routed[0]
    assert r.digest == MODEL_DIGEST and r.queue == queue and r.expected_worker == "a"
    candidates = r.breakdown["candidates"]
    assert isinstance(candidates, list) and candidates[0]["worker"] == "a"
    order = [
        type(e).__name__
        async for _, e in ledger.read()
        if type(e).__name__ in ("TaskSubmitted", "TaskRouted")
    ]
    assert order == ["TaskSubmitted", "TaskRouted"]
    assert decision.digest == MODEL_DIGEST


async def test_auto_picks_a_served_model_and_the_domain_is_classified_from_the_prompt(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    keys = Keys.for_client(redis_client)
    queues = TaskStore(redis_client, keys, ledger)
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a")):
            msgs = [
                Message(role="user", content="def add(a, b):\n    return a + b  # fix this Python function")
            ]
            sub = await route_and_submit(
                queues, LiveView(redis_client, keys), TaskMessage(model="auto", messages=msgs)
            )
            task, decision = sub.task, sub.decision
    assert task.model in ("m", "m:latest") and task.digest == MODEL_DIGEST
    assert task.domain == "code" and decision.choice is not None


async def test_the_preview_is_the_documented_json_best_first_with_sources(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    keys = Keys.for_client(redis_client)
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with (
            running_agent(redis_client, sim.url("a"), fast_config("a")),
            running_agent(redis_client, sim.url("b"), fast_config("b")),
        ):
            direct = await preview_request(LiveView(redis_client, keys), RouteQuery(model="m", max_tokens=40))
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "routeledger",
                "route",
                "preview",
                "--model",
                "m",
                "--tokens",
                "40",
                "--json",
                "--redis-url",
                redis_url,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    printed = json.loads(out)
    for result in (direct, printed):
        assert set(result) == {"model", "digest", "candidates", "plan"}
        assert result["digest"] == MODEL_DIGEST
        candidates = result["candidates"]
        assert [c["worker"] for c in candidates] in (["a", "b"], ["b", "a"])
        finishes = [c["expected_finish_s"] for c in candidates]
        assert finishes == sorted(finishes)
        for c in candidates:
            assert set(c["fields"]["decode_tps"]) >= {"value", "n", "source", "age_s"}
            assert "quality" in c["fields"]
        assert result["plan"]["taker"] == candidates[0]["worker"]
