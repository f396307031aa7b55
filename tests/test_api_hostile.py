"""Hostile input on every route: bodies nested deeper than anything reads, numbers past every
bound, methods a path does not have. Each is a 4xx in the client's own error shape, that says what
is wrong, and never a 500, nor a 503 that blames Redis for the request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from api.errors import NATIVE, OLLAMA, OPENAI, surface_of
from api.schemas import MAX_DEPTH
from events.ledger import Ledger
from tests.test_api_support import ghost_worker, serving

HI: Final = [{"role": "user", "content": "hi"}]
# Where a deep value fits each route's body: a field the route reads whatever JSON it holds. `{}`
# marks the spot; an empty list: only the body itself (its fields are typed all the way down).
FREE_FORM: Final[dict[str, list[dict[str, Any]]]] = {
    "/v1/tasks": [
        {"model": "m", "messages": HI, "options": {"temperature": {}}},
        {"model": "m", "messages": HI, "format": {}},
        {"model": "m", "messages": HI, "tools": [{}]},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": {}}]}]},
        {
            "model": "m",
            "messages": [
                *HI,
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
            ],
        },
    ],
    "/v1/chat/completions": [
        {"model": "m", "messages": HI, "response_format": {}},
        {"model": "m", "messages": HI, "tools": [{}]},
        {"model": "m", "messages": HI, "tool_choice": {}},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": {}}]}]},
    ],
    "/api/chat": [
        {"model": "m", "messages": HI, "options": {"top_k": {}}},
        {"model": "m", "messages": HI, "format": {}},
        {"model": "m", "messages": HI, "tools": [{}]},
    ],
    "/v1/completions": [],
    "/api/generate": [
        {"model": "m", "prompt": "hi", "options": {}},
        {"model": "m", "prompt": "hi", "format": {}},
    ],
    "/api/show": [],
    "/v1/embeddings": [{"model": "m", "input": {}}],
    "/api/embed": [{"model": "m", "input": "hi", "options": {}}],
    "/api/embeddings": [{"model": "m", "prompt": "hi", "options": {}}],
    "/v1/bench": [],
    "/v1/pipelines": [],
}


def nested(depth: int, kind: str) -> bytes:
    """JSON arrays (`[`) or objects (`{`) nested `depth` deep."""
    if kind == "[":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * (depth - 1) + b"{}" + b"}" * (depth - 1)


def placed(body: dict[str, Any], deep: bytes) -> bytes:
    """`body` as JSON with `deep` where its `{}` marks the spot."""
    return httpx.Request("POST", "/", json=body).content.replace(b"{}", deep, 1)


def refused_as_too_deep(path: str, response: httpx.Response) -> str | None:
    """What is wrong with the answer to a body nested too deep, if anything."""
    if response.status_code != 400:
        return f"{path}: {response.status_code} {response.text[:200]}"
    error = response.json()["error"]
    surface = surface_of(path)
    if surface == OLLAMA:
        message = error if isinstance(error, str) else ""
    elif surface == OPENAI:
        message = error["message"] if set(error) == {"message", "type", "param", "code"} else ""
    else:
        message = error["message"] if {"type", "message", "hint"} <= set(error) else ""
    if f"more than {MAX_DEPTH} deep" not in message:
        return f"{path}: not the {surface} shape, or not about depth: {response.text[:200]}"
    return None


@pytest.fixture
async def http(redis_client: aioredis.Redis, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The API over a fleet of one lease for `m` (no agent), taking bodies up to 1 MiB."""
    await ghost_worker(redis_client)
    config = AppConfig(redis_url=redis_url, max_body_bytes=1024 * 1024)
    async with serving(config) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        yield client


async def test_a_body_nested_a_thousand_or_a_hundred_thousand_deep_is_a_400_on_every_route(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    before = await ledger.length()
    wrong = []
    for path, bodies in FREE_FORM.items():
        for depth in (1_000, 100_000):
            for kind in "[{":
                deep = nested(depth, kind)
                # The body itself, a field the route does not know, and each field it reads as is.
                sent = [deep, placed({"model": "m", "messages": HI, "extra": {}}, deep)]
                sent += [placed(body, deep) for body in bodies]
                for content in sent:
                    response = await http.post(
                        path, content=content, headers={"content-type": "application/json"}
                    )
                    wrong.append(refused_as_too_deep(path, response))
    assert [w for w in wrong if w] == []
    assert await ledger.length() == before


async def test_a_field_nested_past_the_limit_is_refused_before_anything_recursive_reads_it(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    # Deep enough for no parser to fail, too deep for the msgpack encoder and the worker's encoders
    # to be safe with: refused by depth, as a body nested too deep to read at all is.
    before = await ledger.length()
    wrong = []
    for path, bodies in FREE_FORM.items():
        for body in bodies:
            for kind in "[{":
                # In an object: each spot takes one (a format, an option's value, a tool, a text).
                deep = b'{"x":' + nested(MAX_DEPTH + 50, kind) + b"}"
                response = await http.post(
                    path, content=placed(body, deep), headers={"content-type": "application/json"}
                )
                wrong.append(refused_as_too_deep(path, response))
    assert [w for w in wrong if w] == []
    assert await ledger.length() == before


async def test_a_body_nested_within_the_limit_is_read_as_usual(http: httpx.AsyncClient) -> None:
    # A JSON schema for structured output nested 40 levels: queued like any other task.
    schema = placed({"model": "m", "messages": HI, "format": {}}, nested(40, "{"))
    response = await http.post("/v1/tasks", content=schema, headers={"content-type": "application/json"})
    assert response.status_code == 202, response.text


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("/v1/dashboard/samples?since=18446744073709551616", "since"),
        ("/v1/dashboard/samples?since=-1", "since"),
        ("/v1/dashboard/samples?since=soon", "since"),
        ("/v1/dashboard/samples?since=1.5", "since"),
        ("/v1/dashboard/samples?limit=0", "limit"),
        ("/v1/dashboard/samples?limit=50001", "limit"),
        ("/v1/dashboard/samples?limit=99999999999999999999999", "limit"),
        ("/v1/route/preview?model=m&tokens=18446744073709551616", "tokens"),
        ("/v1/route/preview?model=m&tokens=0", "tokens"),
        ("/v1/route/preview?model=m&tokens=many", "tokens"),
        ("/v1/dashboard/stream?after=99999999999999999999-0", "after"),
        ("/v1/dashboard/stream?after=1-99999999999999999999", "after"),
        ("/v1/dashboard/stream?after=123", "after"),
    ],
)
async def test_a_query_number_out_of_range_or_malformed_is_a_422_naming_it_not_an_outage(
    http: httpx.AsyncClient, query: str, param: str
) -> None:
    response = await http.get(query)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "validation_error"
    assert param in error["message"] and "Redis" not in error["message"]


async def test_the_largest_ledger_time_is_a_valid_since(http: httpx.AsyncClient) -> None:
    response = await http.get("/v1/dashboard/samples?since=18446744073709551615")
    assert response.status_code == 200, response.text
    assert response.json()["samples"] == []


async def test_options_lists_every_method_of_a_path_and_a_wrong_method_is_a_405_that_does_too(
    http: httpx.AsyncClient,
) -> None:
    options = await http.options("/v1/tasks/abc")
    assert options.status_code == 204
    assert options.headers["allow"] == "DELETE, GET, OPTIONS"
    put = await http.put("/v1/tasks/abc", json={})
    assert put.status_code == 405 and put.headers["allow"] == "DELETE, GET"
    assert put.json()["error"]["type"] == "method_not_allowed"
    # In each surface's own shape.
    chat = await http.get("/v1/chat/completions")
    assert chat.status_code == 405 and chat.headers["allow"] == "POST"
    assert set(chat.json()["error"]) == {"message", "type", "param", "code"}
    ollama = await http.get("/api/chat")
    assert ollama.status_code == 405 and isinstance(ollama.json()["error"], str)


async def test_a_value_of_another_json_type_is_refused_and_a_whole_number_written_as_5_0_is_not(
    http: httpx.AsyncClient,
) -> None:
    task = {"model": "m", "messages": HI}
    for field, value in (("wait", 0), ("stream", "true"), ("max_tokens", "5"), ("priority", True)):
        response = await http.post("/v1/tasks", json={**task, field: value})
        assert response.status_code == 422, (field, response.text)
        assert response.json()["error"]["message"].startswith(f"body.{field}: Input should be a valid")
    generate = await http.post("/api/generate", json={"model": "m", "prompt": "hi", "stream": 0})
    assert generate.status_code == 422, generate.text
    # JSON Schema counts 5.0 an integer, and so does the API; 5.5 is not one.
    assert (
        await http.post("/v1/tasks", json={**task, "max_tokens": 5.0, "priority": 3.0})
    ).status_code == 202
    assert (await http.post("/v1/tasks", json={**task, "max_tokens": 5.5})).status_code == 422
    bench = await http.post("/v1/bench", json={"model": "nobody", "count": 2.0})
    assert bench.status_code == 404, bench.text


async def test_the_document_lists_what_each_route_answers_in_its_surfaces_shape(
    http: httpx.AsyncClient,
) -> None:
    doc = (await http.get("/openapi.json")).json()
    shapes = {NATIVE: "NativeError", OPENAI: "OpenAIError", OLLAMA: "OllamaError"}
    assert set(shapes.values()) <= set(doc["components"]["schemas"])
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            # The guard's answers, on every route; a body's type on every route that takes one.
            assert {"403", "413"} <= set(responses), (method, path)
            assert ("415" in responses) == (method == "post" and not path.startswith("/api/")), (method, path)
            for status, response in responses.items():
                if status.startswith(("4", "5")) and "$ref" in str(response):
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/" + shapes[surface_of(path)]), (method, path, status)
    submits = ("400", "404", "413", "422", "429", "502", "503", "504")
    for path in ("/v1/tasks", "/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"):
        assert set(submits) <= set(doc["paths"][path]["post"]["responses"]), path
    assert {"404", "409", "503"} <= set(doc["paths"]["/v1/tasks/{task_id}"]["delete"]["responses"])
    assert "text/event-stream" in doc["paths"]["/v1/tasks"]["post"]["responses"]["200"]["content"]
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert [kind.split(";")[0] for kind in metrics] == ["text/plain"]
    # What is refused after decoding is in the document too: the configured domains, for one.
    task = doc["components"]["schemas"]["TaskCreate"]
    assert "general" in task["properties"]["domain"]["enum"]
    assert task["properties"]["wait"]["type"] == "boolean"


async def test_with_keys_configured_the_document_says_so_and_lists_the_401(redis_url: str) -> None:
    config = AppConfig(redis_url=redis_url, api_keys=["k1"])
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as http:
        doc = (await http.get("/openapi.json", headers={"authorization": "Bearer k1"})).json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert "401" in doc["paths"]["/v1/tasks"]["post"]["responses"]
    assert doc["paths"]["/v1/tasks"]["post"]["security"] == [{"bearer": []}]
    # The probes need no key.
    assert "401" not in doc["paths"]["/healthz"]["get"]["responses"]
    assert "security" not in doc["paths"]["/readyz"]["get"]
