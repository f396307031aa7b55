"""The real `openai` client, sync and async, streaming and not, against the API and a simulated fleet."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from events.event import TaskRouted
from events.ledger import Ledger
from tests.helpers import events_of
from tests.test_api_support import fleet_and_api, stored_result, stored_results

# The test fleet's model `m` answers 40 tokens at 200 tok/s: 0.2 s a task at time_scale 1.
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


async def test_the_sync_client_gets_a_chat_completion_with_the_backends_usage_and_routing_headers(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):

        def call() -> tuple[ChatCompletion, dict[str, str]]:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
            return raw.parse(), dict(raw.headers)

        completion, headers = await asyncio.to_thread(call)
        task_id = headers["x-routeledger-task"]
        stored = await stored_result(redis_client, task_id)
        assert stored is not None
    assert completion.choices[0].message.content == stored.text
    assert completion.choices[0].message.content
    assert completion.usage is not None
    assert completion.usage.completion_tokens == stored.timings.eval_count == 40
    assert completion.usage.prompt_tokens == stored.timings.prompt_eval_count
    assert headers["x-routeledger-worker"] == "a"
    assert headers["x-routeledger-model"] == "m"


async def test_the_sync_client_streams_a_chat_completion(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):

        def call() -> tuple[str, str | None, int | None]:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            text, reason, used = "", None, None
            for chunk in client.chat.completions.create(
                model="m",
                messages=MESSAGES,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.usage is not None:
                    used = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    reason = choice.finish_reason or reason
            return text, reason, used

        text, reason, used = await asyncio.to_thread(call)
        (stored,) = await stored_results(redis_client)
    assert text == stored.text
    assert reason == "stop"
    assert used == 40


async def test_the_async_client_completes_and_streams_both_endpoints(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        chat = await client.chat.completions.create(model="m", messages=MESSAGES)
        legacy = await client.completions.create(model="m", prompt="once upon a time", max_tokens=5)
        streamed = ""
        async for chunk in await client.completions.create(model="m", prompt="once", stream=True):
            streamed += chunk.choices[0].text if chunk.choices else ""
        models = [m.id async for m in client.models.list()]
        await client.close()
        texts = {r.text for r in await stored_results(redis_client)}
    assert chat.choices[0].message.content
    assert legacy.choices[0].finish_reason == "length"
    assert len(legacy.choices[0].text.split()) == 5
    assert streamed in texts
    assert models == ["m:latest", "auto", "pipeline"]


async def test_a_streamed_answer_delivers_its_first_chunk_before_the_generation_ends(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=5.0) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        first_ms: float | None = None
        response = await client.chat.completions.with_raw_response.create(
            model="m",
            messages=MESSAGES,
            stream=True,
        )
        task_id = response.headers["x-routeledger-task"]
        chunks = response.parse()
        assert isinstance(chunks, openai.AsyncStream)
        async for chunk in chunks:
            if first_ms is None and chunk.choices and chunk.choices[0].delta.content:
                first_ms = time.time() * 1000
        await client.close()
        stored = await stored_result(redis_client, task_id)
        assert stored is not None
    assert first_ms is not None
    # The worker records the result when the generation has ended (1 s here).
    assert first_ms < stored.finished_at


async def test_an_unknown_model_is_a_not_found_error_that_lists_the_available_models(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="gpt-9", messages=MESSAGES)
        await client.close()
    assert caught.value.code == "model_not_found"
    assert "m:latest" in caught.value.message
    assert "gpt-9" in caught.value.message


async def test_auto_picks_a_served_model_and_says_which(redis_client: aioredis.Redis, redis_url: str) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        completion = await client.chat.completions.create(model="auto", messages=MESSAGES)
        await client.close()
    assert completion.model == "m:latest"
    assert completion.choices[0].message.content


async def test_with_paced_streams_on_a_streamed_chat_is_ranked_for_its_reader_and_a_waited_one_for_its_finish(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    async with fleet_and_api(redis_client, redis_url, paced_streams=True) as (base, _):
        waited_id, streamed_id = await _waited_and_streamed(base)
        routed = {r.task_id: r for r in await events_of(ledger, TaskRouted)}
    terms = _terms(routed, waited_id, streamed_id)
    assert all("reading_s" in t for t in terms[streamed_id])
    assert not any("reading_s" in t for t in terms[waited_id])


async def test_by_default_a_streamed_chat_is_ranked_for_its_finish_like_a_waited_one(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    async with fleet_and_api(redis_client, redis_url) as (base, _):
        waited_id, streamed_id = await _waited_and_streamed(base)
        routed = {r.task_id: r for r in await events_of(ledger, TaskRouted)}
    terms = _terms(routed, waited_id, streamed_id)
    assert terms[streamed_id] and not any("reading_s" in t for ts in terms.values() for t in ts)


def _terms(routed: dict[str, TaskRouted], *task_ids: str) -> dict[str, list[dict[str, float]]]:
    return {
        task_id: [c["terms"] for c in routed[task_id].breakdown["candidates"]]  # type: ignore[union-attr]
        for task_id in task_ids
    }


async def _waited_and_streamed(base: str) -> tuple[str, str]:
    """The task ids of one chat answered whole and one streamed, sent in that order."""

    def call() -> tuple[str, str]:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
        with client.chat.completions.with_streaming_response.create(
            model="m", messages=MESSAGES, stream=True
        ) as streamed:
            for _ in streamed.iter_lines():
                pass
        return raw.headers["x-routeledger-task"], streamed.headers["x-routeledger-task"]

    return await asyncio.to_thread(call)
