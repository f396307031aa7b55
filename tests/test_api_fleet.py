"""Fleet, capacity, preview, stats and the operations endpoints."""

from __future__ import annotations

import httpx
import redis.asyncio as aioredis

from api.app import AppConfig
from events.event import TaskClaimed, now_ms
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from tests.test_api_support import fleet_and_api, serving

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_the_fleet_shows_each_live_worker_and_the_capacity_per_model(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url, workers=("a", "b", "c"), slots=2) as (base, _),
        httpx.AsyncClient(base_url=base) as http,
    ):
        fleet = (await http.get("/v1/fleet")).json()
    assert [w["id"] for w in fleet["workers"]] == ["a", "b", "c"]
    assert {w["status"] for w in fleet["workers"]} == {"online"}
    assert fleet["workers"][0]["models"] == ["m:latest"] and fleet["workers"][0]["slots"] == 2
    assert fleet["workers"][0]["lease_age_s"] is not None
    assert fleet["capacity"] == {"m:latest": 4, "other:latest": 2}


async def test_the_preview_ranks_the_holders_with_every_term(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url, workers=("a", "b")) as (base, _),
        httpx.AsyncClient(base_url=base) as http,
    ):
        named = (await http.get("/v1/route/preview", params={"model": "m", "tokens": 20})).json()
        auto = (await http.get("/v1/route/preview", params={"model": "auto", "domain": "code"})).json()
        unknown = await http.get("/v1/route/preview", params={"model": "nope"})
    assert {c["worker"] for c in named["candidates"]} == {"a", "b"}
    assert {"expected_finish_s", "terms", "fields"} <= set(named["candidates"][0])
    assert named["candidates"][0]["fields"]["decode_tps"]["source"]
    assert auto["plan"]["auto"]["domain"] == "code"
    assert unknown.status_code == 404 and "m:latest" in unknown.json()["error"]["message"]


async def test_metrics_count_requests_by_route_and_model_and_show_the_fleet(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _), httpx.AsyncClient(base_url=base) as http:
        await http.post("/v1/chat/completions", json=CHAT, timeout=30)
        await http.get("/metrics")
        text = (await http.get("/metrics")).text
        stats = await http.get("/v1/stats")
        ready = (await http.get("/readyz")).json()
    assert 'routeledger_api_requests_total{model="m",route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'routeledger_model_capacity{model="m:latest"} 1.0' in text
    assert 'routeledger_worker_slots{worker="a"} 1.0' in text
    assert "routeledger_queue_depth" in text and "routeledger_dead_letters 0.0" in text
    assert stats.status_code == 200 and set(stats.json()) >= {"speed", "length", "quality"}
    assert ready["status"] == "ready" and "projector" in ready


async def test_a_benchmark_request_reaches_every_live_holder(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    from events.event import BenchmarkRequested
    from events.ledger import Ledger
    from tests.helpers import events_of

    async with (
        fleet_and_api(redis_client, redis_url, workers=("a", "b", "c")) as (base, _),
        httpx.AsyncClient(base_url=base) as http,
    ):
        response = await http.post("/v1/bench", json={"model": "m", "count": 2})
    assert response.status_code == 202
    sent = response.json()["benchmarks"]
    # Two speed prompts (answers long enough to measure) and two graded ones, to each holder.
    assert sorted(b["worker"] for b in sent) == ["a", "b"] and {b["prompts"] for b in sent} == {4}
    requested = await events_of(Ledger(redis_client), BenchmarkRequested)
    assert sorted(r.worker for r in requested) == ["a", "b"] and {r.prompts for r in requested} == {4}


async def test_a_worker_whose_clock_is_off_the_ledgers_is_flagged_in_the_fleet(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    await Ledger(redis_client, Keys()).append_many(
        [
            TaskClaimed(at=now_ms() + 3_600_000, task_id="t1", worker="ahead", digest="d" * 64, attempt=1),
            TaskClaimed(at=now_ms(), task_id="t2", worker="true", digest="d" * 64, attempt=1),
        ]
    )
    projector = Projector(redis_client, Keys())
    await projector.start()
    await projector.catch_up()
    async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as http:
        workers = {w["id"]: w for w in (await http.get("/v1/fleet")).json()["workers"]}
    assert workers["ahead"]["clock_skewed"] is True
    assert abs(workers["ahead"]["clock_offset_s"] - 3600) < 60
    assert workers["true"]["clock_skewed"] is False and abs(workers["true"]["clock_offset_s"]) < 5
