"""Redis killed and restarted under a running API: 503 with Retry-After while down, then service again."""

from __future__ import annotations

import httpx
import redis.asyncio as aioredis

from routeledger.embedded import EmbeddedRedis
from tests.helpers import wait_until
from tests.test_api_support import fleet_and_api

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_requests_get_503_while_redis_is_down_and_succeed_after_it_is_back(
    redis_client: aioredis.Redis, redis_url: str, redis_server: EmbeddedRedis
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url, time_scale=0.0, retry_budget_s=0.3) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        before = await http.post("/v1/chat/completions", json=CHAT)
        redis_server.kill()
        try:
            chat = await http.post("/v1/chat/completions", json=CHAT)
            native = await http.post("/v1/tasks", json={**CHAT, "wait": True})
            ollama = await http.post("/api/chat", json={**CHAT, "stream": False})
            models = await http.get("/v1/models")
            ready = await http.get("/readyz")
            alive = await http.get("/healthz")
        finally:
            # Other tests share this server: it must be back whatever happened here.
            redis_server.restart()

        async def served() -> bool:
            response = await http.post("/v1/chat/completions", json=CHAT)
            return response.status_code == 200

        await wait_until(served, timeout=20, every=0.2)
        after = await http.get("/readyz")
    assert before.status_code == 200
    for response in (chat, native, ollama, models, ready):
        assert response.status_code == 503
        assert int(response.headers["retry-after"]) >= 1
    assert chat.json()["error"]["type"] == "server_error"
    assert native.json()["error"]["type"] == "unavailable"
    assert isinstance(ollama.json()["error"], str)
    assert alive.status_code == 200
    assert after.status_code == 200
