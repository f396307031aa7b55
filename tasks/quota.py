"""API keys with limits, and the limiter that holds each key to them in Redis.

A key is named (its name, never the key, is what the ledger, the statistics and the logs show) and
may carry limits: requests per minute, tokens per day, tasks queued at once, the highest priority
it may ask for. Every check and every count is one Lua script on the key's own Redis keys (one
hash tag per key name), so that any number of API processes hold a key to the same limits.

The rate is a GCRA (one timestamp per key: `rpm` requests may come at once, then one every
60/rpm s). A key's open tasks are a sorted set of task ids (admitted, not yet settled), so that a
re-sent admission or settlement counts once. Tokens are charged once per task (Quotas.settle),
whoever settles it first: the live projector when it folds the task's completion (or a cancelled
run's partial counts) from the ledger, whether or not anybody collects the result, and the API when
it hands the outcome to a client. A set of the tasks charged in the last two days makes the charge
happen once, independent of the open set. An open task nobody settles (the API process died and no
completion came) is dropped from the open set once it is older than the longest a task may wait
(max_queue_s) plus the longest a client waits for it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from events.codec import as_str
from events.connection import is_cluster
from events.keys import Keys
from events.scripts import read_lua
from tasks.errors import QuotaExceededError

# Settled tasks of one key in a row put its next one in a later fair-share round.
FAIR_QUANTUM: Final = 4
# Rounds a model's queue is split in per priority band (the last takes every task beyond).
FAIR_ROUNDS: Final = 3
# Limit names, as the 429's body and the statistics spell them.
RPM: Final = "rpm"
TOKENS_PER_DAY: Final = "tokens_per_day"
MAX_QUEUED: Final = "max_queued"
LIMITS: Final = (RPM, TOKENS_PER_DAY, MAX_QUEUED)
_DAY_MS: Final = 86_400_000
# How long a charged task is remembered (so that it is never charged twice): longer than the
# projector's charge horizon (projections/projector.py CHARGE_HORIZON_MS) and than a task may live.
CHARGED_TTL_MS: Final = 2 * _DAY_MS


class ApiKey(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One API key and its limits (None: unlimited)."""

    name: str
    key: str
    rpm: int | None = None
    tokens_per_day: int | None = None
    max_queued: int | None = None
    # Higher priorities asked with this key are lowered to this one (not refused).
    max_priority: int | None = None
    # May pull and delete models on the fleet's machines (api/pulls.py): plain `api_keys` may.
    manage_models: bool = False


def named_keys(plain: Sequence[str], tables: Sequence[ApiKey]) -> list[ApiKey]:
    """Every configured key: the plain ones (`api_keys`, named key-1, key-2… in order, no limits)
    and the named ones (`[[keys]]`). Raises ValueError on a repeated name or key."""
    out = [ApiKey(name=f"key-{i}", key=k, manage_models=True) for i, k in enumerate(plain, 1)] + list(tables)
    names = [k.name for k in out]
    if len(set(names)) != len(names):
        raise ValueError(
            f"API key names must differ; repeated: {sorted({n for n in names if names.count(n) > 1})}"
        )
    if len({k.key for k in out}) != len(out):
        raise ValueError("two API keys have the same key")
    for k in out:
        if not k.key or not k.name:
            raise ValueError(f"API key {k.name!r} needs a non-empty name and key")
        for limit in (k.rpm, k.tokens_per_day, k.max_queued):
            if limit is not None and limit < 1:
                raise ValueError(f"API key {k.name!r}: limits must be at least 1 (omit one for no limit)")
    return out


def band_of(priority: int, key: ApiKey | None) -> int:
    """The priority a task is queued with: the key's ceiling caps it (clamped, not refused)."""
    if key is not None and key.max_priority is not None:
        return min(priority, key.max_priority)
    return priority


def round_of(open_tasks: int) -> int:
    """The fair-share round of a key's next task, from how many of its tasks are open: the first
    FAIR_QUANTUM go in round 0, the next in round 1, and so on up to the last round."""
    return min(FAIR_ROUNDS - 1, open_tasks // FAIR_QUANTUM)


# The Lua this module runs (tasks/lua/quota_*.lua), each file headed by the KEYS and ARGV it takes.
_LUA: Final = Path(__file__).parent / "lua"
_ADMIT: Final = read_lua(_LUA / "quota_admit.lua")

_SETTLE: Final = read_lua(_LUA / "quota_settle.lua")


class Admitted(msgspec.Struct, frozen=True):
    """A request a key's limits let through: its priority (capped) and fair-share round."""

    priority: int
    round: int


class Usage(msgspec.Struct, kw_only=True):
    """What one key has used: requests admitted, tokens today and in all, tasks open, refusals."""

    name: str
    requests: int = 0
    tokens_today: int = 0
    tokens_total: int = 0
    queued: int = 0
    refused: int = 0
    refused_by: dict[str, int] = msgspec.field(default_factory=dict)
    limits: dict[str, int | None] = msgspec.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


class Quotas:
    """The limiter: admits, settles and reports each key's use, in Redis."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, open_ttl_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.open_ttl_ms = int(open_ttl_s * 1000)
        self._admit = redis.register_script(_ADMIT)
        self._settle = redis.register_script(_SETTLE)

    async def admit(self, key: ApiKey, task_id: str, priority: int, *, child: bool = False) -> Admitted:
        """Count one request of `key` for `task_id`, or raise QuotaExceededError naming the limit
        and when to retry. A pipeline's `child` is held to tokens_per_day and max_queued, not rpm."""
        reply: Any = await self._admit(
            keys=[self.keys.quota(key.name), self.keys.quota_open(key.name)],
            args=[
                task_id,
                key.rpm or 0,
                key.tokens_per_day or 0,
                key.max_queued or 0,
                self.open_ttl_ms,
                1 if child else 0,
            ],
        )
        refused, wait_ms, open_tasks, limit = reply
        if int(refused):
            name = as_str(limit)
            value = {RPM: key.rpm, TOKENS_PER_DAY: key.tokens_per_day, MAX_QUEUED: key.max_queued}[name]
            retry_s = max(1, math.ceil(int(wait_ms) / 1000))
            raise QuotaExceededError(
                f"API key {key.name!r} is over its limit {name}={value}",
                hint=_HINTS[name],
                limit=name,
                retry_after_s=retry_s,
            )
        return Admitted(priority=band_of(priority, key), round=round_of(int(open_tasks)))

    async def settle(self, name: str, task_id: str, tokens: int) -> bool:
        """Close the key's task `task_id`, charging `tokens` to it once (a settlement with no tokens
        only gives back its open place); True when this call charged it or gave back its place."""
        reply: Any = await self._settle(
            keys=[self.keys.quota(name), self.keys.quota_open(name), self.keys.quota_charged(name)],
            args=[task_id, max(0, tokens), CHARGED_TTL_MS],
        )
        return bool(reply)

    async def settle_all(self, charges: Sequence[tuple[str, str, int]]) -> None:
        """`settle` each (key name, task id, tokens), in one round trip; on a cluster, each in a call of
        its own, all at once (a cluster pipeline refuses a script sent by its hash, EVALSHA)."""
        if not charges:
            return
        if is_cluster(self.redis):
            await asyncio.gather(*(self.settle(name, task_id, tokens) for name, task_id, tokens in charges))
            return
        pipe = self.redis.pipeline(transaction=False)
        for name, task_id, tokens in charges:
            await self._settle(
                keys=[self.keys.quota(name), self.keys.quota_open(name), self.keys.quota_charged(name)],
                args=[task_id, max(0, tokens), CHARGED_TTL_MS],
                client=pipe,
            )
        await pipe.execute()

    async def usage(self, configured: Sequence[ApiKey]) -> list[Usage]:
        """Each configured key's use (one pipeline for all of them)."""
        pipe = self.redis.pipeline(transaction=False)
        for key in configured:
            pipe.hgetall(self.keys.quota(key.name))
            pipe.zcard(self.keys.quota_open(key.name))
        replies: list[Any] = await pipe.execute()
        out = []
        for i, key in enumerate(configured):
            raw: Mapping[Any, Any] = replies[2 * i] or {}
            h = {as_str(k): as_str(v) for k, v in raw.items()}
            today = int(h.get("day", -1)) == int(time.time() * 1000) // _DAY_MS
            out.append(
                Usage(
                    name=key.name,
                    requests=int(h.get("requests", 0)),
                    tokens_today=int(h.get("tokens", 0)) if today else 0,
                    tokens_total=int(h.get("tokens_total", 0)),
                    queued=int(replies[2 * i + 1]),
                    refused=int(h.get("refused", 0)),
                    refused_by={lim: int(h.get(f"refused:{lim}", 0)) for lim in LIMITS},
                    limits={
                        RPM: key.rpm,
                        TOKENS_PER_DAY: key.tokens_per_day,
                        MAX_QUEUED: key.max_queued,
                        "max_priority": key.max_priority,
                    },
                )
            )
        return out


_HINTS: Final = {
    RPM: "wait for the time Retry-After says, or ask for a higher rpm for this key",
    TOKENS_PER_DAY: "the day's token budget is spent; it renews at 00:00 UTC (Retry-After)",
    MAX_QUEUED: "wait for some of this key's tasks to finish before sending more",
}
