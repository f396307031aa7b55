"""How routeledger opens an asyncio Redis client: the API, every command and the tests go through here.

With RESP3, its default, redis-py 8.1.0 turns on maintenance notifications ("auto"), and while they
are on its pool skips the check, at checkout, of whether the server closed a pooled connection.
After a Redis restart every connection that sat idle in the pool through the outage is then handed
out again, and its next command fails with "Connection closed by server." (redis-py issue 4252; the
clients from from_url do not retry). A worker that draws one for a task's claim leaves the task
pending until the reaper takes it back. routeledger talks to a Redis that sends no maintenance
notifications, so it turns them off and gets the check back: a closed connection is replaced.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.maint_notifications import MaintNotificationsConfig


def open_redis(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio client for the Redis at `url`; `options` are redis-py's from_url options."""
    return aioredis.Redis.from_url(
        url, maint_notifications_config=MaintNotificationsConfig(enabled=False), **options
    )
