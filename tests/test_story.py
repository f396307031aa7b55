"""The story, replayed: a fast machine that nobody measured joins a fleet whose statistics say the
slow laptop is the only one that runs qwen3:8b. Real Redis, simulated hosts, worker processes, the
projector, and the router's preview, as the API would show it; over plain Redis and over TLS."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from urllib.parse import parse_qsl, urlsplit

import pytest
import redis.asyncio as aioredis

from dispatch.submit import preview_request
from dispatch.view import LiveView
from events.connection import redis_client
from events.event import Event, QualityScored, TaskCompleted, Timings
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from router.choose import RouteQuery
from sim.backends.hosts import SimHosts
from sim.fleetspec import load_fleet
from tests.helpers import fast_config, running_agent, wait_until

SEED = load_fleet("seed")
QWEN = SEED.model["qwen3:8b"].digest
ELYZA = SEED.model["elyza-jp-8b"].digest


def _history(now_ms: int) -> list[Event]:
    """Two months of the laptop: 60 samples of each model at its speed, and graded answers."""
    events: list[Event] = []
    for i in range(60):
        at = now_ms - (60 - i) * 60_000
        for digest, tps in ((QWEN, 11.4), (ELYZA, 12.0)):
            tokens = 200
            events.append(
                TaskCompleted(
                    at=at,
                    task_id=f"old-{digest[:4]}-{i}",
                    worker="macbookair",
                    digest=digest,
                    attempt=1,
                    timings=Timings(
                        prompt_eval_count=40,
                        prompt_eval_duration=int(40 / 120 * 1e9),
                        eval_count=tokens,
                        eval_duration=int(tokens / tps * 1e9),
                        load_duration=0,
                        total_duration=int((tokens / tps + 0.4) * 1e9),
                    ),
                )
            )
        events.append(QualityScored(at=at, digest=QWEN, domain="general", score=0.74, worker="macbookair"))
        events.append(QualityScored(at=at, digest=ELYZA, domain="general", score=0.82, worker="macbookair"))
    return events


@contextlib.asynccontextmanager
async def projector_running(redis: aioredis.Redis) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(Projector(redis, Keys(), lease_ms=2000).run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


# The settings that carry each TLS file of a rediss:// URL's query to a process.
_TLS_SETTINGS = {
    "ssl_ca_certs": "ROUTELEDGER_REDIS_CA",
    "ssl_certfile": "ROUTELEDGER_REDIS_CERT",
    "ssl_keyfile": "ROUTELEDGER_REDIS_KEY",
}


@pytest.fixture(params=["redis", pytest.param("rediss", marks=pytest.mark.tls)])
def story_redis_url(request: pytest.FixtureRequest) -> str:
    """The session's Redis, and in turn its TLS one (which also asks for a client certificate)."""
    return str(request.getfixturevalue("redis_url" if request.param == "redis" else "tls_redis_url"))


def _worker(redis_url: str, backend: str, name: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ROUTELEDGER_LEASE_MS": "1500", "ROUTELEDGER_HEARTBEAT_MS": "300"}
    # A worker on another machine is given the TLS files as settings, beside a bare rediss:// URL.
    parts = urlsplit(redis_url)
    env.update({_TLS_SETTINGS[name]: path for name, path in parse_qsl(parts.query) if name in _TLS_SETTINGS})
    redis_url = parts._replace(query="").geturl()
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
            "--redis-url",
            redis_url,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@contextlib.asynccontextmanager
async def client_of(url: str) -> AsyncIterator[aioredis.Redis]:
    client = redis_client(url)
    try:
        yield client
    finally:
        await client.aclose()


async def test_the_unmeasured_fast_machine_becomes_the_top_candidate_by_its_own_measured_speed(
    story_redis_url: str,
) -> None:
    async with client_of(story_redis_url) as client:
        await _the_story(story_redis_url, client)


async def _the_story(redis_url: str, redis: aioredis.Redis) -> None:
    keys = Keys()
    view = LiveView(redis, keys, snapshot_every_s=0.2)
    await Ledger(redis, keys).append_many(_history(int(time.time() * 1000)))
    async with SimHosts(SEED, time_scale=0.2, seed=2) as sim, projector_running(redis):
        async with running_agent(redis, sim.url("macbookair"), fast_config("macbookair")):
            await asyncio.sleep(1.0)
            before = await preview_request(view, RouteQuery(model="qwen3:8b", max_tokens=200))
            assert [c["worker"] for c in before["candidates"]] == ["macbookair"]
            laptop_quality = before["candidates"][0]["fields"]["quality"]

            rtx = _worker(redis_url, sim.url("rtx3070ti"), "rtx3070ti")
            joined = time.monotonic()
            try:
                top: dict[str, object] = {}

                async def rtx_on_top() -> bool:
                    nonlocal top
                    p = await preview_request(view, RouteQuery(model="qwen3:8b", max_tokens=200))
                    top = p["candidates"][0]  # type: ignore[index]
                    fields = top["fields"]  # type: ignore[index]
                    return top["worker"] == "rtx3070ti" and fields["decode_tps"]["n"] >= 1  # type: ignore[index]

                await wait_until(rtx_on_top, timeout=60, every=0.3)
                took = time.monotonic() - joined
                decode = top["fields"]["decode_tps"]  # type: ignore[index]
                assert decode["source"].startswith("worker n=") and 1 <= decode["n"] <= 3, decode
                assert decode["value"] > 3 * 11.4, decode
                after = await preview_request(view, RouteQuery(model="qwen3:8b", max_tokens=200))
                by_worker = {c["worker"]: c for c in after["candidates"]}  # type: ignore[union-attr]
                laptop, gpu = by_worker["macbookair"], by_worker["rtx3070ti"]
                # Quality belongs to the model: both machines carry the same value, so the rank
                # changed on speed alone, not because the laptop's quality fell.
                assert gpu["fields"]["quality"]["value"] == laptop["fields"]["quality"]["value"]
                assert abs(laptop["fields"]["quality"]["value"] - laptop_quality["value"]) < 0.05
                # Its own speed is the reason (finish times also hold waits for its benchmark runs).
                assert gpu["fields"]["decode_tps"]["value"] > 3 * laptop["fields"]["decode_tps"]["value"]
                assert took < 60

                # ELYZA: the GPU PC gets a copy with the same digest, and ranks first once it holds it.
                sim.give_model("rtx3070ti", "elyza-jp-8b")

                async def rtx_top_for_elyza() -> bool:
                    p = await preview_request(view, RouteQuery(model="elyza-jp-8b", max_tokens=200))
                    best = p["candidates"][0]  # type: ignore[index]
                    return best["worker"] == "rtx3070ti"  # type: ignore[index,no-any-return]

                await wait_until(rtx_top_for_elyza, timeout=60, every=0.3)
                elyza = await preview_request(view, RouteQuery(model="elyza-jp-8b", max_tokens=200))
                by_worker = {c["worker"]: c for c in elyza["candidates"]}  # type: ignore[union-attr]
                assert (
                    by_worker["rtx3070ti"]["fields"]["quality"]["value"]
                    == by_worker["macbookair"]["fields"]["quality"]["value"]
                )
            finally:
                rtx.send_signal(signal.SIGTERM)
                await asyncio.to_thread(rtx.wait, 30)
