"""A keyless local API against a hostile web page, in real headless Chromium.

A page of another origin tries what any site the user opens can: a cross-site "simple" POST (a
form posted as text/plain, and fetch in no-cors mode) that would queue a task, and, as a DNS
rebinding attack, a page whose host name resolves to 127.0.0.1 reading the API same-origin.
(Without the guard the POSTs already failed, with a 422, because the pinned FastAPI reads no body
as JSON unless it is typed so; the guard refuses them by their origin, 403, whatever the
framework does. The rebound read succeeded without the guard.)

Rebinding is simulated with the browser's own tools: the page at http://evil.test:<api port>/ is
served by DevTools (Fetch.fulfillRequest) as the attacker's server would serve it before the name
re-resolves, and every later request of the page goes to the network, where
`--host-resolver-rules` resolves evil.test to 127.0.0.1: to the API, with `Host: evil.test:<port>`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import redis.asyncio as aioredis
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from events.event import TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from tests.helpers import events_of, wait_until
from tests.test_api_support import fleet_and_api, free_port
from tests.test_dashboard import Browser, Page, chromium

EVIL = "evil.test"
RESOLVE_EVIL = f"--host-resolver-rules=MAP {EVIL} 127.0.0.1"
# Chromium's own guard against public pages reaching loopback (Local Network Access) would stop
# the rebound page first; it is off, as in browsers without it, so that the API's guard is tested.
NO_LOCAL_NETWORK_ACCESS = "--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests"


def csrf_page(api: str) -> str:
    """Six cross-site tries at queueing a task: a text/plain form post (whose body is valid JSON),
    no-cors fetches with a text/plain body and with a Blob body (sent with no Content-Type at all,
    which FastAPI alone would read as JSON), the same two at Ollama's routes (which read any body as
    JSON), and a JSON fetch (which needs a CORS preflight)."""
    field = '{"model": "m", "messages": [{"role": "user", "content": "csrf by form", "pad": "'
    body = json.dumps({"model": "m", "prompt": "csrf by fetch"})
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "csrf by blob"}]})
    return f"""<!doctype html><html><body>
<iframe name="sink"></iframe>
<form id="f" method="POST" action="{api}/v1/chat/completions" enctype="text/plain" target="sink">
<input type="hidden" name='{field}' value='"}}]}}'></form>
<script>
window.results = {{}};
(async () => {{
  try {{
    await fetch("{api}/v1/tasks", {{method: "POST", mode: "no-cors",
      headers: {{"Content-Type": "text/plain"}}, body: {json.dumps(body)}}});
    results.simple = "sent";
  }} catch (e) {{ results.simple = "failed: " + e; }}
  try {{
    await fetch("{api}/v1/tasks", {{method: "POST", mode: "no-cors", body: new Blob([{json.dumps(body)}])}});
    results.untyped = "sent";
  }} catch (e) {{ results.untyped = "failed: " + e; }}
  // Ollama's routes read any body as JSON (as Ollama does): only the Origin keeps these out.
  try {{
    await fetch("{api}/api/generate", {{method: "POST", mode: "no-cors",
      headers: {{"Content-Type": "text/plain"}}, body: {json.dumps(body)}}});
    await fetch("{api}/api/chat", {{method: "POST", mode: "no-cors", body: new Blob([{json.dumps(chat)}])}});
    results.ollama = "sent";
  }} catch (e) {{ results.ollama = "failed: " + e; }}
  try {{
    const r = await fetch("{api}/v1/tasks", {{method: "POST",
      headers: {{"Content-Type": "application/json"}}, body: {json.dumps(body)}}});
    results.json = r.status;
  }} catch (e) {{ results.json = "blocked: " + e; }}
  document.getElementById("f").submit();
  results.form = "submitted";
}})();
</script></body></html>"""


REBOUND_PAGE = """<!doctype html><html><body><script>
window.results = {};
(async () => {
  const read = async (path, init) => {
    try { const r = await fetch(path, init); return {status: r.status, body: await r.text()}; }
    catch (e) { return {status: 0, body: String(e)}; }
  };
  results.overview = await read("/v1/dashboard/overview");
  results.task = await read("/v1/tasks/" + new URLSearchParams(location.search).get("task"));
  results.submit = await read("/v1/chat/completions", {method: "POST",
    headers: {"Content-Type": "application/json"},
    body: JSON.stringify({model: "m", messages: [{role: "user", content: "rebound"}]})});
  results.done = true;
})();
</script></body></html>"""


def app_page(api: str) -> str:
    """A web app of another origin calling the API as a browser client does: JSON, with CORS."""
    body = json.dumps({"model": "m", "prompt": "from an allowed app", "wait": True})
    return f"""<!doctype html><html><body><script>
window.results = {{}};
(async () => {{
  try {{
    const r = await fetch("{api}/v1/tasks", {{method: "POST",
      headers: {{"Content-Type": "application/json"}}, body: {json.dumps(body)}}});
    results.status = r.status;
    results.task = r.headers.get("X-Routeledger-Task");
    results.body = await r.json();
  }} catch (e) {{ results.status = "blocked: " + e; }}
  results.done = true;
}})();
</script></body></html>"""


@contextlib.asynccontextmanager
async def attacker_site(
    api: str, port: int | None = None, make_page: Callable[[str], str] = csrf_page
) -> AsyncIterator[int]:
    """A server of another origin (the attacker's, unless the API allows it), on another port:
    yields the port."""

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(make_page(api))

    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(Starlette(routes=[Route("/", page)]), host="127.0.0.1", port=port, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.02)
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


def exchanges(browser: Browser, prefix: str) -> list[dict[str, Any]]:
    """Every request the browser sent to a URL under `prefix`: method, url, status (None: no answer)."""
    sent = {
        r["requestId"]: {"method": r["request"]["method"], "url": r["request"]["url"], "status": None}
        for r in browser.of("Network.requestWillBeSent")
        if r["request"]["url"].startswith(prefix)
    }
    for r in browser.of("Network.responseReceived"):
        if r["requestId"] in sent:
            sent[r["requestId"]]["status"] = r["response"]["status"]
    return list(sent.values())


async def submitted(redis: aioredis.Redis) -> list[TaskSubmitted]:
    return await events_of(Ledger(redis, Keys()), TaskSubmitted)


async def open_dashboard(page: Page, url: str) -> str:
    """The dashboard at `url`, once its first overview arrived: the fleet table's text."""
    await page.call("Page.navigate", url=url)
    await page.wait_for("document.body?.dataset.ready === '1'", what="the first overview")
    text: str = await page.wait_for(
        "document.querySelector('#fleet tbody')?.innerText", what="the fleet table"
    )
    return text


async def test_a_page_of_another_origin_cannot_queue_a_task_by_form_or_simple_fetch(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url) as (base, _),
        attacker_site(base) as evil_port,
        chromium(NO_LOCAL_NETWORK_ACCESS) as browser,
    ):
        page = await browser.new_page()
        await page.call("Page.navigate", url=f"http://127.0.0.1:{evil_port}/")
        await page.wait_for("window.results && window.results.form === 'submitted'", what="the tries")

        def posts() -> list[dict[str, Any]]:
            return [x for x in exchanges(browser, base) if x["method"] == "POST"]

        async def answered() -> bool:
            return len([x for x in posts() if x["status"] is not None]) >= 5

        await wait_until(answered, timeout=20)
        results = await page.evaluate("window.results")
        tasks = await submitted(redis_client)
        everything = exchanges(browser, base)
        # The dashboard on its own origin still works, in the same browser.
        fleet = await open_dashboard(page, base + "/dashboard")

    # The form post and the no-cors fetches reached the API and were refused there; the JSON
    # fetch never got past its preflight.
    refused = [(x["url"], x["status"]) for x in posts() if x["status"] is not None]
    assert sorted(refused) == sorted(
        [
            (base + "/v1/chat/completions", 403),
            (base + "/v1/tasks", 403),
            (base + "/v1/tasks", 403),
            (base + "/api/generate", 403),
            (base + "/api/chat", 403),
        ]
    ), everything
    assert all(x["status"] in (403, None) for x in everything), everything
    assert results["simple"] == results["untyped"] == results["ollama"] == "sent", results
    assert str(results["json"]).startswith("blocked"), results
    assert tasks == []
    assert "a" in fleet


async def test_a_rebound_host_name_reads_nothing_and_queues_nothing_while_the_dashboard_works(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url) as (base, _),
        chromium(RESOLVE_EVIL, NO_LOCAL_NETWORK_ACCESS) as browser,
    ):
        port = base.rsplit(":", 1)[1]
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            done = await http.post(
                "/v1/tasks", json={"model": "m", "prompt": "a secret answer", "wait": True}
            )
        assert done.status_code == 200, done.text
        victim = done.json()["task_id"]

        page = await browser.new_page()
        rebound = f"http://{EVIL}:{port}/"
        # The first answer for evil.test was the attacker's server: this page is what it served.
        await page.call("Fetch.enable", patterns=[{"urlPattern": rebound + "?*", "requestStage": "Request"}])
        navigation = asyncio.create_task(page.call("Page.navigate", url=f"{rebound}?task={victim}"))

        async def paused() -> bool:
            return bool(browser.of("Fetch.requestPaused"))

        await wait_until(paused, timeout=20)
        await page.call(
            "Fetch.fulfillRequest",
            requestId=browser.of("Fetch.requestPaused")[0]["requestId"],
            responseCode=200,
            responseHeaders=[{"name": "Content-Type", "value": "text/html"}],
            body=base64.b64encode(REBOUND_PAGE.encode()).decode(),
        )
        await navigation
        await page.call("Fetch.disable")
        results = await page.wait_for("window.results && window.results.done && window.results")
        failed = browser.of("Network.loadingFailed")
        tasks = await submitted(redis_client)

        # The same API, reached under a name it answers to, serves the dashboard as before.
        fleet = await open_dashboard(page, base + "/dashboard")
        local = await open_dashboard(page, f"http://localhost:{port}/dashboard")
        # And the page itself is not served under the rebound name.
        await page.call("Page.navigate", url=f"http://{EVIL}:{port}/dashboard")
        shell = await page.wait_for("document.body?.innerText", what="the answer to the rebound name")

    for name in ("overview", "task", "submit"):
        assert results[name]["status"] == 403, (name, results[name], json.dumps(failed))
        assert "allowed_hosts" in results[name]["body"]
    assert "a secret answer" not in json.dumps(results)
    assert [t.task_id for t in tasks] == [victim]
    assert "a" in fleet and "a" in local
    assert "allowed_hosts" in shell


async def test_a_web_app_of_an_allowed_origin_calls_the_api_with_cors(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    app_port = free_port()
    allowed = [f"http://127.0.0.1:{app_port}"]
    async with (
        fleet_and_api(redis_client, redis_url, allowed_origins=allowed) as (base, _),
        attacker_site(base, app_port, app_page),
        chromium(NO_LOCAL_NETWORK_ACCESS) as browser,
    ):
        page = await browser.new_page()
        await page.call("Page.navigate", url=f"http://127.0.0.1:{app_port}/")
        results = await page.wait_for("window.results && window.results.done && window.results", timeout=30)
        tasks = await submitted(redis_client)
    assert results["status"] == 200, results
    assert results["task"] and [t.task_id for t in tasks] == [results["task"]]
    assert results["body"]["status"] == "completed"
