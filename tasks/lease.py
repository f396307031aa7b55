"""Worker leases (`rl:live:{worker}`): what a live worker holds, serves, has loaded and runs.

A worker's lease is a key with a TTL that its heartbeats refresh; its value says what the worker
holds right now, so that a submission can resolve a model name without waiting for a projection,
and what it could read of its machine (resources are liveness, not history: never in the ledger).
A missing key means the worker is presumed dead: that, and only that, lets the reaper reclaim.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from events.event import ModelEntry, Resources, now_ms
from events.keys import Keys
from events.scripts import ScriptDef, read_lua
from tasks.prefix import SlotCache


class RunningInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A task a worker is running, as its lease reports it (the plan counts what each slot runs)."""

    task_id: str
    digest: str
    started_at: int
    domain: str = "general"
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    # Its backend has answered (the slot is free; the run still writes what it made): the plan
    # leaves it out, while the fleet's overview and the reaper still see it.
    answered: bool = False
    # A benchmark or grading answer, which the worker gives up for user work (workers.agent): the
    # plan counts its slot as free.
    background: bool = False


class LoadedModel(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A model loaded in a worker's backend, as the backend reports it (Ollama's /api/ps); None:
    it does not say."""

    name: str
    digest: str
    # Bytes it takes in memory, and how many of them are in GPU memory.
    size: int | None = None
    size_vram: int | None = None
    # When the backend will unload it if it stays idle (RFC 3339, as the backend wrote it).
    expires_at: str | None = None
    context_length: int | None = None


class LeaseInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The value of a worker's lease key (which of its models it serves: dispatch.serving.served)."""

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
    # What the worker could read of its machine at `renewed_at` (for operators; no score reads it).
    resources: Resources = Resources()
    # False: its backend cannot say what is loaded, and `loaded` means nothing (not "none loaded").
    loaded_known: bool = True
    # How many of the models it serves fit in its memory at once (1: loading one evicts another);
    # None: unknown (sizes or memory not reported).
    max_loaded: int | None = None
    # `loaded` as its backend reports each one (sizes, expiry), for the Ollama surface's /api/ps.
    loaded_models: list[LoadedModel] = msgspec.field(default_factory=list)
    # What its backend's slots hold of earlier prompts, as far as it can tell (workers.slots).
    cache: list[SlotCache] = msgspec.field(default_factory=list)
    # The worker's clock minus the ledger's (Redis TIME), in ms, as the worker last measured it
    # (events.clock.LedgerClock); None: not measured. `since`, `renewed_at` and each running task's
    # `started_at` are the worker's clock: `on_ledger` reads them on the ledger's.
    ledger_offset_ms: int | None = None
    # How long the lease holds without a renewal (the worker's setting): the reaper judges the
    # worker's running entries by it, not by its own; None: a worker from before this field.
    lease_ms: int | None = None
    # Its backend's kind (`ollama`, `openai`): which workers' servers can pull a model (dispatch.control).
    backend_kind: str | None = None
    # The models it was told to serve (`--models`), held or not; None: every model it holds.
    # `serves` is what it serves now; this says whether a model it is given would be served.
    serves_named: list[str] | None = None

    def on_ledger(self, worker_ms: int) -> int:
        """A time this lease gives (the worker's clock), on the ledger's clock: what an age or an
        order across workers must use, so that a worker whose clock is off misleads no reader."""
        return worker_ms - (self.ledger_offset_ms or 0)


# The Lua this module runs (tasks/lua/*.lua), each file headed by the KEYS and ARGV it takes.
_LUA: Final = Path(__file__).parent / "lua"

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(LeaseInfo)


def resources_of(info: LeaseInfo) -> dict[str, Any]:
    """Every resource metric the lease reports, None where the worker could not read it."""
    return msgspec.structs.asdict(info.resources)


def encode_lease(info: LeaseInfo) -> bytes:
    return _encoder.encode(info)


def decode_lease(data: bytes) -> LeaseInfo:
    return _decoder.decode(data)


_LEASE: Final = read_lua(_LUA / "lease.lua")
_PRUNE: Final = read_lua(_LUA / "prune_workers.lua")
_RELEASE: Final = read_lua(_LUA / "release_lease.lua")
# The scripts above as functions of the routeledger library (events/scripts.py), which a worker
# calls with FCALL; allow_oom for those that free or keep entries (they ran at the memory limit).
_LEASE_DEF: Final = ScriptDef("lease", _LEASE)
_RELEASE_DEF: Final = ScriptDef("release_lease", _RELEASE, allow_oom=True)
_PRUNE_DEF: Final = ScriptDef("prune_workers", _PRUNE, allow_oom=True)


class LeaseTaken(msgspec.Struct, frozen=True):
    """What a take or renewal of a lease did."""

    ok: bool
    # ok: there was no lease before (first take, or it had lapsed); not ok: always False.
    lapsed: bool = False
    # not ok: the token of the process that holds the lease.
    holder: str = ""


class Leases:
    """Writes of worker leases: a token compare-and-set in one script, with the live registry."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._lease = _LEASE_DEF.bind(redis)
        self._release = _RELEASE_DEF.bind(redis)
        self._prune = _PRUNE_DEF.bind(redis)

    async def put(self, info: LeaseInfo, ttl_ms: int) -> LeaseTaken:
        """Write `info` as `info.worker`'s lease unless another process (token) holds it."""
        return self.taken(await self._lease(**self._call(info, ttl_ms)))

    def put_command(self, info: LeaseInfo, ttl_ms: int) -> tuple[Any, ...] | None:
        """The same write as one command to send with others (Script.command); None when it must
        be queued on a pipeline (put_in)."""
        return self._lease.command(**self._call(info, ttl_ms))

    async def put_in(self, pipe: Pipeline, info: LeaseInfo, ttl_ms: int) -> None:
        """The same write, queued on `pipe` (its reply, read with `taken`, says what it did)."""
        await self._lease(**self._call(info, ttl_ms), client=pipe)

    def _call(self, info: LeaseInfo, ttl_ms: int) -> dict[str, Any]:
        return {
            "keys": [self.keys.live(info.worker), self.keys.workers],
            "args": [info.token, encode_lease(info), str(ttl_ms), info.worker],
        }

    @staticmethod
    def taken(reply: Any) -> LeaseTaken:
        """What a lease write did, from its reply."""
        ok, detail = reply
        if int(ok) == 1:
            return LeaseTaken(ok=True, lapsed=int(detail) == 1)
        return LeaseTaken(ok=False, holder=detail.decode() if isinstance(detail, bytes) else str(detail))

    async def prune(self, gone: list[str]) -> int:
        """Drop `gone` (workers seen without a lease) from the registry, each if its lease is still
        gone; how many were dropped."""
        if not gone:
            return 0
        keys = [self.keys.workers, *(self.keys.live(n) for n in gone)]
        return int(await self._prune(keys=keys, args=gone))

    async def release(self, worker: str, token: str) -> bool:
        """Delete `worker`'s lease if `token` still holds it; True if released."""
        reply: Any = await self._release(
            keys=[self.keys.live(worker), self.keys.workers], args=[token, worker]
        )
        return bool(reply)


async def registered(redis: aioredis.Redis, keys: Keys) -> list[str]:
    """The registry's worker names (live ones, and dead ones the reaper has not pruned yet)."""
    raw: Any = await redis.smembers(keys.workers)
    return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in raw)


async def live_workers(redis: aioredis.Redis, keys: Keys) -> dict[str, LeaseInfo]:
    """Every worker whose lease is alive now, with what it holds: the registry's names, then one
    MGET of their leases (a name whose lease is gone is dead; the reaper prunes it). No SCAN."""
    names = await registered(redis, keys)
    if not names:
        return {}
    values: list[Any] = await redis.mget([keys.live(n) for n in names])
    out: dict[str, LeaseInfo] = {}
    for raw in values:
        if raw is None:
            continue  # lapsed; pruned by the reaper
        try:
            info = decode_lease(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        out[info.worker] = info
    return out
