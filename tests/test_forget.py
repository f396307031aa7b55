"""Retiring a machine for good: `routeledger worker forget`."""

from __future__ import annotations

import asyncio
import sys

import redis.asyncio as aioredis

from events.event import WorkerOffline
from events.keys import Keys
from events.ledger import Ledger
from sim.backends.hosts import SimHosts
from tests.helpers import events_of, fast_config, make_test_fleet, running_agent


async def _forget(redis_url: str, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "routeledger",
        "worker",
        "forget",
        *args,
        "--redis-url",
        redis_url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return int(proc.returncode or 0), out.decode() + err.decode()


async def test_a_live_worker_is_not_forgotten_without_force(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with SimHosts(make_test_fleet(), time_scale=0.0) as sim:
        async with running_agent(redis_client, sim.url("c"), fast_config("c")):
            code, text = await _forget(redis_url, "c")
            assert code == 2 and "live right now" in text
            assert await redis_client.exists(Keys().live("c"))


async def test_a_forgotten_worker_stops_counting_anywhere(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    from projections.projector import Projector
    from projections.reader import snapshot

    code, text = await _forget(redis_url, "ai-core")
    assert code == 0 and "forgot worker ai-core" in text
    assert [e.reason for e in await events_of(ledger, WorkerOffline)] == ["forgotten"]
    assert await redis_client.sismember(Keys().forgotten, "ai-core")
    projector = Projector(redis_client, Keys())
    await projector.start()
    await projector.catch_up()
    snap = await snapshot(redis_client, Keys())
    assert snap.fleet["ai-core"].status == "forgotten" and "ai-core" not in snap.live
