"""A worker agent through what goes wrong around it: a connection dropped mid-command, a Redis
restart that lost writes, a cancel that never arrives, a partition longer than its lease."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from dispatch.submit import submit_task
from events.connection import redis_client as open_redis
from events.event import WorkerChanged, WorkerOnline
from events.keys import Keys
from events.ledger import Ledger
from routeledger.embedded import EmbeddedRedis
from sim.backends.hosts import SimHosts
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.faultproxy import fault_proxy
from tests.helpers import (
    events_of,
    fast_config,
    make_test_fleet,
    redis_exists,
    running_agent,
    wait_until,
)
from tests.reliability.proxy import redis_proxy
from workers.agent import WorkerAgent
from workers.backend import OllamaBackend


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=0.0, seed=7) as sim:
        yield sim


async def test_a_connection_dropped_while_the_worker_appends_its_news_leaves_its_heartbeat_beating(
    redis_client: aioredis.Redis, redis_url: str, redis_server: EmbeddedRedis, hosts: SimHosts
) -> None:
    keys = Keys()
    ledger = Ledger(redis_client, keys)
    queues = TaskStore(redis_client, keys, ledger)
    parts = urlsplit(redis_url)
    async with redis_proxy(parts.hostname or "127.0.0.1", redis_server.port) as relay:
        worker_redis = open_redis(relay.url(parts.password))
        try:
            async with running_agent(worker_redis, hosts.url("a"), fast_config("a")):
                # Running a task loads model m on the backend, so the next beat appends a
                # WorkerChanged; the connection it is sent on drops.
                relay.drop_on(b"WorkerChanged")
                await submit_task(
                    queues, TaskMessage(model="m", messages=[Message(role="user", content="hi")])
                )
                await asyncio.wait_for(relay.dropped.wait(), 15)

                async def told() -> bool:
                    return any(e.loaded for e in await events_of(ledger, WorkerChanged))

                # A later beat tells the ledger after all, and the lease is still being renewed.
                await wait_until(told, timeout=10)
                assert await redis_client.pttl(keys.live("a")) > 0
        finally:
            await worker_redis.aclose()


async def test_a_worker_whose_queues_lost_their_groups_in_a_redis_restart_still_takes_new_tasks(
    redis_client: aioredis.Redis, hosts: SimHosts
) -> None:
    keys = Keys()
    ledger = Ledger(redis_client, keys)
    queues = TaskStore(redis_client, keys, ledger)

    async def done(task_id: str) -> bool:
        return bool(await redis_client.hexists(keys.result(task_id), "result"))

    request = TaskMessage(model="m", messages=[Message(role="user", content="hi")])
    async with running_agent(redis_client, hosts.url("a"), fast_config("a")):
        first = (await submit_task(queues, request)).task
        await wait_until(lambda: done(first.task_id), timeout=10)
        # What a Redis restarted on an AOF that missed its last writes can look like: the queues
        # and their groups are gone, and every process still remembers having made the groups.
        await redis_client.delete(keys.pinned("a"), keys.queue(first.digest))
        second = (await submit_task(queues, request)).task
        await wait_until(lambda: done(second.task_id), timeout=10)


async def test_the_heartbeat_ends_by_itself_once_the_worker_stops_so_a_lost_cancel_cannot_keep_it_beating(
    redis_client: aioredis.Redis, hosts: SimHosts
) -> None:
    # On Python 3.11 a cancel that lands as redis-py's asyncio.wait_for finishes sending a command
    # is dropped; the drain cancels the heartbeat, but must not depend on that alone.
    keys = Keys()
    backend = OllamaBackend(hosts.url("a"), timeout_s=10.0)
    agent = WorkerAgent(redis_client, keys, backend, fast_config("a"))
    beating = asyncio.create_task(agent.heartbeat.beat())
    try:
        await wait_until(lambda: redis_exists(redis_client, keys.live("a")), timeout=10)
        agent.stopping.set()  # and nothing cancels it
        await asyncio.wait_for(asyncio.shield(beating), 5)
    finally:
        beating.cancel()
        await backend.aclose()


async def test_a_worker_cut_off_past_its_lease_announces_itself_again_though_a_late_renewal_revived_it(
    redis_client: aioredis.Redis, redis_url: str, redis_server: EmbeddedRedis, hosts: SimHosts
) -> None:
    # The renewals sent into the black hole are held, as a link's retransmissions are, and reach
    # Redis when it heals: the first re-creates the lapsed lease and answers a connection the worker
    # gave up, so Redis never tells the worker that its lease lapsed. It must know from its own side.
    keys = Keys()
    ledger = Ledger(redis_client, keys)
    parts = urlsplit(redis_url)
    async with fault_proxy(parts.hostname or "127.0.0.1", redis_server.port) as link:
        worker_redis = open_redis(f"redis://:{parts.password}@127.0.0.1:{link.port}/0")
        try:
            async with running_agent(worker_redis, hosts.url("a"), fast_config("a")):
                await wait_until(lambda: _online(ledger, 1), timeout=10)
                link.blackhole()
                await wait_until(lambda: _gone(redis_client, keys.live("a")), timeout=10)
                link.heal()
                await wait_until(lambda: _online(ledger, 2), timeout=10)
                assert await redis_client.pttl(keys.live("a")) > 0
        finally:
            await worker_redis.aclose()


async def _online(ledger: Ledger, n: int) -> bool:
    return len(await events_of(ledger, WorkerOnline)) >= n


async def _gone(redis: aioredis.Redis, key: str) -> bool:
    return not await redis.exists(key)
