"""The hot routes' lane: answered by their endpoints past FastAPI's routing, errors in each shape."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import APIRouter
from starlette.types import Message, Receive, Scope, Send

from api import native, ollama, openai
from api.app import AppConfig, create_app
from api.hotpath import HOT_ROUTES, HotPath


def _lane() -> tuple[HotPath, list[str]]:
    passed: list[str] = []

    async def downstream(scope: Scope, receive: Receive, send: Send) -> None:
        passed.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = create_app(AppConfig(redis_url="redis://127.0.0.1:1"))
    lane = HotPath(downstream, fastapi=app, routers=(native.router, openai.router, ollama.router))
    return lane, passed


async def _call(lane: HotPath, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any], Scope]:
    scope: Scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await lane(scope, receive, send)
    status = sent[0]["status"]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return status, (json.loads(payload) if payload else {}), scope


async def test_each_hot_route_is_answered_by_its_endpoint_without_passing_the_request_on() -> None:
    lane, passed = _lane()
    assert set(lane.routes) == HOT_ROUTES
    for method, path in sorted(HOT_ROUTES):
        # A body of the wrong shape never reaches Redis: the endpoint's own decoding refuses it.
        status, body, scope = await _call(lane, method, path, b'{"model": 7}')
        assert status == 422
        assert "model" in json.dumps(body["error"])
        assert scope["route"].path == path
    assert passed == []


async def test_anything_else_goes_on_to_fastapi() -> None:
    lane, passed = _lane()
    status, _, _ = await _call(lane, "GET", "/v1/chat/completions", b"")
    assert status == 204
    status, _, _ = await _call(lane, "POST", "/v1/completions", b"{}")
    assert status == 204
    assert passed == ["/v1/chat/completions", "/v1/completions"]


async def test_malformed_json_on_the_lane_is_a_400_in_the_clients_shape() -> None:
    lane, _ = _lane()
    status, body, _ = await _call(lane, "POST", "/v1/chat/completions", b"[1, 2")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body, _ = await _call(lane, "POST", "/api/chat", b"nope")
    assert status == 400 and isinstance(body["error"], str)


def test_a_lane_whose_routers_lack_a_hot_route_refuses_to_start() -> None:
    app = create_app(AppConfig(redis_url="redis://127.0.0.1:1"))
    with pytest.raises(ValueError, match="/api/chat"):
        HotPath(app, fastapi=app, routers=(native.router, openai.router, APIRouter()))


async def test_a_client_gone_before_its_body_arrived_is_a_400_not_a_server_error() -> None:
    lane, _ = _lane()
    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await lane(scope, receive, send)
    assert sent[0]["status"] == 400
