"""Backend adapters against the simulated hosts: Ollama's API and the OpenAI-compatible one."""

from __future__ import annotations

import msgspec
import pytest

from dispatch.payload import Message, TaskMessage
from events.event import TaskCompleted, Timings
from sim.backends.hosts import SimHosts
from tests.helpers import MODEL_DIGEST, make_test_fleet
from workers.backend import Generated, OllamaBackend, OpenAIBackend, _ollama_timings, openai_digest
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
        else:
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
