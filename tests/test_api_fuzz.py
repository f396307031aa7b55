"""Fuzzing the POST endpoints from the app's own OpenAPI schema: whatever the body, never a 5xx.

(schemathesis does this over an OpenAPI schema; this is the same idea with
hypothesis: bodies are drawn from each endpoint's schema, then broken in every way: malformed
JSON, wrong types, missing and extra fields, empty and huge values.)
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import redis
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import AppConfig, create_app
from events.event import ModelEntry
from events.keys import Keys
from tasks.lease import LeaseInfo, encode_lease
from tests.helpers import MODEL_DIGEST
from tests.test_api_support import free_port

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
# Values the schema allows in type but not in size or sense.
EXTREMES = st.one_of(
    st.just(""),
    st.just("x" * 70_000),
    st.just([]),
    st.just({}),
    st.just(0),
    st.just(-1),
    st.just(2**64),
    st.lists(st.fixed_dictionaries({"role": st.text(max_size=5), "content": ANY_JSON}), max_size=300),
    st.dictionaries(
        st.text(max_size=5), st.integers(min_value=2**64, max_value=2**80), min_size=1, max_size=2
    ),
)
# A request that would be accepted, for the drawn fields to break: the deeper paths get exercised.
PLAUSIBLE = st.sampled_from(
    [
        {},
        {"model": "m", "prompt": "hi"},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    ]
)


@contextlib.contextmanager
def api_in_thread(config: AppConfig) -> Iterator[str]:
    """The API served by uvicorn on its own event loop in a thread (hypothesis drives it synchronously)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline, "the API did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    target: Any = schema
    for part in ref.removeprefix("#/").split("/"):
        target = target[part]
    return _resolve(schema, target)


def post_bodies(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """POST path -> its request body's (resolved) JSON schema."""
    out = {}
    for path, ops in schema["paths"].items():
        post = ops.get("post")
        if post is None or "requestBody" not in post:
            continue
        body = post["requestBody"]["content"]["application/json"]["schema"]
        out[path] = _resolve(schema, body)
    return out


def _at_once(value: Any) -> Any:
    # Without wait or stream a task is answered when queued: nothing waits for a worker.
    return (
        {k: v for k, v in value.items() if k not in ("wait", "stream")} if isinstance(value, dict) else value
    )


def bodies(spec: dict[str, Any], answer_at_once: bool = False) -> st.SearchStrategy[bytes]:
    """Bodies for a schema: its field names with wrong, odd or extreme values; any JSON; garbage."""
    names = sorted(spec.get("properties", {}))
    required = spec.get("required", [])
    fields = st.sampled_from(names) if names else st.text(max_size=8)
    shaped = st.builds(
        lambda plausible, base, extra: {**plausible, **base, **extra},
        PLAUSIBLE,
        st.fixed_dictionaries(
            {n: st.one_of(st.just("m"), st.just("auto"), ANY_JSON, EXTREMES) for n in required}
        ),
        st.dictionaries(fields, st.one_of(ANY_JSON, EXTREMES), max_size=len(names) or 3),
    )
    # One field of a plausible request broken at a time reaches the deepest code.
    mutated = st.builds(
        lambda base, name, value: {**base, name: value}, PLAUSIBLE, fields, st.one_of(ANY_JSON, EXTREMES)
    )
    values = st.one_of(mutated, shaped, ANY_JSON)
    if answer_at_once:
        values = values.map(_at_once)
    as_json = values.map(lambda v: json.dumps(v).encode())
    broken = as_json.flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda i: b[:i]))
    return st.one_of(as_json, broken, st.binary(max_size=64))


def test_no_body_sent_to_any_post_endpoint_gets_a_5xx(redis_url: str) -> None:
    config = AppConfig(redis_url=redis_url, max_body_bytes=64 * 1024, max_messages=64)
    with api_in_thread(config) as base, httpx.Client(base_url=base, timeout=30) as http:
        schema = http.get("/openapi.json").json()
        specs = post_bodies(schema)
        assert {"/v1/tasks", "/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"} <= set(
            specs
        )

        @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(st.sampled_from(sorted(specs)).flatmap(lambda p: st.tuples(st.just(p), bodies(specs[p]))))
        def fuzz(case: tuple[str, bytes]) -> None:
            path, body = case
            response = http.post(path, content=body, headers={"content-type": "application/json"})
            assert response.status_code < 500, (path, body[:200], response.text[:300])
            assert "error" in response.json() or response.status_code < 300

        fuzz()


def test_no_task_body_gets_a_5xx_even_when_its_model_is_served(redis_url: str) -> None:
    # A lease for `m` with no agent behind it: valid bodies are queued, so the whole submission runs.
    lease = LeaseInfo(
        worker="ghost", token="t", slots=1, inventory=[ModelEntry(name="m:latest", digest=MODEL_DIGEST)]
    )
    client = redis.Redis.from_url(redis_url)
    client.set(Keys().live("ghost"), encode_lease(lease), px=300_000)
    client.sadd(Keys().workers, "ghost")  # the registry, as Leases.put would write it
    client.close()
    config = AppConfig(redis_url=redis_url, max_body_bytes=64 * 1024, max_messages=64)
    with api_in_thread(config) as base, httpx.Client(base_url=base, timeout=30) as http:
        spec = post_bodies(http.get("/openapi.json").json())["/v1/tasks"]

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(bodies(spec, answer_at_once=True))
        def fuzz(body: bytes) -> None:
            response = http.post("/v1/tasks", content=body, headers={"content-type": "application/json"})
            assert response.status_code < 500, (body[:200], response.text[:300])

        fuzz()
