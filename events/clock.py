"""Two clocks: this process's own (every time it writes) and the ledger's (every age it computes).

`now_ms` is the producer clock: every `at` an event carries, every time in a lease, a result or a
heartbeat comes from it. A test can shift it (`set_offset_ms`, the `clock_offset_ms` setting of
`routeledger worker`) to play a machine whose clock is wrong.

The ledger's clock is Redis's: it stamps every stream id (projections take sample times from
them) and answers TIME. An age (how long a task waited, how old a sample is, how long a running
task has run) is a difference of two readings of one clock, so code that compares its own time
with a time from the ledger reads `LedgerClock`: its own clock minus an offset it measures against
Redis now and then. Durations a process measures on its own clock alone (a decode's seconds, a
first token's wait) need neither.
"""

from __future__ import annotations

import time
from typing import Any, Final

import redis.asyncio as aioredis

# How often a LedgerClock measures its offset again (clocks drift by milliseconds a day; NTP may
# step one, and a step shows within this long).
RESYNC_S: Final = 30.0

_offset_ms = 0


def set_offset_ms(offset_ms: int) -> None:
    """Shift this process's clock by `offset_ms` (for tests playing a machine whose clock is off)."""
    global _offset_ms
    _offset_ms = int(offset_ms)


def offset_ms() -> int:
    """The shift `set_offset_ms` gave this process's clock (0: none)."""
    return _offset_ms


def now_ms() -> int:
    """The producer clock, in milliseconds since the epoch: the machine's own, shifted by
    `set_offset_ms` where a test asked for it."""
    return time.time_ns() // 1_000_000 + _offset_ms


async def redis_ms(redis: aioredis.Redis) -> int:
    """Redis's clock (TIME) in milliseconds since the epoch: the clock of the ledger's stream ids."""
    reply: Any = await redis.time()
    seconds, micros = int(reply[0]), int(reply[1])
    return seconds * 1000 + micros // 1000


class LedgerClock:
    """The ledger's clock as this process reads it: `now_ms()` minus the offset last measured
    against Redis's TIME (half the round trip counted as transit), measured again every `every_s`."""

    def __init__(self, redis: aioredis.Redis, every_s: float = RESYNC_S) -> None:
        self.redis = redis
        self.every_s = every_s
        # This process's clock minus Redis's, in ms; None until first measured.
        self.offset_ms: int | None = None
        self._measured = 0.0

    async def sync(self) -> int:
        """Measure the offset now; returns it."""
        sent = time.monotonic()
        local = now_ms()
        remote = await redis_ms(self.redis)
        back = time.monotonic()
        self.offset_ms = round(local + (back - sent) * 500.0 - remote)
        self._measured = back
        return self.offset_ms

    async def now_ms(self) -> int:
        """The ledger's time now, in ms since the epoch (a round trip only when the offset is due)."""
        if self.offset_ms is None or time.monotonic() - self._measured >= self.every_s:
            await self.sync()
        assert self.offset_ms is not None
        return now_ms() - self.offset_ms

    def to_ledger(self, producer_ms: int) -> int:
        """A time this process's clock gave, on the ledger's clock (as is, before the first measure)."""
        return producer_ms - (self.offset_ms or 0)
