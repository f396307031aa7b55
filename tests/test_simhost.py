"""Simulated Ollama machines, spoken to by the real `ollama` and `openai` clients.

Speeds are checked from the durations the sim reports (never from wall time), so the tests hold on a
loaded machine; waits poll with generous deadlines.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import ollama
import openai
import pytest

from sim.backends.hosts import SimHosts
from sim.backends.machine import SimMachine, keep_alive_seconds
from sim.backends.text import benchset, count_tokens
from sim.fleetspec import Fleet, load_fleet, parse_fleet
from tests.helpers import make_test_fleet

SEED = 1234
QWEN_DIGEST = "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41"

# A small fleet for the timing tests: fast machines, so that a scaled run takes a fraction of a second.
LAB = """
[model."m"]
digest = "aa11aa11aa11aa11aa11aa11aa11aa11aa11aa11aa11aa11aa11aa11aa11aa11"
family = "llama"
parameter_size = "1B"
size = 1000000
quality = { general = 0.5 }
output = { dist = "fixed", mean = 40.0 }

[[worker]]
name = "one"
slots = 1
[worker.models."m"]
decode_tps = 100.0
prompt_tps = 1000.0
load_s = 2.0

[[worker]]
name = "two"
slots = 2
parallel_exponent = 0.5
[worker.models."m"]
decode_tps = 100.0
prompt_tps = 1000.0
load_s = 2.0
"""


async def poll_until(
    check: Callable[[], Awaitable[bool]], timeout: float = 15.0, every: float = 0.01
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(every)


@pytest.fixture
async def seed_hosts() -> AsyncIterator[SimHosts]:
    """The story's fleet, 100x faster than life."""
    async with SimHosts(load_fleet("seed"), time_scale=0.01, seed=SEED) as hosts:
        yield hosts


@pytest.fixture
async def instant_hosts() -> AsyncIterator[SimHosts]:
    """The story's fleet with no waiting at all."""
    async with SimHosts(load_fleet("seed"), time_scale=0, seed=SEED) as hosts:
        yield hosts


def lab(time_scale: float) -> SimHosts:
    return SimHosts(parse_fleet(LAB, "lab.toml"), time_scale=time_scale, seed=SEED)


def chat_msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def decode_tps(resp: Any) -> float:
    return float(resp.eval_count / resp.eval_duration * 1e9)


# -- the ollama client parses everything ----------------------------------------------------------


async def test_the_ollama_client_lists_each_machines_models_with_digests_and_details(
    seed_hosts: SimHosts,
) -> None:
    listing = await ollama.AsyncClient(seed_hosts.url("rtx3070ti")).list()
    assert [m.model for m in listing.models] == ["qwen3:8b"]
    model = listing.models[0]
    assert model.digest == QWEN_DIGEST
    assert model.size == 5225376047
    assert model.modified_at is not None
    assert model.details is not None
    assert model.details.family == "qwen3"
    assert model.details.parameter_size == "8.2B"
    assert model.details.quantization_level == "Q4_K_M"
    assert model.details.format == "gguf"
    sync_listing = await asyncio.to_thread(ollama.Client(seed_hosts.url("macbookair")).list)
    assert sorted(m.model or "" for m in sync_listing.models) == ["elyza-jp-8b:latest", "qwen3:8b"]


async def test_a_model_name_without_a_tag_means_latest_as_in_ollama(seed_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(seed_hosts.url("macbookair"))
    for name in ("elyza-jp-8b", "elyza-jp-8b:latest"):
        resp = await client.chat(model=name, messages=chat_msgs("hi"), options={"num_predict": 2})
        assert resp.done
        assert resp.model == name


async def test_version_and_root_answer_like_ollama(seed_hosts: SimHosts) -> None:
    async with httpx.AsyncClient(base_url=seed_hosts.url("macbookair")) as http:
        version = (await http.get("/api/version")).json()
        assert re.match(r"^\d+\.\d+\.\d+$", version["version"])
        root = await http.get("/")
        assert root.text == "Ollama is running"


async def test_a_non_streaming_chat_has_ollamas_final_fields(seed_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(seed_hosts.url("rtx3070ti"))
    resp = await client.chat(model="qwen3:8b", messages=chat_msgs("Tell me a story."), stream=False)
    assert resp.done is True
    assert resp.done_reason == "stop"
    assert resp.message.role == "assistant"
    assert resp.message.content
    assert resp.created_at is not None
    for field in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(resp[field], int)
    assert resp.prompt_eval_count == count_tokens("Tell me a story.")
    assert resp.eval_count is not None
    assert resp.eval_count > 0
    assert resp.total_duration is not None
    assert resp.total_duration >= (resp.load_duration or 0) + (resp.eval_duration or 0)


async def test_a_streamed_chat_sends_one_token_per_chunk_then_a_done_chunk(seed_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(seed_hosts.url("rtx3070ti"))
    whole = await client.chat(
        model="qwen3:8b", messages=chat_msgs("stream me"), options={"seed": 5, "num_predict": 30}
    )
    parts = [
        part
        async for part in await client.chat(
            model="qwen3:8b",
            messages=chat_msgs("stream me"),
            stream=True,
            options={"seed": 5, "num_predict": 30},
        )
    ]
    *tokens, final = parts
    assert all(not p.done for p in tokens)
    assert final.done is True
    assert final.message.content == ""
    assert final.eval_count == len(tokens) == 30
    assert final.done_reason == "length"
    assert "".join(p.message.content or "" for p in tokens) == whole.message.content


async def test_generate_streams_and_answers_whole_through_the_sync_client(seed_hosts: SimHosts) -> None:
    client = ollama.Client(seed_hosts.url("rtx3070ti"))
    options = {"seed": 9, "num_predict": 12}

    def both() -> tuple[Any, list[Any]]:
        whole = client.generate(model="qwen3:8b", prompt="Write a haiku.", options=options)
        parts = list(client.generate(model="qwen3:8b", prompt="Write a haiku.", stream=True, options=options))
        return whole, parts

    whole, parts = await asyncio.to_thread(both)
    assert whole.done is True
    assert whole.eval_count == 12
    *tokens, final = parts
    assert final.done is True
    assert final.prompt_eval_count == count_tokens("Write a haiku.")
    assert len(tokens) == final.eval_count == 12
    assert "".join(p.response for p in tokens) == whole.response


async def test_show_describes_a_held_model(seed_hosts: SimHosts) -> None:
    shown = await ollama.AsyncClient(seed_hosts.url("macbookair")).show("qwen3:8b")
    assert shown.details is not None
    assert shown.details.family == "qwen3"
    assert shown.modelinfo is not None
    assert shown.modelinfo["general.architecture"] == "qwen3"
    assert shown.capabilities == ["completion"]


async def test_a_model_the_machine_lacks_is_a_404_with_ollamas_error(seed_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(seed_hosts.url("rtx3070ti"))
    with pytest.raises(ollama.ResponseError) as caught:
        await client.chat(model="elyza-jp-8b", messages=chat_msgs("hi"))
    assert caught.value.status_code == 404
    assert "not found" in caught.value.error
    with pytest.raises(ollama.ResponseError):
        await client.show("elyza-jp-8b")


# -- pull gives a machine a model its preset lists ------------------------------------------------


async def test_pull_gives_the_gpu_pc_elyza_with_the_laptops_digest(seed_hosts: SimHosts) -> None:
    gpu = ollama.AsyncClient(seed_hosts.url("rtx3070ti"))
    air = ollama.AsyncClient(seed_hosts.url("macbookair"))
    statuses = [p.status async for p in await gpu.pull("elyza-jp-8b", stream=True)]
    assert statuses[0] == "pulling manifest"
    assert statuses[-1] == "success"
    digests = {m.model: m.digest for m in (await gpu.list()).models}
    air_digests = {m.model: m.digest for m in (await air.list()).models}
    assert digests["elyza-jp-8b:latest"] == air_digests["elyza-jp-8b:latest"]
    resp = await gpu.chat(model="elyza-jp-8b", messages=chat_msgs("こんにちは"), options={"num_predict": 3})
    assert resp.eval_count == 3
    assert (await gpu.pull("elyza-jp-8b")).status == "success"


async def test_pull_of_a_model_outside_the_preset_fails(seed_hosts: SimHosts) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        await ollama.AsyncClient(seed_hosts.url("rtx3070ti")).pull("llama3.2:3b")
    assert "file does not exist" in caught.value.error


async def test_delete_and_give_model_change_what_the_machine_holds(seed_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(seed_hosts.url("macbookair"))
    await client.delete("elyza-jp-8b")
    assert [m.model for m in (await client.list()).models] == ["qwen3:8b"]
    assert seed_hosts.give_model("macbookair", "elyza-jp-8b") == "elyza-jp-8b:latest"
    assert len((await client.list()).models) == 2


# -- speeds, loading, keep_alive ------------------------------------------------------------------


@pytest.mark.parametrize(("machine", "tps"), [("macbookair", 11.4), ("rtx3070ti", 83.0)])
async def test_the_reported_decode_speed_is_the_presets(
    seed_hosts: SimHosts, machine: str, tps: float
) -> None:
    client = ollama.AsyncClient(seed_hosts.url(machine))
    resp = await client.chat(model="qwen3:8b", messages=chat_msgs("speed"), options={"num_predict": 40})
    assert decode_tps(resp) == pytest.approx(tps, rel=0.01)
    prompt_tps = {"macbookair": 120.0, "rtx3070ti": 2000.0}[machine]
    assert resp.prompt_eval_count is not None
    assert resp.prompt_eval_duration is not None
    assert resp.prompt_eval_count / resp.prompt_eval_duration * 1e9 == pytest.approx(prompt_tps, rel=0.01)


async def test_zero_delay_reports_real_timings_without_waiting_for_them(instant_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(instant_hosts.url("macbookair"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    resp = await client.chat(
        model="qwen3:8b", messages=chat_msgs("long answer"), options={"num_predict": 500}
    )
    wall = loop.time() - started
    assert resp.load_duration == 8_000_000_000
    assert decode_tps(resp) == pytest.approx(11.4, rel=0.01)
    # 500 tokens at 11.4 tok/s are 44 simulated seconds, plus the load.
    assert resp.total_duration is not None
    assert wall < resp.total_duration / 1e9 / 10


async def test_a_model_loads_on_first_use_and_stays_loaded(seed_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(seed_hosts.url("macbookair"))
    assert (await client.ps()).models == []
    first = await client.chat(model="qwen3:8b", messages=chat_msgs("a"), options={"num_predict": 2})
    second = await client.chat(model="qwen3:8b", messages=chat_msgs("b"), options={"num_predict": 2})
    assert first.load_duration == 8_000_000_000
    assert second.load_duration == 0
    loaded = (await client.ps()).models
    assert [m.model for m in loaded] == ["qwen3:8b"]
    assert loaded[0].digest == QWEN_DIGEST
    assert loaded[0].size_vram == loaded[0].size
    assert loaded[0].expires_at is not None
    assert seed_hosts.state("macbookair").counters.loads == 1


async def test_a_model_unloads_after_its_keep_alive(seed_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(seed_hosts.url("rtx3070ti"))
    # 30 simulated seconds are 0.3 s at this time scale.
    await client.chat(model="qwen3:8b", messages=chat_msgs("a"), options={"num_predict": 2}, keep_alive="30s")
    assert [m.model for m in (await client.ps()).models] == ["qwen3:8b"]

    async def unloaded() -> bool:
        return (await client.ps()).models == []

    await poll_until(unloaded)
    again = await client.chat(model="qwen3:8b", messages=chat_msgs("b"), options={"num_predict": 2})
    assert again.load_duration == 3_000_000_000


async def test_keep_alive_zero_unloads_at_once_and_an_empty_prompt_only_loads(seed_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(seed_hosts.url("rtx3070ti"))
    loaded = await client.generate(model="qwen3:8b", prompt="")
    assert loaded.done_reason == "load"
    assert loaded.load_duration == 3_000_000_000
    assert [m.model for m in (await client.ps()).models] == ["qwen3:8b"]
    await client.chat(model="qwen3:8b", messages=chat_msgs("x"), options={"num_predict": 1}, keep_alive=0)
    assert (await client.ps()).models == []


def test_keep_alive_accepts_ollamas_duration_spellings() -> None:
    assert keep_alive_seconds(None) is None
    assert keep_alive_seconds(30) == 30.0
    assert keep_alive_seconds("5m") == 300.0
    assert keep_alive_seconds("1h30m") == 5400.0
    assert keep_alive_seconds("-1") == -1.0
    assert keep_alive_seconds("250ms") == pytest.approx(0.25)


async def test_num_predict_caps_the_output(instant_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(instant_hosts.url("rtx3070ti"))
    resp = await client.generate(model="qwen3:8b", prompt="go on", options={"num_predict": 7})
    assert resp.eval_count == 7
    assert resp.done_reason == "length"


async def test_the_same_seed_gives_the_same_text_and_another_seed_another(instant_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(instant_hosts.url("rtx3070ti"))

    async def text(seed: int) -> str:
        resp = await client.chat(model="qwen3:8b", messages=chat_msgs("same"), options={"seed": seed})
        return resp.message.content or ""

    assert await text(1) == await text(1)
    assert await text(1) != await text(2)


# -- slots and the FIFO ---------------------------------------------------------------------------


async def test_one_slot_runs_one_request_and_queues_the_rest_in_order() -> None:
    # Each request decodes for 0.4 simulated seconds: 0.2 s of wall time.
    async with lab(0.5) as hosts:
        client = ollama.AsyncClient(hosts.url("one"))
        await client.generate(model="m", prompt="")
        finished: list[int] = []

        async def ask(i: int) -> Any:
            resp = await client.chat(model="m", messages=chat_msgs(f"q{i}"), options={"num_predict": 40})
            finished.append(i)
            return resp

        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(ask(i)))

            async def queued(n: int = i) -> bool:
                s = hosts.state("one")
                return s.running + s.queued == n + 1

            await poll_until(queued)
        state = hosts.state("one")
        assert state.running == 1
        assert state.queued == 2
        results = await asyncio.gather(*tasks)
        assert finished == [0, 1, 2]
        # Alone in its slot, each ran at full speed; the waiting shows only in total_duration.
        assert all(decode_tps(r) == pytest.approx(100.0, rel=0.01) for r in results)
        totals = [r.total_duration for r in results]
        assert totals[0] < totals[1] < totals[2]
        assert hosts.state("one").running == 0


async def test_two_slots_run_together_and_share_throughput_sublinearly() -> None:
    async with lab(0.2) as hosts:
        client = ollama.AsyncClient(hosts.url("two"))
        # Load first, so that both requests start decoding at nearly the same moment.
        await client.generate(model="m", prompt="")

        async def ask(i: int) -> Any:
            return await client.chat(model="m", messages=chat_msgs(f"p{i}"), options={"num_predict": 40})

        first = asyncio.create_task(ask(0))
        second = asyncio.create_task(ask(1))

        async def both_running() -> bool:
            return hosts.state("two").running == 2

        await poll_until(both_running)
        assert hosts.state("two").queued == 0
        results = await asyncio.gather(first, second)
    # Two at once with exponent 0.5: each at 100 * 2**0.5 / 2 = 70.7 tok/s while they overlap.
    shared = 100.0 * 2**0.5 / 2
    for resp in results:
        assert shared * 0.95 < decode_tps(resp) < 100.0 * 0.97


# -- the prompt cache -----------------------------------------------------------------------------

# Two conversations that share no token: their first four bytes already differ.
ALPHA = "Alpha. " + " ".join(f"fact {i} of the first story" for i in range(120))
BRAVO = "Bravo. " + " ".join(f"line {i} of the other story" for i in range(120))

Msgs = list[dict[str, str]]


async def native_chat(url: str, messages: Msgs, **body: Any) -> dict[str, Any]:
    """A non-streaming /api/chat, its JSON as sent (the ollama client drops fields it does not know)."""
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        resp = await http.post(
            "/api/chat",
            json={
                "model": "m",
                "messages": messages,
                "stream": False,
                "options": {"num_predict": 40},
                **body,
            },
        )
        resp.raise_for_status()
        return dict(resp.json())


def rendered(messages: Msgs) -> str:
    """The prompt as the simulator renders a chat: the messages' texts joined by "\n"."""
    return "\n".join(m["content"] for m in messages)


def held_after(messages: Msgs, answer: str) -> int:
    """Tokens a slot holds after answering `messages` with `answer`: the rendered prompt, "\n" and
    the answer, at four bytes a token (the simulator's tokenizer)."""
    return len((rendered(messages) + "\n" + answer).encode()) // 4


def next_turn(messages: Msgs, answer: str, question: str) -> Msgs:
    """What a chat client sends next: everything so far, the answer it received, a new question."""
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def before_first_token_s(resp: dict[str, Any]) -> float:
    """Reported time to the first token: everything but decoding."""
    return float(resp["total_duration"] - resp["eval_duration"]) / 1e9


async def test_a_second_turn_evaluates_only_its_new_tokens_and_reaches_its_first_token_sooner() -> None:
    async with lab(0.01) as hosts:
        url = hosts.url("one")
        turn1 = [{"role": "user", "content": ALPHA}]
        # The first answer streamed, as a chat client reads it: what it resends is what it received.
        stream = await ollama.AsyncClient(url).chat(
            model="m", messages=turn1, stream=True, options={"num_predict": 40}
        )
        answer = "".join([part.message.content or "" async for part in stream])
        assert answer
        turn2 = next_turn(turn1, answer, "And then?")
        assert rendered(turn2).startswith(rendered(turn1) + "\n" + answer)

        warm = await native_chat(url, turn2)
        # The same turn on a machine that never saw the conversation (its model loaded first).
        await native_chat(hosts.url("two"), [])
        cold = await native_chat(hosts.url("two"), turn2)

    total = count_tokens(rendered(turn2))
    cached = held_after(turn1, answer)
    assert warm["prompt_eval_count"] == cold["prompt_eval_count"] == total
    assert warm["prompt_eval_cached_count"] == cached
    assert "prompt_eval_cached_count" not in cold
    # Only the tokens after the cached prefix are evaluated, at the preset's 1000 tok/s.
    assert warm["prompt_eval_duration"] / 1e9 == pytest.approx((total - cached) / 1000.0, rel=0.01)
    assert cold["prompt_eval_duration"] / 1e9 == pytest.approx(total / 1000.0, rel=0.01)
    assert total - cached < 10 < cached
    assert before_first_token_s(warm) < before_first_token_s(cold) / 5
    counters = hosts.state("one").counters
    assert counters.cached_prompt_tokens == cached
    assert counters.cache_hits == 1
    assert counters.prompt_tokens == count_tokens(ALPHA) + total


async def test_the_openai_surface_reports_the_whole_prompt_and_its_cached_part() -> None:
    async with lab(0) as hosts:
        turn1 = [{"role": "user", "content": ALPHA}]
        first = await native_chat(hosts.url("one"), turn1)
        turn2 = next_turn(turn1, first["message"]["content"], "And then?")
        client = openai.AsyncOpenAI(base_url=hosts.url("one") + "/v1", api_key="sim", max_retries=0)
        done = await client.chat.completions.create(model="m", messages=turn2, max_tokens=5)  # type: ignore[arg-type]
        await client.close()
    assert done.usage is not None
    assert done.usage.prompt_tokens == count_tokens(rendered(turn2))
    assert done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == held_after(turn1, first["message"]["content"])


async def test_a_different_conversation_on_a_one_slot_machine_evicts_the_first() -> None:
    async with lab(0) as hosts:
        url = hosts.url("one")
        alpha = [{"role": "user", "content": ALPHA}]
        first = await native_chat(url, alpha)
        await native_chat(url, [{"role": "user", "content": BRAVO}])
        again = await native_chat(url, next_turn(alpha, first["message"]["content"], "And then?"))
        state = hosts.state("one")
    assert "prompt_eval_cached_count" not in again
    assert again["prompt_eval_duration"] / 1e9 == pytest.approx(again["prompt_eval_count"] / 1000.0, rel=0.01)
    assert state.counters.cached_prompt_tokens == 0
    assert state.counters.cache_hits == 0


async def test_two_conversations_on_a_two_slot_machine_each_keep_their_cache() -> None:
    async with lab(0) as hosts:
        url = hosts.url("two")
        alpha = [{"role": "user", "content": ALPHA}]
        bravo = [{"role": "user", "content": BRAVO}]
        a1 = (await native_chat(url, alpha))["message"]["content"]
        b1 = (await native_chat(url, bravo))["message"]["content"]
        a2 = await native_chat(url, next_turn(alpha, a1, "And then?"))
        b2 = await native_chat(url, next_turn(bravo, b1, "Go on."))
        counters = hosts.state("two").counters
    assert a2["prompt_eval_cached_count"] == held_after(alpha, a1)
    assert b2["prompt_eval_cached_count"] == held_after(bravo, b1)
    assert counters.cache_hits == 2
    assert counters.cached_prompt_tokens == held_after(alpha, a1) + held_after(bravo, b1)


async def test_unloading_the_model_or_powering_off_loses_every_slots_cache() -> None:
    async with lab(0) as hosts:
        url = hosts.url("two")
        alpha = [{"role": "user", "content": ALPHA}]
        first = await native_chat(url, alpha, keep_alive=0)
        after_unload = await native_chat(url, next_turn(alpha, first["message"]["content"], "And then?"))
        second = await native_chat(url, alpha)
        await hosts.go_offline("two")
        await hosts.go_online("two")
        after_power = await native_chat(url, next_turn(alpha, second["message"]["content"], "And then?"))
        counters = hosts.state("two").counters
    for resp in (after_unload, after_power):
        assert resp["load_duration"] == 2_000_000_000
        assert "prompt_eval_cached_count" not in resp
    # Between the two, the reloaded model cached again: the first turn, asked again, was a prefix of
    # what its slot held.
    assert second["prompt_eval_cached_count"] == second["prompt_eval_count"] - 1
    assert counters.cache_hits == 1


# -- faults ---------------------------------------------------------------------------------------


async def test_an_error_fault_is_an_http_500_with_ollamas_error_json(seed_hosts: SimHosts) -> None:
    seed_hosts.set_faults("rtx3070ti", error_rate=1.0)
    client = ollama.AsyncClient(seed_hosts.url("rtx3070ti"))
    with pytest.raises(ollama.ResponseError) as caught:
        await client.chat(model="qwen3:8b", messages=chat_msgs("x"))
    assert caught.value.status_code == 500
    assert "llama runner" in caught.value.error
    with pytest.raises(ollama.ResponseError):
        async for _ in await client.chat(model="qwen3:8b", messages=chat_msgs("x"), stream=True):
            pass
    assert seed_hosts.state("rtx3070ti").counters.errors == 2


async def test_a_hang_never_answers_until_the_client_gives_up(seed_hosts: SimHosts) -> None:
    seed_hosts.set_faults("rtx3070ti", hang_rate=1.0)
    client = ollama.AsyncClient(seed_hosts.url("rtx3070ti"), timeout=0.5)
    with pytest.raises(httpx.ReadTimeout):
        await client.chat(model="qwen3:8b", messages=chat_msgs("x"))
    assert seed_hosts.state("rtx3070ti").counters.hangs == 1
    # A hang holds no slot: the machine serves the next request once the fault is cleared.
    seed_hosts.set_faults("rtx3070ti", hang_rate=0.0)
    resp = await ollama.AsyncClient(seed_hosts.url("rtx3070ti")).chat(
        model="qwen3:8b", messages=chat_msgs("y"), options={"num_predict": 2}
    )
    assert resp.done


async def test_a_disconnect_fault_cuts_a_stream_after_some_chunks(seed_hosts: SimHosts) -> None:
    async with httpx.AsyncClient(base_url=seed_hosts.url("rtx3070ti")) as http:
        set_resp = await http.post("/sim/faults", json={"disconnect_rate": 1.0})
        assert set_resp.json()["disconnect_rate"] == 1.0
    client = ollama.AsyncClient(seed_hosts.url("rtx3070ti"))
    received: list[Any] = []

    async def read_stream() -> None:
        async for part in await client.chat(model="qwen3:8b", messages=chat_msgs("x"), stream=True):
            received.append(part)

    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await read_stream()
    assert all(not part.done for part in received)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await client.chat(model="qwen3:8b", messages=chat_msgs("x"), stream=False)
    state = seed_hosts.state("rtx3070ti")
    assert state.counters.disconnects == 2
    assert state.running == 0


async def test_fault_rates_out_of_range_are_refused(seed_hosts: SimHosts) -> None:
    async with httpx.AsyncClient(base_url=seed_hosts.url("rtx3070ti")) as http:
        resp = await http.post("/sim/faults", json={"error_rate": 1.5})
        assert resp.status_code == 400
        assert "error_rate" in resp.json()["error"]


async def test_a_speed_factor_set_at_run_time_slows_every_generation_until_it_is_set_back(
    seed_hosts: SimHosts,
) -> None:
    client = ollama.AsyncClient(seed_hosts.url("rtx3070ti"))

    async def tps() -> float:
        resp = await client.chat(model="qwen3:8b", messages=chat_msgs("x"), options={"num_predict": 20})
        assert resp.eval_count and resp.eval_duration
        return float(resp.eval_count / (resp.eval_duration / 1e9))

    usual = await tps()
    async with httpx.AsyncClient(base_url=seed_hosts.url("rtx3070ti")) as http:
        slowed = await http.post("/sim/speed", json={"factor": 0.06})
        assert slowed.status_code == 200 and slowed.json()["speed_factor"] == 0.06
        assert await tps() == pytest.approx(0.06 * usual, rel=1e-3)
        refused = await http.post("/sim/speed", json={"factor": 0})
        assert refused.status_code == 400 and "factor" in refused.json()["error"]
        await http.post("/sim/speed", json={"factor": 1.0})
    assert await tps() == pytest.approx(usual, rel=1e-3)


# -- offline and online ---------------------------------------------------------------------------


async def test_offline_closes_the_port_and_online_reopens_it_with_nothing_loaded(
    seed_hosts: SimHosts,
) -> None:
    url = seed_hosts.url("rtx3070ti")
    client = ollama.AsyncClient(url)
    await client.chat(model="qwen3:8b", messages=chat_msgs("warm"), options={"num_predict": 1})
    await seed_hosts.go_offline("rtx3070ti")
    with pytest.raises(ConnectionError):
        await ollama.AsyncClient(url).list()
    assert seed_hosts.state("rtx3070ti").online is False
    await seed_hosts.go_online("rtx3070ti")
    assert seed_hosts.url("rtx3070ti") == url
    client = ollama.AsyncClient(url)
    assert (await client.ps()).models == []
    cold = await client.chat(model="qwen3:8b", messages=chat_msgs("cold"), options={"num_predict": 1})
    assert cold.load_duration == 3_000_000_000


async def test_going_offline_cuts_a_running_generation(seed_hosts: SimHosts) -> None:
    client = ollama.AsyncClient(seed_hosts.url("macbookair"))
    # 2,000 tokens at 11.4 tok/s take ~1.8 s at this time scale.
    running = asyncio.create_task(
        client.chat(model="qwen3:8b", messages=chat_msgs("long"), options={"num_predict": 2000})
    )

    async def started() -> bool:
        return seed_hosts.state("macbookair").running == 1

    await poll_until(started)
    await seed_hosts.go_offline("macbookair")
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await running
    await seed_hosts.go_online("macbookair")
    assert seed_hosts.state("macbookair").running == 0


async def test_the_control_port_takes_a_machine_offline_and_back(seed_hosts: SimHosts) -> None:
    url = seed_hosts.url("macbookair")
    async with httpx.AsyncClient(base_url=seed_hosts.control_url) as control:
        off = await control.post("/sim/macbookair/offline")
        assert off.json()["online"] is False
        with pytest.raises(ConnectionError):
            await ollama.AsyncClient(url).list()
        on = await control.post("/sim/macbookair/online")
        assert on.json()["online"] is True
        everything = (await control.get("/sim/state")).json()
        assert everything["hosts"] == seed_hosts.urls
        assert (await control.get("/sim/nobody/state")).status_code == 404
    assert len((await ollama.AsyncClient(url).list()).models) == 2


async def test_a_machine_takes_itself_offline_through_its_own_port(seed_hosts: SimHosts) -> None:
    url = seed_hosts.url("rtx3070ti")
    async with httpx.AsyncClient(base_url=url) as http:
        resp = await http.post("/sim/offline")
        assert resp.json()["online"] is False
    with pytest.raises(ConnectionError):
        await ollama.AsyncClient(url).list()


async def test_online_windows_power_a_machine_off_and_on_by_the_schedule() -> None:
    fleet = parse_fleet(
        """
        [[worker]]
        name = "night"
        online = [[0.0, 20.0], [60.0, 1e9]]
        [worker.models."m"]
        decode_tps = 10.0
        """
    )
    # Offline from 0.2 s to 0.6 s of wall time.
    async with SimHosts(fleet, time_scale=0.01) as hosts:

        async def offline() -> bool:
            return not hosts.is_online("night")

        async def online() -> bool:
            return hosts.is_online("night")

        await poll_until(offline, every=0.005)
        with pytest.raises(ConnectionError):
            await ollama.AsyncClient(hosts.url("night")).list()
        await poll_until(online, every=0.005)
        assert len((await ollama.AsyncClient(hosts.url("night")).list()).models) == 1


# -- the OpenAI-compatible API --------------------------------------------------------------------


async def test_the_openai_client_lists_models_and_chats(seed_hosts: SimHosts) -> None:
    client = openai.AsyncOpenAI(base_url=seed_hosts.url("macbookair") + "/v1", api_key="sim", max_retries=0)
    models = await client.models.list()
    assert sorted(m.id for m in models.data) == ["elyza-jp-8b:latest", "qwen3:8b"]
    done = await client.chat.completions.create(
        model="qwen3:8b", messages=[{"role": "user", "content": "hi"}], max_tokens=5, seed=3
    )
    assert done.object == "chat.completion"
    assert done.choices[0].message.content
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert done.usage.completion_tokens == 5
    assert done.usage.prompt_tokens == count_tokens("hi")
    await client.close()


async def test_the_openai_client_streams_sse_with_usage(seed_hosts: SimHosts) -> None:
    client = openai.AsyncOpenAI(base_url=seed_hosts.url("rtx3070ti") + "/v1", api_key="sim", max_retries=0)
    stream = await client.chat.completions.create(
        model="qwen3:8b",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) == 6
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    await client.close()


async def test_an_openai_error_fault_is_an_api_error(seed_hosts: SimHosts) -> None:
    seed_hosts.set_faults("rtx3070ti", error_rate=1.0)
    client = openai.AsyncOpenAI(base_url=seed_hosts.url("rtx3070ti") + "/v1", api_key="sim", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="qwen3:8b", messages=[{"role": "user", "content": "hi"}])
    await client.close()


# -- quality --------------------------------------------------------------------------------------


def test_the_benchmark_set_has_six_answerable_prompts_per_domain() -> None:
    prompts = benchset()
    assert len({p.id for p in prompts}) == len(prompts)
    for domain in ("general", "code", "japanese"):
        mine = [p for p in prompts if p.domain == domain]
        assert len(mine) >= 6, domain
        for p in mine:
            # Models end answers with a full stop; that must not fail a right answer.
            assert p.passes(p.answer), p.id
            assert p.passes(p.answer + "."), p.id
            assert p.passes(p.answer + "。"), p.id
            if domain == "japanese":
                assert re.search(r"[\u3040-\u30ff\u4e00-\u9fff]", p.prompt), p.id


@pytest.mark.parametrize(("machine", "model"), [("rtx3070ti", "qwen3:8b"), ("macbookair", "elyza-jp-8b")])
async def test_benchmark_answers_pass_at_the_models_quality(
    instant_hosts: SimHosts, machine: str, model: str
) -> None:
    fleet: Fleet = instant_hosts.fleet
    quality = fleet.model_spec(model).quality
    client = ollama.AsyncClient(instant_hosts.url(machine))
    prompts = benchset()
    for domain in ("general", "code", "japanese"):
        mine = [p for p in prompts if p.domain == domain]
        passed = total = 0
        for round_ in range(40):
            for p in mine:
                resp = await client.chat(
                    model=model,
                    messages=chat_msgs(p.prompt),
                    options={"seed": round_, "num_predict": p.max_tokens},
                )
                total += 1
                passed += p.passes(resp.message.content or "")
        rate = passed / total
        # Binomial with n >= 240: a standard deviation under 0.033; 0.1 is three of them.
        assert rate == pytest.approx(quality[domain], abs=0.1), (domain, rate)


async def test_an_ordinary_prompt_never_contains_a_benchmark_answer_by_design(
    instant_hosts: SimHosts,
) -> None:
    resp = await ollama.AsyncClient(instant_hosts.url("rtx3070ti")).chat(
        model="qwen3:8b", messages=chat_msgs("Tell me about France."), options={"num_predict": 50}
    )
    assert resp.eval_count == 50
    assert resp.message.content


# -- the command line -----------------------------------------------------------------------------


def test_sim_hosts_json_prints_urls_that_answer_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "routeledger",
            "sim",
            "hosts",
            "--preset",
            "seed",
            "--time-scale",
            "0",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        info = json.loads(line)
        assert set(info["hosts"]) == {"macbookair", "rtx3070ti", "ai-core"}
        for url in info["hosts"].values():
            assert httpx.get(url + "/api/version", timeout=10).status_code == 200
        assert httpx.get(info["control"] + "/sim/state", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sim_hosts_with_an_unknown_preset_fails_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "routeledger", "sim", "hosts", "--preset", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no fleet preset 'nope'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


async def test_a_slot_released_while_its_cancelled_waiters_unwind_raises_nothing_and_frees_the_slot() -> None:
    # As at a shutdown: every request is cancelled at once, and the one holding the slot releases
    # it before the waiters' own handlers run (the ValueError "<Future cancelled> is not in deque").
    fleet = make_test_fleet()
    machine = SimMachine(fleet.worker[0], fleet, time_scale=0)
    slots = machine.slots
    for _ in range(slots):
        await machine.acquire()
    waiters = [asyncio.create_task(machine.acquire()) for _ in range(2)]
    await asyncio.sleep(0)
    for task in waiters:
        task.cancel()  # cancels the future it waits on now; its handler runs on the next turn
    machine.release()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    assert machine.queued == 0 and machine.running == slots - 1
    await asyncio.wait_for(machine.acquire(), 1)
    assert machine.running == slots
