"""Helpers for tests that run workers against simulated backends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

from events.clock import LedgerClock, redis_ms
from events.event import Event
from events.keys import Keys
from events.ledger import Ledger
from sim.fleetspec import Fleet, parse_fleet
from workers.admission import Gate
from workers.agent import WorkerAgent
from workers.backend import Backend, OllamaBackend, OpenAIBackend
from workers.config import WorkerConfig

T = TypeVar("T", bound=Event)

MODEL_DIGEST = "6d6f64656c2d6d2d666f722d74657374732d6f6e6c792d3031323334353637aa"

# Two machines that hold model `m`, one that holds only `other`; fixed output lengths.
TEST_FLEET = f"""
name = "test"
[model."m"]
digest = "{MODEL_DIGEST}"
output = {{ dist = "fixed", mean = 40 }}
quality = {{ general = 0.9 }}
[model."other"]
output = {{ dist = "fixed", mean = 10 }}

[[worker]]
name = "a"
slots = 1
[worker.models."m"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0

[[worker]]
name = "b"
slots = 1
[worker.models."m"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0

[[worker]]
name = "c"
slots = 1
[worker.models."other"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
"""


class SteppedLedgerClock(LedgerClock):
    """The ledger's clock as a test moves it: Redis's time when made (`start`), then only what
    `advance` adds, so that a test of an age or a timeout steps past it instead of sleeping."""

    def __init__(self, redis: aioredis.Redis) -> None:
        super().__init__(redis)
        self.now: int | None = None

    async def start(self) -> SteppedLedgerClock:
        self.now = await redis_ms(self.redis)
        self.offset_ms = 0
        return self

    def advance(self, ms: int) -> None:
        assert self.now is not None, "start() the clock first"
        self.now += ms

    async def now_ms(self) -> int:
        assert self.now is not None, "start() the clock first"
        return self.now


def make_test_fleet() -> Fleet:
    return parse_fleet(TEST_FLEET, "test.toml")


async def wait_until(
    check: Callable[[], Awaitable[bool]], timeout: float = 20.0, every: float = 0.05
) -> None:
    """Poll `check` until it is true; fail the test with a clear message after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s")


def rl(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`routeledger ARGS` run as a user runs it (a process of its own), its output captured; wide
    enough (COLUMNS) that rich does not wrap what a test reads."""
    return subprocess.run(
        [sys.executable, "-m", "routeledger", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


async def events_of(ledger: Ledger, kind: type[T]) -> list[T]:
    return [e async for _, e in ledger.read() if isinstance(e, kind)]


def fast_config(name: str, **overrides: object) -> WorkerConfig:
    """Short leases and heartbeats, so that tests about death and recovery run in seconds."""
    values: dict[str, object] = {
        "name": name,
        "lease_ms": 1500,
        "heartbeat_ms": 300,
        "block_ms": 200,
        "cooldown_s": 0.3,
        "drain_timeout_s": 10.0,
        "auto_bench": False,
    }
    values.update(overrides)
    return WorkerConfig(**values)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running_agent(
    redis: aioredis.Redis,
    url: str,
    config: WorkerConfig,
    *,
    gate: Gate | None = None,
    idle_timeout_s: float = 30.0,
    keys: Keys | None = None,
    kind: str = "ollama",
) -> AsyncIterator[WorkerAgent]:
    """A worker agent in this process, online until the block ends (then it drains); `kind`
    "openai" speaks to the machine's OpenAI-compatible API instead of Ollama's."""
    backend: Backend = (
        OpenAIBackend(url + "/v1", timeout_s=60.0, idle_timeout_s=idle_timeout_s)
        if kind == "openai"
        else OllamaBackend(url, timeout_s=60.0, idle_timeout_s=idle_timeout_s)
    )
    agent = WorkerAgent(redis, keys or Keys.for_client(redis), backend, config, gate=gate)
    task = asyncio.create_task(agent.run())
    try:
        await wait_until(
            lambda: redis_exists(redis, (keys or Keys.for_client(redis)).live(config.name)), timeout=15
        )
        yield agent
    finally:
        agent.stopping.set()
        try:
            await asyncio.wait_for(task, 30)
        finally:
            await backend.aclose()


async def redis_exists(redis: aioredis.Redis, key: str) -> bool:
    return bool(await redis.exists(key))


def worker_process(
    redis_url: str,
    backend: str,
    name: str,
    *,
    slots: int = 1,
    lease_ms: int = 1500,
    heartbeat_ms: int = 300,
    clock_offset_ms: int = 0,
) -> subprocess.Popen[bytes]:
    """A real `routeledger worker` process (for tests that kill it, or shift its clock)."""
    env = {
        **os.environ,
        "ROUTELEDGER_LEASE_MS": str(lease_ms),
        "ROUTELEDGER_HEARTBEAT_MS": str(heartbeat_ms),
        "ROUTELEDGER_LOG_LEVEL": "warning",
        "ROUTELEDGER_CLOCK_OFFSET_MS": str(clock_offset_ms),
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "routeledger",
            "worker",
            "--backend",
            backend,
            "--id",
            name,
            "--slots",
            str(slots),
            "--redis-url",
            redis_url,
            "--no-bench",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@contextlib.asynccontextmanager
async def running_projector(redis: aioredis.Redis, *, lease_ms: int = 2000) -> AsyncIterator[None]:
    """The projector, folding the ledger into the tables until the block ends."""
    from projections.projector import Projector

    stop = asyncio.Event()
    task = asyncio.create_task(Projector(redis, Keys(), lease_ms=lease_ms).run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def running_reaper(
    redis: aioredis.Redis, *, lease_ms: int = 1500, delivery_limit: int = 3, stall_after_s: float = 600.0
) -> AsyncIterator[None]:
    """The reaper, sweeping every 100 ms in this process."""
    from workers.reaper import Reaper, ReaperConfig

    stop = asyncio.Event()
    config = ReaperConfig(
        lease_ms=lease_ms, delivery_limit=delivery_limit, stall_after_s=stall_after_s, interval_s=0.1
    )
    task = asyncio.create_task(Reaper(redis, Keys.for_client(redis), config).run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
