"""Backend adapters against the simulated hosts: Ollama's API and the OpenAI-compatible one."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import msgspec
import pytest

from events.event import TaskCompleted, Timings
from sim.backends.hosts import SimHosts
from sim.fleetspec import parse_fleet
from tasks.payload import Message, TaskMessage, Thought, ToolCall
from tests.helpers import MODEL_DIGEST, make_test_fleet
from workers.backend import (
    Generated,
    OllamaBackend,
    OpenAIBackend,
    _ollama_timings,
    image_content,
    ollama_messages,
    openai_digest,
    openai_messages,
)
from workers.errors import BackendError
from workers.resources import read_resources


def _task(max_tokens: int = 12) -> TaskMessage:
    return TaskMessage(
        task_id="t",
        model="m",
        digest=MODEL_DIGEST,
        messages=[Message(role="user", content="hi")],
        max_tokens=max_tokens,
    )


async def _run(backend: OllamaBackend | OpenAIBackend, name: str) -> tuple[str, Generated]:
    pieces: list[str] = []
    final: Generated | None = None
    async for item in backend.generate(_task(), name):
        if isinstance(item, Generated):
            final = item
        elif isinstance(item, str):
            pieces.append(item)
    assert final is not None
    return "".join(pieces), final


async def test_the_ollama_adapter_reads_inventory_and_the_backends_own_timings() -> None:
    async with SimHosts(make_test_fleet(), time_scale=0.0) as sim:
        backend = OllamaBackend(sim.url("a"))
        try:
            inventory = await backend.inventory()
            assert [(m.name, m.digest) for m in inventory.models] == [("m:latest", MODEL_DIGEST)]
            text, final = await _run(backend, "m:latest")
            assert (await backend.inventory()).loaded == [MODEL_DIGEST]
        finally:
            await backend.aclose()
    t = final.timings
    assert text and t.eval_count == 12 and t.eval_duration == pytest.approx(12 / 200 * 1e9, rel=0.01)
    assert t.prompt_eval_count and t.total_duration and final.done_reason == "length"


async def test_the_openai_adapter_measures_durations_and_takes_counts_from_usage() -> None:
    async with SimHosts(make_test_fleet(), time_scale=0.05) as sim:
        backend = OpenAIBackend(sim.url("a") + "/v1")
        try:
            inventory = await backend.inventory()
            names = [m.name for m in inventory.models]
            assert names and inventory.loaded == []  # the protocol cannot say what is loaded
            assert inventory.models[0].digest == openai_digest(names[0])
            text, final = await _run(backend, names[0])
        finally:
            await backend.aclose()
    t = final.timings
    assert text and t.eval_count == 12 and t.prompt_eval_count
    assert t.eval_duration is not None and t.eval_duration > 0 and t.total_duration is not None
    assert t.load_duration is None  # not reported by the protocol: unknown, not zero


async def test_a_backend_that_is_not_there_is_an_unreachable_failure() -> None:
    from routeledger.embedded import free_port

    backend = OllamaBackend(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(BackendError) as info:
            await backend.inventory()
    finally:
        await backend.aclose()
    assert info.value.kind == "unreachable" and info.value.retryable


def test_resources_that_cannot_be_read_are_none_never_a_sentinel() -> None:
    r = read_resources()
    assert r.cpu_percent is None or 0.0 <= r.cpu_percent <= 100.0 * 64
    assert r.mem_total_bytes is None or r.mem_total_bytes > 0
    for value in (r.gpu_percent, r.vram_used_bytes, r.vram_total_bytes):
        assert value is None or value >= 0  # this machine has no GPU: None; never -1


def test_a_backend_timing_no_ledger_column_could_hold_is_recorded_as_unknown() -> None:
    t = _ollama_timings(
        {
            "prompt_eval_count": 2**64 - 1,
            "prompt_eval_duration": float("nan"),
            "eval_count": 12,
            "eval_duration": 1e30,
            "load_duration": -5,
            "total_duration": True,
        }
    )
    assert t == Timings(eval_count=12)
    # What the worker would append decodes again: it can never be poison.
    event = TaskCompleted(task_id="t", worker="w", digest="d", attempt=1, timings=t)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=TaskCompleted) == event


def test_a_machine_whose_memory_cannot_hold_its_two_smallest_models_has_room_for_one() -> None:
    from events.event import ModelEntry, Resources
    from workers.backend import Inventory
    from workers.resources import max_loaded

    gib = 2**30
    models = [ModelEntry(name="a", digest="a", size=5 * gib), ModelEntry(name="b", digest="b", size=4 * gib)]
    # Loaded, `a` takes more than its file (its context): /api/ps's size is the one that counts.
    listed = Inventory(models=models, loaded=["a"], loaded_bytes={"a": 6 * gib})
    assert max_loaded(listed, Resources(vram_total_bytes=8 * gib, mem_total_bytes=64 * gib)) == 1
    assert max_loaded(listed, Resources(mem_total_bytes=64 * gib)) == 2
    assert max_loaded(listed, Resources()) is None
    unsized = Inventory(models=[*models, ModelEntry(name="c", digest="c")], loaded=[])
    assert max_loaded(unsized, Resources(mem_total_bytes=64 * gib)) is None


# -- tools ------------------------------------------------------------------------------------------

TOOLS_FLEET = """
[model."caller"]
capabilities = ["completion", "tools"]
output = { dist = "fixed", mean = 8 }
[model."plain"]
output = { dist = "fixed", mean = 8 }
[[worker]]
name = "a"
[worker.models."caller"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
[worker.models."plain"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _tools_task(text: str, **fields: Any) -> TaskMessage:
    return TaskMessage(
        task_id="t",
        model="caller",
        digest="d",
        messages=[Message(role="user", content=text)],
        tools=[WEATHER, CLOCK],
        **fields,
    )


async def _items(
    backend: OllamaBackend | OpenAIBackend, task: TaskMessage
) -> tuple[str, list[ToolCall], Generated]:
    text, calls, final = "", [], None
    async for item in backend.generate(task, task.model):
        if isinstance(item, Generated):
            final = item
        elif isinstance(item, list):
            calls += item
        elif isinstance(item, str):
            text += item
    assert final is not None
    return text, calls, final


async def test_the_ollama_adapter_asks_each_digest_its_capabilities_once() -> None:
    shown: list[str] = []

    async def count(request: httpx.Request) -> None:
        if request.url.path == "/api/show":
            shown.append(json.loads(request.content)["model"])

    async with SimHosts(parse_fleet(TOOLS_FLEET, "t.toml"), time_scale=0.0) as sim:
        backend = OllamaBackend(sim.url("a"))
        backend.client.event_hooks["request"].append(count)
        try:
            first = await backend.inventory()
            again = await backend.inventory()
        finally:
            await backend.aclose()
    caps = {m.name: m.capabilities for m in first.models}
    assert caps == {"caller:latest": ["completion", "tools"], "plain:latest": ["completion"]}
    assert again.models == first.models
    assert sorted(shown) == ["caller:latest", "plain:latest"]


async def test_an_openai_compatible_backend_cannot_say_what_a_model_can_do() -> None:
    async with SimHosts(parse_fleet(TOOLS_FLEET, "t.toml"), time_scale=0.0) as sim:
        backend = OpenAIBackend(sim.url("a") + "/v1")
        try:
            inventory = await backend.inventory()
        finally:
            await backend.aclose()
    assert {m.capabilities for m in inventory.models} == {None}


@pytest.mark.parametrize("kind", ["ollama", "openai"])
async def test_each_adapter_offers_the_tools_and_yields_the_calls_whole_with_ids(kind: str) -> None:
    async with SimHosts(parse_fleet(TOOLS_FLEET, "t.toml"), time_scale=0.0) as sim:
        backend = OllamaBackend(sim.url("a")) if kind == "ollama" else OpenAIBackend(sim.url("a") + "/v1")
        try:
            text, calls, final = await _items(backend, _tools_task("use get_time and get_weather"))
        finally:
            await backend.aclose()
    assert text == ""
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    # In the ledger's terms: the model stopped of itself (OpenAI's "tool_calls" is not a reason there).
    assert final.done_reason == "stop"
    assert final.timings.eval_count is not None and final.timings.eval_count > 0


@pytest.mark.parametrize("kind", ["ollama", "openai"])
async def test_a_tool_choice_of_none_gets_prose_from_either_backend(kind: str) -> None:
    async with SimHosts(parse_fleet(TOOLS_FLEET, "t.toml"), time_scale=0.0) as sim:
        backend = OllamaBackend(sim.url("a")) if kind == "ollama" else OpenAIBackend(sim.url("a") + "/v1")
        try:
            text, calls, _ = await _items(backend, _tools_task("use get_time", tool_choice="none"))
        finally:
            await backend.aclose()
    assert text and calls == []


def test_a_tool_result_that_names_only_its_call_id_reaches_ollama_named_by_its_function() -> None:
    asked = Message(
        role="assistant",
        tool_calls=[ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')],
    )
    answer = Message(role="tool", content="rain", tool_call_id="call_1")
    assert ollama_messages([Message(role="user", content="hi"), asked, answer]) == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "rain", "tool_name": "get_weather"},
    ]


def test_calls_sent_back_without_ids_reach_an_openai_backend_with_ids_their_results_name() -> None:
    asked = Message(
        role="assistant",
        tool_calls=[
            ToolCall(name="get_weather", arguments='{"city": "Oslo"}'),
            ToolCall(name="get_time"),
        ],
    )
    results = [
        Message(role="tool", content="noon", tool_name="get_time"),
        Message(role="tool", content="rain"),
    ]
    sent = openai_messages([Message(role="user", content="hi"), asked, *results])
    assert sent[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
            {"id": "call_1_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }
    # By function name where the result names one, else the earliest call not answered yet.
    assert [m["tool_call_id"] for m in sent[2:]] == ["call_1_1", "call_1_0"]


@pytest.mark.parametrize("kind", ["ollama", "openai"])
async def test_parallel_tool_calls_false_gets_one_call_from_either_backend(kind: str) -> None:
    async with SimHosts(parse_fleet(TOOLS_FLEET, "t.toml"), time_scale=0.0) as sim:
        backend = OllamaBackend(sim.url("a")) if kind == "ollama" else OpenAIBackend(sim.url("a") + "/v1")
        try:
            _, calls, _ = await _items(
                backend, _tools_task("use get_time and get_weather", parallel_tool_calls=False)
            )
        finally:
            await backend.aclose()
    assert [c.name for c in calls] == ["get_weather"]


# -- images, structured output, thinking ------------------------------------------------------------

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4//8/AAX+Av6n1qTBAAAAAElFTkSuQmCC"
JPEG = "/9j/4AAQSkZJRgABAQAAAQABAAD"


def test_images_reach_an_openai_backend_as_data_url_parts_of_their_media_type() -> None:
    assert image_content("look", None) == "look"
    assert image_content("look", [PNG, JPEG]) == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{JPEG}"}},
    ]


async def test_the_openai_adapter_asks_in_openai_terms_and_reads_thinking_under_either_name() -> None:
    sent: list[dict[str, Any]] = []
    deltas = [
        {"reasoning": "weigh "},
        {"reasoning_content": "it"},
        {"content": "{}"},
    ]
    lines = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    lines.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    body = "".join(f"data: {json.dumps(line)}\n\n" for line in lines) + "data: [DONE]\n\n"

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    backend = OpenAIBackend("http://backend")
    await backend.client.aclose()
    backend.client = httpx.AsyncClient(base_url="http://backend", transport=httpx.MockTransport(answer))
    task = TaskMessage(
        task_id="t",
        model="m",
        digest="d",
        kind="generate",
        prompt="look",
        images=[PNG],
        format={"type": "object"},
        think=True,
    )
    items = [item async for item in backend.generate(task, "m")]
    await backend.aclose()
    assert [i for i in items if not isinstance(i, Generated)] == [Thought("weigh "), Thought("it"), "{}"]
    assert sent[0]["messages"][0]["content"][1]["image_url"]["url"] == f"data:image/png;base64,{PNG}"
    # Ollama's format and think, spelled OpenAI's way.
    assert sent[0]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": {"type": "object"}},
    }
    assert sent[0]["reasoning_effort"] == "medium"


@pytest.mark.parametrize(
    ("fault", "kind"),
    [("error_rate", "http_5xx"), ("disconnect_rate", "disconnect"), ("model", "model_missing")],
)
async def test_a_run_request_that_fails_says_how_in_the_kind_the_worker_acts_on(
    fault: str, kind: str
) -> None:
    # A run's request goes over the worker's own connection pool (LineStreams): an error answer,
    # a stream cut mid-way and an unknown model each come back as the failure the worker handles.
    async with SimHosts(make_test_fleet(), time_scale=0.0) as sim:
        backend = OllamaBackend(sim.url("a"))
        try:
            name = "m:latest"
            if fault == "model":
                name = "nothing:latest"
            else:
                async with httpx.AsyncClient() as http:
                    await http.post(sim.url("a") + "/sim/faults", json={fault: 1.0})
            with pytest.raises(BackendError) as info:
                await _run(backend, name)
            # The pool serves the next run once the fault is gone.
            async with httpx.AsyncClient() as http:
                await http.post(
                    sim.url("a") + "/sim/faults", json={"error_rate": 0.0, "disconnect_rate": 0.0}
                )
            text, _ = await _run(backend, "m:latest")
        finally:
            await backend.aclose()
    assert info.value.kind == kind
    assert info.value.retryable
    assert text


async def test_what_one_read_of_the_backend_brings_is_handed_on_piece_by_piece_in_order() -> None:
    lines = [
        {"message": {"role": "assistant", "content": "", "thinking": "hm"}},
        {"message": {"role": "assistant", "content": "", "thinking": "m."}},
        {"message": {"role": "assistant", "content": "Hel"}},
        {"message": {"role": "assistant", "content": "lo"}},
        {
            "message": {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
            }
        },
        {"message": {"role": "assistant", "content": "!"}},
        {
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": "stop",
            "eval_count": 4,
        },
    ]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    backend = OllamaBackend(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        items = [item async for item in backend.generate(_task(), "m")]
    finally:
        await backend.aclose()
        server.close()
    # Piece by piece (a run counts its pieces as tokens), in order, all from one read.
    assert items[:4] == [Thought("hm"), Thought("m."), "Hel", "lo"] and items[5] == "!"
    assert isinstance(items[4], list) and [(c.name, c.arguments) for c in items[4]] == [("f", "{}")]
    assert isinstance(items[6], Generated) and items[6].timings.eval_count == 4
