"""What the operator's dashboard and `routeledger status` show: the fleet (live leases and what the
ledger last said of each worker), capacity and queue depth per model, the projection's lag, and,
from dispatch/recent.py, the newest tasks and incidents; plus the live feed the page follows.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from dispatch.memory import MemoryWatch, archive_info, read_memory
from dispatch.recent import SAMPLE_TYPES, TASK_TYPES, Recent, Sample, load_recent, sample_of, wanted
from dispatch.serving import catalog, served
from events.clock import LedgerClock
from events.codec import decode_rows
from events.keys import DIGEST_PREFIX_LEN, WORKERS_GROUP, Keys
from events.ledger import Ledger, next_id
from projections.errors import ProjectionError
from projections.reader import lag
from projections.reader import snapshot as read_snapshot
from projections.snapshot import FleetRow, Snapshot
from tasks.lease import LeaseInfo, live_workers, resources_of
from tasks.store import band_queues, requeued_count


def model_names(leases: dict[str, LeaseInfo], fleet: dict[str, FleetRow]) -> dict[str, str]:
    """digest -> the name it is known by (live inventories first, then what the ledger last saw)."""
    names: dict[str, str] = {}
    for info in sorted(leases.values(), key=lambda i: i.worker):
        for m in info.inventory:
            names.setdefault(m.digest, m.name)
    for row in fleet.values():
        inventory = row.inventory.value
        if isinstance(inventory, dict):
            for name, digest in inventory.items():
                if isinstance(name, str) and isinstance(digest, str):
                    names.setdefault(digest, name)
    return names


def worker_row(
    name: str, info: LeaseInfo | None, row: FleetRow | None, names: dict[str, str], now: int
) -> dict[str, Any]:
    if info is not None:
        serving = {m.digest for m in served(info)}
        # The lease's times are the worker's clock: read on the ledger's, as `now` is.
        renewed = info.on_ledger(info.renewed_at)
        return {
            "id": name,
            "status": "draining" if info.draining else "online",
            "since": info.on_ledger(info.since),
            "lease_age_s": round(max(0.0, (now - renewed) / 1000), 2),
            "slots": info.slots,
            "busy": info.in_flight,
            "models": [
                {
                    "name": m.name,
                    "digest": m.digest,
                    "loaded": m.digest in info.loaded,
                    "serving": m.digest in serving,
                }
                for m in info.inventory
            ],
            "running": [
                {
                    "task_id": r.task_id,
                    "model": names.get(r.digest, r.digest[:DIGEST_PREFIX_LEN]),
                    "started_at": info.on_ledger(r.started_at),
                    # A benchmark or grading answer: not a task of the recent tasks' rows.
                    "background": r.background,
                }
                for r in info.running
            ],
            # Liveness is the lease's: the ledger records no beats.
            "last_heartbeat": renewed,
            "resources": resources_of(info),
            "seen_from": "lease",
            **clock_fields(row),
        }
    inventory = row.inventory.value if row is not None and isinstance(row.inventory.value, dict) else {}
    loaded = row.loaded.value if row is not None and isinstance(row.loaded.value, list) else []
    slots = row.slots.value if row is not None and isinstance(row.slots.value, int) else None
    return {
        "id": name,
        "status": row.status if row is not None and row.status != "online" else "offline",
        "since": row.status_since if row is not None else None,
        "lease_age_s": None,
        "slots": slots,
        "busy": len(row.in_flight) if row is not None else None,
        "models": [
            {"name": n, "digest": d, "loaded": d in loaded, "serving": False}
            for n, d in sorted(inventory.items())
        ],
        "running": [],
        "last_heartbeat": row.last_heartbeat if row is not None else None,
        "resources": row.resources.value
        if row is not None and isinstance(row.resources.value, dict)
        else None,
        "seen_from": "ledger" if row is not None else None,
        **clock_fields(row),
    }


async def queue_depths(
    redis: aioredis.Redis, keys: Keys, digests: Iterable[str]
) -> dict[str, dict[str, int | None]]:
    """Per model queue (all its band queues together): entries nobody took yet (`queued`) and taken,
    not finished (`running`)."""
    out: dict[str, dict[str, int | None]] = {}
    for digest in sorted(set(digests)):
        total: dict[str, int | None] = {"queued": 0, "running": 0}
        for queue in await band_queues(redis, keys, digest):
            one = await _depth(redis, queue)
            for field in ("queued", "running"):
                mine, theirs = total[field], one[field]
                total[field] = None if mine is None or theirs is None else mine + theirs
        out[digest] = total
    return out


async def _depth(redis: aioredis.Redis, queue: str) -> dict[str, int | None]:
    try:
        groups: Any = await redis.xinfo_groups(queue)
    except ResponseError:
        return {"queued": 0, "running": 0}  # no queue yet: nothing was ever submitted
    group = next((g for g in groups if g.get("name") in (WORKERS_GROUP, WORKERS_GROUP.encode())), None)
    if group is None:
        return {"queued": None, "running": None}
    queued: int | None = None if group.get("lag") is None else int(group["lag"])
    if queued is None:
        # Redis 6.2 has no lag (nor does 7 after a deletion): count what lies past the group's cursor.
        last = group.get("last-delivered-id") or b"0-0"
        start = next_id(last.decode() if isinstance(last, bytes) else str(last))
        rows: Any = await redis.xrange(queue, start, "+", count=10_000)
        queued = len(rows)
    # Re-queued entries are pending for no worker: they wait, like unread ones.
    again = await requeued_count(redis, queue)
    return {"queued": queued + again, "running": int(group.get("pending") or 0) - again}


# A worker whose clock is off the ledger's by more than this is flagged (clock_skewed). Transit to
# Redis adds milliseconds and NTP keeps clocks within milliseconds, so 5 s is no noise; it is half
# the default lease, the shortest span the fleet times by a worker's own clock, so a skew that
# could mislead a reader of its times is flagged. No table or age depends on it either way.
CLOCK_SKEW_S: Final = 5.0


def clock_fields(row: FleetRow | None) -> dict[str, Any]:
    """A worker's clock against the ledger's, as the fleet surfaces show it: the robust estimate
    (`clock_skew_s`, the median of its recent offsets, and the ledger time of the newest), whether
    it is past CLOCK_SKEW_S, and the newest claim's offset alone (`clock_offset_s`)."""
    skew = row.clock_skew.value if row is not None else None
    offset = row.clock_offset_ms if row is not None else None
    return {
        "clock_skew_s": skew / 1000 if isinstance(skew, int) else None,
        "clock_skew_at": row.clock_skew.at if row is not None else None,
        "clock_skewed": abs(skew) / 1000 > CLOCK_SKEW_S if isinstance(skew, int) else None,
        "clock_offset_s": None if offset is None else offset / 1000,
    }


async def fleet_state(redis: aioredis.Redis, keys: Keys) -> dict[str, Any]:
    """Workers (live and known), models with capacity and queues, the projection's lag."""
    now = await LedgerClock(redis).now_ms()
    leases = await live_workers(redis, keys)
    try:
        snap = await read_snapshot(redis, keys, now_ms=now)
        projection: dict[str, Any] = {"status": "ok"}
    except ProjectionError as exc:
        snap, projection = Snapshot(taken_at=now), {"status": str(exc)}
    names = model_names(leases, snap.fleet)
    workers = [
        worker_row(name, leases.get(name), snap.fleet.get(name), names, now)
        for name in sorted(set(leases) | set(snap.fleet))
    ]
    models = catalog(leases)
    depths = await queue_depths(redis, keys, [m.entry.digest for m in models])
    try:
        entries, ms = await lag(redis, keys)
        projection.update(lag_entries=entries, lag_ms=ms)
    except ProjectionError as exc:
        projection.update(status=str(exc), lag_entries=None, lag_ms=None)
    return {
        "now": now,
        "workers": workers,
        "models": [
            {
                "name": m.name,
                "digest": m.entry.digest,
                "capacity": m.slots,
                "holders": m.holders,
                "loaded_on": m.loaded_on,
                **depths.get(m.entry.digest, {"queued": None, "running": None}),
            }
            for m in models
        ],
        "names": names,
        "projection": projection,
    }


async def storage_state(
    redis: aioredis.Redis, keys: Keys, memory: MemoryWatch | None = None
) -> dict[str, Any]:
    """Redis's memory against its limit (through `memory`, a process's cached reading, when given)
    and the archive's state."""
    reading = await memory.state() if memory is not None else await read_memory(redis)
    archive = await archive_info(redis, keys)
    return {"redis": reading.to_dict(), "archive": archive.to_dict()}


async def overview(
    redis: aioredis.Redis, keys: Keys, recent: Recent | None = None, memory: MemoryWatch | None = None
) -> dict[str, Any]:
    """Everything the dashboard and `routeledger status` show, but the speed samples."""
    if recent is None:
        recent, _ = await load_recent(redis, keys)
    state = await fleet_state(redis, keys)
    state.update(await storage_state(redis, keys, memory))
    state.update(recent.to_dict())
    names: dict[str, str] = state["names"]
    for incident in state["incidents"]:
        # A queue names its model by a digest prefix (or a worker, for pinned queues).
        prefix = incident["digest"]
        incident["model"] = next((n for d, n in names.items() if d.startswith(prefix)), prefix)
    return state


# A feed ends itself after this long and the page reconnects (from where it was): an open
# response would otherwise hold a graceful server shutdown until the supervisor kills it.
STREAM_LIFETIME_S: Final = 25.0
# The fleet part (leases, queues, lag) is re-read at most this often, and at least this often.
_FLEET_MIN_S: Final = 1.0
_FLEET_MAX_S: Final = 5.0


class Update(msgspec.Struct, frozen=True):
    """One message of the live feed: `overview` (what `overview()` returns), `samples` (new
    decode-speed samples) or `reconnect` (the feed ended; continue after `entry_id`)."""

    kind: str
    data: Any
    entry_id: str


async def live_updates(
    redis: aioredis.Redis,
    keys: Keys,
    after: str | None,
    lifetime_s: float = STREAM_LIFETIME_S,
    memory: MemoryWatch | None = None,
) -> AsyncIterator[Update]:
    """The live feed: an `overview` first and whenever something changed, `samples` as they land,
    and `reconnect` after `lifetime_s`. Each update carries the ledger id it is current to."""
    recent, loaded_to = await load_recent(redis, keys)
    # Resuming, the tail is read again from `after` for the samples the page has not seen; what
    # the fresh load already folded is not folded twice.
    cursor = after if after is not None and _after(loaded_to, after) else loaded_to
    ledger = Ledger(redis, keys)
    state = await overview(redis, keys, recent, memory)
    yield Update("overview", state, cursor)
    fleet_at = time.monotonic()
    dirty = False
    ends = time.monotonic() + lifetime_s
    while time.monotonic() < ends:
        rows = await ledger.read_after(cursor, count=1000, block_ms=int(_FLEET_MIN_S * 1000))
        found: list[Sample] = []
        if rows:
            cursor = rows[-1][0]
            for entry_id, event in decode_rows(wanted(rows, TASK_TYPES | SAMPLE_TYPES), lambda exc: None):
                if _after(entry_id, loaded_to):
                    dirty |= recent.add(entry_id, event)
                s = sample_of(event)
                if s is not None:
                    found.append(s)
            # Any entry may change the fleet part (heartbeats, workers coming and going, claims).
            dirty = True
        if found:
            yield Update("samples", {"samples": msgspec.to_builtins(found)}, cursor)
        since = time.monotonic() - fleet_at
        if (dirty and since >= _FLEET_MIN_S) or since >= _FLEET_MAX_S:
            state = await overview(redis, keys, recent, memory)
            yield Update("overview", state, cursor)
            fleet_at, dirty = time.monotonic(), False
    yield Update("reconnect", {"after": cursor}, cursor)


def _after(a: str, b: str) -> bool:
    am, _, aseq = a.partition("-")
    bm, _, bseq = b.partition("-")
    return (int(am), int(aseq or 0)) > (int(bm), int(bseq or 0))
