"""Faults that used to make a task run twice: a stalled Redis, lost replies, half-open and black-holed
connections, and two processes with one name. Each run here must end with every task counted once."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from dispatch.submit import submit_task
from events.connection import redis_client as make_client
from events.event import TaskClaimed, TaskCompleted, TaskReclaimed, WorkerOnline
from events.keys import Keys
from events.ledger import Ledger
from events.scripts import load_library
from routeledger.embedded import EmbeddedRedis
from sim.backends.hosts import SimHosts
from tasks.lease import live_workers
from tasks.payload import Message, TaskMessage, chunk_decoder
from tasks.store import _REQUEUE, _REQUEUE_DEF, TaskStore
from tests.helpers import MODEL_DIGEST, events_of, fast_config, make_test_fleet, running_agent, wait_until
from tests.reliability.proxy import RedisProxy, redis_proxy
from tests.reliability.support import counted_completions, reaper_process, spawn_worker, stop_all
from tests.test_api_support import serving, stored_result
from workers.reaper import Reaper, ReaperConfig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}


@contextlib.asynccontextmanager
async def _proxied(
    redis_url: str, socket_timeout: float = 2.0
) -> AsyncIterator[tuple[RedisProxy, aioredis.Redis]]:
    """A proxy in front of the test's Redis and a client (made as every process makes one) through it."""
    parts = urlsplit(redis_url)
    async with redis_proxy(parts.hostname or "127.0.0.1", parts.port or 6379) as proxy:
        client = make_client(proxy.url(parts.password), socket_timeout=socket_timeout)
        try:
            yield proxy, client
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.aclose(), 5)


@contextlib.asynccontextmanager
async def _reaping(redis: aioredis.Redis, lease_ms: int = 1500) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(
        Reaper(redis, Keys(), ReaperConfig(lease_ms=lease_ms, interval_s=0.2)).run(stop)
    )
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _claims_per_run(claims: list[TaskClaimed]) -> collections.Counter[tuple[str, int]]:
    return collections.Counter((c.task_id, c.attempt) for c in claims)


async def test_a_worker_whose_connections_go_half_open_keeps_its_lease_and_runs_each_task_once(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, Keys(), ledger)
    async with (
        SimHosts(make_test_fleet(), time_scale=0.2, seed=3) as hosts,
        _proxied(redis_url, socket_timeout=10.0) as (proxy, client),
        running_agent(client, hosts.url("a"), fast_config("a")),
        _reaping(redis_client),
    ):
        lease = Keys().live("a")
        # Every connection the worker has now stops forwarding, the blocked read and the pool's.
        proxy.hang_existing()
        lapsed = False
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            lapsed = lapsed or not await redis_client.exists(lease)
            await asyncio.sleep(0.05)
        tasks = [
            (
                await submit_task(
                    queues, TaskMessage(model="m", messages=[Message(role="user", content=f"{i}")])
                )
            ).task
            for i in range(4)
        ]
        await wait_until(lambda: _all_counted(ledger, [t.task_id for t in tasks]), timeout=30)
    assert not lapsed, "the lease lapsed although a fresh connection could renew it"
    claims = await events_of(ledger, TaskClaimed)
    assert {c.worker for c in claims} == {"a"}
    assert max(_claims_per_run(claims).values()) == 1
    assert not await events_of(ledger, TaskReclaimed)


async def _all_counted(ledger: Ledger, task_ids: list[str]) -> bool:
    counted = await counted_completions(ledger)
    return all(counted[t] == 1 for t in task_ids)


async def test_a_black_holed_worker_stops_taking_before_its_lease_expires_and_its_task_runs_once(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, Keys(), ledger)
    # Slow enough that the first task is still running when the network goes.
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=3) as hosts:
        async with (
            _proxied(redis_url) as (proxy, client),
            running_agent(client, hosts.url("a"), fast_config("a")) as a,
        ):
            long = TaskMessage(model="m", messages=[Message(role="user", content="long")], max_tokens=400)
            task = (await submit_task(queues, long)).task
            await wait_until(lambda: _claimed(ledger, task.task_id), timeout=15)
            async with (
                running_agent(redis_client, hosts.url("b"), fast_config("b")),
                _reaping(redis_client),
            ):
                proxy.hang_all()
                stopped_taking: float | None = None
                lease_gone: float | None = None
                while lease_gone is None:
                    now = time.monotonic()
                    if stopped_taking is None and not a.may_take():
                        stopped_taking = now
                    if not await redis_client.exists(Keys().live("a")):
                        lease_gone = now
                    await asyncio.sleep(0.02)
                await wait_until(lambda: _all_counted(ledger, [task.task_id]), timeout=30)
                proxy.heal()
                # Back on the network, the worker renews (its life starts again) and takes work.
                await wait_until(lambda: _live(redis_client, "a"), timeout=15)
                after = (
                    await submit_task(
                        queues, TaskMessage(model="m", messages=[Message(role="user", content="x")])
                    )
                ).task
                await wait_until(lambda: _all_counted(ledger, [after.task_id]), timeout=30)
    assert stopped_taking is not None and stopped_taking < lease_gone
    completions = [e for e in await events_of(ledger, TaskCompleted) if e.task_id == task.task_id]
    # The black-holed run was stopped, not finished: one completion, by the other worker.
    assert [(e.worker, e.duplicate) for e in completions] == [("b", False)]
    assert [e.task_id for e in await events_of(ledger, TaskReclaimed)] == [task.task_id]


async def _claimed(ledger: Ledger, task_id: str) -> bool:
    return any(c.task_id == task_id for c in await events_of(ledger, TaskClaimed))


async def _live(redis: aioredis.Redis, name: str) -> bool:
    return name in await live_workers(redis, Keys())


async def test_a_reclaim_whose_reply_was_lost_is_sent_again_and_recorded(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    keys = Keys()
    queues = TaskStore(redis_client, keys, ledger)
    req = TaskMessage(model="m", messages=[Message(role="user", content="x")])
    task = (await submit_task(queues, req, digest=MODEL_DIGEST)).task
    queue = keys.queue(MODEL_DIGEST)
    # A worker that took it and died (it has no lease).
    assert (await queues.take(queue, "dead")).entry_id
    # The re-queue's FCALL (EVALSHA on a Redis without functions) is the call whose reply is lost.
    sha = await redis_client.script_load(_REQUEUE)
    call = _REQUEUE_DEF.function if await load_library(redis_client) else sha
    await asyncio.sleep(0.3)
    async with _proxied(redis_url, socket_timeout=1.0) as (proxy, client):
        proxy.mute_reply_after(call.encode() if isinstance(call, str) else call)
        report = await Reaper(client, keys, ReaperConfig(lease_ms=200)).sweep()
    assert proxy.muted_replies == 1
    assert report.reclaimed == 1
    assert [(e.task_id, e.owner, e.attempt) for e in await events_of(ledger, TaskReclaimed)] == [
        (task.task_id, "dead", 2)
    ]
    again = await queues.take(queue, "alive")
    assert (again.attempt, again.fields[b"id"].decode()) == (2, task.task_id)


async def test_two_processes_started_at_once_with_one_name_leave_exactly_one_running(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, tmp_path: Path
) -> None:
    log = tmp_path / "twins.log"
    async with SimHosts(make_test_fleet(), time_scale=0.0, seed=3) as hosts:
        twins = [spawn_worker(redis_url, hosts.url("a"), "a", log) for _ in range(2)]
        try:
            # The loser waits out one lease (1.5 s) plus a second for the winner to go, then leaves.
            await wait_until(lambda: _one_exited(twins), timeout=30)
            task = (
                await submit_task(
                    TaskStore(redis_client, Keys(), ledger),
                    TaskMessage(model="m", messages=[Message(role="user", content="x")]),
                )
            ).task
            await wait_until(lambda: _all_counted(ledger, [task.task_id]), timeout=30)
            alive = [p.poll() is None for p in twins]
            codes = [p.poll() for p in twins]
        finally:
            await asyncio.to_thread(stop_all, twins)
    assert sorted(alive) == [False, True]
    assert 2 in codes
    assert "already holds its lease" in log.read_text()
    assert [e.worker for e in await events_of(ledger, WorkerOnline)] == ["a"]


async def _one_exited(procs: list[subprocess.Popen[bytes]]) -> bool:
    return sum(p.poll() is not None for p in procs) >= 1


@pytest.mark.slow
async def test_redis_stalled_for_six_seconds_under_traffic_runs_no_task_twice_and_mixes_no_stream(
    fresh_server: EmbeddedRedis, tmp_path: Path
) -> None:
    url = fresh_server.url
    log = tmp_path / "processes.log"
    client = make_client(url)
    ledger = Ledger(client, Keys())
    async with SimHosts(make_test_fleet(), time_scale=0.3, seed=11) as hosts:
        procs = [spawn_worker(url, hosts.url(name), name, log) for name in ("a", "b")]
        procs.append(reaper_process(url, log))
        try:
            await wait_until(lambda: _live(client, "a"), timeout=60)
            await wait_until(lambda: _live(client, "b"), timeout=60)
            async with (
                serving(AppConfig(redis_url=url)) as base,
                httpx.AsyncClient(base_url=base, timeout=60) as http,
            ):

                async def one(i: int) -> tuple[int, str | None, str, bool]:
                    body = {
                        **CHAT,
                        "messages": [{"role": "user", "content": f"task {i}"}],
                        "stream": i % 2 == 1,
                    }
                    response = await http.post("/v1/chat/completions", json=body)
                    text, whole = "", response.status_code == 200
                    if response.status_code == 200 and body["stream"]:
                        text = "".join(_sse_texts(response.text))
                        # A stream that ended with an error line (Redis stalled mid-stream) is cut short.
                        whole = '"error"' not in response.text
                    elif response.status_code == 200:
                        text = response.json()["choices"][0]["message"]["content"]
                    return response.status_code, response.headers.get("x-routeledger-task"), text, whole

                sending = [asyncio.create_task(one(i)) for i in range(6)]
                await asyncio.sleep(0.05)
                # Stalled with requests in flight (some just submitted, some streaming), for
                # longer than the API's socket timeout (5 s).
                pid = fresh_server.process.pid  # type: ignore[union-attr]
                os.kill(pid, signal.SIGSTOP)
                later = [asyncio.create_task(one(i)) for i in range(6, 10)]
                await asyncio.sleep(6.0)
                os.kill(pid, signal.SIGCONT)
                # And traffic once it is back: served as usual.
                await asyncio.sleep(1.0)
                resumed = [asyncio.create_task(one(i)) for i in range(10, 14)]
                answers = await asyncio.gather(*sending, *later, *resumed)
                answered = [(t, text, whole) for code, t, text, whole in answers if code == 200 and t]

                async def settled() -> bool:
                    counted = await counted_completions(ledger)
                    return all(counted[t] >= 1 for t, _, _ in answered)

                await wait_until(settled, timeout=60)
                stored = {t: await stored_result(client, t) for t, _, _ in answered}
                runs = {t: await _texts_by_run(client, t) for t, _, _ in answered}
        finally:
            await asyncio.to_thread(stop_all, procs)
            claims = await events_of(ledger, TaskClaimed)
            counted = await counted_completions(ledger)
            await client.aclose()
    assert answered, "some requests should have been answered"
    assert max(_claims_per_run(claims).values()) == 1, "a run was claimed twice"
    assert max(counted.values()) == 1, "a task was completed twice"
    assert any(whole for _, _, whole in answered)
    for task_id, text, whole in answered:
        result = stored[task_id]
        assert result is not None, task_id
        if whole:
            # Whole, the answer is the text of the run whose result counts.
            assert text == result.text, (task_id, text)
        else:
            # Cut short, a beginning of one run's text, never a mixture: the run may be one that
            # the stall lost (its task re-ran and another run's result counts).
            assert any(t.startswith(text) for t in runs[task_id].values()), (task_id, text, runs[task_id])


async def _texts_by_run(redis: aioredis.Redis, task_id: str) -> dict[str, str]:
    """Each run's text in the task's output stream, by the run's nonce."""
    texts: dict[str, str] = collections.defaultdict(str)
    for _, fields in await redis.xrange(Keys().out(task_id)):
        chunk = chunk_decoder.decode(fields[b"c"])
        texts[chunk.run] += chunk.text
    return dict(texts)


def _sse_texts(body: str) -> list[str]:
    import json

    out: list[str] = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: ") :])
            for choice in event.get("choices", []):
                out.append((choice.get("delta") or {}).get("content") or "")
    return out
