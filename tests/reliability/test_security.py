"""A worker under its own Redis ACL user serves tasks and cannot touch what is not a worker's; the
API refuses every route without a key when keys are configured."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from api.app import AppConfig, create_app
from dispatch.submit import submit_task
from events.event import TaskCompleted
from events.keys import Keys
from events.ledger import Ledger
from events.scripts import LIBRARY
from projections.projector import Projector
from routeledger.embedded import find_redis_server, redis_version
from sim.backends.hosts import SimHosts
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import events_of, make_test_fleet, wait_until
from tests.reliability.support import acl_line, spawn_worker, stop_all
from tests.test_api_support import serving

PASSWORD = "worker-a-secret"


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=19) as sim:
        yield sim


async def test_a_worker_under_its_acl_serves_a_task_and_cannot_write_a_projection_or_the_ledger(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts, tmp_path: Path
) -> None:
    version = redis_version(find_redis_server())
    if version is None or version < (7,):
        pytest.skip(f"worker ACLs need Redis 7 (selectors, %R~); this redis-server is {version}")
    await redis_client.execute_command(*acl_line("a", PASSWORD))
    parts = urlsplit(redis_url)
    worker_url = f"redis://a:{PASSWORD}@{parts.hostname}:{parts.port}/0"
    log = tmp_path / "worker.log"
    # The projector loads the functions the worker calls and moves its inbox into the ledger.
    stop = asyncio.Event()
    projector = asyncio.create_task(Projector(redis_client, Keys(), lease_ms=2000).run(stop))
    await wait_until(lambda: _library_loaded(redis_client), timeout=30)
    proc = spawn_worker(worker_url, hosts.url("a"), "a", log, inbox=True)
    worker = aioredis.Redis.from_url(worker_url)
    try:
        await wait_until(lambda: _exists(redis_client, Keys().live("a")), timeout=60)
        queues = TaskStore(redis_client, Keys(), ledger)
        task = (
            await submit_task(queues, TaskMessage(model="m", messages=[Message(role="user", content="hi")]))
        ).task
        await wait_until(lambda: _completed(ledger, task.task_id), timeout=30)
        refused = []
        for command in (
            ("HSET", "rl:p:{x}:speed", "w", "1"),
            ("SET", "rl:p:current", "x"),
            ("XDEL", "rl:events", "0-1"),
            ("XADD", "rl:events", "*", "type", "TaskCompleted"),
            ("XTRIM", "rl:events", "MAXLEN", "0"),
            ("DEL", "rl:events"),
            ("SET", Keys().live("b"), "x"),
            ("XADD", Keys().pinned("b"), "*", "task", "x"),
            ("FLUSHALL",),
            ("CONFIG", "SET", "appendonly", "no"),
            ("EVAL", "return redis.call('XTRIM', KEYS[1], 'MAXLEN', 0)", "1", "rl:events"),
            ("EVAL", "return redis.call('HSET', KEYS[1], 'w', 1)", "1", "rl:p:{x}:speed"),
        ):
            with pytest.raises((NoPermissionError, ResponseError)) as info:
                await worker.execute_command(*command)
            assert _refusal(info.value), (command, str(info.value))
            refused.append(command[0])
        assert await redis_client.exists("rl:p:{x}:speed") == 0
        assert await redis_client.xlen("rl:events") > 0
        assert proc.poll() is None
    finally:
        await worker.aclose()
        await asyncio.to_thread(stop_all, [proc])
        stop.set()
        await projector
        await redis_client.execute_command("ACL", "DELUSER", "a")
    text = log.read_text()
    assert "NOPERM" not in text and "permission" not in text.lower(), text[-2000:]
    assert len(refused) == 12
    done = [e for e in await events_of(ledger, TaskCompleted) if e.task_id == task.task_id]
    assert [(e.worker, e.duplicate) for e in done] == [("a", False)]


def _refusal(exc: BaseException) -> bool:
    # A command is refused with NOPERM (redis-py: NoPermissionError); a command inside a script with
    # "the user executing the script can't run this command" (or "can't access" a key).
    return isinstance(exc, NoPermissionError) or "user executing the script can't" in str(exc)


async def _library_loaded(redis: aioredis.Redis) -> bool:
    return bool(await redis.function_list(library=LIBRARY))


async def _exists(redis: aioredis.Redis, key: str) -> bool:
    return bool(await redis.exists(key))


async def _completed(ledger: Ledger, task_id: str) -> bool:
    return any(e.task_id == task_id for e in await events_of(ledger, TaskCompleted))


# Open by design: probes for a balancer and the metrics scraper carry no key.
OPEN_ROUTES = {"/healthz", "/readyz", "/metrics"}


async def test_with_keys_configured_no_route_of_the_api_answers_without_a_key(redis_url: str) -> None:
    config = AppConfig(redis_url=redis_url, api_keys=["the-key"])
    schema = create_app(config).openapi()
    routes = [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, methods in schema["paths"].items()
        for method in methods
    ]
    assert len(routes) > 15
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as http:
        answers = {}
        for method, path in routes:
            if path in OPEN_ROUTES:
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "the-key"}):
                response = await http.request(method, path, json={}, headers=headers)
                answers[method, path, tuple(headers.values())] = response.status_code
    assert answers and set(answers.values()) == {401}, {k: v for k, v in answers.items() if v != 401}
