"""The FastAPI application. It keeps no state of its own beyond connections, so several can run."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from events.keys import Keys


class AppConfig(msgspec.Struct, kw_only=True):
    """What the API needs to know; built by the composition root."""

    redis_url: str
    prefix: str = "rl:"
    api_keys: list[str] = msgspec.field(default_factory=list)


def create_app(config: AppConfig) -> FastAPI:
    """The API application over the Redis at `config.redis_url`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.redis = aioredis.Redis.from_url(
            config.redis_url, socket_connect_timeout=2, socket_timeout=5, health_check_interval=10
        )
        app.state.keys = Keys(config.prefix)
        try:
            yield
        finally:
            await app.state.redis.aclose()

    app = FastAPI(title="routeledger", version="0.1.0", lifespan=lifespan)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process is up; says nothing of Redis."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Ready when Redis answers."""
        try:
            await app.state.redis.ping()
        except (RedisError, OSError) as exc:
            return JSONResponse(
                {"status": "unavailable", "redis": "unreachable", "detail": str(exc) or type(exc).__name__},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        return JSONResponse({"status": "ready", "redis": "ok"})

    return app
