"""The real `ollama` client against the API's Ollama-compatible surface."""

from __future__ import annotations

import asyncio

import httpx
import ollama
import pytest
import redis.asyncio as aioredis

from tests.test_api_support import fleet_and_api, stored_results

MESSAGES = [{"role": "user", "content": "hello there"}]


async def test_the_ollama_client_chats_with_and_without_streaming(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):
        client = ollama.AsyncClient(host=base)
        whole = await client.chat(model="m", messages=MESSAGES, stream=False)
        pieces = [part async for part in await client.chat(model="m", messages=MESSAGES, stream=True)]
    assert whole.message.content
    assert whole.done and whole.eval_count == 40
    assert whole.total_duration is not None and whole.total_duration > 0
    assert [p.done for p in pieces].count(True) == 1 and pieces[-1].done
    assert pieces[-1].eval_count == 40
    assert "".join(p.message.content or "" for p in pieces)


async def test_the_ollama_client_generates_lists_shows_and_reads_what_is_loaded(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):
        client = ollama.AsyncClient(host=base)
        generated = await client.generate(model="m", prompt="once upon a time", options={"num_predict": 5})
        streamed = "".join(
            [p.response or "" async for p in await client.generate(model="m", prompt="x", stream=True)]
        )
        listed = await client.list()
        shown = await client.show("m:latest")
        loaded = await client.ps()
        async with httpx.AsyncClient(base_url=base) as http:
            version = (await http.get("/api/version")).json()
        texts = {r.text for r in await stored_results(redis_client)}
    assert generated.done_reason == "length" and generated.eval_count == 5
    assert streamed in texts
    assert [m.model for m in listed.models] == ["m:latest", "auto", "pipeline"]
    assert listed.models[0].digest
    assert shown.details is not None and shown.details.quantization_level == "Q4_K_M"
    assert [m.model for m in loaded.models] == ["m:latest"]
    assert version["version"]


async def test_an_unknown_model_is_an_ollama_error_naming_what_is_served(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):
        client = ollama.AsyncClient(host=base)
        with pytest.raises(ollama.ResponseError) as caught:
            await client.chat(model="llama9", messages=MESSAGES)
        with pytest.raises(ollama.ResponseError) as streamed:
            async for _ in await client.chat(model="llama9", messages=MESSAGES, stream=True):
                pass
    assert caught.value.status_code == 404
    assert "llama9" in caught.value.error and "m:latest" in caught.value.error
    assert streamed.value.status_code == 404


async def test_the_sync_ollama_client_works_too(redis_client: aioredis.Redis, redis_url: str) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):
        answer = await asyncio.to_thread(lambda: ollama.Client(host=base).chat(model="m", messages=MESSAGES))
    assert answer.message.content


async def test_a_null_option_means_not_set_as_ollama_reads_it(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    # LangChain's Ollama clients send every option they know, unset ones as null.
    body = {"model": "m", "prompt": "hi", "stream": False, "options": {"num_ctx": None, "num_predict": 3}}
    async with fleet_and_api(redis_client, redis_url) as (base, _), httpx.AsyncClient(base_url=base) as http:
        answer = await http.post("/api/generate", json=body)
        stored = await stored_results(redis_client)
    assert answer.status_code == 200, answer.text
    assert answer.json()["done_reason"] == "length" and answer.json()["eval_count"] == 3
    assert [r.text for r in stored] == [answer.json()["response"]]
