"""A LAN rehearsal: Redis, the API, the projector and the reaper on this side; two worker processes on
the far side, each in a network namespace of its own (loopback where namespaces cannot be made, see
tests/netns.py), reaching Redis (TLS, as a Redis user of its own) and its simulated backend only
through fault-injecting proxies (tests/faultproxy.py) that add 20 ms each way and jitter.

Each test prints one JSON line of what it measured (`pytest -s` shows it); the README's "Running on
several machines" quotes them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from events.connection import redis_client
from events.event import (
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskFailed,
    TaskReclaimed,
    WorkerOffline,
    WorkerOnline,
)
from events.keys import Keys
from events.ledger import Ledger
from events.scripts import LIBRARY
from projections.projector import Projector
from routeledger.certs import ensure_server_tls, issue_client_certificate
from routeledger.cli_acl import worker_acl_rules
from routeledger.embedded import EmbeddedRedis, find_redis_server, redis_version
from sim.backends.hosts import SimHosts
from sim.fleetspec import Fleet, parse_fleet
from tests.faultproxy import FaultProxy
from tests.helpers import MODEL_DIGEST, events_of, wait_until
from tests.netns import Side, far_sides
from tests.reliability.support import counted_completions, queues_settled, spawn_worker, stop_all
from tests.test_api_support import serving
from workers.reaper import Reaper, ReaperConfig

LEASE_MS = 3000
HEARTBEAT_MS = 500
PARTITION_S = 30.0
DELAY_S = 0.020  # each way
JITTER_S = 0.005

# Two equal machines on the far side; 40 tokens a second, so a 400-token answer takes 10 s.
FLEET = f"""
name = "lan"
[model."m"]
digest = "{MODEL_DIGEST}"
output = {{ dist = "fixed", mean = 400 }}
quality = {{ general = 0.9 }}

[[worker]]
name = "a"
slots = 1
[worker.models."m"]
decode_tps = 40.0
prompt_tps = 5000.0
load_s = 0.0

[[worker]]
name = "b"
slots = 1
[worker.models."m"]
decode_tps = 40.0
prompt_tps = 5000.0
load_s = 0.0
"""


class Lan:
    """The rehearsal's network: this side's services and, per far-side worker, its side, its two
    proxies (Redis, backend) and its process once started."""

    def __init__(self, admin: aioredis.Redis, base: str, tmp: Path) -> None:
        self.admin = admin
        self.ledger = Ledger(admin, Keys())
        self.base = base
        self.log = tmp / "workers.log"
        self.sides: dict[str, Side] = {}
        self.redis_proxy: dict[str, FaultProxy] = {}
        self.backend_proxy: dict[str, FaultProxy] = {}
        self.redis_urls: dict[str, str] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.every: list[subprocess.Popen[bytes]] = []
        self.tls = False

    def proxies(self, name: str) -> tuple[FaultProxy, FaultProxy]:
        return self.redis_proxy[name], self.backend_proxy[name]

    def start(self, name: str) -> None:
        side = self.sides[name]
        proc = spawn_worker(
            self.redis_urls[name],
            f"http://{self.backend_proxy[name].address}",
            name,
            self.log,
            lease_ms=LEASE_MS,
            heartbeat_ms=HEARTBEAT_MS,
            inbox=True,
            wrap=side.prefix,
        )
        self.procs[name] = proc
        self.every.append(proc)

    def partition(self, name: str) -> None:
        for proxy in self.proxies(name):
            proxy.blackhole()

    def heal(self, name: str) -> None:
        for proxy in self.proxies(name):
            proxy.heal()

    async def live(self, *names: str) -> bool:
        return all([await self.admin.exists(Keys().live(n)) for n in names])

    def network(self) -> str:
        return "netns+veth" if all(s.isolated for s in self.sides.values()) else "loopback"


def _redis_7() -> bool:
    version = redis_version(find_redis_server())
    return version is not None and version >= (7,)


@contextlib.asynccontextmanager
async def lan(
    tmp_path: Path, *, delay_s: float = DELAY_S, jitter_s: float = JITTER_S, rate: float | None = None
) -> AsyncIterator[Lan]:
    """The whole rehearsal, torn down in reverse however the test ends; workers start on `start`."""
    if not _redis_7():
        pytest.skip("workers under their own Redis users need Redis 7 (ACL selectors)")
    fleet: Fleet = parse_fleet(FLEET, "lan.toml")
    names = ("a", "b")
    with far_sides(names) as sides, contextlib.ExitStack() as sync:
        data = tmp_path / "near"
        near = sorted({"127.0.0.1", *(s.near for s in sides.values())})
        tls = shutil.which("openssl") is not None
        server = EmbeddedRedis(
            data / "redis",
            tls=ensure_server_tls(data, near) if tls else None,
            client_certificate=issue_client_certificate(data, "workers") if tls else None,
        )
        await asyncio.to_thread(server.start)
        sync.callback(server.stop)
        admin = redis_client(server.url)
        stop = asyncio.Event()
        background: list[asyncio.Task[None]] = []
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(admin.aclose)
            hosts = await stack.enter_async_context(SimHosts(fleet, time_scale=1.0, seed=11))
            background.append(
                asyncio.create_task(Projector(admin, Keys(), lease_ms=2000, block_ms=100).run(stop))
            )
            reaper = ReaperConfig(lease_ms=LEASE_MS, interval_s=0.2, delivery_limit=5)
            background.append(asyncio.create_task(Reaper(admin, Keys(), reaper).run(stop)))

            async def stop_background() -> None:
                stop.set()
                await asyncio.wait_for(asyncio.gather(*background), 30)

            stack.push_async_callback(stop_background)
            await wait_until(lambda: _library_loaded(admin), timeout=30)
            base = await stack.enter_async_context(serving(AppConfig(redis_url=server.url)))
            net = Lan(admin, base, tmp_path)
            net.sides = sides
            net.tls = tls
            query = urlsplit(server.url).query
            for name in names:
                side = sides[name]
                password = f"{name}-lan-secret"
                await admin.execute_command("ACL", "SETUSER", name, *worker_acl_rules(name, password))
                backend = urlsplit(hosts.url(name))
                for table, port in ((net.redis_proxy, server.port), (net.backend_proxy, backend.port or 0)):
                    proxy = FaultProxy(
                        "127.0.0.1",
                        port,
                        listen_host=side.near,
                        delay_s=delay_s,
                        jitter_s=jitter_s,
                        rate=rate,
                        seed=len(table),
                    )
                    await proxy.start()
                    stack.push_async_callback(proxy.close)
                    table[name] = proxy
                scheme = "rediss" if tls else "redis"
                url = f"{scheme}://{name}:{quote(password)}@{net.redis_proxy[name].address}/0"
                net.redis_urls[name] = f"{url}?{query}" if query else url
            # Workers go first (after the proxies are healed, so that they can drain).
            stack.push_async_callback(_stop_workers, net)
            yield net


async def _stop_workers(net: Lan) -> None:
    for name in net.redis_proxy:
        net.heal(name)
    await asyncio.to_thread(stop_all, net.every)


async def _library_loaded(redis: aioredis.Redis) -> bool:
    return bool(await redis.function_list(library=LIBRARY))


async def _claims(net: Lan, worker: str) -> list[TaskClaimed]:
    return [e for e in await events_of(net.ledger, TaskClaimed) if e.worker == worker]


async def _chat(http: httpx.AsyncClient, text: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    response = await http.post("/v1/chat/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _now_ms() -> int:
    return int(time.time() * 1000)


@pytest.mark.slow
@pytest.mark.tls
async def test_a_worker_partitioned_for_30_s_mid_generation_loses_its_task_to_the_other_once_and_rejoins(
    tmp_path: Path,
) -> None:
    # Over 30 s by design: the partition the rehearsal is about lasts 30 s.
    async with lan(tmp_path) as net, httpx.AsyncClient(base_url=net.base) as http:
        net.start("a")
        await wait_until(lambda: net.live("a"), timeout=60)
        asked = asyncio.create_task(_chat(http, "a long story, please", 400))
        await wait_until(lambda: _has(_claims(net, "a")), timeout=30)
        (claim,) = await _claims(net, "a")
        task_id = claim.task_id
        net.start("b")  # it comes up while a generates, and takes nothing a holds
        # Mid-generation: a's backend has streamed part of the answer to it (tens of tokens).
        await wait_until(lambda: _forwarded(net.backend_proxy["a"], 6000), timeout=30)
        await wait_until(lambda: net.live("b"), timeout=60)
        partitioned = _now_ms()
        net.partition("a")
        answer = await asyncio.wait_for(asked, 120)
        answered = _now_ms()
        reclaims = [e for e in await events_of(net.ledger, TaskReclaimed) if e.task_id == task_id]
        b_claims = [e for e in await _claims(net, "b") if e.task_id == task_id]
        await asyncio.sleep(max(0.0, PARTITION_S - (time.time() * 1000 - partitioned) / 1000))
        healed = _now_ms()
        net.heal("a")
        # a notices: its lease lapsed, so it announces itself again (a new WorkerOnline).
        await wait_until(lambda: _online_since(net, "a", healed), timeout=60)
        await wait_until(lambda: net.live("a", "b"), timeout=30)
        rejoined = _now_ms()
        # With b gone, the next task can only be a's, through the healed link.
        await asyncio.to_thread(stop_all, [net.procs["b"]])
        after = [await _chat(http, "after the partition", 20)]
        await wait_until(lambda: queues_settled(net.admin, Keys()), timeout=60)
        counted = await counted_completions(net.ledger)
        completions = [e for e in await events_of(net.ledger, TaskCompleted) if e.task_id == task_id]
        a_after = [
            e for e in await events_of(net.ledger, TaskCompleted) if e.worker == "a" and e.at >= healed
        ]
        text = answer["choices"][0]["message"]["content"]
        figures = {
            "rehearsal": "partition",
            "network": net.network(),
            "tls": net.tls,
            "lease_ms": LEASE_MS,
            "partitioned_after_claim_s": round((partitioned - claim.at) / 1000, 2),
            "partition_s": round((healed - partitioned) / 1000, 1),
            "reclaim_s": round((reclaims[0].at - partitioned) / 1000, 2) if reclaims else None,
            "taken_by_b_s": round((b_claims[0].at - partitioned) / 1000, 2) if b_claims else None,
            "answered_s": round((answered - partitioned) / 1000, 2),
            "rejoined_after_heal_s": round((rejoined - healed) / 1000, 2),
            "tasks": 2,
            "lost": sum(1 for t in (task_id, *(a["id"] for a in after)) if counted[_task(t)] == 0),
            "counted_twice": sum(1 for n in counted.values() if n > 1),
            "completions_of_partitioned_task": [(e.worker, e.duplicate) for e in completions],
            "dead_lettered": len(await events_of(net.ledger, TaskDeadLettered)),
            "a_recorded_offline": any(
                e.worker == "a" and partitioned <= e.at <= healed
                for e in await events_of(net.ledger, WorkerOffline)
            ),
        }
        print("\n" + json.dumps(figures))
    assert [(e.worker, e.duplicate) for e in completions if not e.duplicate] == [("b", False)]
    # a gave the run up when its lease surely expired, before the partition healed.
    assert f"task {task_id}: this worker could not renew its lease in time" in net.log.read_text()
    assert len(reclaims) == 1 and reclaims[0].owner == "a"
    # The client got b's whole answer: every token, and the very text b's completion records.
    assert answer["usage"]["completion_tokens"] == 400
    assert hashlib.sha256(text.encode()).hexdigest() == completions[0].output_sha256
    assert figures["lost"] == 0 and figures["counted_twice"] == 0 and figures["dead_lettered"] == 0
    assert [e.task_id for e in a_after] == [_task(after[0]["id"])]
    assert reclaims[0].at < healed
    # The reaper ended a's life in the ledger during the partition; a started a new one after it.
    assert figures["a_recorded_offline"]


def _task(answer_id: str) -> str:
    return answer_id.removeprefix("chatcmpl-")


async def _has(claims: Any) -> bool:
    return bool(await claims)


async def _forwarded(proxy: FaultProxy, n: int) -> bool:
    return proxy.forwarded >= n


async def _online_since(net: Lan, worker: str, since: int) -> bool:
    return any(e.worker == worker and e.at >= since for e in await events_of(net.ledger, WorkerOnline))


BATCH = 20


@pytest.mark.tls
async def test_twenty_tasks_over_slow_links_with_a_drop_mid_task_lose_none_and_complete_none_twice(
    tmp_path: Path,
) -> None:
    async with lan(tmp_path, rate=256 * 1024.0) as net, httpx.AsyncClient(base_url=net.base) as http:
        net.start("a")
        net.start("b")
        await wait_until(lambda: net.live("a", "b"), timeout=60)
        began = _now_ms()
        asked = [asyncio.create_task(_chat(http, f"task {i}", 20)) for i in range(BATCH)]
        # Mid-task on a: its backend is streaming an answer to it when every connection of a's
        # (Redis and backend) is reset.
        await wait_until(lambda: _has(_claims(net, "a")), timeout=30)
        streamed = net.backend_proxy["a"].forwarded
        await wait_until(lambda: _forwarded(net.backend_proxy["a"], streamed + 1500), timeout=30)
        dropped = sum(proxy.drop() for proxy in net.proxies("a"))
        answers = await asyncio.wait_for(asyncio.gather(*asked), 180)
        finished = _now_ms()
        await wait_until(lambda: queues_settled(net.admin, Keys()), timeout=60)
        counted = await counted_completions(net.ledger)
        ids = [_task(a["id"]) for a in answers]
        by_worker = collections.Counter(
            e.worker for e in await events_of(net.ledger, TaskCompleted) if not e.duplicate
        )
        failed = await events_of(net.ledger, TaskFailed)
        figures = {
            "rehearsal": "slow links and a drop",
            "network": net.network(),
            "tls": net.tls,
            "delay_ms_each_way": DELAY_S * 1000,
            "jitter_ms": JITTER_S * 1000,
            "rate_kib_s": 256,
            "tasks": BATCH,
            "connections_dropped": dropped,
            "lost": sum(1 for t in ids if counted[t] == 0),
            "counted_twice": sum(1 for t in ids if counted[t] > 1),
            "completed_by": dict(sorted(by_worker.items())),
            "failed_runs_retried": len(failed),
            "batch_s": round((finished - began) / 1000, 2),
        }
        print("\n" + json.dumps(figures))
    assert dropped >= 2  # a's Redis connection and its backend stream at least
    assert len(set(ids)) == BATCH and all(a["usage"]["completion_tokens"] == 20 for a in answers)
    assert figures["lost"] == 0 and figures["counted_twice"] == 0
