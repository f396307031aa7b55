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
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from events.codec import as_str
from events.connection import is_cluster
from events.keys import Keys
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


# Admit one request for a key, or say which limit refuses it. KEYS[1] the key's usage hash, KEYS[2]
# its open tasks (zset task id -> admitted at ms); ARGV task id, rpm, tokens per day, max queued
# (0 = no limit), how long an unsettled task stays open (ms), 1 for a pipeline's child (held to
# tokens per day and max queued, not to rpm: the pipeline's own request paid the rate). Returns
# {0, 0, open tasks before this one, ''} when admitted (a re-sent admission of the same task is
# admitted again, counted once); {1, retry after ms, 0, limit} when refused.
_ADMIT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local day = math.floor(now / 86400000)
if tonumber(redis.call('HGET', KEYS[1], 'day') or '-1') ~= day then
  redis.call('HSET', KEYS[1], 'day', day, 'tokens', 0)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[5]))
local open = redis.call('ZCARD', KEYS[2])
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return {0, 0, open - 1, ''} end
local function refuse(limit, wait)
  redis.call('HINCRBY', KEYS[1], 'refused', 1)
  redis.call('HINCRBY', KEYS[1], 'refused:' .. limit, 1)
  return {1, math.max(1, math.ceil(wait)), 0, limit}
end
local rpm, tpd, maxq = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if tpd > 0 and tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0') >= tpd then
  return refuse('tokens_per_day', (day + 1) * 86400000 - now)
end
if maxq > 0 and open >= maxq then return refuse('max_queued', 1000) end
if rpm > 0 and ARGV[6] ~= '1' then
  local interval = 60000 / rpm
  local tat = math.max(tonumber(redis.call('HGET', KEYS[1], 'tat') or '0'), now)
  local early = tat + interval - 60000 - now
  if early > 0 then return refuse('rpm', early) end
  redis.call('HSET', KEYS[1], 'tat', string.format('%.3f', tat + interval))
end
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('HINCRBY', KEYS[1], 'requests', 1)
return {0, 0, open, ''}
"""

# Settle a key's task: drop it from the open set and charge its tokens to today's count once per
# task, whoever settles it and whenever (the charged set remembers each task charged for longer
# than any completion can come late, independent of the open set, whose tasks expire). A settlement
# with no tokens only gives back the task's open place, so that a later one with its tokens (the
# projector's, from the ledger) still charges it. KEYS[1] the usage hash, KEYS[2] its open tasks,
# KEYS[3] its charged tasks (zset task id -> charged at ms); ARGV task id, tokens, how long a
# charged task is remembered (ms). Returns 1 when this call charged it or gave back its place.
_SETTLE: Final = """
local was_open = redis.call('ZREM', KEYS[2], ARGV[1])
local tokens = tonumber(ARGV[2])
if tokens <= 0 then return was_open end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[3]))
if redis.call('ZADD', KEYS[3], 'NX', now, ARGV[1]) == 0 then return was_open end
redis.call('PEXPIRE', KEYS[3], ARGV[3])
local day = math.floor(now / 86400000)
if tonumber(redis.call('HGET', KEYS[1], 'day') or '-1') ~= day then
  redis.call('HSET', KEYS[1], 'day', day, 'tokens', 0)
end
redis.call('HINCRBY', KEYS[1], 'tokens', tokens)
redis.call('HINCRBY', KEYS[1], 'tokens_total', tokens)
return 1
"""


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
