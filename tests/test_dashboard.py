"""The dashboard in real headless Chromium, against a demo-like set-up; and its endpoints over HTTP.

No browser-automation package is installed (Playwright and Selenium are not dependencies), so a
small client of the Chrome DevTools Protocol drives Debian's `chromium` over a websocket (the
`websockets` package comes with uvicorn[standard]). It navigates, evaluates, clicks with the
mouse, types, watches every network request, and takes the screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import ollama
import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect

from api.app import AppConfig
from api.dashboard import CSP
from dispatch.submit import route_and_submit
from dispatch.view import LiveView
from events.event import (
    Event,
    ModelEntry,
    TaskClaimed,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskStalled,
    TaskSubmitted,
    WorkerOffline,
    WorkerOnline,
    now_ms,
)
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from routeledger.cli_traffic import trickle
from sim.backends.hosts import SimHosts
from sim.fleetspec import load_fleet
from tasks.lease import LeaseInfo, Leases, RunningInfo
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import events_of, fast_config, running_agent, running_reaper, wait_until
from tests.test_api_support import fleet_and_api, serving

KEY = "dashboard-test-key"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
GHOST_DIGEST = "6a6f62732d6e6f626f64792d72756e732d686572652d3031323334353637aa"


# -- a small Chrome DevTools Protocol client -----------------------------------------------------------


def chromium_binary() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail(
            "the dashboard test needs Debian's chromium: run `apt-get update && apt-get install -y chromium` "
            "(.ci/run does this when it is missing)",
            pytrace=False,
        )
    return found


class Page:
    """One tab, attached through a flat session on the browser's websocket."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    async def call(self, method: str, **params: Any) -> Any:
        return await self.browser.send(method, params, self.session)

    async def evaluate(self, expression: str) -> Any:
        reply = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise AssertionError(f"page script failed: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20.0, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                text = await self.evaluate("document.body.innerText.slice(0, 2000)")
                raise AssertionError(f"waited {timeout}s for {what or expression}; the page says:\n{text}")
            await asyncio.sleep(0.1)

    async def click(self, selector: str) -> None:
        """A real mouse click in the middle of the element (pressed and released)."""
        box = await self.evaluate(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)});"
            " el.scrollIntoView({block: 'center'}); const r = el.getBoundingClientRect();"
            " return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            await self.call(
                "Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left", clickCount=1
            )

    async def type(self, selector: str, text: str) -> None:
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.call("Input.insertText", text=text)

    async def screenshot(self, path: Path) -> None:
        metrics = await self.call("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        shot = await self.call(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        )
        await asyncio.to_thread(_write, path, base64.b64decode(shot["data"]))


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


class Browser:
    """Headless Chromium with its DevTools websocket; events are kept for the test to read."""

    def __init__(self, proc: asyncio.subprocess.Process, ws: ClientConnection) -> None:
        self.proc = proc
        self.ws = ws
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self.ws:
            message = json.loads(raw)
            future = self.waiting.pop(message.get("id", -1), None)
            if future is None:
                self.events.append(message)
            elif "error" in message:
                future.set_exception(AssertionError(f"DevTools error: {message['error']}"))
            else:
                future.set_result(message.get("result", {}))

    async def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> Any:
        n = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[n] = future
        message: dict[str, Any] = {"id": n, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        await self.ws.send(json.dumps(message))
        return await asyncio.wait_for(future, 30)

    async def new_page(self, width: int = 1400, height: int = 1000) -> Page:
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = Page(self, attached["sessionId"])
        for domain in ("Page", "Network", "Runtime", "Log"):
            await page.call(f"{domain}.enable")
        await page.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return page

    def of(self, method: str) -> list[dict[str, Any]]:
        return [e["params"] for e in self.events if e.get("method") == method]


async def _devtools_url(proc: asyncio.subprocess.Process) -> str:
    assert proc.stderr is not None
    while True:
        line = (await proc.stderr.readline()).decode(errors="replace")
        if not line:
            raise AssertionError("chromium exited before it opened its DevTools port")
        if "DevTools listening on " in line:
            return line.split("DevTools listening on ", 1)[1].strip()


async def _drain(stream: asyncio.StreamReader | None) -> None:
    # Chromium keeps logging to stderr; an unread pipe would fill and stall it.
    while stream is not None and await stream.read(65536):
        pass


@contextlib.asynccontextmanager
async def chromium(*flags: str) -> AsyncIterator[Browser]:
    """Headless Chromium; `flags` are added to its command line (host resolver rules, say)."""
    binary = chromium_binary()
    with tempfile.TemporaryDirectory(prefix="rl-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            *flags,
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        drain: asyncio.Task[None] | None = None
        try:
            url = await asyncio.wait_for(_devtools_url(proc), 30)
            drain = asyncio.create_task(_drain(proc.stderr))
            async with connect(url, max_size=None) as ws:
                browser = Browser(proc, ws)
                try:
                    yield browser
                finally:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(browser.send("Browser.close"), 5)
                    browser.reader.cancel()
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            if drain is not None:
                drain.cancel()


# -- a demo-like set-up ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def demo(redis: aioredis.Redis, redis_url: str) -> AsyncIterator[str]:
    """The seed fleet simulated (sped up), its workers, the projector, the reaper, and the API with
    a key; traffic has run and a task for a model whose only holder is gone has stalled."""
    keys = Keys()
    stop = asyncio.Event()
    projector = asyncio.create_task(Projector(redis, keys, lease_ms=2000).run(stop))
    async with (
        SimHosts(load_fleet("seed"), time_scale=0.05, seed=3) as hosts,
        running_agent(redis, hosts.url("rtx3070ti"), fast_config("rtx3070ti")),
        running_agent(redis, hosts.url("macbookair"), fast_config("macbookair")),
        running_agent(redis, hosts.url("ai-core"), fast_config("ai-core", serves=[])),
        running_reaper(redis, stall_after_s=1.0),
        serving(AppConfig(redis_url=redis_url, api_keys=[KEY])) as base,
    ):
        try:
            # A holder whose lease is still there but which runs nothing: its task will stall.
            ghost = LeaseInfo(
                worker="old-nas",
                token="t",
                slots=1,
                inventory=[ModelEntry(name="mistral:7b", digest=GHOST_DIGEST)],
            )
            await Leases(redis, keys).put(ghost, 120_000)
            await route_and_submit(
                TaskStore(redis, keys),
                LiveView(redis, keys),
                TaskMessage(model="mistral:7b", messages=[Message(role="user", content="anyone there?")]),
            )
            sent = await trickle(redis, keys, rate=20.0, count=10, seed=7, max_tokens=(40, 120))
            assert sent == 10
            ledger = Ledger(redis, keys)

            async def settled() -> bool:
                done = [e for e in await events_of(ledger, TaskCompleted) if e.bench_id is None]
                return len(done) >= 8 and len(await events_of(ledger, TaskStalled)) >= 1

            await wait_until(settled, timeout=40, every=0.2)
            yield base
        finally:
            stop.set()
            await asyncio.wait_for(projector, 10)


# -- the tests -----------------------------------------------------------------------------------------


async def test_the_dashboard_shows_the_live_demo_in_chromium_and_fetches_nothing_from_outside(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with demo(redis_client, redis_url) as base:
        async with chromium() as browser:
            page = await browser.new_page()
            # The root, as a browser asks for it, leads to the dashboard; the page asks for the key.
            await page.call("Page.navigate", url=base + "/")
            await page.wait_for("document.querySelector('#key-dialog')?.open", what="the API key dialog")
            await page.type("#key-input", KEY)
            await page.click("#key-form button[type=submit]")
            await page.wait_for("document.body.dataset.ready === '1'", what="the first overview")

            fleet = await page.wait_for(
                "(() => { const r = [...document.querySelectorAll('#fleet tbody tr')]"
                ".map(tr => tr.innerText); return r.length >= 4 ? r : null; })()",
                what="four workers in the fleet table",
            )
            points = await page.wait_for(
                "(() => { const s = document.querySelector('#chart svg');"
                " return s && Number(s.dataset.points) >= 8 ? Number(s.dataset.points) : 0; })()",
                what="the chart with points",
            )
            legend = await page.evaluate("document.querySelector('#legend').innerText")
            taker = await page.wait_for(
                "document.querySelector('#preview .taker')?.innerText", what="a preview"
            )
            preview_text = await page.evaluate("document.querySelector('#preview').innerText")
            models = await page.evaluate("document.querySelector('#models').innerText")
            incidents = await page.wait_for(
                "(() => { const t = document.querySelector('#incidents tbody').innerText;"
                " return t.includes('Stalled') ? t : null; })()",
                what="the stalled task among the incidents",
            )

            # A task submitted now appears without a reload: the stream carries it.
            live_id = f"live-{time.time_ns()}"
            await route_and_submit(
                TaskStore(redis_client, Keys()),
                LiveView(redis_client, Keys()),
                TaskMessage(
                    model="qwen3:8b",
                    messages=[Message(role="user", content="one more, please")],
                    max_tokens=40,
                    task_id=live_id,
                ),
            )
            await page.wait_for(
                f"document.querySelector('#tasks tr[data-task=\"{live_id}\"] .ran-on')"
                "?.innerText.trim().length > 1",
                what="the new task, run, in the recent tasks",
            )

            # Whatever the traffic did: a task taken by another worker than the expected one says
            # why, and a busy slot's user task is one of the task rows (one render, one look).
            agreement = await page.evaluate(
                "(() => { const rows = [...document.querySelectorAll('#tasks tbody tr[data-task]')];"
                " const ids = new Set(rows.map(tr => tr.dataset.task));"
                " return {unexplained: rows.filter(tr => tr.querySelector('.taker.changed')"
                " && /does not say why|^$/.test(tr.querySelector('.reason')?.innerText.trim() || ''))"
                ".map(tr => tr.innerText),"
                " orphans: [...document.querySelectorAll('#fleet .slot-task:not(.muted)')]"
                ".map(s => s.dataset.task).filter(id => !ids.has(id))}; })()"
            )
            # Clicking a task shows its routing breakdown with every field's source (first: the worker
            # filter below hides the task when the other machine ran it).
            await page.click(f"#tasks tbody tr[data-task='{live_id}']")
            breakdown = await page.wait_for(
                "document.querySelector('#task-detail table.breakdown')?.innerText", what="a task's breakdown"
            )
            # Clicking a worker shows its rows only.
            await page.click("#fleet tr[data-worker='rtx3070ti']")
            detail = await page.wait_for(
                "(() => { const d = document.querySelector('#worker-detail');"
                " return d.hidden ? null : d.innerText; })()",
                what="the worker's detail",
            )
            ran_on = await page.evaluate(
                "[...document.querySelectorAll('#tasks tbody tr[data-task]')].map(tr => tr.dataset.worker)"
            )
            dimmed = await page.evaluate(
                "[...document.querySelectorAll('#chart g.series.dim')].map(g => g.dataset.worker)"
            )

            await page.screenshot(ARTIFACTS / "dashboard.png")

            requests = [r["request"]["url"] for r in browser.of("Network.requestWillBeSent")]
            documents = [r for r in browser.of("Network.responseReceived") if r.get("type") == "Document"]
            thrown = browser.of("Runtime.exceptionThrown")
            logged = [e["entry"] for e in browser.of("Log.entryAdded")]

    assert [row.split("\t")[0].strip() for row in fleet] == ["ai-core", "macbookair", "old-nas", "rtx3070ti"]
    assert all("online" in row and "/ 1" in row for row in fleet)
    assert points >= 8
    assert "rtx3070ti · qwen3:8b" in legend and "macbookair" in legend
    assert taker in {"rtx3070ti", "macbookair"}
    assert "source" in preview_text and "decode_tps" in preview_text
    assert "qwen3:8b" in models and "mistral:7b" in models
    assert "mistral:7b" in incidents and "nobody took it" in incidents
    assert "anyone there" not in incidents  # prompts never reach the page

    assert detail.startswith("rtx3070ti: its rows") and "qwen3:8b" in detail
    assert ran_on and set(ran_on) == {"rtx3070ti"}
    assert dimmed and "rtx3070ti" not in dimmed
    assert "decode_tps" in breakdown and "worker n=" in breakdown
    assert agreement == {"unexplained": [], "orphans": []}

    # Nothing left this origin: every request went to the API that served the page.
    outside = [u for u in requests if not u.startswith((base + "/", "data:"))]
    assert not outside, f"the page fetched from outside: {outside}"
    assert any(u.startswith(base + "/v1/dashboard/stream") for u in requests)
    assert documents and documents[-1]["response"]["headers"].get("content-security-policy") == CSP
    assert not thrown, thrown
    assert not [e for e in logged if e.get("source") in ("security", "javascript")], logged
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 20_000


async def test_browsers_opening_the_root_get_the_dashboard_and_ollama_clients_still_get_the_text(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):
        client = ollama.Client(host=base)
        # The ollama client's own HTTP client, with the headers it sends.
        probe = await asyncio.to_thread(client._client.get, "/")
        listed = await asyncio.to_thread(client.list)
        async with httpx.AsyncClient(base_url=base) as http:
            plain = await http.get("/")
            browser = await http.get("/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
            page = await http.get("/dashboard")
            script = await http.get("/dashboard/dashboard.js")
    assert probe.status_code == 200 and probe.text == "Ollama is running"
    assert "m:latest" in [m.model for m in listed.models]
    assert plain.text == "Ollama is running"
    assert browser.status_code == 307 and browser.headers["location"] == "/dashboard"
    assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
    assert '<script type="module" src="/dashboard/dashboard.js">' in page.text
    assert "http://" not in page.text and "https://" not in page.text
    assert script.headers["content-type"].startswith("text/javascript")
    # The SVG namespace is a name, never fetched; no other URL may appear in the script.
    code = script.text.replace('"http://www.w3.org/2000/svg"', "")
    assert "https://" not in code and "http://" not in code


async def test_with_keys_the_page_loads_without_one_but_its_data_and_stream_need_the_key(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url, api_keys=[KEY]) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=10) as http,
    ):
        page = await http.get("/dashboard")
        refused = await http.get("/v1/dashboard/overview")
        refused_stream = await http.get("/v1/dashboard/stream")
        auth = {"Authorization": f"Bearer {KEY}"}
        overview = (await http.get("/v1/dashboard/overview", headers=auth)).json()
        await http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers=auth,
            timeout=30,
        )
        samples = (await http.get("/v1/dashboard/samples", params={"since": 0}, headers=auth)).json()
        first: dict[str, Any] = {}
        async with http.stream("GET", "/v1/dashboard/stream", headers=auth) as streamed:
            kind = streamed.headers["content-type"]
            block = ""
            async for text in streamed.aiter_text():
                block += text
                if "\n\n" in block:
                    break
        for line in block.split("\n\n", 1)[0].splitlines():
            name, _, value = line.partition(": ")
            first[name] = value
    assert page.status_code == 200
    assert refused.status_code == 401 and refused_stream.status_code == 401
    assert [w["id"] for w in overview["workers"]] == ["a"]
    assert overview["models"][0]["name"] == "m:latest" and overview["models"][0]["capacity"] == 1
    assert [s[1] for s in samples["samples"]] == ["a"] and samples["samples"][0][3] > 0
    assert samples["names"][samples["samples"][0][2]] == "m:latest"
    assert kind.startswith("text/event-stream")
    assert first["event"] == "overview" and "-" in first["id"]
    assert msgspec.json.decode(first["data"])["tasks"][0]["worker"] == "a"


# -- expected and actual takers, busy slots, the first paint ----------------------------------------

QWEN = "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41"


def _routed(keys: Keys, task_id: str, expected: str, *, queue: str | None = None) -> list[Event]:
    """A task submitted and routed as route_and_submit records it: the expected worker first in
    the ranking, the other after it."""
    other = "rtx3070ti" if expected == "macbookair" else "macbookair"
    candidates = [
        {"worker": expected, "expected_finish_s": 2.1},
        {"worker": other, "expected_finish_s": 4.9},
    ]
    return [
        TaskSubmitted(task_id=task_id, model="qwen3:8b", digest=QWEN, queue=keys.queue(QWEN)),
        TaskRouted(
            task_id=task_id,
            digest=QWEN,
            queue=queue or keys.queue(QWEN),
            breakdown={"candidates": candidates},
            expected_worker=expected,
            expected_finish_s=2.1,
        ),
    ]


def _claim(keys: Keys, task_id: str, worker: str, attempt: int = 1, queue: str | None = None) -> TaskClaimed:
    return TaskClaimed(
        task_id=task_id, worker=worker, digest=QWEN, attempt=attempt, queue=queue or keys.queue(QWEN)
    )


async def _plan_changes(redis: aioredis.Redis) -> None:
    """A ledger where the router expected macbookair for each task and rtx3070ti took most of them,
    each for another reason, and one task as planned; rtx3070ti's lease runs `t-busy`."""
    keys = Keys()
    events: list[Event] = [
        WorkerOnline(worker="macbookair", slots=1),
        WorkerOnline(worker="rtx3070ti", slots=1),
        # macbookair is busy with a long task when t-busy comes.
        *_routed(keys, "t-long-running", "macbookair"),
        _claim(keys, "t-long-running", "macbookair"),
        *_routed(keys, "t-busy", "macbookair"),
        _claim(keys, "t-busy", "rtx3070ti"),
        *_routed(keys, "t-planned", "rtx3070ti"),
        _claim(keys, "t-planned", "rtx3070ti"),
        TaskCompleted(task_id="t-planned", worker="rtx3070ti", digest=QWEN, attempt=1, wall_ms=900.0),
        # Its first attempt failed on macbookair; the second went to rtx3070ti.
        *_routed(keys, "t-retried", "macbookair"),
        TaskCompleted(task_id="t-long-running", worker="macbookair", digest=QWEN, attempt=1),
        _claim(keys, "t-retried", "macbookair"),
        TaskFailed(
            task_id="t-retried",
            worker="macbookair",
            digest=QWEN,
            attempt=1,
            kind="unreachable",
            retryable=True,
        ),
        _claim(keys, "t-retried", "rtx3070ti", attempt=2),
        TaskCompleted(task_id="t-retried", worker="rtx3070ti", digest=QWEN, attempt=2),
        # Handed off to macbookair's pinned stream, then taken from the shared queue.
        *_routed(keys, "t-handed", "macbookair", queue=keys.pinned("macbookair")),
        _claim(keys, "t-handed", "rtx3070ti"),
        TaskCompleted(task_id="t-handed", worker="rtx3070ti", digest=QWEN, attempt=1),
        # macbookair left before its task was taken.
        *_routed(keys, "t-left", "macbookair"),
        WorkerOffline(worker="macbookair", reason="shutdown"),
        _claim(keys, "t-left", "rtx3070ti"),
        TaskCompleted(task_id="t-left", worker="rtx3070ti", digest=QWEN, attempt=1),
        TaskCompleted(task_id="t-busy", worker="rtx3070ti", digest=QWEN, attempt=1),
        *_routed(keys, "t-running-now", "rtx3070ti"),
        _claim(keys, "t-running-now", "rtx3070ti"),
    ]
    await Ledger(redis, keys).append_many(events)
    lease = LeaseInfo(
        worker="rtx3070ti",
        token="t",
        slots=1,
        in_flight=1,
        inventory=[ModelEntry(name="qwen3:8b", digest=QWEN)],
        running=[RunningInfo(task_id="t-running-now", digest=QWEN, started_at=now_ms())],
    )
    await Leases(redis, keys).put(lease, 120_000)
    projector = Projector(redis, keys)
    await projector.start()
    await projector.catch_up()


async def test_the_overview_shows_the_expected_and_the_actual_taker_and_why_they_differ(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    await _plan_changes(redis_client)
    async with (
        serving(AppConfig(redis_url=redis_url)) as base,
        httpx.AsyncClient(base_url=base, timeout=10) as http,
    ):
        overview = (await http.get("/v1/dashboard/overview")).json()
    tasks = {t["task_id"]: t for t in overview["tasks"]}
    taken = {i: (t["expected_worker"], t["taker"]) for i, t in tasks.items()}
    reasons = {i: t["reason"] for i, t in tasks.items()}
    assert taken["t-busy"] == ("macbookair", "rtx3070ti")
    assert reasons["t-busy"] == "macbookair was busy (running t-long-r); rtx3070ti had a free slot first"
    assert taken["t-planned"] == ("rtx3070ti", "rtx3070ti") and reasons["t-planned"] is None
    assert reasons["t-retried"] == (
        "re-queued after attempt 1 failed on macbookair (unreachable); rtx3070ti took attempt 2"
    )
    assert reasons["t-handed"] == (
        "handed off to macbookair, who did not take it in time; rtx3070ti took it from the shared queue"
    )
    assert reasons["t-left"] == "macbookair was offline (shutdown); rtx3070ti took it"
    # The busy slot names the task the task rows show.
    (rtx,) = [w for w in overview["workers"] if w["id"] == "rtx3070ti"]
    assert rtx["busy"] == 1 and [r["task_id"] for r in rtx["running"]] == ["t-running-now"]
    assert tasks["t-running-now"]["status"] == "running"


async def test_chromium_fills_the_tables_within_2_s_and_shows_both_takers_the_reason_and_each_slot_s_task(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    await _plan_changes(redis_client)
    async with serving(AppConfig(redis_url=redis_url)) as base, chromium() as browser:
        page = await browser.new_page()
        loaded = time.monotonic()
        await page.call("Page.navigate", url=base + "/dashboard")
        await page.wait_for(
            "document.querySelectorAll('#fleet tbody tr[data-worker]').length >= 2"
            " && document.querySelectorAll('#tasks tbody tr[data-task]').length >= 7"
            " && document.querySelectorAll('#models tbody tr[data-model]').length >= 1",
            timeout=10,
            what="the fleet, models and tasks tables filled",
        )
        filled_s = time.monotonic() - loaded
        row = await page.evaluate(
            "(() => { const tr = document.querySelector('#tasks tr[data-task=\"t-busy\"]');"
            " return {expected: tr.querySelector('.expected').innerText,"
            " ranOn: tr.querySelector('.ran-on').innerText, ranking: tr.querySelector('.ranking').innerText,"
            " bold: tr.querySelector('.ranking b').innerText}; })()"
        )
        planned = await page.evaluate(
            "document.querySelector('#tasks tr[data-task=\"t-planned\"] .ran-on').innerText"
        )
        slot = await page.evaluate(
            "[...document.querySelectorAll('#fleet tr[data-worker=\"rtx3070ti\"] .slot-task')]"
            ".map(s => [s.dataset.task, s.innerText])"
        )
        shown = await page.evaluate(
            "[...document.querySelectorAll('#tasks tbody tr[data-task]')]"
            ".map(tr => [tr.dataset.task, tr.children[1].innerText])"
        )
        await page.click("#fleet tr[data-worker='rtx3070ti'] .slot-task")
        opened = await page.wait_for(
            "document.querySelector('#tasks tr.selected')?.dataset.task", what="the slot's task opened"
        )
        thrown = browser.of("Runtime.exceptionThrown")
        # `chromium --headless --dump-dom` (as --screenshot) takes the page at its load event.
        dumped = await asyncio.create_subprocess_exec(
            chromium_binary(),
            *("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--dump-dom"),
            base + "/dashboard",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        at_load = (await asyncio.wait_for(dumped.communicate(), 60))[0].decode()
    assert filled_s < 2.0, f"the tables were filled {filled_s:.2f}s after the navigation"
    assert 'data-ready="1"' in at_load and 'data-task="t-busy"' in at_load and "was busy" in at_load
    assert row["expected"] == "macbookair"
    assert row["ranOn"].startswith("rtx3070ti") and "macbookair was busy" in row["ranOn"]
    # The taker is the bold one, the expected one is marked as such.
    assert row["bold"].startswith("rtx3070ti") and "macbookair 2.1s (expected)" in row["ranking"]
    assert planned.strip() == "rtx3070ti"  # as planned: no reason
    # The busy slot shows the task's id as the task rows show it.
    assert slot == [["t-running-now", "t-runnin"]]
    assert ["t-running-now", "t-runnin"] in shown
    assert opened == "t-running-now"
    assert not thrown, thrown
