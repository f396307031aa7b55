"""The guard's host, origin and content-type checks: what a web page could send is refused, what
the API's clients send is not."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import ollama
import openai
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from api.auth import allowed_host_names, host_name, is_json, normal_origin, same_origin
from events.ledger import Ledger
from tests.test_api_support import fleet_and_api, ghost_worker, serving

HI = [{"role": "user", "content": "hi"}]
TASK = {"model": "m", "messages": HI}


@pytest.fixture
async def http(redis_client: aioredis.Redis, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The keyless API with one configured host name and origin, over a fleet of one lease."""
    await ghost_worker(redis_client)
    config = AppConfig(
        redis_url=redis_url,
        allowed_hosts=["router.lan"],
        allowed_origins=["https://chat.example:3000"],
        bound_host="10.1.2.3",
    )
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as client:
        yield client


def test_a_host_name_is_read_without_its_port_and_in_lower_case() -> None:
    assert host_name(b"LocalHost:8600") == b"localhost"
    assert host_name(b"[::1]:8600") == b"[::1]"
    assert host_name(b"127.0.0.1") == b"127.0.0.1"


def test_the_allowed_names_are_loopback_the_configured_ones_and_a_bound_address_but_not_a_wildcard() -> None:
    names = allowed_host_names(["Router.LAN:8600"], "fe80::1")
    assert names == {b"localhost", b"127.0.0.1", b"[::1]", b"router.lan", b"[fe80::1]"}
    assert allowed_host_names([], "0.0.0.0") == {b"localhost", b"127.0.0.1", b"[::1]"}
    assert allowed_host_names(["*"], None) is None


def test_an_origin_is_the_same_as_the_host_it_came_to_whatever_the_default_port() -> None:
    assert same_origin(b"http://127.0.0.1:8600", b"127.0.0.1:8600")
    assert same_origin(b"http://localhost", b"localhost:80")
    assert not same_origin(b"http://127.0.0.1:9000", b"127.0.0.1:8600")
    assert not same_origin(b"null", b"127.0.0.1:8600")
    assert normal_origin(b"HTTPS://Chat.Example:443/") == b"https://chat.example"


def test_json_is_application_json_with_or_without_parameters() -> None:
    assert is_json(b"application/json")
    assert is_json(b"Application/JSON; charset=utf-8")
    assert not is_json(b"text/plain")
    assert not is_json(b"application/x-www-form-urlencoded")
    assert not is_json(b"application/jsonp")


@pytest.mark.parametrize(
    "host", ["localhost:8600", "127.0.0.1", "[::1]:1234", "ROUTER.lan:80", "10.1.2.3:8600", "localhost"]
)
async def test_loopback_configured_and_bound_host_names_are_served_on_any_port(
    http: httpx.AsyncClient, host: str
) -> None:
    response = await http.get("/v1/models", headers={"host": host})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "read"),
    [
        ("/v1/dashboard/overview", lambda body: body["error"]["message"] + body["error"]["hint"]),
        ("/v1/models", lambda body: body["error"]["message"]),
        ("/api/tags", lambda body: body["error"]),
        ("/dashboard", lambda body: body["error"]["message"] + body["error"]["hint"]),
    ],
)
async def test_another_host_name_is_refused_with_how_to_allow_it_in_each_surfaces_shape(
    http: httpx.AsyncClient, path: str, read: object
) -> None:
    response = await http.get(path, headers={"host": "evil.test:8600"})
    assert response.status_code == 403
    text = read(response.json())  # type: ignore[operator]
    assert "evil.test" in text and "allowed_hosts" in text


async def test_a_wildcard_allows_any_host_name(redis_client: aioredis.Redis, redis_url: str) -> None:
    await ghost_worker(redis_client)
    config = AppConfig(redis_url=redis_url, allowed_hosts=["*"])
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as http:
        response = await http.get("/v1/models", headers={"host": "anything.example"})
    assert response.status_code == 200


async def test_a_foreign_origin_is_refused_and_queues_nothing(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    before = await ledger.length()
    posted = await http.post("/v1/tasks", json=TASK, headers={"origin": "https://evil.example"})
    sandboxed = await http.post("/v1/tasks", json=TASK, headers={"origin": "null"})
    preflight = await http.options(
        "/v1/chat/completions",
        headers={"origin": "http://127.0.0.1:9999", "access-control-request-method": "POST"},
    )
    assert posted.status_code == sandboxed.status_code == preflight.status_code == 403
    assert "allowed_origins" in posted.json()["error"]["hint"]
    assert "access-control-allow-origin" not in preflight.headers
    assert await ledger.length() == before


async def test_the_apis_own_origin_and_a_configured_one_may_call_it(http: httpx.AsyncClient) -> None:
    own = http.base_url.host + ":" + str(http.base_url.port)
    same = await http.post("/v1/tasks", json=TASK, headers={"origin": f"http://{own}"})
    configured = await http.post("/v1/tasks", json=TASK, headers={"origin": "https://chat.example:3000"})
    assert same.status_code == configured.status_code == 202
    # Only the other origin needs CORS headers to read the answer.
    assert "access-control-allow-origin" not in same.headers
    assert configured.headers["access-control-allow-origin"] == "https://chat.example:3000"
    assert "x-routeledger-task" in configured.headers["access-control-expose-headers"]


async def test_a_configured_origins_preflight_is_answered_without_a_key_and_its_request_needs_one(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    await ghost_worker(redis_client)
    config = AppConfig(redis_url=redis_url, api_keys=["k"], allowed_origins=["https://chat.example"])
    origin = {"origin": "https://chat.example"}
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as http:
        preflight = await http.options(
            "/v1/chat/completions",
            headers={
                **origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization",
            },
        )
        keyless = await http.post("/v1/tasks", json=TASK, headers=origin)
        keyed = await http.post("/v1/tasks", json=TASK, headers={**origin, "authorization": "Bearer k"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "https://chat.example"
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    assert keyless.status_code == 401 and keyed.status_code == 202


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/v1/tasks", "text/plain"),
        ("/v1/chat/completions", "text/plain;charset=UTF-8"),
        ("/v1/embeddings", "application/x-www-form-urlencoded"),
        ("/v1/completions", "multipart/form-data; boundary=x"),
        ("/v1/tasks", None),
    ],
)
async def test_a_body_sent_as_anything_but_json_is_a_415_that_says_what_to_send(
    http: httpx.AsyncClient, ledger: Ledger, path: str, content_type: str | None
) -> None:
    before = await ledger.length()
    headers = {} if content_type is None else {"content-type": content_type}
    response = await http.post(path, content=b'{"model": "m", "prompt": "hi"}', headers=headers)
    assert response.status_code == 415
    assert "application/json" in response.text
    assert await ledger.length() == before


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
async def test_the_ollama_routes_read_a_body_as_json_whatever_its_type_as_ollama_does(
    http: httpx.AsyncClient, ledger: Ledger, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    before = await ledger.length()
    body = b'{"model": "m", "prompt": "hi", "stream": false, "options": {"num_predict": 1}}'
    # `m` has no worker here (a ghost lease): the task is accepted and queued, so ask nothing back.
    shown = await http.post("/api/show", content=b'{"model": "m"}', headers=headers)
    garbled = await http.post("/api/generate", content=b"model=m&prompt=hi", headers=headers)
    # A page of another site gets no further for it: its Origin is refused before any body is read.
    forged = await http.post(
        "/api/generate", content=body, headers={**headers, "origin": "https://evil.example"}
    )
    assert shown.status_code == 200 and "FROM m:latest" in shown.json()["modelfile"]
    assert garbled.status_code == 400 and "JSON" in garbled.json()["error"]
    assert forged.status_code == 403
    assert await ledger.length() == before


async def test_json_with_a_charset_and_a_bodiless_request_pass(http: httpx.AsyncClient) -> None:
    typed = await http.post(
        "/v1/tasks",
        content=b'{"model": "m", "prompt": "hi"}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    cancelled = await http.delete(f"/v1/tasks/{typed.json()['task_id']}")
    assert typed.status_code == 202 and cancelled.status_code == 200


async def test_the_openai_and_ollama_clients_pass_every_check_with_sampling_options(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):
        oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused")
        chat = await oai.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0.2,
            top_p=0.9,
            seed=1,
            stop=["x"],
        )
        oll = ollama.AsyncClient(host=base)
        answer = await oll.chat(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            options={
                "temperature": 0.2,
                "top_k": 20,
                "num_predict": 30,
                "repeat_penalty": 1.1,
                "num_ctx": 2048,
            },
        )
    assert chat.choices[0].message.content
    assert answer.message.content
