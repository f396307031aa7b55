"""Bad inputs get the documented 4xx in each surface's shape and leave the ledger unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from events.ledger import Ledger
from tests.test_api_support import ghost_worker, serving

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def http(redis_client: aioredis.Redis, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The API with small limits over a fleet of one lease (no agent: nothing appends heartbeats)."""
    await ghost_worker(redis_client)
    config = AppConfig(redis_url=redis_url, max_body_bytes=4096, max_messages=3)
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "body", "status", "kind"),
    [
        ("/v1/tasks", {"model": "nope", "messages": HI}, 404, "model_not_found"),
        ("/v1/tasks", {"model": "m", "messages": []}, 400, "invalid_request"),
        ("/v1/tasks", {"model": "m"}, 400, "invalid_request"),
        ("/v1/tasks", {"model": 7, "messages": HI}, 422, "validation_error"),
        ("/v1/tasks", {"model": "m", "messages": "hi"}, 422, "validation_error"),
        ("/v1/tasks", {"model": "m", "messages": HI, "max_tokens": 0}, 422, "validation_error"),
        ("/v1/tasks", {"model": "m", "messages": HI * 4}, 413, "payload_too_large"),
        ("/v1/tasks", {"model": "m", "prompt": "x" * 5000}, 413, "payload_too_large"),
    ],
)
async def test_a_bad_native_request_gets_its_status_and_type_and_leaves_the_ledger_alone(
    http: httpx.AsyncClient, ledger: Ledger, path: str, body: dict[str, object], status: int, kind: str
) -> None:
    before = await ledger.length()
    response = await http.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == kind
    assert error["message"]
    assert set(error) >= {"type", "message", "hint"}
    assert await ledger.length() == before


async def test_an_unknown_model_lists_the_available_ones_in_every_shape(http: httpx.AsyncClient) -> None:
    native = await http.post("/v1/tasks", json={"model": "nope", "messages": HI})
    oai = await http.post("/v1/chat/completions", json={"model": "nope", "messages": HI})
    oll = await http.post("/api/chat", json={"model": "nope", "messages": HI, "stream": False})
    assert native.json()["error"]["available"] == ["m:latest"]
    assert oai.status_code == 404 and oai.json()["error"]["code"] == "model_not_found"
    assert set(oai.json()["error"]) == {"message", "type", "param", "code"}
    assert "m:latest" in oai.json()["error"]["message"]
    assert (
        oll.status_code == 404 and isinstance(oll.json()["error"], str) and "m:latest" in oll.json()["error"]
    )


async def test_an_image_that_is_not_base64_is_refused_before_anything_is_queued(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    before = await ledger.length()
    bad = [{"role": "user", "content": "what is this?", "images": ["aGk=", "data:image/png;base64,aGk="]}]
    chat = await http.post("/api/chat", json={"model": "m", "messages": bad, "stream": False})
    generate = await http.post("/api/generate", json={"model": "m", "prompt": "x", "images": ["%%%"]})
    assert (chat.status_code, generate.status_code) == (422, 422)
    assert "image 1 is not valid base64" in chat.json()["error"]
    assert "image 0 is not valid base64" in generate.json()["error"]
    assert await ledger.length() == before


async def test_malformed_json_is_a_400_in_the_clients_shape(http: httpx.AsyncClient, ledger: Ledger) -> None:
    before = await ledger.length()
    headers = {"content-type": "application/json"}
    native = await http.post("/v1/tasks", content=b'{"model": ', headers=headers)
    oai = await http.post("/v1/chat/completions", content=b"[1, 2", headers=headers)
    oll = await http.post("/api/generate", content=b"nope", headers=headers)
    assert (native.status_code, oai.status_code, oll.status_code) == (400, 400, 400)
    assert native.json()["error"]["type"] == "invalid_request"
    assert oai.json()["error"]["type"] == "invalid_request_error"
    assert isinstance(oll.json()["error"], str)
    assert await ledger.length() == before


async def test_a_body_over_the_limit_is_refused_before_it_is_parsed(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    before = await ledger.length()
    big = {"model": "m", "messages": [{"role": "user", "content": "y" * 10_000}]}
    oai = await http.post("/v1/chat/completions", json=big)

    async def chunked() -> AsyncIterator[bytes]:
        # No Content-Length: the guard counts the body as it arrives.
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"z" * 1000
        yield b'"}'

    streamed = await http.post("/v1/tasks", content=chunked(), headers={"content-type": "application/json"})
    assert oai.status_code == 413 and oai.json()["error"]["code"] == "request_too_large"
    assert streamed.status_code == 413 and streamed.json()["error"]["type"] == "payload_too_large"
    assert await ledger.length() == before


async def test_only_one_completion_per_request_is_supported(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", json={"model": "m", "messages": HI, "n": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


async def test_an_unknown_route_and_an_unknown_task_are_404(http: httpx.AsyncClient) -> None:
    route = await http.get("/v1/nothing")
    task = await http.get("/v1/tasks/0123")
    history = await http.get("/v1/tasks/0123/events")
    assert route.status_code == task.status_code == history.status_code == 404
    assert task.json()["error"]["type"] == "not_found"


async def test_a_benchmark_of_a_model_nobody_serves_is_a_404_that_lists_the_models(
    http: httpx.AsyncClient,
) -> None:
    response = await http.post("/v1/bench", json={"model": "nope"})
    assert response.status_code == 404 and "nope" in response.json()["error"]["message"]
    bad = await http.post("/v1/bench", json={"domain": "astrology"})
    assert bad.status_code == 400 and "general" in bad.json()["error"]["hint"]


async def test_with_keys_configured_a_missing_or_wrong_key_is_refused(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    await ghost_worker(redis_client)
    before = await ledger.length()
    config = AppConfig(redis_url=redis_url, api_keys=["k-one", "k-two"])
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as http:
        body = {"model": "m", "messages": HI}
        none = await http.post("/v1/tasks", json=body)
        wrong = await http.post("/v1/tasks", json=body, headers={"Authorization": "Bearer k-three"})
        oll = await http.get("/api/tags", headers={"Authorization": "Bearer k-on"})
        right = await http.get("/v1/models", headers={"Authorization": "Bearer k-two"})
        probe = await http.get("/healthz")
    assert none.status_code == wrong.status_code == oll.status_code == 401
    assert none.headers["www-authenticate"] == "Bearer"
    assert wrong.json()["error"]["type"] == "unauthorized"
    assert isinstance(oll.json()["error"], str)
    assert right.status_code == 200 and probe.status_code == 200
    assert await ledger.length() == before


async def test_a_body_of_the_wrong_shape_is_a_422_naming_the_field_in_each_surfaces_shape(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    before = await ledger.length()
    bad = [{"role": 5, "content": "hi"}]
    native = await http.post("/v1/tasks", json={"model": "m", "messages": bad})
    oai = await http.post("/v1/chat/completions", json={"model": "m", "messages": bad})
    oll = await http.post("/api/chat", json={"model": "m", "messages": bad, "stream": False})
    assert (native.status_code, oai.status_code, oll.status_code) == (422, 422, 422)
    assert native.json()["error"]["type"] == "validation_error"
    assert native.json()["error"]["message"].startswith(
        "body.messages.0.role: Input should be a valid string"
    )
    assert oai.json()["error"]["param"] == "messages.0.role"
    assert "messages.0.role" in oll.json()["error"]
    # A missing field is named down to the field; an empty body is a missing one.
    missing = await http.post("/v1/chat/completions", json={"model": "m", "messages": [{"content": "x"}]})
    empty = await http.post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "messages.0.role"
    assert empty.status_code == 422 and "body: Field required" in empty.json()["error"]["message"]
    assert await ledger.length() == before


async def test_the_hot_routes_bodies_are_described_in_the_openapi_document(http: httpx.AsyncClient) -> None:
    doc = (await http.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    for path, name in (
        ("/v1/tasks", "TaskCreate"),
        ("/v1/chat/completions", "ChatCompletionCreate"),
        ("/api/chat", "OllamaChat"),
    ):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert schemas[name]["properties"]["messages"]
    assert schemas["ChatMessage"]["required"] == ["role"]
    assert schemas["TaskCreate"]["properties"]["priority"] == {
        "type": "integer",
        "minimum": -1000,
        "maximum": 1000,
        "default": 0,
    }
