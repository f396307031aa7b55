"""Keys, quotas and fair queueing end to end: real Redis, real worker agents on simulated machines.

One key floods while another sends its usual requests: the flooder is refused (429) past its
limits and the other key's latency stays near what it is alone. A priority 9 task overtakes a queue
of priority 0 ones; a key with a long queue does not make another key's first task wait behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator

import httpx
import redis.asyncio as aioredis

from api.app import AppConfig
from events.event import TaskClaimed, TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from sim.backends.hosts import SimHosts
from tasks.quota import FAIR_QUANTUM, ApiKey
from tests.helpers import events_of, fast_config, make_test_fleet, running_agent, wait_until
from tests.test_api_support import fleet_and_api, ghost_worker, serving

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
# Each generation takes 40 tokens / 200 tok/s x 2.5 = 0.5 s: service time dominates the overhead.
TIME_SCALE = 2.5
# Sequential requests of the steady key in each phase (its p95 is read from these).
STEADY_REQUESTS = 24
FLOODERS = 4


def p95(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=20, method="inclusive")[-1]


async def steady_latencies(http: httpx.AsyncClient) -> list[float]:
    out = []
    for _ in range(STEADY_REQUESTS):
        start = time.perf_counter()
        reply = await http.post("/v1/tasks", json={**CHAT, "wait": True}, timeout=60)
        assert reply.status_code == 200, reply.text
        out.append(time.perf_counter() - start)
    return out


@contextlib.asynccontextmanager
async def flooding(base: str, counts: dict[int, int]) -> AsyncIterator[None]:
    """FLOODERS clients sending as fast as they are answered (a refusal is retried after 50 ms), in
    a process of their own (tests/reliability/flooder.py); `counts` gets their statuses at the end."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.reliability.flooder",
        base,
        "flood-key",
        str(FLOODERS),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None
    try:
        # The flood is under way before the steady key measures anything: it is being refused.
        await wait_until(lambda: _refusing(base), timeout=20)
        yield
    finally:
        proc.stdin.close()
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    counts.update({int(status): n for status, n in json.loads(out).items()})


async def _refusing(base: str) -> bool:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": "Bearer steady-key"}) as http:
        usage = {k["name"]: k for k in (await http.get("/v1/stats")).json()["keys"]}
    flood = usage.get("flood", {})
    return bool(flood.get("refused")) and bool(flood.get("requests"))


async def test_a_flooding_key_gets_429s_and_the_other_keys_p95_stays_within_1_5x_of_its_solo_run(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    keys = [
        ApiKey(name="steady", key="steady-key"),
        # The flooder may hold one task at a time and 120 a minute: one of the two workers stays free.
        ApiKey(name="flood", key="flood-key", max_queued=1, rpm=120),
    ]
    counts: dict[int, int] = {}
    async with (
        fleet_and_api(redis_client, redis_url, workers=("a", "b"), time_scale=TIME_SCALE, keys=keys) as (
            base,
            _,
        ),
        httpx.AsyncClient(base_url=base, headers={"Authorization": "Bearer steady-key"}) as http,
    ):
        await http.post("/v1/tasks", json={**CHAT, "wait": True}, timeout=60)  # warm both paths
        solo = await steady_latencies(http)
        async with flooding(base, counts):
            crowded = await steady_latencies(http)
        usage = {k["name"]: k for k in (await http.get("/v1/stats")).json()["keys"]}
    ratio = p95(crowded) / p95(solo)
    assert ratio <= 1.5, f"p95 {p95(crowded):.3f}s crowded vs {p95(solo):.3f}s alone ({ratio:.2f}x)"
    assert counts.get(429, 0) > 0 and counts.get(200, 0) > 0
    assert usage["flood"]["refused"] == counts[429] and usage["steady"]["refused"] == 0
    assert usage["steady"]["requests"] == 2 * STEADY_REQUESTS + 1
    # Every completion was charged: prompt and 40 output tokens each.
    assert usage["steady"]["tokens_today"] >= 40 * (2 * STEADY_REQUESTS + 1)


async def claim_order(ledger: Ledger) -> list[str]:
    return [e.task_id for e in await events_of(ledger, TaskClaimed)]


@contextlib.asynccontextmanager
async def one_worker_later(redis: aioredis.Redis) -> AsyncIterator[None]:
    """A single-slot worker started only now, after the ghost that let tasks be queued is gone."""
    await redis.delete(Keys().live("ghost"))
    async with SimHosts(make_test_fleet(), time_scale=0.0, seed=5) as hosts:
        async with running_agent(redis, hosts.url("a"), fast_config("a", slots=1)):
            yield


async def test_a_priority_9_task_overtakes_a_queue_of_priority_0_tasks_on_the_same_model(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    await ghost_worker(redis_client)
    async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as http:
        low = [(await http.post("/v1/tasks", json=CHAT)).json()["task_id"] for _ in range(10)]
        high = (await http.post("/v1/tasks", json={**CHAT, "priority": 9})).json()["task_id"]
        async with one_worker_later(redis_client):
            await wait_until(lambda: _claimed(ledger, 11), timeout=30)
    order = await claim_order(ledger)
    assert order[0] == high
    assert order[1:] == low


async def test_a_key_with_a_long_queue_does_not_make_another_keys_first_task_wait_behind_it(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    await ghost_worker(redis_client)
    config = AppConfig(
        redis_url=redis_url, keys=[ApiKey(name="busy", key="busy-key"), ApiKey(name="quiet", key="quiet-key")]
    )
    busy_n = 3 * FAIR_QUANTUM
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as http:
        busy = [
            (await http.post("/v1/tasks", json=CHAT, headers={"Authorization": "Bearer busy-key"})).json()[
                "task_id"
            ]
            for _ in range(busy_n)
        ]
        quiet = (
            await http.post("/v1/tasks", json=CHAT, headers={"Authorization": "Bearer quiet-key"})
        ).json()["task_id"]
        async with one_worker_later(redis_client):
            await wait_until(lambda: _claimed(ledger, busy_n + 1), timeout=30)
    order = await claim_order(ledger)
    # The busy key's first FAIR_QUANTUM tasks were in round 0 before the quiet key's; the rest after.
    assert order.index(quiet) == FAIR_QUANTUM
    assert [t for t in order if t != quiet] == busy
    rounds = {e.task_id: e.share_round for e in await events_of(ledger, TaskSubmitted)}
    assert rounds[quiet] == 0 and rounds[busy[-1]] == 2
    assert {e.key for e in await events_of(ledger, TaskSubmitted)} == {"busy", "quiet"}


async def _claimed(ledger: Ledger, n: int) -> bool:
    return len(await claim_order(ledger)) >= n
