"""The operator's dashboard: the page, its data, and a live stream of what changes.

The page (api/static/) is static: HTML, one JS module and a stylesheet, no build step and no
request to anything but this API (a `default-src 'self'` policy says so to the browser). It asks
for its data with the same Bearer key as every other client, so it works with keys configured:
the key is asked for once and kept in sessionStorage.

Live updates are Server-Sent Events read with fetch() rather than EventSource: EventSource cannot
send an Authorization header, and a key in a query string ends up in logs and browser history.
fetch() streams the same `text/event-stream` body with the header, through the same guard.

The data comes from dispatch/overview.py and dispatch/recent.py, which `routeledger status` reads
too, from Redis directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib import resources
from typing import Final

import msgspec
from fastapi import APIRouter, Query, Request
from redis.exceptions import RedisError
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from api.auth import wants_html
from api.common import JSON, gateway
from api.errors import NATIVE, READS, SSE_EVENT, UnprocessableError, documented
from dispatch.gateway import TRANSIENT
from dispatch.overview import Update, live_updates, model_names, overview
from dispatch.recent import MAX_SAMPLES, read_samples
from events.event import now_ms

router = APIRouter(tags=["dashboard"])

# The latest time a ledger id can name: its time part is an unsigned 64-bit count of ms. A larger
# `since` would reach Redis as an id it refuses, which is the client's mistake, not an outage.
MAX_MS: Final = 2**64 - 1

# -- the page --------------------------------------------------------------------------------------

PAGE_PATH: Final = "/dashboard"
_ASSETS: Final = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
# What the shell serves: the guard lets a browser load these without a key.
SHELL_PATHS: Final = frozenset(_ASSETS)
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


# How long the page waits for the overview it carries; past it the page is sent without one and
# fetches it, as it does with keys configured.
FIRST_OVERVIEW_S: Final = 1.0
_BODY_END: Final = b"</body>"


class Shell:
    """Serves the page's static files, and sends browsers that open `/` to it, inside the guard's
    host and origin checks but exempt from its key (Guard's `pages`).

    A browser cannot attach a Bearer key to a page navigation, so the shell must load without one.
    With keys configured it holds no data (every number on the page comes from the guarded /v1
    endpoints). Without keys, where GET /v1/dashboard/overview answers anyone the page reaches,
    the page carries the overview in a JSON data block: the tables are filled by the script that
    runs before the load event, so that a capture at load (a headless screenshot) is complete,
    not only the tables' heads. Any other request to `/` (the ollama CLI and clients probe it)
    still gets "Ollama is running".
    """

    def __init__(self, app: ASGIApp, keyed: bool = True) -> None:
        self.app = app
        self.keyed = keyed
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
        if path.rstrip("/") == PAGE_PATH and not self.keyed and scope["method"] == "GET":
            body = await self._with_overview(scope, body)
        headers = [(b"content-type", kind.encode()), *_SECURITY_HEADERS]
        await _send(send, 200, b"" if scope["method"] == "HEAD" else body, headers, len(body))

    async def _with_overview(self, scope: Scope, page: bytes) -> bytes:
        """The page with the overview in a data block (not a script: the CSP runs none inline), or
        the page alone when Redis does not answer in time."""
        gw = gateway(Request(scope))
        try:
            data = await asyncio.wait_for(overview(gw.redis, gw.keys, memory=gw.memory), FIRST_OVERVIEW_S)
        except (TimeoutError, RedisError, *TRANSIENT):
            return page
        # "<" never occurs outside a JSON string, and inside one \u003c reads the same: no "</script>".
        block = msgspec.json.encode(data).replace(b"<", b"\\u003c")
        tag = b'<script type="application/json" id="first-overview">' + block + b"</script>\n"
        return page.replace(_BODY_END, tag + _BODY_END, 1)


async def _send(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]], length: int | None = None
) -> None:
    size = str(len(body) if length is None else length).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [*headers, (b"content-length", size)]}
    )
    await send({"type": "http.response.body", "body": body})


# -- the endpoints -------------------------------------------------------------------------------------


@router.get("/v1/dashboard/overview", responses=documented(NATIVE, *READS))
async def read_overview(request: Request) -> JSON:
    """The fleet, capacity and queue depth per model, recent tasks with their routing, incidents."""
    gw = gateway(request)
    return JSON(await gw.retrying(lambda: overview(gw.redis, gw.keys, memory=gw.memory)))


@router.get("/v1/dashboard/keys", responses=documented(NATIVE, *READS))
async def read_keys(request: Request) -> JSON:
    """Each configured API key's use (by name, never the key) against its limits: requests, tokens
    today, tasks open, refusals by limit."""
    gw = gateway(request)
    usage = await gw.retrying(lambda: gw.quotas.usage(request.app.state.api_keys))
    return JSON({"keys": [u.to_dict() for u in usage]})


@router.get("/v1/dashboard/samples", responses=documented(NATIVE, 422, *READS))
async def samples(
    request: Request,
    since: int | None = Query(
        None, ge=0, le=MAX_MS, description="ms since the epoch; default: the last hour"
    ),
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


def _sse(update: Update) -> bytes:
    head = f"event: {update.kind}\n" + (f"id: {update.entry_id}\n" if update.entry_id else "")
    return head.encode() + b"data: " + msgspec.json.encode(update.data) + b"\n\n"


@router.get(
    "/v1/dashboard/stream",
    response_class=StreamingResponse,
    responses={
        200: {"description": "the events", "content": {"text/event-stream": {"schema": SSE_EVENT}}},
        **documented(NATIVE, 422),
    },
)
async def stream(
    request: Request,
    after: str | None = Query(
        None, pattern=r"^\d{1,20}-\d{1,20}$", description="a ledger id: continue after it"
    ),
) -> StreamingResponse:
    """Server-Sent Events: `overview` (as GET /v1/dashboard/overview) when anything changed, and
    `samples` with each new decode-speed sample; every event's id is a ledger id. The stream ends
    after about 25 s with a `reconnect` event; continue with `?after=<its id>`."""
    if after is not None and any(int(part) > MAX_MS for part in after.split("-")):
        # Redis would refuse it: the client's mistake, not an outage.
        raise UnprocessableError(
            f"query.after: {after} is not a ledger id: each part is at most {MAX_MS}",
            hint="continue after an id an event of this stream gave",
            param="after",
        )
    gw = gateway(request)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for update in live_updates(gw.redis, gw.keys, after, memory=gw.memory):
                yield _sse(update)
        except (RedisError, *TRANSIENT) as exc:
            yield _sse(Update("error", {"message": f"Redis is unreachable ({type(exc).__name__})"}, ""))

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
