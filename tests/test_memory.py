"""Redis memory bounded and visible: embedded Redis's limit, what the surfaces show, submissions refused
near the limit in each surface's shape, accepted work finishing, a worker waiting out OOM on its
closing writes, and the capped dead-letter stream."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import ResponseError

from api.app import AppConfig
from dispatch.errors import RedisMemoryFullError
from dispatch.gateway import Gateway
from dispatch.memory import REFUSE_AT, archive_info, read_memory
from events.connection import is_oom
from events.event import TaskCompleted
from events.keys import WORKERS_GROUP, Keys
from events.ledger import Ledger
from routeledger.config import Settings, maxmemory_bytes
from routeledger.embedded import EmbeddedRedis
from routeledger.errors import ConfigError
from sim.backends.hosts import SimHosts
from tasks.payload import Message, Result, TaskMessage, queue_fields
from tasks.store import TaskStore
from tests.helpers import MODEL_DIGEST, events_of, fast_config, make_test_fleet, running_agent, wait_until
from tests.test_api_support import fleet_and_api, ghost_worker, serving

HI = [{"role": "user", "content": "hi"}]
# Filler that makes used memory large enough that a few percent of it is room for a task's writes.
FILLER_BYTES = 16 * 1024 * 1024

SetLimit = Callable[[float], Awaitable[None]]


@pytest.fixture
async def limit(redis_client: aioredis.Redis) -> AsyncIterator[SetLimit]:
    """Sets the test Redis's maxmemory so that what it holds now is `ratio` of it (after a filler
    key); puts the old limit back after the test."""
    before: Any = await redis_client.config_get("maxmemory")

    async def set_ratio(ratio: float) -> None:
        if not await redis_client.exists("filler"):
            # Built inside Redis: a 16 MB argument would sit in the query buffer and skew the reading.
            await redis_client.eval(
                "redis.call('SET', KEYS[1], string.rep('x', ARGV[1]))", 1, "filler", FILLER_BYTES
            )  # type: ignore[misc]
        used = (await read_memory(redis_client)).used_bytes
        await redis_client.config_set("maxmemory", int(used / ratio))

    try:
        yield set_ratio
    finally:
        await redis_client.config_set("maxmemory", before["maxmemory"])
        await redis_client.delete("filler")


def test_redis_maxmemory_takes_bytes_sizes_and_a_share_of_ram() -> None:
    assert maxmemory_bytes(Settings(redis_maxmemory=64 * 1024**2)) == 64 * 1024**2
    assert maxmemory_bytes(Settings(redis_maxmemory="2gb")) == 2 * 1024**3
    assert maxmemory_bytes(Settings(redis_maxmemory="512MB")) == 512 * 1024**2
    assert maxmemory_bytes(Settings(redis_maxmemory="100000000")) == 100_000_000
    quarter = maxmemory_bytes(Settings())
    import psutil

    assert abs(quarter - psutil.virtual_memory().total // 4) <= 1
    for bad in ("lots", "2tb", "0%", "150%", "1kb"):
        with pytest.raises(ConfigError, match="redis_maxmemory"):
            maxmemory_bytes(Settings(redis_maxmemory=bad))


def test_embedded_redis_starts_with_the_configured_maxmemory_and_never_evicts(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "r", maxmemory=64 * 1024**2)
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        try:
            assert client.config_get("maxmemory") == {"maxmemory": str(64 * 1024**2)}
            assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        finally:
            client.close()
    finally:
        server.stop()


def _gauges(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text page, by name."""
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


async def _archived(redis_client: aioredis.Redis, keys: Keys) -> None:
    await redis_client.hset(
        keys.archive,
        mapping={
            "ledger": "t",
            "last_id": "5-0",
            "segments": 2,
            "events": 1200,
            "bytes": 4096,
            "ran_at": 1_700_000_000_000,
            "error": "",
            "dir": "/tmp/a",
        },
    )


async def test_readyz_and_metrics_show_memory_the_limit_and_the_archive_never_run_then_run(
    redis_client: aioredis.Redis, redis_url: str, keys: Keys, limit: SetLimit
) -> None:
    await limit(0.85)
    async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as http:
        ready = (await http.get("/readyz")).json()
        assert ready["status"] == "ready"
        memory = ready["memory"]
        assert memory["max_bytes"] > memory["used_bytes"] > FILLER_BYTES
        assert memory["level"] == "warn" and 0.8 <= memory["ratio"] < REFUSE_AT
        assert "routeledger archive" in memory["warning"]
        assert ready["archive"]["ran"] is False and ready["archive"]["summary"] == "never run"
        gauges = _gauges((await http.get("/metrics")).text)
        assert gauges["routeledger_redis_used_memory_bytes"] > FILLER_BYTES
        assert gauges["routeledger_redis_maxmemory_bytes"] == memory["max_bytes"]
        assert 0.8 <= gauges["routeledger_redis_memory_ratio"] < REFUSE_AT
        assert gauges["routeledger_archive_last_run_timestamp_seconds"] == 0
        assert gauges["routeledger_ledger_entries"] == 0

        await _archived(redis_client, keys)
        ready = (await http.get("/readyz")).json()
        assert ready["archive"]["ran"] is True and ready["archive"]["events"] == 1200
        assert ready["archive"]["summary"].startswith("1200 events in 2 segments")
        gauges = _gauges((await http.get("/metrics")).text)
        assert gauges["routeledger_archive_events"] == 1200
        assert gauges["routeledger_archive_last_run_timestamp_seconds"] == 1_700_000_000
        assert gauges["routeledger_archive_error"] == 0


def _status(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "routeledger", "status", "--redis-url", redis_url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )


async def test_status_shows_memory_against_the_limit_and_the_archive_absent_then_present(
    redis_client: aioredis.Redis, redis_url: str, keys: Keys, limit: SetLimit
) -> None:
    await limit(0.9)
    shown = await asyncio.to_thread(_status, redis_url)
    assert shown.returncode == 0, shown.stderr
    assert "Redis memory" in shown.stdout and "archive: never run" in shown.stdout
    assert "new tasks will be refused from 95%" in shown.stdout
    await _archived(redis_client, keys)
    as_json = await asyncio.to_thread(_status, redis_url, "--json")
    import json

    data = json.loads(as_json.stdout)
    assert data["redis"]["level"] == "warn" and data["redis"]["max_bytes"] > 0
    assert data["archive"]["events"] == 1200 and data["archive"]["segments"] == 2


async def test_above_the_high_water_mark_every_surface_answers_503_with_the_cause_and_queues_nothing(
    redis_client: aioredis.Redis, redis_url: str, keys: Keys, ledger: Ledger, limit: SetLimit
) -> None:
    await ghost_worker(redis_client)
    await limit(0.97)
    before = await ledger.length()
    async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as http:
        native = await http.post("/v1/tasks", json={"model": "m", "messages": HI})
        oai = await http.post("/v1/chat/completions", json={"model": "m", "messages": HI})
        oai_stream = await http.post(
            "/v1/chat/completions", json={"model": "m", "messages": HI, "stream": True}
        )
        oll = await http.post("/api/chat", json={"model": "m", "messages": HI, "stream": False})
    for response in (native, oai, oai_stream, oll):
        assert response.status_code == 503 and response.headers["retry-after"] == "30"
    error = native.json()["error"]
    assert error["type"] == "redis_memory_full"
    assert "of its memory limit" in error["message"] and "routeledger archive" in error["message"]
    assert error["memory"]["level"] == "full"
    assert set(oai.json()["error"]) == {"message", "type", "param", "code"}
    assert oai.json()["error"]["code"] == "redis_memory_full"
    assert "raise redis_maxmemory" in oai.json()["error"]["message"]
    assert "routeledger archive" in oll.json()["error"]
    assert await ledger.length() == before
    assert await redis_client.exists(keys.queue(MODEL_DIGEST)) == 0


async def test_a_submission_redis_refuses_with_oom_is_the_same_refusal_and_queues_nothing(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await ghost_worker(redis_client)
    gw = Gateway(redis_client, keys)
    await gw.memory.state()  # a reading from before the limit, as a busy API would hold
    before: Any = await redis_client.config_get("maxmemory")
    await redis_client.config_set("maxmemory", 1)
    try:
        request = TaskMessage(model="m", messages=[Message(role="user", content="hi")])
        with pytest.raises(RedisMemoryFullError, match="memory limit"):
            await gw.submit(request)
    finally:
        await redis_client.config_set("maxmemory", before["maxmemory"])
    assert await ledger.length() == 0
    assert await redis_client.xlen(keys.queue(MODEL_DIGEST)) == 0


async def test_a_task_accepted_before_the_limit_completes_and_its_result_is_readable(
    redis_client: aioredis.Redis, redis_url: str, keys: Keys, limit: SetLimit
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url, time_scale=10.0) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        accepted = await http.post("/v1/tasks", json={"model": "m", "messages": HI})
        assert accepted.status_code == 202
        task_id = accepted.json()["task_id"]
        await limit(0.96)
        assert await redis_client.exists(keys.result(task_id)) == 0, "it should still be running"
        await asyncio.sleep(1.1)  # the API's memory reading is a second old at most
        refused = await http.post("/v1/tasks", json={"model": "m", "messages": HI})
        assert refused.status_code == 503

        async def done() -> bool:
            return bool((await http.get(f"/v1/tasks/{task_id}")).json()["status"] == "completed")

        await wait_until(done, timeout=20)
        view = (await http.get(f"/v1/tasks/{task_id}")).json()
        assert view["result"]["text"] and view["worker"] == "a"


async def test_a_worker_refused_its_closing_writes_for_lack_of_memory_keeps_the_result_and_completes_once(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    before: Any = await redis_client.config_get("maxmemory")
    queues = TaskStore(redis_client, keys, ledger)
    async with (
        SimHosts(make_test_fleet(), time_scale=10.0, seed=3) as hosts,
        running_agent(redis_client, hosts.url("a"), fast_config("a", lease_ms=10_000)),
    ):
        from dispatch.submit import submit_task

        request = TaskMessage(model="m", messages=[Message(role="user", content="hi")])
        task_id = (await submit_task(queues, request)).task_id
        queue = keys.queue(MODEL_DIGEST)

        async def claimed() -> bool:
            pending: Any = await redis_client.xpending(queue, WORKERS_GROUP)
            return int(pending["pending"]) == 1

        await wait_until(claimed, timeout=10)
        await redis_client.config_set("maxmemory", 1)
        try:
            # The run (40 tokens at 200 tok/s, ten times slowed) ends while Redis refuses every write.
            await asyncio.sleep(3.0)
            assert await redis_client.exists(keys.result(task_id)) == 0
            assert not [e for e in await events_of(ledger, TaskCompleted) if e.task_id == task_id]
            assert await claimed(), "the entry must stay pending, not acknowledged"
        finally:
            await redis_client.config_set("maxmemory", before["maxmemory"])

        async def acked() -> bool:
            pending: Any = await redis_client.xpending(queue, WORKERS_GROUP)
            return int(pending["pending"]) == 0

        await wait_until(acked, timeout=15)
        completions = [e for e in await events_of(ledger, TaskCompleted) if e.task_id == task_id]
        assert len(completions) == 1 and not completions[0].duplicate and completions[0].attempt == 1
        stored = await redis_client.hgetall(keys.result(task_id))
        assert stored[b"status"] == b"completed" and stored[b"logged"] == b"1"


async def test_rl_dead_stays_at_its_cap_and_holds_ids_and_a_reason_but_no_prompt(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    queues = TaskStore(redis_client, keys, dead_max_entries=1000)
    task = TaskMessage(
        task_id="t1",
        model="m",
        digest=MODEL_DIGEST,
        messages=[Message(role="user", content="a SECRET prompt")],
    )
    fields = queue_fields(task, attempt=3)
    for i in range(3000):
        await queues.dead_letter(keys.queue(MODEL_DIGEST), f"{i + 1}-0", fields, "delivery limit 3 reached")
    # MAXLEN ~ trims whole stream nodes (100 entries each by default), so it holds the cap or a node over.
    assert 1000 <= await redis_client.xlen(keys.dead) <= 1100
    newest: Any = (await redis_client.xrevrange(keys.dead, count=1))[0][1]
    assert newest[b"id"] == b"t1" and newest[b"attempt"] == b"3" and newest[b"type"] == b"chat"
    assert newest[b"entry"] == b"3000-0" and newest[b"queue"] == keys.queue(MODEL_DIGEST).encode()
    assert newest[b"reason"] == b"delivery limit 3 reached"
    assert not any(b"SECRET" in value for value in newest.values())
    assert b"task" not in newest


async def test_the_archive_state_reads_never_run_until_the_archiver_records_a_run(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await redis_client.hset(keys.archive, "ledger", "token-only")
    assert (await archive_info(redis_client, keys)).describe() == "never run"
    await _archived(redis_client, keys)
    await redis_client.hset(keys.archive, "error", "disk full")
    info = await archive_info(redis_client, keys)
    assert info.ran and info.describe().endswith("last run failed: disk full")


async def test_a_closing_script_redis_refuses_for_lack_of_memory_is_recognised_on_every_version(
    any_redis_url: str, keys: Keys
) -> None:
    client = aioredis.Redis.from_url(any_redis_url)
    before: Any = await client.config_get("maxmemory")
    await client.config_set("maxmemory", 1)
    try:
        queues = TaskStore(client, keys)
        with pytest.raises(ResponseError) as refused:
            await queues.close_run(Result(task_id="t", status="completed", attempt=1, text="x"), "x")
        assert is_oom(refused.value)
        assert await client.exists(keys.result("t"), keys.out("t")) == 0
    finally:
        await client.config_set("maxmemory", before["maxmemory"])
        await client.aclose()
