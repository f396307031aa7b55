"""Redis's memory against its limit, and the archive that keeps the ledger's share of it bounded.

Redis runs with `maxmemory-policy noeviction`: an evicted key would be a queued task, a result or
ledger entries lost without a word, so at the limit Redis refuses writes instead. The API refuses
new work earlier, at a high-water mark (REFUSE_AT), so that what was accepted can still finish: the
worker's claim, output, result and completion all need room. Operators are warned before that
(WARN_AT). INFO is read at most once a second per process, whatever the request rate.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final, Literal, cast

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from dispatch.errors import RedisMemoryFullError
from events.codec import as_str
from events.connection import is_cluster
from events.keys import Keys

# Share of maxmemory from which every surface warns.
WARN_AT: Final = 0.80
# Share of maxmemory from which new submissions are refused (503); the rest is for accepted work.
REFUSE_AT: Final = 0.95
# How long one INFO reading serves a process.
READ_EVERY_S: Final = 1.0
NOEVICTION: Final = "noeviction"
# What to do about it, in every message that says memory is short.
REMEDY: Final = "run `routeledger archive` or raise redis_maxmemory"

Level = Literal["ok", "warn", "full", "unbounded"]


def human_bytes(n: int) -> str:
    """1.9 GiB, 512.0 MiB, 20 KiB: sizes as an operator reads them."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


class MemoryState(msgspec.Struct, kw_only=True, frozen=True):
    """One reading of INFO memory."""

    used_bytes: int
    # 0: no limit set.
    max_bytes: int
    policy: str
    read_at_ms: int

    @property
    def ratio(self) -> float | None:
        """Used over the limit; None when Redis has no limit."""
        return None if self.max_bytes <= 0 else self.used_bytes / self.max_bytes

    @property
    def level(self) -> Level:
        ratio = self.ratio
        if ratio is None:
            return "unbounded"
        if ratio >= REFUSE_AT:
            return "full"
        return "warn" if ratio >= WARN_AT else "ok"

    def describe(self) -> str:
        """`used 1.9 GiB of 2.0 GiB (96%)`, or `used 1.2 GiB, no limit`."""
        if self.ratio is None:
            return f"used {human_bytes(self.used_bytes)}, no limit"
        return f"used {human_bytes(self.used_bytes)} of {human_bytes(self.max_bytes)} ({self.ratio:.0%})"

    def warning(self) -> str | None:
        """What an operator should read now, or None when all is well."""
        level = self.level
        if level == "full":
            return (
                f"Redis is at {self.ratio:.0%} of its memory limit ({self.describe()}): new tasks are "
                f"refused from {REFUSE_AT:.0%}; {REMEDY}"
            )
        if level == "warn":
            return (
                f"Redis is at {self.ratio:.0%} of its memory limit ({self.describe()}); new tasks will be "
                f"refused from {REFUSE_AT:.0%}: {REMEDY}"
            )
        if level == "unbounded":
            return "Redis has no maxmemory: it can grow until the machine runs out; set one"
        if self.policy != NOEVICTION:
            return evicting(self.policy)
        return None

    def to_dict(self) -> dict[str, Any]:
        ratio = self.ratio
        return {
            "used_bytes": self.used_bytes,
            "max_bytes": self.max_bytes,
            "ratio": None if ratio is None else round(ratio, 4),
            "policy": self.policy,
            "level": self.level,
            "warn_at": WARN_AT,
            "refuse_at": REFUSE_AT,
            "warning": self.warning(),
        }


def evicting(policy: str) -> str:
    return (
        f"Redis evicts keys at its limit (maxmemory-policy {policy}): queued tasks and results can vanish; "
        f"set maxmemory-policy {NOEVICTION}"
    )


def parse_info(info: dict[str, Any], now_ms: int | None = None) -> MemoryState:
    """A MemoryState from the fields of INFO memory."""
    return MemoryState(
        used_bytes=int(info.get("used_memory") or 0),
        max_bytes=int(info.get("maxmemory") or 0),
        policy=str(info.get("maxmemory_policy") or NOEVICTION),
        read_at_ms=time.time_ns() // 1_000_000 if now_ms is None else now_ms,
    )


async def read_memory(redis: aioredis.Redis) -> MemoryState:
    """INFO memory now (one round trip; use a MemoryWatch where requests call it)."""
    if is_cluster(redis):
        # Each master has its own limit: the fullest one is the one that refuses writes first.
        per_node: Any = await cast(Any, redis).info("memory", target_nodes=RedisCluster.PRIMARIES)
        states = [parse_info(info) for info in per_node.values()]
        return max(states, key=lambda s: (s.ratio or 0.0, s.used_bytes))
    info: dict[str, Any] = await redis.info("memory")
    return parse_info(info)


def full_error(state: MemoryState | None) -> RedisMemoryFullError:
    """The error a submission gets when Redis is (nearly) out of memory."""
    if state is not None and state.ratio is not None:
        head = f"Redis is at {state.ratio:.0%} of its memory limit ({state.describe()})"
    else:
        head = "Redis refused the task: it is at its memory limit (OOM)"
    return RedisMemoryFullError(
        f"{head}; {REMEDY}",
        hint=f"tasks already accepted still finish; new ones are taken again below {REFUSE_AT:.0%}",
        extra={"memory": state.to_dict() if state is not None else None},
    )


class MemoryWatch:
    """INFO memory of one Redis, read at most every `every_s` however many callers ask."""

    def __init__(self, redis: aioredis.Redis, every_s: float = READ_EVERY_S) -> None:
        self.redis = redis
        self.every_s = every_s
        self._state: MemoryState | None = None
        self._read_at = 0.0
        self._lock = asyncio.Lock()

    async def state(self) -> MemoryState:
        if self._state is not None and time.monotonic() - self._read_at < self.every_s:
            return self._state
        async with self._lock:
            # Whoever waited on the lock finds the reading its predecessor just made.
            if self._state is None or time.monotonic() - self._read_at >= self.every_s:
                self._state = await read_memory(self.redis)
                self._read_at = time.monotonic()
            return self._state

    def forget(self) -> None:
        """Read again on the next call (after Redis refused a write: the cached reading was old)."""
        self._read_at = 0.0

    async def admit(self) -> None:
        """Raise RedisMemoryFullError when Redis is past the high-water mark for new work."""
        state = await self.state()
        if state.level == "full":
            raise full_error(state)


class ArchiveInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What `Keys.archive` says of the archive (replay/archive.py writes it), for status surfaces."""

    ran: bool
    last_id: str = ""
    segments: int = 0
    events: int = 0
    bytes: int = 0
    ran_at: int | None = None
    error: str = ""
    dir: str = ""

    def describe(self) -> str:
        if not self.ran:
            return "never run"
        text = f"{self.events} events in {self.segments} segments ({human_bytes(self.bytes)})"
        return f"{text}; last run failed: {self.error}" if self.error else text

    def to_dict(self) -> dict[str, Any]:
        return {**msgspec.to_builtins(self), "summary": self.describe()}


def _int(raw: str | None) -> int:
    try:
        return int(raw or 0)
    except ValueError:
        return 0


async def archive_info(redis: aioredis.Redis, keys: Keys) -> ArchiveInfo:
    """The archive's state; `ran` is False while the hash is absent (the archiver never ran)."""
    raw: dict[Any, Any] = await redis.hgetall(keys.archive)
    fields = {as_str(k): as_str(v) for k, v in raw.items()}
    if "ran_at" not in fields:
        return ArchiveInfo(ran=False)
    return ArchiveInfo(
        ran=True,
        last_id=fields.get("last_id", ""),
        segments=_int(fields.get("segments")),
        events=_int(fields.get("events")),
        bytes=_int(fields.get("bytes")),
        ran_at=_int(fields.get("ran_at")) or None,
        error=fields.get("error", ""),
        dir=fields.get("dir", ""),
    )
