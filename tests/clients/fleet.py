"""One running routeledger for the client tier: the demo fleet's machines simulated, a worker agent
in front of each, and the API, all served on an event loop of their own in a background thread.

The clients under test are mostly synchronous (and the CLIs are subprocesses): with the API on its
own loop, a test can call them as their users do, without blocking what answers them. Each
instance has a Redis server of its own, so the rest of the suite (which flushes the shared one
for every test) never touches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

from api.app import AppConfig
from events.connection import redis_client
from routeledger.embedded import EmbeddedRedis, find_redis_server
from sim.backends.hosts import SimHosts
from sim.fleetspec import Fleet, load_fleet
from tests.helpers import fast_config, running_agent
from tests.test_api_support import serving

T = TypeVar("T")

# The machines that get a worker agent (a preset may describe others that serve nothing).
DEMO_WORKERS = ("macbookair", "rtx3070ti")

# Simulated seconds are waited this many times over: a load of 8 s takes 40 ms, and an answer of
# 64 tokens on the laptop (11.4 tok/s) about 28 ms.
TIME_SCALE = 0.005


def demo_fleet() -> Fleet:
    """The demo preset (sim/presets/demo.toml), what `make demo` runs."""
    return load_fleet("demo")


@dataclass(frozen=True)
class Routeledger:
    """A running instance: the API's base URL, its Redis, and each simulated machine's own URL."""

    url: str
    redis_url: str
    machines: dict[str, str]


@contextlib.contextmanager
def running_routeledger(
    data_dir: Path,
    fleet: Fleet | None = None,
    *,
    workers: tuple[str, ...] = DEMO_WORKERS,
    time_scale: float = TIME_SCALE,
) -> Iterator[Routeledger]:
    """Redis, the fleet's machines, a worker for each of `workers` and the API, until the block ends."""
    redis = EmbeddedRedis(data_dir / "redis", binary=find_redis_server())
    redis.start()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    found: list[Routeledger] = []
    failed: list[BaseException] = []

    async def serve() -> None:
        client = redis_client(redis.url)
        try:
            async with (
                SimHosts(fleet or demo_fleet(), time_scale=time_scale, seed=5) as hosts,
                contextlib.AsyncExitStack() as stack,
            ):
                for name in workers:
                    # Leases outlive a few seconds of a busy test process (2 cores, a client's import).
                    config = fast_config(name, lease_ms=6000, heartbeat_ms=400)
                    await stack.enter_async_context(running_agent(client, hosts.url(name), config))
                async with serving(AppConfig(redis_url=redis.url)) as base:
                    found.append(Routeledger(base, redis.url, {n: hosts.url(n) for n in workers}))
                    ready.set()
                    await stop.wait()
        finally:
            await client.aclose()

    def run() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as exc:  # handed to the test thread, which raises it
            failed.append(exc)
        finally:
            ready.set()
            loop.close()

    thread = threading.Thread(target=run, name="routeledger", daemon=True)
    thread.start()
    try:
        ready.wait(60)
        if failed:
            raise RuntimeError("the routeledger under test did not start") from failed[0]
        assert found, "the routeledger under test did not start within 60 s"
        yield found[0]
    finally:
        if thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
            thread.join(60)
        redis.stop()
    if failed:
        raise RuntimeError("the routeledger under test failed as it stopped") from failed[0]


def eventually(check: Callable[[], T | None], *, timeout: float = 10.0, what: str = "the condition") -> T:
    """Poll `check` until it returns something other than None (a worker reports what its machine
    holds and has loaded at its next heartbeat); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} was not seen within {timeout} s")
        time.sleep(0.1)


def load_on_machine(instance: Routeledger, machine: str, model: str) -> None:
    """Load `model` on the machine itself and keep it loaded (someone at that machine ran it), the
    way Ollama loads a model for a request with no prompt."""
    answer = httpx.post(
        instance.machines[machine] + "/api/generate", json={"model": model, "keep_alive": -1}, timeout=30
    )
    assert answer.status_code == 200 and answer.json()["done_reason"] == "load", answer.text


def holders(instance: Routeledger, model: str) -> list[str]:
    """The machines routeledger says hold `model` (its /api/show's `routeledger.holders`)."""
    shown = httpx.post(instance.url + "/api/show", json={"model": model}, timeout=10)
    assert shown.status_code == 200, shown.text
    return list(shown.json()["model_info"]["routeledger.holders"])
