"""Worker leases (`rl:live:{worker}`): what a live worker holds, serves, has loaded and runs.

A worker's lease is a key with a TTL that its heartbeats refresh; its value says what the worker
holds right now, so that a submission can resolve a model name without waiting for a projection,
and what it could read of its machine (resources are liveness, not history: never in the ledger).
A missing key means the worker is presumed dead: that, and only that, lets the reaper reclaim.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from events.event import ModelEntry, Resources, now_ms
from events.keys import Keys


class RunningInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A task a worker is running, as its lease reports it (the plan counts what each slot runs)."""

    task_id: str
    digest: str
    started_at: int
    domain: str = "general"
    prompt_tokens: int | None = None
    max_tokens: int | None = None


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


_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(LeaseInfo)


def resources_of(info: LeaseInfo) -> dict[str, Any]:
    """Every resource metric the lease reports, None where the worker could not read it."""
    return msgspec.structs.asdict(info.resources)


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
