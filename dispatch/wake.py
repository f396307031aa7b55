"""Sleeping machines: their records, the magic packet that wakes one, and the one way a wake is sent.

A worker started with `--wake-mac` keeps a record (`Keys.sleeper`) saying how its machine is woken
(the MAC, the broadcast address and UDP port of the magic packet), what it serves (slots, digests,
model names) and how long a wake takes as configured (`--wake-s`). The record outlives the worker's
lease: while the lease is absent the machine is asleep (or off), and the record is what the waker
(workers/waker.py) and `routeledger wake` read. An operator can write one too (`routeledger wake
NAME --mac ...`) for a machine whose worker never ran with the flag.

A wake is sent at most once per machine per window: `SET NX PX` of `Keys.woken` is the lock, taken
before the packet goes, so that two wakers (or a waker and an operator) never both send one.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from dispatch.errors import WakeError
from dispatch.serving import served
from events.event import MAX_SECONDS, WakeRequested, now_ms
from events.keys import Keys
from events.ledger import Ledger
from projections.snapshot import FleetRow
from router.choose import RouteQuery
from router.estimate import Estimator
from router.plan import FleetView
from router.wake import Sleeper, sleeping_candidate
from tasks.lease import LeaseInfo

# The magic packet's standard port (discard); 7 is the other one in use.
DEFAULT_PORT: Final = 9
DEFAULT_BROADCAST: Final = "255.255.255.255"
# What a machine is expected to take from the packet to a serving worker when nobody said.
DEFAULT_WAKE_S: Final = 90.0
# A machine not online within this multiple of its wake time (and at least MIN_BOUND_S) failed to wake.
BOUND_FACTOR: Final = 3.0
MIN_BOUND_S: Final = 30.0
# How long one packet stands for a machine: no second is sent to it within this window.
DEFAULT_WINDOW_S: Final = 60.0

_MAC: Final = re.compile(r"[0-9A-Fa-f]{2}([:-]?)[0-9A-Fa-f]{2}(\1[0-9A-Fa-f]{2}){4}")


# Where a wake time comes from.
MEASURED: Final = "measured: wake request to WorkerOnline, from the ledger"
CONFIGURED: Final = "configured (--wake-s)"


class WakeTime(msgspec.Struct, kw_only=True, frozen=True):
    """Seconds from a magic packet to the machine's worker online, where the figure comes from, and
    the age of the measure (None: configured)."""

    seconds: float
    source: str
    age_s: float | None = None


class SleepRecord(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """How to wake a machine and what it serves once awake (the value of `Keys.sleeper`)."""

    worker: str
    mac: str
    broadcast: str = DEFAULT_BROADCAST
    port: int = DEFAULT_PORT
    wake_s: float = DEFAULT_WAKE_S
    slots: int = 1
    # Digests and names of the models its worker serves, as its lease last said.
    holds: list[str] = msgspec.field(default_factory=list)
    models: list[str] = msgspec.field(default_factory=list)
    updated_at: int = msgspec.field(default_factory=now_ms)

    def wake_time(self, row: FleetRow | None = None, now_ms: int | None = None) -> WakeTime:
        """How long a wake takes: the last one the ledger measured (`row`, the machine's projected
        fleet row: WakeRequested to the WorkerOnline that followed), else the configured one."""
        if row is not None and isinstance(row.wake_s.value, int | float) and row.wake_s.at is not None:
            age = None if now_ms is None else max(0.0, (now_ms - row.wake_s.at) / 1000.0)
            return WakeTime(seconds=float(row.wake_s.value), source=MEASURED, age_s=age)
        return WakeTime(seconds=self.wake_s, source=CONFIGURED)

    def bound_s(self, wake_s: float | None = None, min_s: float = MIN_BOUND_S) -> float:
        """Seconds after the packet by which its worker must be online (for a wake of `wake_s`,
        default the configured one), or the wake failed."""
        return max(min_s, BOUND_FACTOR * (self.wake_s if wake_s is None else wake_s))


_encoder: Final = msgspec.json.Encoder()
_decoder: Final = msgspec.json.Decoder(SleepRecord)


def normalize_mac(mac: str) -> str:
    """`mac` as six upper-case pairs joined by colons; WakeError if it is not a MAC address."""
    text = mac.strip()
    if not _MAC.fullmatch(text):
        raise WakeError(f"{mac!r} is not a MAC address (six hex pairs, e.g. AA:BB:CC:DD:EE:FF)")
    digits = re.sub(r"[:-]", "", text).upper()
    return ":".join(digits[i : i + 2] for i in range(0, 12, 2))


def magic_packet(mac: str) -> bytes:
    """The wake-on-LAN magic packet for `mac`: six 0xFF bytes, then the MAC's six bytes 16 times."""
    raw = bytes.fromhex(normalize_mac(mac).replace(":", ""))
    return b"\xff" * 6 + raw * 16


def send_magic_packet(mac: str, broadcast: str = DEFAULT_BROADCAST, port: int = DEFAULT_PORT) -> None:
    """Send the magic packet for `mac` as one UDP datagram to `broadcast`:`port` (SO_BROADCAST set,
    so that a broadcast address is allowed)."""
    payload = magic_packet(mac)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            sock.sendto(payload, (broadcast, port))
    except OSError as exc:
        raise WakeError(
            f"cannot send the magic packet to {broadcast}:{port}: {exc.strerror or exc}"
        ) from None


def record_from_lease(info: LeaseInfo, mac: str, *, broadcast: str, port: int, wake_s: float) -> SleepRecord:
    """A worker's record as its lease shows it now."""
    models = served(info)
    return SleepRecord(
        worker=info.worker,
        mac=normalize_mac(mac),
        broadcast=broadcast,
        port=port,
        wake_s=wake_s,
        slots=info.slots,
        holds=sorted({m.digest for m in models}),
        models=sorted({m.name for m in models}),
    )


async def write_record(redis: aioredis.Redis, keys: Keys, record: SleepRecord) -> None:
    """Store `record` (no expiry: it describes the machine while it sleeps) and list it."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(keys.sleeper(record.worker), _encoder.encode(record))
        pipe.sadd(keys.sleepers, record.worker)
        await pipe.execute()


async def read_record(redis: aioredis.Redis, keys: Keys, worker: str) -> SleepRecord | None:
    """`worker`'s record, or None (none, or unreadable)."""
    raw: Any = await redis.get(keys.sleeper(worker))
    if raw is None:
        return None
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


async def read_records(redis: aioredis.Redis, keys: Keys) -> dict[str, SleepRecord]:
    """Every record listed in `Keys.sleepers`, by worker name (one SMEMBERS, one MGET)."""
    raw_names: Any = await redis.smembers(keys.sleepers)
    names = sorted(n.decode() if isinstance(n, bytes) else str(n) for n in raw_names)
    if not names:
        return {}
    values: list[Any] = await redis.mget([keys.sleeper(n) for n in names])
    out: dict[str, SleepRecord] = {}
    for name, raw in zip(names, values, strict=True):
        if raw is None:
            continue
        try:
            rec = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if rec.worker == name:
            out[name] = rec
    return out


async def wake(
    redis: aioredis.Redis,
    keys: Keys,
    record: SleepRecord,
    *,
    why: str,
    gain_s: float | None = None,
    digest: str = "",
    window_s: float = DEFAULT_WINDOW_S,
    wake_time: WakeTime | None = None,
) -> WakeRequested | None:
    """Send `record`'s machine one magic packet and record WakeRequested; None (nothing sent) when a
    packet went to it within the last `window_s`. WakeError if the packet cannot be sent (the window
    is then released, so that the next try may send)."""
    at = now_ms()
    taken = await redis.set(keys.woken(record.worker), str(at), nx=True, px=max(1, int(window_s * 1000)))
    if not taken:
        return None
    try:
        send_magic_packet(record.mac, record.broadcast, record.port)
    except WakeError:
        await redis.delete(keys.woken(record.worker))
        raise
    await redis.hset(keys.waking, record.worker, str(at))
    counted = wake_time or record.wake_time()
    event = WakeRequested(
        at=at,
        worker=record.worker,
        why=why,
        gain_s=None if gain_s is None else min(max(0.0, gain_s), MAX_SECONDS),
        digest=digest,
        wake_s=min(counted.seconds, MAX_SECONDS),
        wake_source=counted.source,
    )
    await Ledger(redis, keys).append(event)
    return event


async def pending_wakes(redis: aioredis.Redis, keys: Keys) -> dict[str, int]:
    """Worker -> epoch ms of each magic packet whose machine has not come online (or failed) yet."""
    raw: Any = await redis.hgetall(keys.waking)
    out: dict[str, int] = {}
    for k, v in raw.items():
        name = k.decode() if isinstance(k, bytes) else str(k)
        try:
            out[name] = int(v)
        except ValueError:
            continue
    return out


async def sleeping_candidates(
    redis: aioredis.Redis,
    keys: Keys,
    view: FleetView,
    est: Estimator,
    digest: str,
    now_ms: int,
    leases: Mapping[str, LeaseInfo],
    fleet: Mapping[str, FleetRow],
    query: RouteQuery | None = None,
) -> list[dict[str, object]]:
    """The sleeping machines that serve `digest` (a record, no lease, not forgotten) as candidates
    for a new task (router.wake.sleeping_candidate), soonest finish first."""
    records = await read_records(redis, keys)
    if not records:
        return []
    raw: Any = await redis.smembers(keys.forgotten)
    forgotten = {n.decode() if isinstance(n, bytes) else str(n) for n in raw}
    out: list[dict[str, object]] = []
    for name, rec in records.items():
        if name in leases or name in forgotten or digest not in rec.holds:
            continue
        row = sleeping_candidate(view, est, digest, sleeper_of(rec, fleet.get(name), now_ms), now_ms, query)
        if row is not None:
            out.append(row)
    out.sort(key=lambda r: float(r["expected_finish_s"]))  # type: ignore[arg-type]
    return out


def sleeper_of(record: SleepRecord, row: FleetRow | None, now_ms: int) -> Sleeper:
    """The router's view of a sleeping machine: its record, and its wake time (`record.wake_time`)."""
    t = record.wake_time(row, now_ms)
    return Sleeper(
        name=record.worker,
        slots=record.slots,
        holds=frozenset(record.holds),
        wake_s=t.seconds,
        wake_source=t.source,
        wake_age_s=t.age_s,
    )
