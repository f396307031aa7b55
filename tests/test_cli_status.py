"""`routeledger status [--watch]` and `routeledger sim traffic`, run as a user runs them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from events.event import TaskCompleted, TaskDeadLettered, TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from sim.backends.hosts import SimHosts
from tests.helpers import MODEL_DIGEST, events_of, fast_config, make_test_fleet, rl, running_agent, wait_until


@pytest.fixture
async def busy_fleet(redis_client: aioredis.Redis, redis_url: str) -> AsyncIterator[Ledger]:
    """Workers a and b serving `m`; three tasks sent by `sim traffic` ran; one task was dead-lettered."""
    ledger = Ledger(redis_client, Keys())
    async with (
        SimHosts(make_test_fleet(), time_scale=0.1, seed=4) as hosts,
        running_agent(redis_client, hosts.url("a"), fast_config("a")),
        running_agent(redis_client, hosts.url("b"), fast_config("b")),
    ):
        sent = await asyncio.to_thread(
            rl,
            "sim",
            "traffic",
            "--rate",
            "20",
            "--count",
            "3",
            "--model",
            "m",
            "--model",
            "auto",
            "--seed",
            "1",
            "--redis-url",
            redis_url,
        )
        assert sent.returncode == 0, sent.stderr

        async def ran() -> bool:
            return len(await events_of(ledger, TaskCompleted)) >= 3

        await wait_until(ran, timeout=30)
        await ledger.append(
            TaskDeadLettered(
                task_id="t-dead", queue=Keys().queue("6d6f64656c2d"), reason="delivery limit", attempts=3
            )
        )
        yield ledger


async def test_sim_traffic_submits_routed_requests_through_the_router(busy_fleet: Ledger) -> None:
    submitted = await events_of(busy_fleet, TaskSubmitted)
    assert len(submitted) == 3
    assert {s.client for s in submitted} == {"sim-traffic"}
    assert {s.digest for s in submitted} == {MODEL_DIGEST}


async def test_status_prints_the_fleet_capacity_queues_recent_tasks_and_incidents(
    busy_fleet: Ledger, redis_url: str
) -> None:
    shown = await asyncio.to_thread(rl, "status", "--redis-url", redis_url)
    data = json.loads((await asyncio.to_thread(rl, "status", "--json", "--redis-url", redis_url)).stdout)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    for title in ("fleet", "capacity and queues", "recent tasks", "reclaims, stalls and dead letters"):
        assert title in out
    assert "online" in out and "m:latest" in out and "completed" in out
    assert "DeadLettered" in out and "delivery limit after 3 attempt(s)" in out
    assert [w["id"] for w in data["workers"]] == ["a", "b"]
    assert data["models"][0] == {
        "name": "m:latest",
        "digest": data["models"][0]["digest"],
        "capacity": 2,
        "holders": ["a", "b"],
        "loaded_on": data["models"][0]["loaded_on"],
        "queued": 0,
        "running": 0,
    }
    assert len(data["tasks"]) == 3 and {t["status"] for t in data["tasks"]} == {"completed"}
    assert all(t["worker"] in ("a", "b") and t["ranking"] for t in data["tasks"])
    assert data["incidents"][0]["type"] == "TaskDeadLettered" and data["incidents"][0]["model"] == "m:latest"


async def test_status_watch_keeps_refreshing_until_ctrl_c(busy_fleet: Ledger, redis_url: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "routeledger",
        "status",
        "--watch",
        "--interval",
        "0.3",
        "--redis-url",
        redis_url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )
    await asyncio.sleep(3)
    running = proc.returncode is None
    proc.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(proc.communicate(), 15)
    assert running, err
    assert proc.returncode in (0, 130), err
    assert b"fleet" in out and b"m:latest" in out
    assert b"Traceback" not in err
