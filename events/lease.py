"""Worker leases (`rl:live:{worker}`) and the leases of singleton processes.

A worker's lease is a key with a TTL that its heartbeats refresh; its value says what the worker
holds right now, so that a submission can resolve a model name without waiting for a projection.
A missing key means the worker is presumed dead: that, and only that, lets the reaper reclaim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from events.event import ModelEntry, now_ms
from events.keys import Keys

log = logging.getLogger("routeledger.lease")


class RunningInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A task a worker is running, as its lease reports it (the plan counts what each slot runs)."""

    task_id: str
    digest: str
    started_at: int
    domain: str = "general"
    prompt_tokens: int | None = None
    max_tokens: int | None = None


class LeaseInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The value of a worker's lease key."""

    worker: str
    token: str
    slots: int
    in_flight: int = 0
    inventory: list[ModelEntry] = msgspec.field(default_factory=list)
    loaded: list[str] = msgspec.field(default_factory=list)
    # Model names it serves; None: every model it holds; []: registered, serving nothing.
    serves: list[str] | None = None
    draining: bool = False
    running: list[RunningInfo] = msgspec.field(default_factory=list)
    since: int = msgspec.field(default_factory=now_ms)
    renewed_at: int = msgspec.field(default_factory=now_ms)

    def serving(self) -> list[ModelEntry]:
        """The held models this worker consumes tasks for."""
        if self.serves is None:
            return list(self.inventory)
        wanted = set(self.serves)
        return [m for m in self.inventory if m.name in wanted or m.digest in wanted]


_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(LeaseInfo)


def encode_lease(info: LeaseInfo) -> bytes:
    return _encoder.encode(info)


def decode_lease(data: bytes) -> LeaseInfo:
    return _decoder.decode(data)


async def live_workers(redis: aioredis.Redis, keys: Keys) -> dict[str, LeaseInfo]:
    """Every worker whose lease is alive now, with what it holds (SCAN + one MGET)."""
    names: list[bytes] = []
    async for key in redis.scan_iter(match=keys.live_pattern, count=500):
        names.append(key)
    if not names:
        return {}
    values: list[Any] = await redis.mget(names)
    out: dict[str, LeaseInfo] = {}
    for raw in values:
        if raw is None:
            continue  # expired between SCAN and MGET
        try:
            info = decode_lease(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        out[info.worker] = info
    return out


# Compare-and-renew / compare-and-delete of a singleton lease: only the holder's token may act.
# Shared by SingletonLease and the projector's own fenced lease.
RENEW_LEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

RELEASE_LEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class SingletonLease:
    """Elects one active instance of a process (projector, reaper) through a key with a TTL.

    `hold()` waits until the lease is ours; a background task renews it; `lost` is set if a
    renewal finds the key taken by someone else, so the holder can stop writing.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, role: str, ttl_ms: int = 10_000) -> None:
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
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        with contextlib.suppress(RedisError, OSError):
            await self._release_script(keys=[self.key], args=[self.token])
