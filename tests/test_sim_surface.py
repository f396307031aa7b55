"""The simulator's whole client surface, spoken to by the real `ollama` and `openai` clients: tools,
embeddings, images, structured output, thinking, and truthful metadata, each with its refusal.

Durations are read from what the sim reports (never from wall time); the hosts run at time scale 0.
"""

from __future__ import annotations

import base64
import json
import math
import random
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import ollama
import openai
import pytest
from pydantic import BaseModel, Field

from sim.backends.ask import IMAGE_TOKENS
from sim.backends.hosts import SimHosts
from sim.backends.schema import schema_value
from sim.backends.text import count_tokens
from sim.errors import FleetError
from sim.fleetspec import parse_fleet

SEED = 77
TALKER_SIZE = 5225376047
VRAM = 4_000_000_000

SURFACE = f"""
[model."talker"]
capabilities = ["completion", "tools", "vision", "thinking"]
family = "qwen3"
parameter_size = "8.2B"
quantization = "Q4_K_M"
size = {TALKER_SIZE}
context_length = 40960
output = {{ dist = "fixed", mean = 20 }}

[model."plain"]
output = {{ dist = "fixed", mean = 10 }}

[model."embedder"]
capabilities = ["embedding"]
family = "nomic-bert"
parameter_size = "137M"
quantization = "F16"
size = 274302450
context_length = 64
embedding_dim = 768

[[worker]]
name = "box"
slots = 2
vram_bytes = {VRAM}
[worker.models."talker"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
[worker.models."plain"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
[worker.models."embedder"]
decode_tps = 200.0
prompt_tps = 5000.0
embed_tps = 1000.0
load_s = 2.0
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for the next days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
# One white pixel, a real PNG.
PIXEL = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c63f8ffff3f0005fe02fea7d6a4c10000000049454e44ae426082"
    )
).decode()


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(parse_fleet(SURFACE, "surface.toml"), time_scale=0, seed=SEED) as h:
        yield h


def ollama_client(hosts: SimHosts) -> ollama.AsyncClient:
    return ollama.AsyncClient(hosts.url("box"))


def openai_client(hosts: SimHosts) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=hosts.url("box") + "/v1", api_key="unused", max_retries=0)


def check_weather_arguments(arguments: dict[str, Any], *, bounded: bool = True) -> None:
    assert isinstance(arguments["city"], str) and arguments["city"]
    assert isinstance(arguments["days"], int)
    # The ollama client keeps only a property's type, description and enum: no bounds reach the sim.
    assert 1 <= arguments["days"] <= 7 or not bounded
    assert arguments.get("unit", "celsius") in ("celsius", "fahrenheit")


# -- tools ------------------------------------------------------------------------------------------


async def test_an_ollama_tool_call_round_trip_streams_and_answers_whole_alike(hosts: SimHosts) -> None:
    client = ollama_client(hosts)
    asked = [{"role": "user", "content": "Use get_weather for Paris, please."}]
    options = {"seed": 3}
    whole = await client.chat(model="talker", messages=asked, tools=[CLOCK, WEATHER], options=options)
    parts = [
        p
        async for p in await client.chat(
            model="talker", messages=asked, tools=[CLOCK, WEATHER], options=options, stream=True
        )
    ]
    calls = whole.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    check_weather_arguments(dict(calls[0].function.arguments), bounded=False)
    assert whole.message.content == ""
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [
        (c.function.name, dict(c.function.arguments)) for c in calls
    ]
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count
    # The offered tools' definitions count in the prompt (as the client reshaped them).
    assert whole.prompt_eval_count is not None
    assert whole.prompt_eval_count > count_tokens(asked[0]["content"]) + count_tokens(
        '"get_time" "get_weather"'
    )

    answered = await client.chat(
        model="talker",
        messages=[
            *asked,
            {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
            {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
        ],
        tools=[CLOCK, WEATHER],
    )
    assert not answered.message.tool_calls
    assert '"sunny, 21 C"' in (answered.message.content or "")


async def test_the_first_tool_is_called_when_none_is_named_and_every_named_one_is_called(
    hosts: SimHosts,
) -> None:
    client = ollama_client(hosts)
    plain = await client.chat(
        model="talker", messages=[{"role": "user", "content": "What now?"}], tools=[CLOCK, WEATHER]
    )
    assert [c.function.name for c in plain.message.tool_calls or []] == ["get_time"]
    both = await client.chat(
        model="talker",
        messages=[{"role": "user", "content": "Call get weather and get_time."}],
        tools=[CLOCK, WEATHER],
    )
    assert [c.function.name for c in both.message.tool_calls or []] == ["get_time", "get_weather"]


async def test_an_openai_tool_call_round_trip_streams_deltas_with_ids_and_argument_chunks(
    hosts: SimHosts,
) -> None:
    client = openai_client(hosts)
    asked: list[Any] = [{"role": "user", "content": "get_weather in Kyoto and get_time there"}]
    whole = await client.chat.completions.create(
        model="talker",
        messages=asked,
        tools=[WEATHER, CLOCK],
        seed=11,  # type: ignore[list-item]
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    check_weather_arguments(json.loads(calls[0].function.arguments))  # type: ignore[union-attr]
    assert all(c.id.startswith("call_") for c in calls)

    stream = await client.chat.completions.create(
        model="talker",
        messages=asked,
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        seed=11,
        stream=True,
    )
    built: dict[int, dict[str, str]] = {}
    argument_chunks = 0
    finish = None
    async for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = built.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += delta.id or ""
            if delta.function is not None:
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
                argument_chunks += bool(delta.function.arguments)
    assert finish == "tool_calls"
    assert [built[i] for i in sorted(built)] == [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
        for c in calls
    ]
    assert argument_chunks > len(calls)

    answered = await client.chat.completions.create(
        model="talker",
        messages=[
            *asked,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": calls[0].id, "content": "rain"},
            {"role": "tool", "tool_call_id": calls[1].id, "content": "09:00"},
        ],
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
    )
    assert answered.choices[0].finish_reason == "stop"
    assert answered.choices[0].message.tool_calls is None
    assert answered.choices[0].message.content == 'The tool answered: "rain". The tool answered: "09:00".'


async def test_openai_tool_choice_and_parallel_tool_calls_pick_the_calls(hosts: SimHosts) -> None:
    client = openai_client(hosts)
    asked: list[Any] = [{"role": "user", "content": "get_weather and get_time"}]
    named = await client.chat.completions.create(
        model="talker",
        messages=asked,
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["get_time"]  # type: ignore[union-attr]
    single = await client.chat.completions.create(
        model="talker",
        messages=asked,
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        parallel_tool_calls=False,
    )
    assert [c.function.name for c in single.choices[0].message.tool_calls or []] == ["get_weather"]  # type: ignore[union-attr]
    none = await client.chat.completions.create(
        model="talker",
        messages=asked,
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice="none",
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="not among the tools offered"):
        await client.chat.completions.create(
            model="talker",
            messages=asked,
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )


async def test_tools_offered_to_a_model_without_the_capability_are_refused_as_ollama_does(
    hosts: SimHosts,
) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        await ollama_client(hosts).chat(
            model="plain", messages=[{"role": "user", "content": "hi"}], tools=[CLOCK]
        )
    assert caught.value.status_code == 400
    assert caught.value.error == '"plain" does not support tools'
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client(hosts).chat.completions.create(
            model="plain",
            messages=[{"role": "user", "content": "hi"}],
            tools=[CLOCK],  # type: ignore[list-item]
        )
    assert refused.value.status_code == 400
    assert '"plain" does not support tools' in refused.value.message


# -- embeddings -------------------------------------------------------------------------------------


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


async def test_ollama_embed_gives_equal_unit_vectors_for_equal_texts_and_times_them(hosts: SimHosts) -> None:
    client = ollama_client(hosts)
    texts = ["the cat sat", "on the mat", "the cat sat"]
    first = await client.embed(model="embedder", input=texts)
    assert len(first.embeddings) == 3
    assert all(len(v) == 768 and abs(norm(list(v)) - 1) < 1e-9 for v in first.embeddings)
    assert first.embeddings[0] == first.embeddings[2]
    assert first.embeddings[0] != first.embeddings[1]
    tokens = sum(count_tokens(t) for t in texts)
    assert first.prompt_eval_count == tokens
    # Load 2 s, then the tokens at 1000 per second.
    assert first.load_duration == 2_000_000_000
    assert first.total_duration == round((2.0 + tokens / 1000.0) * 1e9)
    again = await client.embed(model="embedder", input="the cat sat", dimensions=256)
    assert again.load_duration == 0
    assert len(again.embeddings[0]) == 256 and abs(norm(list(again.embeddings[0])) - 1) < 1e-9
    assert list(again.embeddings[0]) == pytest.approx(
        [x / norm(list(first.embeddings[0])[:256]) for x in list(first.embeddings[0])[:256]]
    )
    old = await client.embeddings(model="embedder", prompt="on the mat")
    assert list(old.embedding) == list(first.embeddings[1])


async def test_an_embedding_longer_than_the_context_is_cut_unless_truncate_is_false(hosts: SimHosts) -> None:
    client = ollama_client(hosts)
    long = "word " * 200
    cut = await client.embed(model="embedder", input=long)
    assert cut.prompt_eval_count == 64
    with pytest.raises(ollama.ResponseError, match="exceeds the context length") as caught:
        await client.embed(model="embedder", input=long, truncate=False)
    assert caught.value.status_code == 400


async def test_openai_embeddings_answer_floats_or_base64_for_a_list_of_inputs(hosts: SimHosts) -> None:
    client = openai_client(hosts)
    floats = await client.embeddings.create(
        model="embedder", input=["alpha", "beta"], encoding_format="float"
    )
    assert [d.index for d in floats.data] == [0, 1]
    assert all(len(d.embedding) == 768 and abs(norm(d.embedding) - 1) < 1e-9 for d in floats.data)
    assert floats.usage.prompt_tokens == count_tokens("alpha") + count_tokens("beta")
    # The SDK asks for base64 by default and decodes it to float32s.
    packed = await client.embeddings.create(model="embedder", input=["alpha", "beta"], dimensions=64)
    assert len(packed.data[0].embedding) == 64
    short = await client.embeddings.create(
        model="embedder", input="alpha", dimensions=64, encoding_format="float"
    )
    assert packed.data[0].embedding == pytest.approx(short.data[0].embedding, abs=1e-6)
    native = await ollama_client(hosts).embed(model="embedder", input="alpha")
    assert floats.data[0].embedding == list(native.embeddings[0])


async def test_embeddings_from_a_model_without_the_capability_are_refused(hosts: SimHosts) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        await ollama_client(hosts).embed(model="talker", input="x")
    assert caught.value.status_code == 400
    assert caught.value.error == '"talker" does not support embedding'
    with pytest.raises(openai.BadRequestError, match="does not support embedding"):
        await openai_client(hosts).embeddings.create(model="talker", input="x")
    with pytest.raises(ollama.ResponseError) as chat:
        await ollama_client(hosts).chat(model="embedder", messages=[{"role": "user", "content": "hi"}])
    assert chat.value.error == '"embedder" does not support chat'
    with pytest.raises(ollama.ResponseError, match="dimensions must be between 1 and the model's 768"):
        await ollama_client(hosts).embed(model="embedder", input="x", dimensions=4096)
    async with httpx.AsyncClient(base_url=hosts.url("box")) as http:
        ids = await http.post("/v1/embeddings", json={"model": "embedder", "input": [[1, 2, 3]]})
        packed = await http.post(
            "/v1/embeddings", json={"model": "embedder", "input": "x", "encoding_format": "int8"}
        )
    assert (
        ids.status_code == 400
        and "input must be a string or a list of strings" in ids.json()["error"]["message"]
    )
    assert packed.status_code == 400 and packed.json()["error"]["type"] == "invalid_request_error"


# -- images -----------------------------------------------------------------------------------------


async def test_an_image_costs_a_vision_model_fixed_prompt_tokens_on_both_apis(hosts: SimHosts) -> None:
    text = "What is in this picture?"
    native = await ollama_client(hosts).chat(
        model="talker", messages=[{"role": "user", "content": text, "images": [PIXEL, PIXEL]}]
    )
    assert native.prompt_eval_count == count_tokens(text) + 2 * IMAGE_TOKENS
    compat = await openai_client(hosts).chat.completions.create(
        model="talker",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PIXEL}"}},
                ],
            }
        ],
    )
    assert compat.usage is not None
    assert compat.usage.prompt_tokens == count_tokens(text) + IMAGE_TOKENS


async def test_images_are_refused_without_vision_or_when_not_inline(hosts: SimHosts) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        await ollama_client(hosts).chat(
            model="plain", messages=[{"role": "user", "content": "look", "images": [PIXEL]}]
        )
    assert caught.value.status_code == 400 and caught.value.error == '"plain" does not support vision'
    with pytest.raises(openai.BadRequestError, match="only inline images are accepted"):
        await openai_client(hosts).chat.completions.create(
            model="talker",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
                }
            ],
        )
    async with httpx.AsyncClient(base_url=hosts.url("box")) as http:
        bad = await http.post(
            "/api/chat",
            json={
                "model": "talker",
                "messages": [{"role": "user", "content": "x", "images": ["not base64!"]}],
            },
        )
    assert bad.status_code == 400 and "not valid base64" in bad.json()["error"]


# -- structured output ------------------------------------------------------------------------------


class Address(BaseModel):
    street: str
    zip_code: str = Field(min_length=5, max_length=5)


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)
    height_m: float = Field(gt=0.5, lt=2.5)
    member: bool
    role: Literal["admin", "user", "guest"]
    tags: list[str] = Field(min_length=1, max_length=4)
    home: Address
    past: list[Address]
    nickname: str | None = None


async def test_ollama_format_with_a_schema_answers_json_the_schema_accepts(hosts: SimHosts) -> None:
    schema = Person.model_json_schema()
    client = ollama_client(hosts)
    whole = await client.chat(
        model="talker", messages=[{"role": "user", "content": "Who?"}], format=schema, options={"seed": 1}
    )
    person = Person.model_validate_json(whole.message.content or "")
    streamed = "".join(
        [
            p.message.content or ""
            async for p in await client.chat(
                model="talker",
                messages=[{"role": "user", "content": "Who?"}],
                format=schema,
                options={"seed": 1},
                stream=True,
            )
        ]
    )
    assert Person.model_validate_json(streamed) == person
    generated = await client.generate(model="talker", prompt="Who?", format=schema)
    Person.model_validate_json(generated.response)
    plain_json = await client.chat(
        model="talker", messages=[{"role": "user", "content": "list"}], format="json"
    )
    # JSON mode answers an object, as real models do (LangChain's json_mode takes nothing else).
    answered = json.loads(plain_json.message.content or "")
    assert isinstance(answered, dict) and isinstance(answered["answer"], str) and answered["answer"]


async def test_openai_response_format_json_schema_is_parsed_by_the_sdk(hosts: SimHosts) -> None:
    client = openai_client(hosts)
    parsed = await client.chat.completions.parse(
        model="talker", messages=[{"role": "user", "content": "Who?"}], response_format=Person
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)
    loose = await client.chat.completions.create(
        model="talker",
        messages=[{"role": "user", "content": "Who?"}],
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(loose.choices[0].message.content or ""), dict)


def test_schema_values_honour_refs_bounds_enums_and_unions() -> None:
    schema = {
        "$defs": {"Leaf": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}}},
        "type": "object",
        "properties": {
            "leaf": {"$ref": "#/$defs/Leaf"},
            "when": {"type": "string", "format": "date-time"},
            "id": {"type": "string", "format": "uuid"},
            "pick": {"anyOf": [{"type": "null"}, {"type": "number", "exclusiveMinimum": 3, "maximum": 4}]},
            "pair": {"type": "array", "prefixItems": [{"type": "boolean"}, {"const": "x"}]},
            "few": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 2},
        },
        "required": ["leaf"],
    }
    for seed in range(20):
        value = schema_value(schema, random.Random(seed))
        assert value["leaf"]["n"] % 5 == 0
        assert value["when"][10] == "T" and value["when"].endswith("Z")
        assert len(value["id"]) == 36
        assert 3 < value["pick"] <= 4
        assert isinstance(value["pair"][0], bool) and value["pair"][1] == "x"
        assert sorted(value["few"]) == [1, 2]
    assert schema_value(schema, random.Random(5)) == schema_value(schema, random.Random(5))


# -- thinking ---------------------------------------------------------------------------------------


async def test_think_streams_thinking_before_content_and_counts_it_in_eval_count(hosts: SimHosts) -> None:
    client = ollama_client(hosts)
    asked = [{"role": "user", "content": "Why is the sky blue?"}]
    whole = await client.chat(model="talker", messages=asked, think=True, options={"seed": 4})
    assert whole.message.thinking and whole.message.content
    # The model's answer is 20 tokens; thinking is half of that, at least 8.
    assert whole.eval_count == 20 + 10
    parts = [
        p
        async for p in await client.chat(
            model="talker", messages=asked, think=True, options={"seed": 4}, stream=True
        )
    ]
    kinds = ["thinking" if p.message.thinking else "content" for p in parts[:-1]]
    assert kinds == ["thinking"] * 10 + ["content"] * 20
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    unthinking = await client.chat(model="talker", messages=asked, options={"seed": 4})
    assert unthinking.message.thinking is None and unthinking.message.content == whole.message.content
    generated = await client.generate(model="talker", prompt="Why?", think="high")
    assert generated.thinking and generated.response


async def test_openai_reasoning_effort_answers_reasoning_content(hosts: SimHosts) -> None:
    client = openai_client(hosts)
    asked: list[Any] = [{"role": "user", "content": "Think about it."}]
    whole = await client.chat.completions.create(
        model="talker", messages=asked, reasoning_effort="low", seed=2
    )
    message = whole.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content")
    assert whole.usage is not None and whole.usage.completion_tokens == 30
    stream = await client.chat.completions.create(
        model="talker", messages=asked, reasoning_effort="low", seed=2, stream=True
    )
    reasoning = ""
    async for chunk in stream:
        if chunk.choices:
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
    assert reasoning == (message.model_extra or {})["reasoning_content"]


async def test_think_to_a_model_without_thinking_is_refused(hosts: SimHosts) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        await ollama_client(hosts).chat(
            model="plain", messages=[{"role": "user", "content": "hi"}], think=True
        )
    assert caught.value.status_code == 400 and caught.value.error == '"plain" does not support thinking'
    with pytest.raises(openai.BadRequestError, match="does not support thinking"):
        await openai_client(hosts).chat.completions.create(
            model="plain", messages=[{"role": "user", "content": "hi"}], reasoning_effort="high"
        )
    quiet = await ollama_client(hosts).chat(
        model="plain", messages=[{"role": "user", "content": "hi"}], think=False
    )
    assert quiet.done


# -- metadata ---------------------------------------------------------------------------------------


async def test_show_list_and_ps_report_the_fleets_facts_and_leave_out_unknown_ones(hosts: SimHosts) -> None:
    client = ollama_client(hosts)
    shown = await client.show("talker")
    assert shown.capabilities == ["completion", "tools", "vision", "thinking"]
    assert shown.details is not None
    assert (shown.details.family, shown.details.parameter_size, shown.details.quantization_level) == (
        "qwen3",
        "8.2B",
        "Q4_K_M",
    )
    assert shown.details.format == "gguf"
    assert shown.modelinfo == {
        "general.architecture": "qwen3",
        "general.parameter_count": 8_200_000_000,
        "qwen3.context_length": 40960,
    }
    assert shown.template is not None and ".Tools" in shown.template and ".Thinking" in shown.template
    assert shown.parameters
    embedder = await client.show("embedder")
    assert embedder.capabilities == ["embedding"]
    assert embedder.modelinfo is not None and embedder.modelinfo["nomic-bert.embedding_length"] == 768
    bare = await client.show("plain")
    assert bare.capabilities == ["completion"]
    assert bare.modelinfo == {}
    assert bare.details is not None and bare.details.family is None and bare.details.parameter_size is None

    listing = {m.model: m for m in (await client.list()).models}
    assert listing["talker:latest"].size == TALKER_SIZE
    assert listing["plain:latest"].size is None

    await client.chat(model="talker", messages=[{"role": "user", "content": "hi"}], keep_alive="10m")
    await client.chat(model="plain", messages=[{"role": "user", "content": "hi"}])
    loaded = {m.model: m for m in (await client.ps()).models}
    talker = loaded["talker:latest"]
    assert talker.size == TALKER_SIZE
    assert talker.size_vram == VRAM
    assert talker.expires_at is not None
    left = talker.expires_at.timestamp() - (await client.ps()).models[0].expires_at.timestamp()  # type: ignore[union-attr]
    assert abs(left) < 60
    async with httpx.AsyncClient(base_url=hosts.url("box")) as http:
        raw = {m["name"]: m for m in (await http.get("/api/ps")).json()["models"]}
    assert "size" not in raw["plain:latest"] and "size_vram" not in raw["plain:latest"]


async def test_ps_expiry_follows_the_requests_keep_alive(hosts: SimHosts) -> None:
    client = ollama_client(hosts)
    async with httpx.AsyncClient(base_url=hosts.url("box")) as http:
        await client.chat(model="talker", messages=[{"role": "user", "content": "hi"}], keep_alive="10m")
        ten = (await client.ps()).models[0].expires_at
        await client.chat(model="talker", messages=[{"role": "user", "content": "hi"}], keep_alive="1h")
        hour = (await client.ps()).models[0].expires_at
        version = (await http.get("/api/version")).status_code
    assert ten is not None and hour is not None and version == 200
    # 50 minutes more, within the few seconds the requests took.
    assert abs((hour - ten).total_seconds() - 3000) < 30


def test_an_unknown_capability_in_the_fleet_is_a_clear_error() -> None:
    bad = '[model."m"]\ncapabilities = ["completion", "telepathy"]\n'
    with pytest.raises(FleetError, match=r"model m has unknown capabilities \['telepathy'\]; known ones are"):
        parse_fleet(bad, "bad.toml")


async def test_an_embed_with_keep_alive_zero_unloads_and_an_empty_input_only_loads(hosts: SimHosts) -> None:
    client = ollama_client(hosts)
    loaded = await client.embed(model="embedder", input=[])
    assert loaded.embeddings == [] and loaded.load_duration == 2_000_000_000
    assert [m.model for m in (await client.ps()).models] == ["embedder:latest"]
    done = await client.embed(model="embedder", input="bye", keep_alive=0)
    assert len(done.embeddings) == 1
    assert (await client.ps()).models == []


async def test_generate_takes_images_for_a_vision_model(hosts: SimHosts) -> None:
    answer = await ollama_client(hosts).generate(model="talker", prompt="Describe.", images=[PIXEL])
    assert answer.prompt_eval_count == count_tokens("Describe.") + IMAGE_TOKENS
    with pytest.raises(ollama.ResponseError, match='"plain" does not support vision'):
        await ollama_client(hosts).generate(model="plain", prompt="Describe.", images=[PIXEL])


async def test_a_scaled_machine_waits_out_an_embedding_and_reports_its_simulated_time() -> None:
    async with SimHosts(parse_fleet(SURFACE, "surface.toml"), time_scale=0.01, seed=SEED) as scaled:
        done = await ollama_client(scaled).embed(model="embedder", input=["one", "two"])
    tokens = count_tokens("one") + count_tokens("two")
    assert done.load_duration == 2_000_000_000
    # Queue time enters as wall time / time scale: a few simulated milliseconds at most here.
    assert done.total_duration == pytest.approx((2.0 + tokens / 1000.0) * 1e9, abs=0.2e9)
