"""The Redis client every routeledger process uses, with the settings that keep writes exact.

With RESP3, its default, redis-py 8.1.0 turns on maintenance notifications ("auto"), and while they
are on its pool skips the check, at checkout, of whether the server closed a pooled connection.
After a Redis restart every connection that sat idle in the pool through the outage is then handed
out again, and its next command fails with "Connection closed by server." (redis-py issue 4252; the
clients from from_url do not retry). A worker that draws one for a task's claim leaves the task
pending until the reaper takes it back. routeledger talks to a Redis that sends no maintenance
notifications, so it turns them off and gets the check back: a closed connection is replaced.
"""

from __future__ import annotations

import socket
from typing import Any, Final

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig

# TCP keepalive: a peer that vanished (Wi-Fi, VPN, a machine switched off) is noticed in about
# 10 + 3 x 3 seconds even on a connection that waits for nothing.
_KEEPALIVE: Final = {
    opt: value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 3))
    if (opt := getattr(socket, name, None)) is not None
}


def redis_client(url: str, *, socket_timeout: float = 10.0, **options: Any) -> aioredis.Redis:
    """The one way routeledger's processes make a Redis client.

    - No command is sent twice by the client: redis-py would retry (and re-send a whole pipeline)
      after a connection error or timeout, and a write whose first sending was applied would be
      applied twice. Retries are explicit, and only of what is safe to repeat
      (`dispatch.queues.resend`, the gateway's submission keyed by task id).
    - Every read has a deadline (`socket_timeout`, longer than any blocking read routeledger
      makes), and TCP keepalive is on, so that a half-open connection fails instead of hanging.
    - Maintenance notifications are off, so that a pooled connection the server closed is replaced
      at checkout (see the module's docstring).
    """
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=3,
        socket_timeout=socket_timeout,
        socket_keepalive=True,
        socket_keepalive_options=_KEEPALIVE,
        health_check_interval=15,
        retry=Retry(NoBackoff(), 0),
        maint_notifications_config=MaintNotificationsConfig(enabled=False),
        **options,
    )
