"""Images, structured output and thinking end to end: the real `openai` and `ollama` clients through
the API to simulated backends, whichever API the worker speaks to its backend, and the refusals in
each surface's error shape.

What reached the backend is read from what the simulator answers (sim/backends/host.py): each image
costs a vision model IMAGE_TOKENS prompt tokens, a model asked for a schema answers JSON valid for
it (prose otherwise), and a `thinking` model thinks only when asked. `seer` has vision and thinking;
`plain` has neither. The hosts run at time scale 0.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

import httpx
import ollama
import openai
import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from pipelines.coordinator import PIPELINE_MODEL
from sim.backends.ask import IMAGE_TOKENS
from sim.backends.text import count_tokens
from sim.fleetspec import Fleet, parse_fleet
from tests.test_api_support import fleet_and_api, stored_result, stored_results

SURFACE_FLEET = """
name = "surface"
[model."seer"]
capabilities = ["completion", "vision", "thinking"]
output = { dist = "fixed", mean = 20 }
[model."plain"]
capabilities = ["completion"]
output = { dist = "fixed", mean = 10 }

[[worker]]
name = "a"
slots = 2
[worker.models."seer"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
[worker.models."plain"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
"""

# A 1x1 PNG.
PIXEL = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c63f8ffff3f0005fe02fea7d6a4c10000000049454e44ae426082"
    )
).decode()
LOOK = "What is in this picture?"
BACKENDS = pytest.mark.parametrize("kind", ["ollama", "openai"])


def surface_fleet() -> Fleet:
    return parse_fleet(SURFACE_FLEET, "surface.toml")


def openai_client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def image_message(*urls: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": LOOK}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"role": "user", "content": parts}


# -- images -----------------------------------------------------------------------------------------


@BACKENDS
async def test_images_reach_the_backend_from_openai_data_urls_and_ollama_images(
    redis_client: aioredis.Redis, redis_url: str, kind: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=surface_fleet(), kind=kind) as (
        base,
        _,
    ):
        client = openai_client(base)
        two = await client.chat.completions.create(
            model="seer",
            messages=[image_message(f"data:image/png;base64,{PIXEL}", f"data:image/png;base64,{PIXEL}")],  # type: ignore[list-item]
        )
        streamed_usage = None
        async for chunk in await client.chat.completions.create(
            model="seer",
            messages=[image_message(f"data:image/png;base64,{PIXEL}")],  # type: ignore[list-item]
            stream=True,
            stream_options={"include_usage": True},
        ):
            streamed_usage = chunk.usage or streamed_usage
        await client.close()
        native = ollama.AsyncClient(host=base)
        chatted = await native.chat(
            model="seer", messages=[{"role": "user", "content": LOOK, "images": [PIXEL]}]
        )
        generated = await native.generate(model="seer", prompt=LOOK, images=[PIXEL])
    text = count_tokens(LOOK)
    # The backend counted the images: each one costs a vision model IMAGE_TOKENS.
    assert two.usage is not None and two.usage.prompt_tokens == text + 2 * IMAGE_TOKENS
    assert streamed_usage is not None and streamed_usage.prompt_tokens == text + IMAGE_TOKENS
    assert chatted.prompt_eval_count == text + IMAGE_TOKENS
    assert generated.prompt_eval_count == text + IMAGE_TOKENS
    assert two.choices[0].message.content and chatted.message.content and generated.response


async def test_remote_images_and_images_for_a_model_without_vision_are_refused_in_each_surfaces_shape(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=surface_fleet()) as (base, _):
        client = openai_client(base)
        with pytest.raises(openai.BadRequestError) as remote:
            await client.chat.completions.create(
                model="seer",
                messages=[image_message("https://example.com/cat.png")],  # type: ignore[list-item]
            )
        with pytest.raises(openai.BadRequestError) as blind:
            await client.chat.completions.create(
                model="plain",
                messages=[image_message(f"data:image/png;base64,{PIXEL}")],  # type: ignore[list-item]
            )
        with pytest.raises(openai.BadRequestError) as not_base64:
            await client.chat.completions.create(
                model="seer",
                messages=[image_message("data:image/png;base64,%%%")],  # type: ignore[list-item]
            )
        await client.close()
        native = ollama.AsyncClient(host=base)
        with pytest.raises(ollama.ResponseError) as blind_chat:
            await native.chat(model="plain", messages=[{"role": "user", "content": LOOK, "images": [PIXEL]}])
        with pytest.raises(ollama.ResponseError) as blind_generate:
            await native.generate(model="plain", prompt=LOOK, images=[PIXEL])
        # Without images, the same model answers.
        answered = await native.chat(model="plain", messages=[{"role": "user", "content": LOOK}])
        results = await stored_results(redis_client)
    assert remote.value.status_code == 400
    assert "only inline data-URL images are accepted (the server fetches nothing)" in remote.value.message
    assert remote.value.param == "messages"
    assert blind.value.status_code == 400
    assert "model 'plain' does not support images" in blind.value.message
    assert "completion" in blind.value.message
    assert not_base64.value.status_code == 400 and "not valid base64" in not_base64.value.message
    assert blind_chat.value.status_code == 400
    assert "model 'plain' does not support images" in blind_chat.value.error
    assert blind_generate.value.status_code == 400
    assert "model 'plain' does not support images" in blind_generate.value.error
    assert answered.message.content
    # Nothing refused was queued.
    assert len(results) == 1


# -- structured output ------------------------------------------------------------------------------


class Address(BaseModel):
    street: str
    zip_code: str = Field(min_length=5, max_length=5)


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[str] = Field(min_length=1, max_length=4)
    home: Address


@BACKENDS
async def test_a_schema_reaches_the_backend_and_both_clients_get_json_it_accepts(
    redis_client: aioredis.Redis, redis_url: str, kind: str
) -> None:
    asked = [{"role": "user", "content": "Who is it?"}]
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=surface_fleet(), kind=kind) as (
        base,
        _,
    ):
        client = openai_client(base)
        parsed = await client.chat.completions.parse(
            model="plain",
            messages=asked,  # type: ignore[arg-type]
            response_format=Person,
        )
        loose = await client.chat.completions.create(
            model="plain",
            messages=asked,  # type: ignore[arg-type]
            response_format={"type": "json_object"},
        )
        streamed = ""
        async for chunk in await client.chat.completions.create(
            model="plain",
            messages=asked,  # type: ignore[arg-type]
            stream=True,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": Person.model_json_schema()},
            },
        ):
            streamed += "".join(c.delta.content or "" for c in chunk.choices)
        await client.close()
        native = ollama.AsyncClient(host=base)
        chatted = await native.chat(model="plain", messages=asked, format=Person.model_json_schema())
        chunks = [
            p.message.content or ""
            async for p in await native.chat(
                model="plain", messages=asked, format=Person.model_json_schema(), stream=True
            )
        ]
        generated = await native.generate(model="plain", prompt="Who?", format=Person.model_json_schema())
        as_json = await native.generate(model="plain", prompt="Who?", format="json")
    assert isinstance(parsed.choices[0].message.parsed, Person)
    # JSON mode answers an object, as real models do (LangChain's json_mode takes nothing else).
    assert isinstance(json.loads(loose.choices[0].message.content or ""), dict)
    Person.model_validate_json(streamed)
    Person.model_validate_json(chatted.message.content or "")
    Person.model_validate_json("".join(chunks))
    Person.model_validate_json(generated.response)
    assert isinstance(json.loads(as_json.response), dict)


async def test_a_response_format_that_is_not_one_is_a_bad_request(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    asked = [{"role": "user", "content": "hi"}]
    async with (
        fleet_and_api(redis_client, redis_url, time_scale=0, fleet=surface_fleet()) as (base, _),
        httpx.AsyncClient(base_url=base) as http,
    ):
        unknown = await http.post(
            "/v1/chat/completions",
            json={"model": "plain", "messages": asked, "response_format": {"type": "xml"}},
        )
        schemaless = await http.post(
            "/v1/chat/completions",
            json={"model": "plain", "messages": asked, "response_format": {"type": "json_schema"}},
        )
        text = await http.post(
            "/v1/chat/completions",
            json={"model": "plain", "messages": asked, "response_format": {"type": "text"}},
        )
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "response_format"
    assert "'xml' is not one of text, json_object, json_schema" in unknown.json()["error"]["message"]
    assert schemaless.status_code == 400
    assert "json_schema.schema" in schemaless.json()["error"]["message"]
    assert text.status_code == 200 and text.json()["choices"][0]["message"]["content"]


# -- thinking ---------------------------------------------------------------------------------------


@BACKENDS
async def test_the_ollama_client_reads_thinking_whole_and_streamed_before_the_answer(
    redis_client: aioredis.Redis, redis_url: str, kind: str
) -> None:
    asked = [{"role": "user", "content": "Why is the sky blue?"}]
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=surface_fleet(), kind=kind) as (
        base,
        _,
    ):
        native = ollama.AsyncClient(host=base)
        async with httpx.AsyncClient(base_url=base) as http:
            raw = await http.post(
                "/api/chat",
                json={
                    "model": "seer",
                    "messages": asked,
                    "think": True,
                    "stream": False,
                    "options": {"seed": 4},
                },
            )
        whole = await native.chat(model="seer", messages=asked, think=True, options={"seed": 4})
        parts = [
            p
            async for p in await native.chat(
                model="seer", messages=asked, think=True, options={"seed": 4}, stream=True
            )
        ]
        unthinking = await native.chat(model="seer", messages=asked, options={"seed": 4})
        generated = await native.generate(model="seer", prompt="Why?", think="high")
        streamed_generate = [
            p async for p in await native.generate(model="seer", prompt="Why?", think=True, stream=True)
        ]
        stored = await stored_result(redis_client, raw.headers["x-routeledger-task"])
    assert whole.message.thinking and whole.message.content
    assert stored is not None and stored.thinking == whole.message.thinking
    # Thinking counts in the backend's own eval_count: the answer's 20 tokens and 10 of thinking.
    assert whole.eval_count == 30
    kinds = ["thinking" if p.message.thinking else "content" for p in parts if not p.done]
    assert kinds.index("content") > 0 and "thinking" not in kinds[kinds.index("content") :]
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert unthinking.message.thinking is None and unthinking.message.content == whole.message.content
    assert generated.thinking and generated.response
    assert "".join(p.thinking or "" for p in streamed_generate) and "".join(
        p.response for p in streamed_generate
    )


@BACKENDS
async def test_the_openai_client_reads_reasoning_content_whole_and_in_deltas(
    redis_client: aioredis.Redis, redis_url: str, kind: str
) -> None:
    asked: list[Any] = [{"role": "user", "content": "Think about it."}]
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=surface_fleet(), kind=kind) as (
        base,
        _,
    ):
        client = openai_client(base)
        whole = await client.chat.completions.create(
            model="seer", messages=asked, reasoning_effort="low", seed=2
        )
        reasoning = content = ""
        async for chunk in await client.chat.completions.create(
            model="seer", messages=asked, reasoning_effort="low", seed=2, stream=True
        ):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                content += delta.content or ""
        unthinking = await client.chat.completions.create(
            model="seer", messages=asked, reasoning_effort="none", seed=2
        )
        await client.close()
    message = whole.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content")
    assert reasoning == (message.model_extra or {})["reasoning_content"]
    assert content == message.content
    assert whole.usage is not None and whole.usage.completion_tokens == 30
    assert "reasoning_content" not in (unthinking.choices[0].message.model_extra or {})
    assert unthinking.choices[0].message.content == message.content


async def test_think_for_a_model_that_cannot_think_is_refused_in_each_surfaces_shape(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    asked = [{"role": "user", "content": "hi"}]
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=surface_fleet()) as (base, _):
        native = ollama.AsyncClient(host=base)
        with pytest.raises(ollama.ResponseError) as chat:
            await native.chat(model="plain", messages=asked, think=True)
        with pytest.raises(ollama.ResponseError) as generate:
            await native.generate(model="plain", prompt="hi", think="high")
        client = openai_client(base)
        with pytest.raises(openai.BadRequestError) as effort:
            await client.chat.completions.create(
                model="plain",
                messages=asked,  # type: ignore[arg-type]
                reasoning_effort="high",
            )
        await client.close()
        # Told not to think, it answers.
        quiet = await native.chat(model="plain", messages=asked, think=False)
        results = await stored_results(redis_client)
    assert chat.value.status_code == 400 and "model 'plain' does not support think" in chat.value.error
    assert generate.value.status_code == 400 and "does not support think" in generate.value.error
    assert effort.value.status_code == 400 and "model 'plain' does not support think" in effort.value.message
    assert quiet.message.content and quiet.message.thinking is None
    assert len(results) == 1


# -- the native surface -----------------------------------------------------------------------------


async def test_native_tasks_take_images_a_format_and_think_and_answer_thinking(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url, time_scale=0, fleet=surface_fleet()) as (base, _),
        httpx.AsyncClient(base_url=base) as http,
    ):
        seen = await http.post(
            "/v1/tasks",
            json={"model": "seer", "prompt": LOOK, "images": [PIXEL], "think": True, "wait": True},
        )
        shaped = await http.post(
            "/v1/tasks",
            json={
                "model": "plain",
                "messages": [{"role": "user", "content": "Who?"}],
                "format": Person.model_json_schema(),
                "wait": True,
            },
        )
        async with http.stream(
            "POST", "/v1/tasks", json={"model": "seer", "prompt": "Why?", "think": "low", "stream": True}
        ) as events:
            lines = [line async for line in events.aiter_lines()]
        blind = await http.post("/v1/tasks", json={"model": "plain", "prompt": LOOK, "images": [PIXEL]})
    result = seen.json()["result"]
    assert result["thinking"] and result["text"]
    assert seen.json()["timings"]["prompt_eval_count"] == count_tokens(LOOK) + IMAGE_TOKENS
    Person.model_validate_json(shaped.json()["result"]["text"])
    assert "event: thinking" in lines
    assert lines.index("event: thinking") < lines.index("event: chunk")
    assert blind.status_code == 400 and blind.json()["error"]["type"] == "invalid_request"
    assert "does not support images" in blind.json()["error"]["message"]


async def test_auto_with_images_or_think_routes_only_to_a_model_that_has_them(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=surface_fleet()) as (base, _):
        native = ollama.AsyncClient(host=base)
        seeing = [
            await native.chat(
                model="auto", messages=[{"role": "user", "content": f"{LOOK} ({i})", "images": [PIXEL]}]
            )
            for i in range(3)
        ]
        thinking = [
            await native.chat(model="auto", messages=[{"role": "user", "content": f"Why? ({i})"}], think=True)
            for i in range(3)
        ]
    assert {c.model for c in seeing + thinking} == {"seer:latest"}
    assert all(c.message.thinking for c in thinking)


async def test_the_pipeline_model_refuses_images_formats_and_thinking_rather_than_drop_them(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    asked = [{"role": "user", "content": "Compare two things."}]
    async with (
        fleet_and_api(redis_client, redis_url, time_scale=0, fleet=surface_fleet()) as (base, _),
        httpx.AsyncClient(base_url=base) as http,
    ):
        shaped = await http.post(
            "/v1/chat/completions",
            json={"model": PIPELINE_MODEL, "messages": asked, "response_format": {"type": "json_object"}},
        )
        effort = await http.post(
            "/v1/chat/completions",
            json={"model": PIPELINE_MODEL, "messages": asked, "reasoning_effort": "high"},
        )
        seen = await http.post(
            "/api/chat",
            json={"model": PIPELINE_MODEL, "messages": [{**asked[0], "images": [PIXEL]}], "stream": False},
        )
        think = await http.post(
            "/api/chat", json={"model": PIPELINE_MODEL, "messages": asked, "think": True, "stream": False}
        )
        results = await stored_results(redis_client)
    assert shaped.status_code == 400 and shaped.json()["error"]["param"] == "response_format"
    assert effort.status_code == 400 and effort.json()["error"]["param"] == "reasoning_effort"
    assert seen.status_code == 400 and "does not take images" in seen.json()["error"]
    assert think.status_code == 400 and "does not support think" in think.json()["error"]
    assert results == []
