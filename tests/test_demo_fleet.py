"""The demo's fleet (sim/presets/demo.toml, what `routeledger up --demo` simulates): the story's
machines with the seed's figures, each model reporting what the real one reports in Ollama, and
the demo's trickle of requests answered by models that complete."""

from __future__ import annotations

import ollama
import openai
import pytest
import redis.asyncio as aioredis

from dispatch.submit import preview_request
from dispatch.view import LiveView
from events.event import TaskCompleted, TaskFailed, TaskRouted
from events.keys import Keys
from events.ledger import Ledger
from routeledger.cli_traffic import trickle
from router.choose import RouteQuery
from sim.backends.hosts import SimHosts
from sim.fleetspec import fleet_from_dict, load_fleet
from tests.helpers import events_of, fast_config, running_agent, wait_until
from tests.test_api_support import fleet_and_api

# What real Ollama reports for these models (`ollama show`, `ollama list`).
REAL: dict[str, dict[str, object]] = {
    "qwen3:8b": {
        "capabilities": ["completion", "tools", "thinking"],
        "family": "qwen3",
        "parameter_size": "8.2B",
        "quantization_level": "Q4_K_M",
        "size": 5225376047,
        "context_length": 40960,
    },
    "gemma3:4b": {
        "capabilities": ["completion", "vision"],
        "family": "gemma3",
        "parameter_size": "4.3B",
        "quantization_level": "Q4_K_M",
        "size": 3338801804,
        "context_length": 131072,
    },
    "nomic-embed-text": {
        "capabilities": ["embedding"],
        "family": "nomic-bert",
        "parameter_size": "137M",
        "quantization_level": "F16",
        "size": 274302450,
        "context_length": 2048,
    },
}


def test_the_demo_keeps_the_seed_machines_and_figures_and_adds_an_embedding_and_a_vision_model() -> None:
    seed, demo = load_fleet("seed"), load_fleet("demo")
    machines = {w.name: w for w in demo.workers}
    assert list(machines) == [w.name for w in seed.workers]
    for machine in seed.workers:
        # The story's models keep the seed's speeds, digests and slots: the demo looks like the story.
        assert machines[machine.name].slots == machine.slots
        for name, figures in machine.models.items():
            assert machines[machine.name].models[name] == figures
            assert demo.digest_of(machines[machine.name], name) == seed.digest_of(machine, name)
        assert machines[machine.name].serves == machine.serves
    assert "nomic-embed-text" in machines["macbookair"].models
    assert "nomic-embed-text" in machines["rtx3070ti"].models
    assert "gemma3:4b" in machines["rtx3070ti"].models and "gemma3:4b" not in machines["macbookair"].models
    assert machines["rtx3070ti"].models["elyza-jp-8b"].held is False
    gpu, laptop = (
        machines["rtx3070ti"].models["nomic-embed-text"],
        machines["macbookair"].models["nomic-embed-text"],
    )
    # A few thousand tokens a second on the GPU, several hundred on the laptop.
    assert 2000 <= gpu.embedding_tps <= 8000 and 300 <= laptop.embedding_tps <= 1200


async def test_the_demo_models_report_what_real_ollama_reports_for_them() -> None:
    async with SimHosts(load_fleet("demo"), time_scale=0, seed=3) as hosts:
        client = ollama.AsyncClient(host=hosts.url("rtx3070ti"))
        shown = {name: await client.show(name) for name in REAL}
        listed = {m.model: m for m in (await client.list()).models}
        vector = await client.embed(model="nomic-embed-text", input="a cat")
        laptop = ollama.AsyncClient(host=hosts.url("macbookair"))
        laptop_models = {m.model for m in (await laptop.list()).models}
    for name, real in REAL.items():
        show = shown[name]
        assert show.capabilities == real["capabilities"], name
        assert show.details is not None and show.details.family == real["family"]
        assert show.details.parameter_size == real["parameter_size"]
        assert show.details.quantization_level == real["quantization_level"]
        assert (
            show.modelinfo is not None
            and show.modelinfo[f"{real['family']}.context_length"] == real["context_length"]
        )
        tagged = next(m for m in listed.values() if m.model is not None and m.model.startswith(name))
        assert tagged.size == real["size"]
    assert len(vector.embeddings[0]) == 768
    assert shown["nomic-embed-text"].modelinfo is not None
    assert shown["nomic-embed-text"].modelinfo["nomic-bert.embedding_length"] == 768
    assert "elyza-jp-8b:latest" not in listed  # pulled at run time
    assert "gemma3:4b" not in laptop_models and any(
        m and m.startswith("nomic-embed-text") for m in laptop_models
    )


async def test_the_demo_trickle_is_answered_by_models_that_complete_never_by_the_embedding_model(
    redis_client: aioredis.Redis,
) -> None:
    fleet = load_fleet("demo")
    embedder = fleet.model_spec("nomic-embed-text").digest
    keys = Keys()
    ledger = Ledger(redis_client, keys)
    async with (
        SimHosts(fleet, time_scale=0, seed=3) as hosts,
        running_agent(redis_client, hosts.url("rtx3070ti"), fast_config("rtx3070ti")),
        running_agent(redis_client, hosts.url("macbookair"), fast_config("macbookair")),
    ):
        sent = await trickle(redis_client, keys, rate=50.0, count=20, seed=7, models=("auto",))

        async def settled() -> bool:
            ended = len(await events_of(ledger, TaskCompleted)) + len(await events_of(ledger, TaskFailed))
            return ended >= sent

        await wait_until(settled, timeout=30, every=0.2)
        # The dashboard's routing preview of `auto` weighs the same models.
        previewed = await preview_request(LiveView(redis_client, keys), RouteQuery(model="auto"))
    routed = await events_of(ledger, TaskRouted)
    assert sent == 20 and len(routed) == 20
    assert not [r for r in routed if r.digest == embedder]
    assert not await events_of(ledger, TaskFailed)
    assert previewed["digest"] != embedder


async def test_auto_for_a_chat_on_a_fleet_that_only_embeds_is_a_400_that_says_so(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    fleet = fleet_from_dict(
        {
            "model": {"nomic-embed-text": {"capabilities": ["embedding"]}},
            "worker": [{"name": "a", "models": {"nomic-embed-text": {"decode_tps": 1.0}}}],
        }
    )
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=fleet) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}])
        await client.close()
    assert refused.value.param == "model"
    assert "no model the live fleet serves answers chats or completions" in refused.value.message
    assert "the models it serves only embed (nomic-embed-text" in refused.value.message
