"""Tools end to end: real clients (`openai`, `ollama`, LangChain's ChatOpenAI and ChatOllama) call
a function through the API and send its result back, streaming and not, whichever API the worker
speaks to its backend; a model that cannot call tools is refused in each surface's error shape.

The simulated model `caller` has the `tools` capability (sim/backends/tools.py: it calls the tools
named in the last user message, and after a tool result answers `The tool answered: "…".`);
`plain` has not. The hosts run at time scale 0.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import openai
import pytest
import redis.asyncio as aioredis
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from sim.fleetspec import Fleet, parse_fleet
from tests.test_api_support import fleet_and_api, stored_result, stored_results

TOOLS_FLEET = """
name = "tools"
[model."caller"]
capabilities = ["completion", "tools"]
output = { dist = "fixed", mean = 20 }
[model."plain"]
output = { dist = "fixed", mean = 10 }

[[worker]]
name = "a"
slots = 2
[worker.models."caller"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
[worker.models."plain"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
"""

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time now.", "parameters": {"type": "object"}},
}
ASK = "What is the weather in Paris? Use get_weather."
FORECAST = "sunny, 21 degrees"
ANSWER = f'The tool answered: "{FORECAST}".'
BACKENDS = pytest.mark.parametrize("kind", ["ollama", "openai"])


def tools_fleet() -> Fleet:
    return parse_fleet(TOOLS_FLEET, "tools.toml")


# -- the openai client ------------------------------------------------------------------------------


@BACKENDS
async def test_the_openai_client_calls_a_tool_and_reads_the_answer_to_its_result(
    redis_client: aioredis.Redis, redis_url: str, kind: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=tools_fleet(), kind=kind) as (
        base,
        _,
    ):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": ASK}]
        raw = await client.chat.completions.with_raw_response.create(
            model="caller", messages=messages, tools=[WEATHER, CLOCK]
        )
        asked = raw.parse()
        stored = await stored_result(redis_client, raw.headers["x-routeledger-task"])
        call = asked.choices[0].message.tool_calls
        assert call is not None and call[0].type == "function"
        messages.append(asked.choices[0].message.model_dump(exclude_none=True))  # type: ignore[arg-type]
        messages.append({"role": "tool", "tool_call_id": call[0].id, "content": FORECAST})
        answered = await client.chat.completions.create(
            model="caller", messages=messages, tools=[WEATHER, CLOCK]
        )
        await client.close()
    choice = asked.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert [c.function.name for c in call] == ["get_weather"]
    assert isinstance(json.loads(call[0].function.arguments)["city"], str)
    assert call[0].id.startswith("call_")
    assert stored is not None and stored.tool_calls is not None
    assert [(c.id, c.name, c.arguments) for c in stored.tool_calls] == [
        (call[0].id, "get_weather", call[0].function.arguments)
    ]
    # The backend's own counts: the call's tokens are the completion.
    assert asked.usage is not None and asked.usage.completion_tokens == stored.timings.eval_count
    assert asked.usage.completion_tokens is not None and asked.usage.completion_tokens > 0
    assert answered.choices[0].finish_reason == "stop"
    assert answered.choices[0].message.content == ANSWER
    assert answered.choices[0].message.tool_calls is None


@BACKENDS
async def test_the_openai_client_streams_a_tool_call_as_deltas_and_then_the_answer(
    redis_client: aioredis.Redis, redis_url: str, kind: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=tools_fleet(), kind=kind) as (
        base,
        _,
    ):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "Call get_weather and get_time, please."}
        ]
        ids: dict[int, str] = {}
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        reason = None
        used = None
        stream = await client.chat.completions.create(
            model="caller",
            messages=messages,
            tools=[WEATHER, CLOCK],
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
            for choice in chunk.choices:
                reason = choice.finish_reason or reason
                for delta in choice.delta.tool_calls or []:
                    if delta.id:
                        ids[delta.index] = delta.id
                    if delta.function and delta.function.name:
                        names[delta.index] = delta.function.name
                    if delta.function and delta.function.arguments:
                        arguments[delta.index] = arguments.get(delta.index, "") + delta.function.arguments
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": ids[i],
                        "type": "function",
                        "function": {"name": names[i], "arguments": arguments.get(i, "{}")},
                    }
                    for i in sorted(names)
                ],
            }
        )
        messages += [
            {"role": "tool", "tool_call_id": ids[0], "content": FORECAST},
            {"role": "tool", "tool_call_id": ids[1], "content": "noon"},
        ]
        text = ""
        async for chunk in await client.chat.completions.create(
            model="caller", messages=messages, tools=[WEATHER, CLOCK], stream=True
        ):
            text += "".join(c.delta.content or "" for c in chunk.choices)
        await client.close()
        stored = {r.text: r for r in await stored_results(redis_client)}
    assert reason == "tool_calls"
    assert [names[i] for i in sorted(names)] == ["get_weather", "get_time"]
    assert sorted(ids) == [0, 1] and all(i.startswith("call_") for i in ids.values())
    assert isinstance(json.loads(arguments[0])["city"], str)
    assert used is not None and used > 0
    assert text == f'{ANSWER} The tool answered: "noon".'
    assert stored[text].tool_calls is None


# -- the ollama client ------------------------------------------------------------------------------


@BACKENDS
async def test_the_ollama_client_calls_a_tool_and_reads_the_answer_with_and_without_streaming(
    redis_client: aioredis.Redis, redis_url: str, kind: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=tools_fleet(), kind=kind) as (
        base,
        _,
    ):
        client = ollama.AsyncClient(host=base)
        messages: list[Any] = [{"role": "user", "content": ASK}]
        whole = await client.chat(model="caller", messages=messages, tools=[WEATHER, CLOCK])
        pieces = [
            p
            async for p in await client.chat(model="caller", messages=messages, tools=[WEATHER], stream=True)
        ]
        messages += [whole.message, {"role": "tool", "content": FORECAST, "tool_name": "get_weather"}]
        answered = await client.chat(model="caller", messages=messages, tools=[WEATHER, CLOCK])
        streamed = "".join(
            [
                p.message.content or ""
                async for p in await client.chat(
                    model="caller", messages=messages, tools=[WEATHER, CLOCK], stream=True
                )
            ]
        )
    calls = whole.message.tool_calls
    assert calls is not None
    assert [c.function.name for c in calls] == ["get_weather"]
    assert isinstance(calls[0].function.arguments["city"], str)
    assert whole.done and whole.eval_count is not None and whole.eval_count > 0
    streamed_calls = [c for p in pieces for c in p.message.tool_calls or []]
    assert [c.function.name for c in streamed_calls] == ["get_weather"]
    assert [p.done for p in pieces].count(True) == 1 and pieces[-1].done
    assert answered.message.content == ANSWER and not answered.message.tool_calls
    assert streamed == ANSWER


# -- LangChain --------------------------------------------------------------------------------------


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return FORECAST


@BACKENDS
@pytest.mark.parametrize("client", ["ChatOpenAI", "ChatOllama"])
async def test_langchain_chat_models_bound_to_a_tool_complete_a_tool_call(
    redis_client: aioredis.Redis, redis_url: str, client: str, kind: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=tools_fleet(), kind=kind) as (
        base,
        _,
    ):
        llm = (
            ChatOpenAI(base_url=base + "/v1", api_key="unused", model="caller", max_retries=0)  # type: ignore[arg-type]
            if client == "ChatOpenAI"
            else ChatOllama(base_url=base, model="caller")
        )
        bound = llm.bind_tools([get_weather])
        question = HumanMessage(ASK)
        asked = await bound.ainvoke([question])
        assert isinstance(asked, AIMessage)
        result = await get_weather.ainvoke(asked.tool_calls[0])
        answered = await bound.ainvoke([question, asked, result])
    assert [c["name"] for c in asked.tool_calls] == ["get_weather"]
    assert isinstance(asked.tool_calls[0]["args"]["city"], str)
    assert isinstance(result, ToolMessage) and result.tool_call_id == asked.tool_calls[0]["id"]
    assert answered.content == ANSWER


# -- refusals ---------------------------------------------------------------------------------------


async def test_tools_for_a_model_that_cannot_call_them_are_refused_in_each_surfaces_shape(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=tools_fleet()) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="plain", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER]
            )
        await client.close()
        with pytest.raises(ollama.ResponseError) as refused_ollama:
            await ollama.AsyncClient(host=base).chat(
                model="plain", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER]
            )
        async with httpx.AsyncClient(base_url=base) as http:
            native = await http.post(
                "/v1/tasks",
                json={"model": "plain", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]},
            )
            # Not offered tools, the same model answers.
            plain = await http.post(
                "/api/chat",
                json={"model": "plain", "messages": [{"role": "user", "content": "hi"}], "stream": False},
            )
        results = await stored_results(redis_client)
    assert refused.value.status_code == 400
    assert refused.value.param == "tools"
    assert "model 'plain' does not support tools" in refused.value.message
    assert "completion" in refused.value.message
    assert refused_ollama.value.status_code == 400
    assert "model 'plain' does not support tools" in refused_ollama.value.error
    assert native.status_code == 400
    assert native.json()["error"]["type"] == "invalid_request"
    assert plain.status_code == 200 and plain.json()["message"]["content"]
    # Nothing refused was queued.
    assert len(results) == 1


@pytest.mark.parametrize(
    ("tools", "says"),
    [
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function has no name"),
        ([{"type": "retrieval"}], "only function tools are supported"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "JSON schema object"),
        ([WEATHER, WEATHER], "two tools are named 'get_weather'"),
        (["get_weather"], "tools[0] is not an object"),
    ],
)
async def test_a_malformed_tool_definition_is_a_bad_request_that_says_what_is_wrong(
    redis_client: aioredis.Redis, redis_url: str, tools: list[Any], says: str
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with (
        fleet_and_api(redis_client, redis_url, time_scale=0, fleet=tools_fleet()) as (base, _),
        httpx.AsyncClient(base_url=base) as http,
    ):
        openai_answer = await http.post(
            "/v1/chat/completions", json={"model": "caller", "messages": messages, "tools": tools}
        )
        ollama_answer = await http.post(
            "/api/chat", json={"model": "caller", "messages": messages, "tools": tools}
        )
    assert openai_answer.status_code == 400
    assert says in openai_answer.json()["error"]["message"]
    assert openai_answer.json()["error"]["param"] == "tools"
    assert ollama_answer.status_code == 400
    assert says in ollama_answer.json()["error"]


async def test_a_tool_choice_naming_a_tool_not_offered_is_a_bad_request(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=tools_fleet()) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="must name one of the tools offered") as caught:
            await client.chat.completions.create(
                model="caller",
                messages=[{"role": "user", "content": "hi"}],
                tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_time"}},
            )
        await client.close()
    assert caught.value.param == "tool_choice"


async def test_auto_with_tools_routes_only_to_a_model_that_can_call_them(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=tools_fleet()) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        chosen = [
            await client.chat.completions.create(
                model="auto", messages=[{"role": "user", "content": f"{ASK} ({i})"}], tools=[WEATHER]
            )
            for i in range(3)
        ]
        await client.close()
    assert {c.model for c in chosen} == {"caller:latest"}
    assert all(c.choices[0].finish_reason == "tool_calls" for c in chosen)
