"""Helpers for the API tests: the app served by uvicorn in this process, with a simulated fleet."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
import uvicorn

from api.app import AppConfig, create_app
from events.event import ModelEntry
from events.keys import Keys
from sim.backends.hosts import SimHosts
from sim.fleetspec import Fleet
from tasks.lease import LeaseInfo, Leases
from tasks.payload import Result, result_decoder
from tests.helpers import MODEL_DIGEST, fast_config, make_test_fleet, running_agent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serving(config: AppConfig) -> AsyncIterator[str]:
    """The API on a free loopback port for the duration of the block; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


@contextlib.asynccontextmanager
async def fleet_and_api(
    redis_client: aioredis.Redis,
    redis_url: str,
    *,
    workers: tuple[str, ...] = ("a",),
    time_scale: float = 1.0,
    slots: int = 1,
    fleet: Fleet | None = None,
    kind: str = "ollama",
    lease_ms: int = 1500,
    **config: object,
) -> AsyncIterator[tuple[str, SimHosts]]:
    """Simulated machines (of `fleet`, else the test fleet), one worker agent per name in
    `workers`, each speaking `kind` (ollama or openai) to its machine, and the API in front.
    `lease_ms`: the workers' lease; a test of load rather than of death gives a long one, so that
    its own crowding of this process's one event loop never lapses a lease."""
    async with (
        SimHosts(fleet or make_test_fleet(), time_scale=time_scale, seed=5) as hosts,
        contextlib.AsyncExitStack() as stack,
    ):
        for name in workers:
            await stack.enter_async_context(
                running_agent(
                    redis_client,
                    hosts.url(name),
                    fast_config(name, slots=slots, lease_ms=lease_ms),
                    kind=kind,
                )
            )
        async with serving(AppConfig(redis_url=redis_url, **config)) as base:  # type: ignore[arg-type]
            yield base, hosts


async def ghost_worker(redis: aioredis.Redis, name: str = "ghost") -> None:
    """A live lease for model `m` with no agent behind it: tasks for `m` are accepted and stay queued."""
    info = LeaseInfo(
        worker=name, token="t", slots=1, inventory=[ModelEntry(name="m:latest", digest=MODEL_DIGEST)]
    )
    await Leases(redis, Keys.for_client(redis)).put(info, 120_000)


async def stored_result(redis: aioredis.Redis, task_id: str) -> Result | None:
    """The task's result as the worker (or a cancel) recorded it."""
    raw: Any = await redis.hget(Keys().result(task_id), "result")
    return None if raw is None else result_decoder.decode(raw)


async def stored_results(redis: aioredis.Redis) -> list[Result]:
    """Every task result in Redis (each test starts with an empty one)."""
    out = []
    async for key in redis.scan_iter(match=Keys().result("*")):
        raw: Any = await redis.hget(key, "result")
        out.append(result_decoder.decode(raw))
    return out
