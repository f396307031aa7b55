"""The operator's dashboard: the page, its data, and a live stream of what changes.

The page (api/static/) is static: HTML, one JS module and a stylesheet, no build step and no
request to anything but this API (a `default-src 'self'` policy says so to the browser). It asks
for its data with the same Bearer key as every other client, so it works with keys configured:
the key is asked for once and kept in sessionStorage.

Live updates are Server-Sent Events read with fetch() rather than EventSource: EventSource cannot
send an Authorization header, and a key in a query string ends up in logs and browser history.
fetch() streams the same `text/event-stream` body with the header, through the same guard.

`overview()` is also what `routeledger status` prints, read from Redis directly.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis
from fastapi import APIRouter, Query, Request
from redis.exceptions import RedisError, ResponseError
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from api.common import JSON, gateway
from api.gateway import TRANSIENT
from dispatch.lease import LeaseInfo, live_workers
from dispatch.serving import catalog, served
from events.codec import decode_rows
from events.event import (
    BenchmarkResult,
    Event,
    TaskCancelled,
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskFailed,
    TaskReclaimed,
    TaskRouted,
    TaskStalled,
    TaskSubmitted,
    Timings,
    now_ms,
)
from events.keys import DIGEST_PREFIX_LEN, WORKERS_GROUP, Keys
from events.ledger import Ledger, RawEntry, next_id
from projections.errors import ProjectionError
from projections.reader import lag
from projections.reader import snapshot as read_snapshot
from projections.snapshot import FleetRow, Snapshot

router = APIRouter(tags=["dashboard"])

# -- the page --------------------------------------------------------------------------------------

PAGE_PATH: Final = "/dashboard"
_ASSETS: Final = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
# The page may load and connect to this origin only: no CDN, font or analytics request can leave.
CSP: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_SECURITY_HEADERS: Final = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
]


def _asset(name: str) -> bytes:
    return resources.files("api").joinpath("static", name).read_bytes()


def wants_html(scope: Scope) -> bool:
    """A browser navigating (Accept names text/html); Ollama clients send JSON or */* and get the text."""
    for name, value in scope.get("headers", ()):
        if name == b"accept":
            return b"text/html" in value
    return False


class Shell:
    """Serves the page's static files, and sends browsers that open `/` to it, before the key guard.

    A browser cannot attach a Bearer key to a page navigation, so the shell must load without one;
    it holds no data (every number on the page comes from the guarded /v1 endpoints). Any other
    request to `/` (the ollama CLI and clients probe it) still gets "Ollama is running".
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        # Read once: the files are package data and do not change while the process runs.
        self.files = {path: (_asset(name), kind) for path, (name, kind) in _ASSETS.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path == "/" and wants_html(scope):
            await _send(send, 307, b"", [(b"location", PAGE_PATH.encode())])
            return
        found = self.files.get(path.rstrip("/") if path != "/" else path)
        if found is None:
            await self.app(scope, receive, send)
            return
        body, kind = found
        headers = [(b"content-type", kind.encode()), *_SECURITY_HEADERS]
        await _send(send, 200, b"" if scope["method"] == "HEAD" else body, headers, len(body))


async def _send(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]], length: int | None = None
) -> None:
    size = str(len(body) if length is None else length).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [*headers, (b"content-length", size)]}
    )
    await send({"type": "http.response.body", "body": body})


# -- reading the ledger -------------------------------------------------------------------------------

_XRANGE: Final = b"XRANGE"
_XREVRANGE: Final = b"XREVRANGE"
_SAMPLE_TYPES: Final = frozenset({b"TaskCompleted", b"BenchmarkResult"})
_INCIDENT_TYPES: Final = frozenset({b"TaskReclaimed", b"TaskStalled", b"TaskDeadLettered"})
_TASK_TYPES: Final = frozenset(
    {b"TaskSubmitted", b"TaskRouted", b"TaskClaimed", b"TaskCompleted", b"TaskFailed", b"TaskCancelled"}
    | _INCIDENT_TYPES
)
# How far back the recent tasks and incidents are looked for (ledger entries, newest first).
RECENT_WINDOW: Final = 5000
MAX_SAMPLES: Final = 5000


def _rows(reply: Any) -> list[RawEntry]:
    return [(row[0].decode(), row[1]) for row in reply]


def _wanted(rows: Iterable[RawEntry], types: frozenset[bytes]) -> list[RawEntry]:
    # The envelope's type is the entry's second value: filter before paying for a decode.
    return [(i, flat) for i, flat in rows if len(flat) > 1 and flat[1] in types]


def decode_tps(timings: Timings) -> float | None:
    """Decode tokens per second from the backend's own counts; None when it did not report them."""
    if timings.eval_count is None or not timings.eval_duration:
        return None
    return timings.eval_count / (timings.eval_duration / 1e9)


class Sample(msgspec.Struct, array_like=True, frozen=True):
    """One decode-speed sample: [at ms, worker, digest, tok/s, from a benchmark]."""

    at: int
    worker: str
    digest: str
    tps: float
    bench: bool


def sample_of(event: Event) -> Sample | None:
    """The speed sample an event carries, counted as the projector counts it (once per run)."""
    if isinstance(event, BenchmarkResult):
        tps = decode_tps(event.timings)
        return None if tps is None else Sample(event.at, event.worker, event.digest, round(tps, 2), True)
    # A benchmark's TaskCompleted repeats its BenchmarkResult; a duplicate changes no statistic.
    if isinstance(event, TaskCompleted) and event.bench_id is None and not event.duplicate:
        tps = decode_tps(event.timings)
        return None if tps is None else Sample(event.at, event.worker, event.digest, round(tps, 2), False)
    return None


async def read_samples(
    redis: aioredis.Redis, keys: Keys, since_ms: int, limit: int = MAX_SAMPLES
) -> tuple[list[Sample], str]:
    """Decode-speed samples appended since `since_ms`, oldest first (the newest `limit` of them),
    and the id of the last ledger entry read (where a live stream picks up)."""
    ledger = Ledger(redis, keys)
    last = await ledger.last_id() or "0-0"
    kept: deque[Sample] = deque(maxlen=limit)
    async for batch in ledger.read_raw(f"{max(0, since_ms)}-0", last, chunk=5000):
        for _, event in decode_rows(_wanted(batch, _SAMPLE_TYPES), lambda exc: None):
            s = sample_of(event)
            if s is not None:
                kept.append(s)
    return list(kept), last


# -- recent tasks and incidents ------------------------------------------------------------------------


def _digest_of_queue(queue: str, keys: Keys) -> str:
    return queue.removeprefix(keys.prefix + "q:")


@dataclass
class TaskView:
    """One recent task as the dashboard shows it: who ran it, and why it was routed so."""

    task_id: str
    model: str
    digest: str
    domain: str
    submitted_at: int
    entry_id: str
    status: str = "queued"
    worker: str | None = None
    attempts: int = 0
    expected_worker: str | None = None
    expected_finish_s: float | None = None
    # Each candidate's expected finish, best first: the short answer to "why this worker".
    ranking: list[tuple[str, float | None]] = field(default_factory=list)
    auto: bool = False
    tps: float | None = None
    wall_ms: float | None = None
    finished_at: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "model": self.model,
            "digest": self.digest,
            "domain": self.domain,
            "submitted_at": self.submitted_at,
            "status": self.status,
            "worker": self.worker,
            "attempts": self.attempts,
            "expected_worker": self.expected_worker,
            "expected_finish_s": self.expected_finish_s,
            "ranking": [{"worker": w, "expected_finish_s": s} for w, s in self.ranking],
            "auto": self.auto,
            "decode_tps": self.tps,
            "wall_ms": self.wall_ms,
            "finished_at": self.finished_at,
        }


def _ranking(breakdown: dict[str, object]) -> list[tuple[str, float | None]]:
    out: list[tuple[str, float | None]] = []
    candidates = breakdown.get("candidates")
    if isinstance(candidates, list):
        for c in candidates:
            if isinstance(c, dict) and isinstance(c.get("worker"), str):
                finish = c.get("expected_finish_s")
                # An unknown finish stays unknown (None), never a sentinel.
                out.append(
                    (c["worker"], round(float(finish), 2) if isinstance(finish, int | float) else None)
                )
    return out


class Recent:
    """The newest tasks and incidents, folded from ledger events (loaded from the tail, then fed live)."""

    def __init__(self, keys: Keys, tasks: int = 25, incidents: int = 25) -> None:
        self.keys = keys
        self.max_tasks = tasks
        self.tasks: OrderedDict[str, TaskView] = OrderedDict()
        self.incidents: deque[dict[str, Any]] = deque(maxlen=incidents)

    def add(self, entry_id: str, event: Event) -> bool:
        """Fold one event; True when it changed what is shown."""
        if isinstance(event, TaskReclaimed | TaskStalled | TaskDeadLettered):
            self.incidents.append(self._incident(entry_id, event))
        if isinstance(event, TaskSubmitted):
            self.tasks[event.task_id] = TaskView(
                task_id=event.task_id,
                model=event.model,
                digest=event.digest,
                domain=event.domain,
                submitted_at=event.at,
                entry_id=entry_id,
            )
            while len(self.tasks) > self.max_tasks:
                self.tasks.popitem(last=False)
            return True
        task_id = getattr(event, "task_id", None)
        view = self.tasks.get(task_id) if isinstance(task_id, str) else None
        if view is None:
            return isinstance(event, TaskReclaimed | TaskStalled | TaskDeadLettered)
        _fold_task(view, event)
        return True

    def _incident(
        self, entry_id: str, event: TaskReclaimed | TaskStalled | TaskDeadLettered
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": entry_id,
            "type": type(event).__name__,
            "at": event.at,
            "task_id": event.task_id,
            "digest": _digest_of_queue(event.queue, self.keys),
        }
        if isinstance(event, TaskReclaimed):
            out["detail"] = (
                f"owner {event.owner} gone; attempt {event.attempt} (idle {event.idle_ms / 1000:.1f}s)"
            )
            out["worker"] = event.owner
        elif isinstance(event, TaskStalled):
            out["detail"] = f"nobody took it for {event.waited_ms / 1000:.1f}s"
        else:
            out["detail"] = f"{event.reason} after {event.attempts} attempt(s)"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "tasks": [t.to_dict() for t in reversed(self.tasks.values())],
            "incidents": list(reversed(self.incidents)),
        }


def _fold_task(view: TaskView, event: Event) -> None:
    if isinstance(event, TaskRouted):
        view.expected_worker = event.expected_worker
        view.expected_finish_s = event.expected_finish_s
        view.ranking = _ranking(event.breakdown)
        view.auto = "auto" in event.breakdown
    elif isinstance(event, TaskClaimed):
        view.status, view.worker, view.attempts = "running", event.worker, event.attempt
    elif isinstance(event, TaskCompleted):
        if not event.duplicate:
            view.status, view.worker = "completed", event.worker
            view.tps = None if (t := decode_tps(event.timings)) is None else round(t, 2)
            view.wall_ms, view.finished_at = event.wall_ms, event.at
    elif isinstance(event, TaskFailed):
        view.status = "retrying" if event.retryable else "failed"
        view.worker = event.worker
    elif isinstance(event, TaskReclaimed):
        view.status = "reclaimed"
    elif isinstance(event, TaskStalled):
        view.status = "stalled"
    elif isinstance(event, TaskDeadLettered):
        view.status = "dead"
    elif isinstance(event, TaskCancelled):
        view.status = "cancelled"


async def load_recent(redis: aioredis.Redis, keys: Keys, window: int = RECENT_WINDOW) -> tuple[Recent, str]:
    """Recent tasks and incidents from the newest `window` ledger entries, and the newest id read."""
    reply: Any = await redis.execute_command(  # type: ignore[no-untyped-call]
        _XREVRANGE, keys.events, "+", "-", "COUNT", window
    )
    rows = _rows(reply)
    last = rows[0][0] if rows else "0-0"
    rows.reverse()
    recent = Recent(keys)
    for entry_id, event in decode_rows(_wanted(rows, _TASK_TYPES), lambda exc: None):
        recent.add(entry_id, event)
    return recent, last


# -- the fleet, capacity and queues --------------------------------------------------------------------


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


def _worker_row(
    name: str, info: LeaseInfo | None, row: FleetRow | None, names: dict[str, str], now: int
) -> dict[str, Any]:
    if info is not None:
        serving = {m.digest for m in served(info)}
        return {
            "id": name,
            "status": "draining" if info.draining else "online",
            "since": info.since,
            "lease_age_s": round(max(0.0, (now - info.renewed_at) / 1000), 2),
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
                    "started_at": r.started_at,
                }
                for r in info.running
            ],
            "last_heartbeat": row.last_heartbeat if row is not None else None,
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
    }


async def queue_depths(
    redis: aioredis.Redis, keys: Keys, digests: Iterable[str]
) -> dict[str, dict[str, int | None]]:
    """Per model queue: entries nobody took yet (`queued`) and taken, not finished (`running`)."""
    out: dict[str, dict[str, int | None]] = {}
    for digest in sorted(set(digests)):
        queue = keys.queue(digest)
        try:
            groups: Any = await redis.xinfo_groups(queue)
        except ResponseError:
            out[digest] = {"queued": 0, "running": 0}  # no queue yet: nothing was ever submitted
            continue
        group = next((g for g in groups if g.get("name") in (WORKERS_GROUP, WORKERS_GROUP.encode())), None)
        if group is None:
            out[digest] = {"queued": None, "running": None}
            continue
        queued: int | None = None if group.get("lag") is None else int(group["lag"])
        if queued is None:
            # Redis 6.2 has no lag (nor does 7 after a deletion): count what lies past the group's cursor.
            last = group.get("last-delivered-id") or b"0-0"
            start = next_id(last.decode() if isinstance(last, bytes) else str(last))
            rows: Any = await redis.execute_command(_XRANGE, queue, start, "+", "COUNT", 10_000)  # type: ignore[no-untyped-call]
            queued = len(rows)
        out[digest] = {"queued": queued, "running": int(group.get("pending") or 0)}
    return out


async def fleet_state(redis: aioredis.Redis, keys: Keys) -> dict[str, Any]:
    """Workers (live and known), models with capacity and queues, the projection's lag."""
    now = now_ms()
    leases = await live_workers(redis, keys)
    try:
        snap = await read_snapshot(redis, keys, now_ms=now)
        projection: dict[str, Any] = {"status": "ok"}
    except ProjectionError as exc:
        snap, projection = Snapshot(taken_at=now), {"status": str(exc)}
    names = model_names(leases, snap.fleet)
    workers = [
        _worker_row(name, leases.get(name), snap.fleet.get(name), names, now)
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


async def overview(redis: aioredis.Redis, keys: Keys, recent: Recent | None = None) -> dict[str, Any]:
    """Everything the dashboard and `routeledger status` show, but the speed samples."""
    if recent is None:
        recent, _ = await load_recent(redis, keys)
    state = await fleet_state(redis, keys)
    state.update(recent.to_dict())
    names: dict[str, str] = state["names"]
    for incident in state["incidents"]:
        # A queue names its model by a digest prefix (or a worker, for pinned queues).
        prefix = incident["digest"]
        incident["model"] = next((n for d, n in names.items() if d.startswith(prefix)), prefix)
    return state


# -- the endpoints -------------------------------------------------------------------------------------


@router.get("/v1/dashboard/overview")
async def read_overview(request: Request) -> JSON:
    """The fleet, capacity and queue depth per model, recent tasks with their routing, incidents."""
    gw = gateway(request)
    return JSON(await gw.retrying(lambda: overview(gw.redis, gw.keys)))


@router.get("/v1/dashboard/samples")
async def samples(
    request: Request,
    since: int | None = Query(None, ge=0, description="ms since the epoch; default: the last hour"),
    limit: int = Query(MAX_SAMPLES, ge=1, le=50_000, description="keep the newest this many"),
) -> JSON:
    """Decode tok/s samples per worker x model (completed tasks and benchmarks), oldest first.

    Each sample is `[at_ms, worker, digest, tok_s, from_benchmark]`; `names` maps digests to model
    names; `last_id` is where GET /v1/dashboard/stream?after= continues without a gap.
    """
    gw = gateway(request)
    start = now_ms() - 3_600_000 if since is None else since
    found, last = await gw.retrying(lambda: read_samples(gw.redis, gw.keys, start, limit))
    leases = await gw.retrying(lambda: gw.fleet.leases(fresh=False))
    evidence = await gw.retrying(lambda: gw.fleet.evidence(fresh=False))
    return JSON(
        {
            "samples": msgspec.to_builtins(found),
            "names": model_names(leases, evidence.snapshot.fleet),
            "since": start,
            "last_id": last,
        }
    )


# A stream ends itself after this long and the page reconnects (from where it was): an open
# response would otherwise hold a graceful server shutdown until the supervisor kills it.
STREAM_LIFETIME_S: Final = 25.0
# The fleet part (leases, queues, lag) is re-read at most this often, and at least this often.
_FLEET_MIN_S: Final = 1.0
_FLEET_MAX_S: Final = 5.0


def _sse(kind: str, data: Any, entry_id: str | None = None) -> bytes:
    head = f"event: {kind}\n" + (f"id: {entry_id}\n" if entry_id else "")
    return head.encode() + b"data: " + msgspec.json.encode(data) + b"\n\n"


async def live_updates(
    redis: aioredis.Redis, keys: Keys, after: str | None, lifetime_s: float = STREAM_LIFETIME_S
) -> AsyncIterator[bytes]:
    """The stream's body: an `overview` first and whenever something changed, `samples` as they land."""
    recent, loaded_to = await load_recent(redis, keys)
    # Resuming, the tail is read again from `after` for the samples the page has not seen; what
    # the fresh load already folded is not folded twice.
    cursor = after if after is not None and _after(loaded_to, after) else loaded_to
    ledger = Ledger(redis, keys)
    state = await overview(redis, keys, recent)
    yield _sse("overview", state, cursor)
    fleet_at = time.monotonic()
    dirty = False
    ends = time.monotonic() + lifetime_s
    while time.monotonic() < ends:
        rows = await ledger.read_after(cursor, count=1000, block_ms=int(_FLEET_MIN_S * 1000))
        found: list[Sample] = []
        if rows:
            cursor = rows[-1][0]
            for entry_id, event in decode_rows(_wanted(rows, _TASK_TYPES | _SAMPLE_TYPES), lambda exc: None):
                if _after(entry_id, loaded_to):
                    dirty |= recent.add(entry_id, event)
                s = sample_of(event)
                if s is not None:
                    found.append(s)
            # Any entry may change the fleet part (heartbeats, workers coming and going, claims).
            dirty = True
        if found:
            yield _sse("samples", {"samples": msgspec.to_builtins(found)}, cursor)
        since = time.monotonic() - fleet_at
        if (dirty and since >= _FLEET_MIN_S) or since >= _FLEET_MAX_S:
            state = await overview(redis, keys, recent)
            yield _sse("overview", state, cursor)
            fleet_at, dirty = time.monotonic(), False
    yield _sse("reconnect", {"after": cursor}, cursor)


def _after(a: str, b: str) -> bool:
    am, _, aseq = a.partition("-")
    bm, _, bseq = b.partition("-")
    return (int(am), int(aseq or 0)) > (int(bm), int(bseq or 0))


@router.get("/v1/dashboard/stream")
async def stream(
    request: Request,
    after: str | None = Query(None, pattern=r"^\d+-\d+$", description="a ledger id: continue after it"),
) -> StreamingResponse:
    """Server-Sent Events: `overview` (as GET /v1/dashboard/overview) when anything changed, and
    `samples` with each new decode-speed sample; every event's id is a ledger id. The stream ends
    after about 25 s with a `reconnect` event; continue with `?after=<its id>`."""
    gw = gateway(request)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in live_updates(gw.redis, gw.keys, after):
                yield chunk
        except (RedisError, *TRANSIENT) as exc:
            yield _sse("error", {"message": f"Redis is unreachable ({type(exc).__name__})"})

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
