"""The `openai` and `ollama` Python SDKs against routeledger: chat streamed and not, a tool call,
embeddings, and the ollama client's list, show and ps (pull: test_pull.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest
from openai.types.chat import ChatCompletionToolParam

from tests.clients.fleet import Routeledger, eventually, load_on_machine

MACHINES = {"macbookair", "rtx3070ti"}
ASK = "Why is the sky blue?"
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture
def openai_client(routeledger: Routeledger) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=routeledger.url + "/v1", api_key="any", max_retries=0)
    yield client
    client.close()


@pytest.fixture
def ollama_client(routeledger: Routeledger) -> ollama.Client:
    return ollama.Client(host=routeledger.url)


# -- openai -----------------------------------------------------------------------------------------


def test_the_openai_sdk_gets_a_chat_answer_and_the_machine_that_ran_it(openai_client: openai.OpenAI) -> None:
    raw = openai_client.chat.completions.with_raw_response.create(
        model="qwen3:8b", messages=[{"role": "user", "content": ASK}], max_tokens=8
    )
    answer = raw.parse()
    assert answer.choices[0].message.content and answer.choices[0].message.content.strip()
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    assert answer.model == "qwen3:8b"
    assert raw.headers["x-routeledger-worker"] in MACHINES


def test_the_openai_sdk_streams_a_chat_answer_with_its_usage(openai_client: openai.OpenAI) -> None:
    stream = openai_client.chat.completions.create(
        model="qwen3:8b",
        messages=[{"role": "user", "content": ASK}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    reasons: list[str] = []
    used = None
    for chunk in stream:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert len([p for p in pieces if p]) >= 2
    assert "".join(pieces).strip()
    assert reasons == ["length"]
    assert used == 8


def test_the_openai_sdk_gets_a_tool_call(openai_client: openai.OpenAI) -> None:
    answer = openai_client.chat.completions.create(
        model="qwen3:8b",
        messages=[{"role": "user", "content": "What is the weather in Paris? Use get_weather."}],
        tools=[WEATHER],
        max_tokens=64,
    )
    calls = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls"
    assert calls is not None and len(calls) == 1
    assert calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert '"city"' in calls[0].function.arguments


def test_the_openai_sdk_embeds_a_batch_of_texts(openai_client: openai.OpenAI) -> None:
    embedded = openai_client.embeddings.create(model="nomic-embed-text", input=[ASK, "Why is grass green?"])
    assert [d.index for d in embedded.data] == [0, 1]
    assert [len(d.embedding) for d in embedded.data] == [768, 768]
    assert embedded.data[0].embedding != embedded.data[1].embedding
    assert embedded.usage.prompt_tokens > 0


# -- ollama -----------------------------------------------------------------------------------------


def test_the_ollama_sdk_gets_a_chat_answer_streamed_and_not(ollama_client: ollama.Client) -> None:
    messages = [{"role": "user", "content": ASK}]
    whole = ollama_client.chat(model="qwen3:8b", messages=messages, options={"num_predict": 8})
    pieces = list(
        ollama_client.chat(model="qwen3:8b", messages=messages, options={"num_predict": 8}, stream=True)
    )
    assert whole.message.content and whole.message.content.strip()
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert "".join(p.message.content or "" for p in pieces).strip()
    assert pieces[-1].eval_count == 8


def test_the_ollama_sdk_gets_a_tool_call(ollama_client: ollama.Client) -> None:
    answer = ollama_client.chat(
        model="qwen3:8b",
        messages=[{"role": "user", "content": "What is the weather in Paris? Use get_weather."}],
        tools=[dict(WEATHER)],
        options={"num_predict": 64},
    )
    calls = answer.message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["get_weather"]
    assert isinstance(calls[0].function.arguments["city"], str)


def test_the_ollama_sdk_embeds_a_batch_of_texts(ollama_client: ollama.Client) -> None:
    embedded = ollama_client.embed(model="nomic-embed-text", input=[ASK, "Why is grass green?"])
    assert [len(v) for v in embedded.embeddings] == [768, 768]
    assert embedded.embeddings[0] != embedded.embeddings[1]
    assert embedded.prompt_eval_count is not None and embedded.prompt_eval_count > 0


def test_the_ollama_sdk_lists_the_fleets_models_and_auto_with_digest_and_details(
    ollama_client: ollama.Client,
) -> None:
    models = {m.model: m for m in ollama_client.list().models}
    assert {"qwen3:8b", "gemma3:4b", "nomic-embed-text:latest", "elyza-jp-8b:latest", "auto"} <= set(models)
    for name, m in models.items():
        assert m.digest is not None and len(m.digest) == 64, name
        assert m.details is not None and m.details.family, name
    assert models["qwen3:8b"].details is not None and models["qwen3:8b"].details.parameter_size == "8.2B"


def test_the_ollama_sdk_shows_a_models_capabilities_and_details(ollama_client: ollama.Client) -> None:
    qwen = ollama_client.show("qwen3:8b")
    gemma = ollama_client.show("gemma3:4b")
    embedder = ollama_client.show("nomic-embed-text")
    assert qwen.capabilities == ["completion", "tools", "thinking"]
    assert gemma.capabilities == ["completion", "vision"]
    assert embedder.capabilities == ["embedding"]
    assert qwen.details is not None and qwen.details.family == "qwen3"
    assert qwen.modelinfo is not None and sorted(qwen.modelinfo["routeledger.holders"]) == sorted(MACHINES)


def test_the_ollama_sdk_ps_lists_a_model_loaded_on_two_machines_once_with_both_inside(
    fresh_routeledger: Routeledger,
) -> None:
    for machine in sorted(MACHINES):
        load_on_machine(fresh_routeledger, machine, "qwen3:8b")

    def loaded_on_both() -> list[dict[str, Any]] | None:
        models: list[dict[str, Any]] = httpx.get(fresh_routeledger.url + "/api/ps").json()["models"]
        named = [m for m in models if m["name"] == "qwen3:8b"]
        machines = {w["name"] for m in named for w in m.get("workers", [])}
        return models if machines == MACHINES else None

    raw = eventually(loaded_on_both, what="qwen3:8b loaded on both machines in /api/ps")
    listed = ollama.Client(host=fresh_routeledger.url).ps().models
    assert [m.model for m in listed] == ["qwen3:8b"]
    assert listed[0].digest == "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41"
    assert listed[0].size is not None and listed[0].size > 0
    assert [m["name"] for m in raw] == ["qwen3:8b"]
    assert sorted(w["name"] for w in raw[0]["workers"]) == sorted(MACHINES)
