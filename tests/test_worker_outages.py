"""A worker agent through what goes wrong around it: a connection dropped mid-command, a Redis
restart that lost writes, a cancel that never arrives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import TracebackType

import pytest
import redis.asyncio as aioredis

from dispatch.payload import Message
from dispatch.queues import TaskQueues
from dispatch.submit import TaskRequest, submit_task
from events.connection import redis_client as open_redis
from events.event import WorkerChanged
from events.keys import Keys
from events.ledger import Ledger
from routeledger.embedded import EmbeddedRedis
from sim.backends.hosts import SimHosts
from tests.helpers import (
    events_of,
    fast_config,
    make_test_fleet,
    redis_exists,
    running_agent,
    wait_until,
)
from workers.agent import WorkerAgent
from workers.backend import OllamaBackend


class DroppingRelay:
    """A TCP relay in front of the test Redis. Once armed, it drops the first connection whose
    request holds `needle`, without forwarding that request: what a client sees when Redis dies
    while the command is in flight ("Connection closed by server")."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.needle: bytes | None = None
        self.dropped = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> DroppingRelay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def url(self, redis_url: str, redis_port: int) -> str:
        """`redis_url` pointed at the relay."""
        return redis_url.replace(f":{redis_port}/", f":{self.port}/")

    async def _relay(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        server_in, server_out = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, watch: bool) -> None:
            seen = b""  # the end of what went before, for a needle split between two reads
            try:
                while data := await src.read(65536):
                    if watch and self.needle is not None and self.needle in seen + data:
                        self.needle = None
                        self.dropped.set()
                        return
                    seen = data[-64:]
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                client_out.transport.abort()
                server_out.transport.abort()

        await asyncio.gather(pump(client_in, server_out, True), pump(server_in, client_out, False))


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=0.0, seed=7) as sim:
        yield sim


async def test_a_connection_dropped_while_the_worker_appends_its_news_leaves_its_heartbeat_beating(
    redis_client: aioredis.Redis, redis_url: str, redis_server: EmbeddedRedis, hosts: SimHosts
) -> None:
    keys = Keys()
    ledger = Ledger(redis_client, keys)
    queues = TaskQueues(redis_client, keys, ledger)
    async with DroppingRelay(redis_server.port) as relay:
        worker_redis = open_redis(relay.url(redis_url, redis_server.port))
        try:
            async with running_agent(worker_redis, hosts.url("a"), fast_config("a")):
                # Running a task loads model m on the backend, so the next beat appends a
                # WorkerChanged; the connection it is sent on drops.
                relay.needle = b"WorkerChanged"
                await submit_task(
                    queues, TaskRequest(model="m", messages=[Message(role="user", content="hi")])
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
    queues = TaskQueues(redis_client, keys, ledger)

    async def done(task_id: str) -> bool:
        return bool(await redis_client.hexists(keys.result(task_id), "result"))

    request = TaskRequest(model="m", messages=[Message(role="user", content="hi")])
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
    beating = asyncio.create_task(agent._heartbeat_loop())
    try:
        await wait_until(lambda: redis_exists(redis_client, keys.live("a")), timeout=10)
        agent.stopping.set()  # and nothing cancels it
        await asyncio.wait_for(asyncio.shield(beating), 5)
    finally:
        beating.cancel()
        await backend.aclose()
