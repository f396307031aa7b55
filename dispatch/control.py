"""Operators' requests to one worker about its machine's models: pull one, or delete one.

The story's fix was a step no router takes: the model was copied onto the fast machine. Each worker
sits beside its own server (often listening on loopback only), so the API cannot reach that server:
it appends a `ControlRequest` to the worker's control stream (`Keys.control`, capped), which only
that worker reads (workers/control.py). The worker carries it out against its backend and writes
each progress line the backend sends, then one closing entry, to its own output stream under the
request's id (`Keys.run_out`: the only keys a worker's ACL lets it write); the API follows that
stream (`follow`). What the machine then holds reaches the lease and the ledger as any inventory
change does (the worker reads its backend's list again at once).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Final, Literal

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from dispatch.errors import DispatchError
from events.keys import Keys

# Requests kept in a worker's control stream (older ones were answered or abandoned long ago).
CONTROL_MAX_ENTRIES: Final = 100
# How long a request's progress stays readable after its last line.
PROGRESS_TTL_MS: Final = 600_000
# How long the API waits for a worker to take a request up (it reads its stream every few seconds
# at most), and for the next line once it has: verifying a large download may print nothing for
# minutes, and Ollama prints at least every few seconds while it downloads.
FIRST_LINE_S: Final = 15.0
NEXT_LINE_S: Final = 600.0
_BLOCK_MS: Final = 2_000
# How long to wait before reading again after Redis failed.
_RETRY_S: Final = 0.5

Op = Literal["pull", "delete"]
Failure = Literal["unsupported", "not_found", "refused", "backend", "expired"]


class ControlRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One operator's request to one worker. When it was asked is its entry's id (Redis's clock):
    the worker skips one older than FIRST_LINE_S, whose caller was answered that it timed out, and
    one whose id it has seen (an append the API retried after a lost reply)."""

    op: Op
    id: str
    model: str
    # Ollama's `insecure`: pull from a registry without TLS.
    insecure: bool = False


class Progress(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One entry of a request's progress: a line the backend sent (Ollama's own shape), or the end.
    `failure` says why it failed: `unsupported` (this machine's server cannot do it), `not_found`
    (its server does not know the model), `refused` (its server refused the request), `backend`
    (its server could not be reached or broke off, or the worker stopped) or `expired` (the worker
    took it up after its caller had been told it timed out)."""

    line: dict[str, Any] | None = None
    end: bool = False
    error: str | None = None
    failure: Failure | None = None


class ControlTimeoutError(DispatchError):
    """Raised when a worker did not take up an operator's request, or went silent while doing it."""


_request_enc: Final = msgspec.msgpack.Encoder()
_request_dec: Final = msgspec.msgpack.Decoder(ControlRequest)
_progress_dec: Final = msgspec.msgpack.Decoder(Progress)


def new_id() -> str:
    return "ctl-" + secrets.token_hex(8)


async def send(redis: aioredis.Redis, keys: Keys, worker: str, request: ControlRequest) -> None:
    """Append `request` to `worker`'s control stream."""
    await redis.xadd(
        keys.control(worker),
        {"m": _request_enc.encode(request)},
        maxlen=CONTROL_MAX_ENTRIES,
        approximate=True,
    )


async def cursor(redis: aioredis.Redis, keys: Keys, worker: str) -> str:
    """The id of the last request in `worker`'s stream: a worker starting reads only what comes after
    (what came before was for an earlier life, whose caller has given up)."""
    last: Any = await redis.xrevrange(keys.control(worker), count=1)
    if not last:
        return "0-0"
    entry_id = last[0][0]
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def asked_ms(entry_id: str) -> int:
    """When a request was appended, on Redis's clock (its entry id's first part)."""
    return int(entry_id.partition("-")[0])


async def requests(
    redis: aioredis.Redis, keys: Keys, worker: str, after: str, block_ms: int = _BLOCK_MS
) -> list[tuple[str, ControlRequest | None]]:
    """The requests appended after `after` (waiting up to `block_ms`), by entry id; None for an
    entry that is not a request (nothing but the API appends here, so that is a bug to log)."""
    raw: Any = await redis.xread({keys.control(worker): after}, block=block_ms, count=16)
    out: list[tuple[str, ControlRequest | None]] = []
    for _stream, entries in raw or []:
        for entry_id, fields in entries:
            eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            body = fields.get(b"m", fields.get("m"))
            try:
                out.append((eid, _request_dec.decode(body)))
            except (msgspec.DecodeError, TypeError):
                out.append((eid, None))
    return out


async def report(redis: aioredis.Redis, keys: Keys, worker: str, request_id: str, progress: Progress) -> None:
    """Append one entry of a request's progress (the worker's own output stream for that id)."""
    key = keys.run_out(worker, request_id)
    # One MULTI: the entry never outlives its expiry (one key, so one slot on a cluster).
    async with redis.pipeline(transaction=True) as pipe:
        pipe.xadd(key, {"p": msgspec.msgpack.encode(progress)})
        pipe.pexpire(key, PROGRESS_TTL_MS)
        await pipe.execute()


async def follow(
    redis: aioredis.Redis,
    keys: Keys,
    worker: str,
    request_id: str,
    *,
    first_line_s: float = FIRST_LINE_S,
    next_line_s: float = NEXT_LINE_S,
) -> AsyncIterator[Progress]:
    """Each entry of a request's progress, as the worker writes it, through its end (the first is
    the worker's acknowledgement, with no line). ControlTimeoutError when the worker did not take it
    up in time, went silent, or lost its lease (it stopped, or its machine did) before the end."""
    key = keys.run_out(worker, request_id)
    after = "0-0"
    started = False
    limit_s = first_line_s
    deadline = time.monotonic() + limit_s
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            what = "went silent while doing it" if started else "did not take it up"
            raise ControlTimeoutError(
                f"worker {worker!r} {what} within {limit_s:g} s",
                hint="check that worker's log; a worker older than this API cannot pull or delete",
            )
        try:
            raw: Any = await redis.xread({key: after}, block=min(_BLOCK_MS, left_ms))
            if not raw and started and not await redis.exists(keys.live(worker)):
                raise ControlTimeoutError(
                    f"worker {worker!r} went offline before it finished",
                    hint="its machine may hold part of the model; ask again once it is back",
                )
        except (RedisError, OSError, TimeoutError):
            # A read is safe to repeat: Redis may be back before the deadline.
            await asyncio.sleep(_RETRY_S)
            continue
        if not raw:
            continue
        started = True
        limit_s = next_line_s
        deadline = time.monotonic() + limit_s
        for _stream, entries in raw:
            for entry_id, fields in entries:
                after = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                body = fields.get(b"p", fields.get("p"))
                try:
                    progress = _progress_dec.decode(body)
                except (msgspec.DecodeError, TypeError):
                    continue
                yield progress
                if progress.end:
                    return
