"""Leases of singleton processes: one active projector and one active reaper per Redis.

A lease is a key with a TTL that its holder renews; only the holder's token may renew or release
it. (Worker leases, which say what a worker holds, live in tasks/lease.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from pathlib import Path
from typing import Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from events.cancellation import cancel_and_wait
from events.keys import Keys
from events.scripts import read_lua

log = logging.getLogger("routeledger.lease")

# How long a lease outlives its holder's last renewal unless configured otherwise (`lease_ms`):
# the default of every lease in routeledger, worker and singleton alike.
DEFAULT_LEASE_MS: Final = 10_000

# Compare-and-renew / compare-and-delete of a singleton lease: only the holder's token may act.
# Shared by SingletonLease and the projector's own fenced lease.
_LUA: Final = Path(__file__).parent / "lua"
RENEW_LEASE: Final = read_lua(_LUA / "renew_lease.lua")
RELEASE_LEASE: Final = read_lua(_LUA / "release_lease.lua")


class SingletonLease:
    """Elects one active instance of a process (projector, reaper) through a key with a TTL.

    `hold()` waits until the lease is ours; a background task renews it; `lost` is set if a
    renewal finds the key taken by someone else, so the holder can stop writing.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, role: str, ttl_ms: int = DEFAULT_LEASE_MS) -> None:
        self.redis = redis
        self.key = keys.singleton(role)
        self.ttl_ms = ttl_ms
        self.token = secrets.token_hex(8)
        self.lost = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None
        self._renew_script = redis.register_script(RENEW_LEASE)
        self._release_script = redis.register_script(RELEASE_LEASE)

    async def try_take(self) -> bool:
        ok = await self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms)
        if ok:
            return True
        return await self._renew()

    async def _renew(self) -> bool:
        # Compare-and-renew, atomically: only the holder's token may extend the lease.
        return bool(await self._renew_script(keys=[self.key], args=[self.token, self.ttl_ms]))

    async def hold(self, poll_s: float | None = None) -> None:
        """Wait until this instance holds the lease, then keep renewing it in the background."""
        wait = poll_s if poll_s is not None else self.ttl_ms / 3000
        announced = False
        while not await self.try_take():
            if not announced:
                log.info("another instance holds %s; waiting for it", self.key)
                announced = True
            await asyncio.sleep(wait)
        self.lost.clear()
        self._renewer = asyncio.create_task(self._renew_loop())

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                if not await self._renew():
                    log.warning("lost the lease %s to another instance", self.key)
                    self.lost.set()
                    return
            except (RedisError, OSError) as exc:
                log.warning("could not renew %s: %s", self.key, exc)

    async def release(self) -> None:
        if self._renewer is not None:
            await cancel_and_wait((self._renewer,))
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        with contextlib.suppress(RedisError, OSError):
            await self._release_script(keys=[self.key], args=[self.token])
