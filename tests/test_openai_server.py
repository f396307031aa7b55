"""What an OpenAI-compatible server says is read as it means it (workers.backend.OpenAIBackend),
against a small server that answers as llama-server does: the model's identity from its weights,
its short name, the server's own timings, its prompt cache, and a 501 learned as a missing
capability."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dispatch.serving import names_model
from events.event import ModelEntry
from tasks.payload import EMBED, Message, TaskMessage
from tests.test_backend_streams import read_request, serving
from workers.backend import Generated, OpenAIBackend, openai_digest, short_name, weights_digest
from workers.errors import BackendError

PATH = "/home/me/models/SmolLM2-135M-Instruct.Q4_1.gguf"
META = {
    "vocab_type": 2,
    "n_vocab": 49152,
    "n_ctx": 4096,
    "n_ctx_train": 8192,
    "n_embd": 576,
    "n_params": 134515008,
    "size": 96576768,
    "ftype": "Q4_1",
}


def _json(status: int, body: Any) -> bytes:
    raw = json.dumps(body).encode()
    return b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status,
        len(raw),
        raw,
    )


def _sse(*chunks: Any) -> bytes:
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


def llama_server(
    model_id: str, seen: list[dict[str, Any]], embeddings: bool = False
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A server answering as llama-server does for one model started from `model_id`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await read_request(reader):
            head, _, body = request.partition(b"\r\n\r\n")
            line = head.split(b"\r\n")[0].decode()
            if line.startswith("GET /v1/models"):
                writer.write(_json(200, {"object": "list", "data": [{"id": model_id, "meta": META}]}))
            elif line.startswith("GET /props"):
                writer.write(_json(200, {"model_path": PATH, "total_slots": 1}))
            elif line.startswith("POST /v1/embeddings"):
                seen.append(json.loads(body))
                if embeddings:
                    writer.write(_json(200, {"data": [{"index": 0, "embedding": [0.5, 0.5]}]}))
                else:
                    message = "This server does not support embeddings. Start it with `--embeddings`"
                    writer.write(_json(501, {"error": {"code": 501, "message": message, "type": "x"}}))
            else:
                seen.append(json.loads(body))
                writer.write(
                    _sse(
                        {"choices": [{"delta": {"content": "Hel"}}]},
                        {"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]},
                        {
                            "choices": [],
                            "usage": {
                                "completion_tokens": 2,
                                "prompt_tokens": 41,
                                "prompt_tokens_details": {"cached_tokens": 40},
                            },
                            "timings": {
                                "cache_n": 40,
                                "prompt_n": 1,
                                "prompt_ms": 25.4,
                                "predicted_n": 2,
                                "predicted_ms": 50.0,
                            },
                        },
                    )
                )
            await writer.drain()

    return handler


def _chat() -> TaskMessage:
    return TaskMessage(task_id="t", model="m", digest="d", messages=[Message(role="user", content="hi")])


async def test_the_same_gguf_from_two_paths_is_one_model_named_by_its_file() -> None:
    entries: list[ModelEntry] = []
    for started_from in (PATH, "/srv/other/place/SmolLM2-135M-Instruct.Q4_1.gguf"):
        async with serving(llama_server(started_from, [])) as (url, _):
            backend = OpenAIBackend(url)
            entries += (await backend.inventory()).models
            await backend.aclose()
    one, two = entries
    assert one.digest == two.digest == weights_digest("SmolLM2-135M-Instruct.Q4_1.gguf", META)
    assert one.name == two.name == "SmolLM2-135M-Instruct.Q4_1"
    assert (one.size, one.parameter_size, one.quantization, one.context_length) == (
        96576768,
        "135M",
        "Q4_1",
        8192,
    )
    # Another file, or the same file with other weights, is another model.
    assert weights_digest("other.gguf", META) != one.digest
    assert weights_digest(one.name + ".gguf", {**META, "size": 1}) != one.digest
    # A server that says nothing of the weights is known by its model's name, as before.
    assert openai_digest("gpt-4o") != one.digest and weights_digest("x", {}) is None


async def test_a_model_started_under_an_alias_is_named_by_it_and_identified_by_its_file() -> None:
    async with serving(llama_server("smol", [])) as (url, _):
        backend = OpenAIBackend(url)
        (entry,) = (await backend.inventory()).models
        await backend.aclose()
    assert entry.name == "smol"
    assert entry.digest == weights_digest("SmolLM2-135M-Instruct.Q4_1.gguf", META)


def test_a_gguf_files_name_or_path_names_the_model_served_from_it() -> None:
    entry = ModelEntry(name=short_name(PATH), digest="ab" * 32)
    assert entry.name == "SmolLM2-135M-Instruct.Q4_1"
    for asked in (
        "SmolLM2-135M-Instruct.Q4_1",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        PATH,
        "C:\\m\\" + entry.name + ".gguf",
    ):
        assert names_model(entry, asked), asked
    assert not names_model(entry, "SmolLM2-360M-Instruct.Q4_1.gguf")
    assert not names_model(entry, "/models/other.gguf")
    # Only a GGUF file's path is cut to its name: `org/model` is not `model`.
    assert not names_model(ModelEntry(name="model", digest="cd" * 32), "org/model")
    assert short_name("qwen3:8b") == "qwen3:8b" and short_name("org/model") == "org/model"


async def test_a_run_sends_the_servers_own_id_and_keeps_its_own_timings_and_cache() -> None:
    seen: list[dict[str, Any]] = []
    async with serving(llama_server(PATH, seen)) as (url, _):
        backend = OpenAIBackend(url)
        (entry,) = (await backend.inventory()).models
        items = [item async for item in backend.generate(_chat(), entry.name)]
        await backend.aclose()
    assert seen[0]["model"] == PATH
    assert items[:2] == ["Hel", "lo"]
    final = items[-1]
    assert isinstance(final, Generated)
    t = final.timings
    # The server's clock and counts: 1 of 41 prompt tokens evaluated in 25.4 ms, 2 decoded in 50 ms.
    assert (t.prompt_eval_count, t.prompt_eval_cached_count, t.evaluated_prompt_tokens()) == (41, 40, 1)
    assert t.prompt_eval_duration == 25_400_000 and (t.eval_count, t.eval_duration) == (2, 50_000_000)


async def test_a_501_to_an_embedding_is_not_retried_and_the_model_is_learned_to_lack_embeddings() -> None:
    seen: list[dict[str, Any]] = []
    async with serving(llama_server(PATH, seen)) as (url, _):
        backend = OpenAIBackend(url)
        (entry,) = (await backend.inventory()).models
        task = TaskMessage(task_id="e", model=entry.name, digest=entry.digest, kind=EMBED, inputs=["x"])
        with pytest.raises(BackendError) as refused:
            [item async for item in backend.generate(task, entry.name)]
        (after,) = (await backend.inventory()).models
        await backend.aclose()
    assert (refused.value.kind, refused.value.retryable) == ("unsupported", False)
    assert "Start it with `--embeddings`" in refused.value.message
    assert entry.lacks is None and after.lacks == ["embedding"]
    assert seen == [{"model": PATH, "input": ["x"], "encoding_format": "float"}]


async def test_two_files_of_one_name_from_two_folders_keep_their_paths_as_names() -> None:
    listed = {
        "object": "list",
        "data": [{"id": "/a/Smol.gguf", "meta": META}, {"id": "/b/Smol.gguf", "meta": {**META, "size": 5}}],
    }

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(_json(200, listed))
            await writer.drain()

    async with serving(handler) as (url, _):
        backend = OpenAIBackend(url)
        models = (await backend.inventory()).models
        await backend.aclose()
    assert [m.name for m in models] == ["/a/Smol.gguf", "/b/Smol.gguf"]
    assert len({m.digest for m in models}) == 2
