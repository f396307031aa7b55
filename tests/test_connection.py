"""The asyncio Redis client routeledger opens, against a Redis that is killed and restarted."""

from __future__ import annotations

import asyncio

from events.connection import redis_client as open_redis
from routeledger.embedded import EmbeddedRedis

POOLED = 5


async def test_after_a_redis_restart_no_command_fails_on_a_connection_the_dead_server_closed(
    fresh_server: EmbeddedRedis,
) -> None:
    client = open_redis(fresh_server.url)
    try:
        # As many connections in the pool as commands ran at once.
        await asyncio.gather(*(client.ping() for _ in range(POOLED)))
        fresh_server.kill()
        # Down for a moment, as after any crash: the pooled connections see the server close them.
        await asyncio.sleep(0.2)
        fresh_server.restart()
        # Each of them is checked out once more, and each must be replaced, not used as it is.
        replies = await asyncio.gather(
            *(client.set(f"k{i}", i) for i in range(POOLED)), return_exceptions=True
        )
    finally:
        await client.aclose()
    assert replies == [True] * POOLED
