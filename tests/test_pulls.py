"""Models onto machines through the fleet: Ollama's /api/pull and /api/delete (api/pulls.py), driven
by the real `ollama` client and raw HTTP, carried out by each worker against its own simulated
Ollama (workers/control.py), which gives a machine a model its fleet table lists as `held = false`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import ollama
import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from api.app import AppConfig
from api.pulls import pull_targets
from dispatch.control import ControlRequest, ControlTimeoutError, cursor, follow, new_id, send
from events.codec import decode_entry
from events.event import ModelEntry, WorkerChanged
from events.keys import Keys
from events.scripts import load_library
from routeledger.cli_acl import worker_acl_rules
from routeledger.embedded import find_redis_server, redis_version
from sim.backends.hosts import SimHosts
from sim.fleetspec import Fleet, parse_fleet
from tasks.lease import LeaseInfo
from tasks.quota import ApiKey
from tests.helpers import fast_config, running_agent
from tests.test_api_support import fleet_and_api, serving
from workers.backend import OllamaBackend
from workers.control import Control

# `talk` on both machines; `extra` on `a`, and `b` can be given it (the story's ELYZA).
PULL_FLEET = """
[model."talk"]
output = { dist = "fixed", mean = 5 }

[model."extra"]
size = 4920734080
output = { dist = "fixed", mean = 5 }

[[worker]]
name = "a"
[worker.models."talk"]
decode_tps = 200.0
load_s = 0.0
[worker.models."extra"]
decode_tps = 200.0
load_s = 0.0

[[worker]]
name = "b"
[worker.models."talk"]
decode_tps = 200.0
load_s = 0.0
[worker.models."extra"]
decode_tps = 200.0
load_s = 0.0
held = false
"""
HI = [{"role": "user", "content": "hi"}]


def pull_fleet() -> Fleet:
    return parse_fleet(PULL_FLEET, "pulls.toml")


async def holders(http: httpx.AsyncClient, model: str) -> set[str]:
    """The machines that hold `model` as the API's /api/show says (its holders' list)."""
    shown = await http.post("/api/show", json={"model": model})
    return set(shown.json()["model_info"]["routeledger.holders"]) if shown.status_code == 200 else set()


async def until_holders(http: httpx.AsyncClient, model: str, expected: set[str]) -> set[str]:
    deadline = time.monotonic() + 10
    found = await holders(http, model)
    while found != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        found = await holders(http, model)
    return found


@contextlib.asynccontextmanager
async def api_over_pull_fleet(
    redis_client: aioredis.Redis, redis_url: str, **config: object
) -> AsyncIterator[httpx.AsyncClient]:
    """The pull fleet's two machines, a worker for each, the API, and a client of it."""
    async with (
        fleet_and_api(
            redis_client, redis_url, workers=("a", "b"), time_scale=0, fleet=pull_fleet(), **config
        ) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        yield http


async def test_the_ollama_client_pulls_a_model_onto_the_machine_that_lacks_it_and_it_runs_there(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with api_over_pull_fleet(redis_client, redis_url) as http:
        client = ollama.AsyncClient(host=str(http.base_url))
        lines = [line async for line in await client.pull("extra", stream=True)]
        assert await until_holders(http, "extra", {"a", "b"}) == {"a", "b"}
        # Gone from `a` (named: `ollama rm` cannot name one), the next request can only run on `b`.
        removed = await http.request("DELETE", "/api/delete", json={"model": "extra", "worker": "a"})
        assert await until_holders(http, "extra", {"b"}) == {"b"}
        after = await http.post("/api/chat", json={"model": "extra", "messages": HI, "stream": False})
        again = await client.pull("extra")
        rows: Any = await redis_client.xrange(Keys().events)
    # Ollama's own progress (one machine's: only `b` lacked it), then success.
    statuses = [line.status for line in lines]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert statuses.count("pulling manifest") == 1
    assert any(line.completed == line.total == 4920734080 for line in lines)
    assert removed.status_code == 200
    assert after.status_code == 200 and after.headers["x-routeledger-worker"] == "b"
    assert after.json()["message"]["content"]
    # Asked again with every machine holding it: nothing to do, and said so as Ollama would.
    assert again.status == "success"
    # The machine's new model reached the ledger as any inventory change does.
    changed = [e for e in (decode_entry(i.decode(), f) for i, f in rows) if isinstance(e, WorkerChanged)]
    assert any(e.worker == "b" and any(m.name.startswith("extra") for m in e.inventory) for e in changed)


async def test_a_named_machine_pulls_without_streaming_and_a_delete_takes_the_model_away_again(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with api_over_pull_fleet(redis_client, redis_url) as http:
        pulled = await http.post("/api/pull", json={"model": "extra", "worker": "b", "stream": False})
        held = await until_holders(http, "extra", {"a", "b"})
        # As `ollama rm` sends it (a body on DELETE); every machine that holds it.
        deleted = await http.request("DELETE", "/api/delete", content=json.dumps({"model": "extra"}))
        gone = await until_holders(http, "extra", set())
        again = await http.request("DELETE", "/api/delete", json={"model": "extra"})
        nobody = await http.post("/api/pull", json={"model": "extra", "worker": "zz", "stream": False})
    assert pulled.status_code == 200 and pulled.json() == {"status": "success"}
    assert held == {"a", "b"}
    assert deleted.status_code == 200 and gone == set()
    assert again.status_code == 404 and "not found" in again.json()["error"]
    assert nobody.status_code == 404 and "'zz'" in nobody.json()["error"] and "a, b" in nobody.json()["error"]


async def test_a_model_the_registry_lacks_is_a_clear_400_from_the_machines_own_server(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with api_over_pull_fleet(redis_client, redis_url) as http:
        waited = await http.post("/api/pull", json={"model": "no-such-model", "stream": False})
        streamed = await http.post("/api/pull", json={"model": "no-such-model"})
    assert waited.status_code == 400
    assert "file does not exist" in waited.json()["error"] and "a:" in waited.json()["error"]
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert streamed.status_code == 200
    assert {line["worker"] for line in lines[:-1]} == {"a", "b"}
    assert "file does not exist" in lines[-1]["error"]


@pytest.mark.parametrize("named", [True, False])
async def test_a_machine_whose_server_cannot_pull_says_so_in_so_many_words(
    redis_client: aioredis.Redis, redis_url: str, named: bool
) -> None:
    async with (
        fleet_and_api(
            redis_client, redis_url, workers=("a",), time_scale=0, fleet=pull_fleet(), kind="openai"
        ) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        body: dict[str, Any] = {"model": "extra", "stream": False}
        if named:
            body["worker"] = "a"
        answer = await http.post("/api/pull", json=body)
    assert answer.status_code == 400
    assert ("cannot pull" if named else "no live worker's server can pull") in answer.json()["error"]
    if named:
        # The worker's own words: its server's kind and address.
        assert "openai at http://" in answer.json()["error"]


async def test_a_worker_under_its_acl_pulls_through_the_api_and_reads_no_other_machines_requests(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    version = redis_version(find_redis_server())
    if version is None or version < (7,):
        pytest.skip(f"worker ACLs need Redis 7 (selectors, %R~); this redis-server is {version}")
    keys = Keys()
    await redis_client.execute_command("ACL", "SETUSER", "b", *worker_acl_rules("b", "pw", keys))  # type: ignore[no-untyped-call]
    await load_library(redis_client)
    parts = urlsplit(redis_url)
    limited = aioredis.Redis.from_url(f"redis://b:pw@{parts.hostname}:{parts.port}/0")
    try:
        async with (
            SimHosts(pull_fleet(), time_scale=0) as hosts,
            running_agent(limited, hosts.url("b"), fast_config("b", inbox=True)),
            serving(AppConfig(redis_url=redis_url)) as base,
            httpx.AsyncClient(base_url=base, timeout=30) as http,
        ):
            pulled = await http.post("/api/pull", json={"model": "extra", "stream": False})
            with pytest.raises(NoPermissionError):
                await limited.xrevrange(keys.control("a"), count=1)
            with pytest.raises(NoPermissionError):
                await limited.xadd(keys.control("b"), {"m": b"forged"})
    finally:
        await limited.aclose()
        await redis_client.execute_command("ACL", "DELUSER", "b")  # type: ignore[no-untyped-call]
    assert pulled.status_code == 200, pulled.text
    assert pulled.json() == {"status": "success"}


async def test_a_request_no_worker_takes_up_ends_in_time_saying_so(redis_client: aioredis.Redis) -> None:
    keys = Keys()
    request = ControlRequest(op="pull", id=new_id(), model="extra")
    await send(redis_client, keys, "gone", request)
    started = time.monotonic()
    with pytest.raises(ControlTimeoutError, match="did not take it up"):
        async for _ in follow(redis_client, keys, "gone", request.id, first_line_s=0.3):
            pass
    assert 0.3 <= time.monotonic() - started < 2.0
    # What was asked stays in that worker's stream for it to find; a new life skips it.
    assert await cursor(redis_client, keys, "gone") != "0-0"


async def test_only_an_operators_key_may_pull_and_insecure_pulls_are_refused(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    tenant = ApiKey(name="tenant", key="k-tenant", rpm=60)
    async with api_over_pull_fleet(
        redis_client,
        redis_url,
        api_keys=["k-operator"],
        keys=[tenant, ApiKey(name="ops", key="k-ops", manage_models=True)],
    ) as http:
        body = {"model": "extra", "stream": False}
        by_tenant = await http.post("/api/pull", json=body, headers={"authorization": "Bearer k-tenant"})
        deleted_by_tenant = await http.request(
            "DELETE", "/api/delete", json={"model": "extra"}, headers={"authorization": "Bearer k-tenant"}
        )
        insecure = await http.post(
            "/api/pull", json={**body, "insecure": True}, headers={"authorization": "Bearer k-operator"}
        )
        by_ops = await http.post("/api/pull", json=body, headers={"authorization": "Bearer k-ops"})
        by_operator = await http.post("/api/pull", json=body, headers={"authorization": "Bearer k-operator"})
    assert by_tenant.status_code == 403 and "'tenant' may not pull" in by_tenant.json()["error"]
    assert deleted_by_tenant.status_code == 403
    assert insecure.status_code == 400 and "insecure" in insecure.json()["error"]
    assert by_ops.status_code == 200 and by_operator.status_code == 200, (by_ops.text, by_operator.text)


async def test_a_worker_runs_a_request_appended_twice_once_and_skips_one_its_caller_gave_up_on(
    redis_client: aioredis.Redis,
) -> None:
    keys = Keys()
    async with SimHosts(pull_fleet(), time_scale=0) as hosts:
        backend = OllamaBackend(hosts.url("b"))
        late = 0

        async def changed() -> None:
            return None

        async def ledger_ms() -> int:
            # The ledger's clock, moved on by `late` ms: a request asked that long ago.
            return int(time.time() * 1000) + late

        control = Control(redis_client, keys, "b", backend, changed, ledger_ms)
        await control.start()
        stopping = asyncio.Event()
        running = asyncio.create_task(control.run(stopping))
        try:
            twice = ControlRequest(op="delete", id=new_id(), model="talk")
            # An append the API retried after its reply was lost: the same request twice.
            await send(redis_client, keys, "b", twice)
            await send(redis_client, keys, "b", twice)
            first = [p async for p in follow(redis_client, keys, "b", twice.id, first_line_s=5)]
            await asyncio.sleep(0.5)
            entries = await redis_client.xlen(keys.run_out("b", twice.id))
            late = 20_000
            stale = ControlRequest(op="pull", id=new_id(), model="extra")
            await send(redis_client, keys, "b", stale)
            skipped = [p async for p in follow(redis_client, keys, "b", stale.id, first_line_s=5)]
            tags = await backend.inventory()
        finally:
            stopping.set()
            await running
            await control.aclose()
            await backend.aclose()
    # Deleted once: an acknowledgement, then a success (a second run would end "not found").
    assert [(p.line, p.end, p.error) for p in first] == [(None, False, None), (None, True, None)]
    assert entries == 2
    # Asked 20 s before it was taken up: its caller was told it timed out, so it is not done.
    assert [(p.end, p.failure) for p in skipped] == [(True, "expired")]
    # The stale pull never reached the machine: it still lacks `extra` (and `talk` is gone).
    assert [m.name for m in tags.models] == []


def test_a_pull_naming_no_machine_goes_to_the_ollama_workers_that_lack_the_model_and_would_serve_it() -> None:
    held = [ModelEntry(name="extra:latest", digest="e" * 64)]
    leases = {
        name: LeaseInfo(worker=name, token="t", slots=1, backend_kind=kind, **more)  # type: ignore[arg-type]
        for name, kind, more in (
            ("gpu", "ollama", {}),
            ("laptop", "ollama", {"inventory": held}),
            ("retired", "ollama", {"serves": [], "serves_named": []}),
            ("picky", "ollama", {"serves_named": ["qwen3:8b"]}),
            ("choosy", "ollama", {"serves_named": ["qwen3:8b", "extra"], "serves": ["qwen3:8b"]}),
            ("leaving", "ollama", {"draining": True}),
            ("llamacpp", "openai", {}),
        )
    }
    assert pull_targets(leases, "extra") == ["choosy", "gpu"]
    assert pull_targets(leases, "extra:latest") == ["choosy", "gpu"]
