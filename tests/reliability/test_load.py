"""Load: many concurrent clients against the API, worker processes and the seed fleet simulated
with no delay. No request fails, every task the API accepted completes once, and the API's memory
stays flat.

The goal is 200 clients for 60 s. On a 2-core machine that alone would take a quarter of the
suite's budget, so the default run is 200 clients for 15 s; `ROUTELEDGER_LOAD_SECONDS=60` (and
`ROUTELEDGER_LOAD_CLIENTS`) make it the full run.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psutil
import pytest
import redis.asyncio as aioredis

from events.keys import Keys
from events.ledger import Ledger
from sim.backends.hosts import SimHosts
from sim.fleetspec import load_fleet
from tests.helpers import wait_until
from tests.reliability.support import counted_completions, queues_settled, spawn_worker, stop_all
from tests.test_api_support import free_port

SECONDS = float(os.environ.get("ROUTELEDGER_LOAD_SECONDS", "15"))
CLIENTS = int(os.environ.get("ROUTELEDGER_LOAD_CLIENTS", "200"))
WARM_UP_S = 3.0


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(load_fleet("seed"), time_scale=0.0, seed=23) as sim:
        yield sim


def api_process(redis_url: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ROUTELEDGER_LOG_LEVEL": "warning"}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "routeledger", "api", "--port", str(port), "--redis-url", redis_url],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )


@pytest.mark.slow
async def test_two_hundred_clients_get_every_answer_no_task_is_lost_and_api_memory_stays_flat(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts, tmp_path: Path
) -> None:
    log = tmp_path / "processes.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs = [
        spawn_worker(redis_url, hosts.url(name), name, log, extra_env={"ROUTELEDGER_LOG_LEVEL": "error"})
        for name in ("macbookair", "rtx3070ti")
    ]
    api = api_process(redis_url, port, log)
    procs.append(api)
    statuses: Counter[int | str] = Counter()
    task_ids: list[str] = []
    try:
        await wait_until(lambda: _live(redis_client, "macbookair", "rtx3070ti"), timeout=60)
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120.0) as http:
            await wait_until(lambda: _ready(http), timeout=60)
            start = time.monotonic()
            deadline = start + SECONDS
            rss: dict[str, int] = {}

            async def client(n: int) -> None:
                i = 0
                while time.monotonic() < deadline:
                    i += 1
                    body = {
                        "model": "qwen3:8b",
                        "messages": [{"role": "user", "content": f"client {n} request {i}"}],
                        "max_tokens": 16,
                    }
                    try:
                        response = await http.post("/v1/chat/completions", json=body)
                    except httpx.HTTPError as exc:
                        statuses[type(exc).__name__] += 1
                        continue
                    statuses[response.status_code] += 1
                    if "x-routeledger-task" in response.headers:
                        task_ids.append(response.headers["x-routeledger-task"])

            async def sample_rss() -> None:
                await asyncio.sleep(WARM_UP_S)
                rss["warm"] = psutil.Process(api.pid).memory_info().rss

            sampler = asyncio.create_task(sample_rss())
            await asyncio.gather(*(client(n) for n in range(CLIENTS)))
            await sampler
            rss["end"] = psutil.Process(api.pid).memory_info().rss
            elapsed = time.monotonic() - start

        async def settled() -> bool:
            return set(await counted_completions(ledger)) >= set(task_ids) and await queues_settled(
                redis_client, Keys()
            )

        await wait_until(settled, timeout=120, every=0.5)
        counted = await counted_completions(ledger)
    finally:
        await asyncio.to_thread(stop_all, procs)
    requests = sum(statuses.values())
    lost = [t for t in task_ids if counted[t] == 0]
    twice = [t for t in task_ids if counted[t] > 1]
    warm, end = rss["warm"] / 2**20, rss["end"] / 2**20
    print(
        f"\nload: {CLIENTS} clients x {SECONDS:.0f} s: {requests} requests in {elapsed:.1f} s "
        f"({requests / elapsed:.0f}/s), statuses {dict(statuses)}, lost {len(lost)}, twice {len(twice)}; "
        f"API RSS {warm:.1f} MiB after {WARM_UP_S:.0f} s, {end:.1f} MiB at the end"
    )
    assert set(statuses) == {200}, dict(statuses)
    assert len(task_ids) == requests and len(set(task_ids)) == requests
    assert lost == [] and twice == []
    # Flat, not frozen: allocator pools and caches settle, a leak of a few KiB per request does not.
    assert end < warm * 1.25 + 16, f"API RSS grew from {warm:.1f} MiB to {end:.1f} MiB"


async def _live(redis: aioredis.Redis, *names: str) -> bool:
    return all([await redis.exists(Keys().live(n)) for n in names])


async def _ready(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/healthz")).status_code == 200
    except httpx.HTTPError:
        return False
