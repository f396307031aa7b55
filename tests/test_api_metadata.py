"""Truthful metadata and what images and thinking count for: the real `ollama` client reads, through
the API, what the holders' own backends report (/api/show, /api/tags, /api/ps) and nothing made up;
an image counts in the routing estimate's prompt, thinking in the completion's output tokens.

The simulated machines (sim/backends/host.py) report a fact only where the fleet gives it: `talker`
has every fact, `plain` none (no family, parameter size or size). The hosts run at time scale 0.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import ollama
import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from api.app import AppConfig
from dispatch.modelcard import MAX_CARD_BYTES, ModelCard, encode_card, publish_cards, read_card
from events.codec import decode_entry
from events.event import Event, TaskCompleted, TaskRouted, TaskSubmitted
from events.keys import Keys
from events.scripts import load_library
from projections.folder import Folder
from projections.tables import Tables
from routeledger.cli_acl import worker_acl_rules
from routeledger.embedded import find_redis_server, redis_version
from router.choose import RouteQuery, rank_workers
from router.estimate import DEFAULT_IMAGE_TOKENS
from sim.backends.ask import IMAGE_TOKENS
from sim.backends.hosts import SimHosts
from sim.backends.text import count_tokens
from sim.fleetspec import Fleet, parse_fleet
from tests.helpers import fast_config, running_agent
from tests.router_helpers import NOW, QWEN, estimator, snapshot, speed_row, view, worker
from tests.test_api_support import fleet_and_api, serving
from workers.backend import OllamaBackend, OpenAIBackend

TALKER_SIZE = 5225376047
VRAM = 4_000_000_000
TEMPLATE = "{{ .System }}<|user|>{{ .Prompt }}<|assistant|>"
PARAMETERS = 'stop "<|user|>"\ntemperature 0.7'

METADATA_FLEET = f"""
[model."talker"]
capabilities = ["completion", "tools", "vision", "thinking"]
family = "qwen3"
parameter_size = "8.2B"
quantization = "Q4_K_M"
size = {TALKER_SIZE}
context_length = 40960
template = '{TEMPLATE}'
parameters = '''{PARAMETERS}'''
output = {{ dist = "fixed", mean = 30 }}

[model."plain"]
quantization = ""
output = {{ dist = "fixed", mean = 10 }}

[[worker]]
name = "a"
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
"""
# A 1x1 PNG.
PIXEL = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4//8/AAX+Av6n1qTBAAAAAElFTkSuQmCC"
HI = [{"role": "user", "content": "hi"}]


def metadata_fleet() -> Fleet:
    return parse_fleet(METADATA_FLEET, "metadata.toml")


async def ledger(redis: aioredis.Redis) -> list[Event]:
    """Every event in the ledger, in order."""
    rows: Any = await redis.xrange(Keys().events)
    return [decode_entry(raw_id.decode(), fields) for raw_id, fields in rows]


async def until_loaded(http: httpx.AsyncClient, *names: str) -> dict[str, dict[str, Any]]:
    """The API's /api/ps once every model in `names` is listed (the workers' heartbeats carry it)."""
    deadline = time.monotonic() + 10
    while True:
        listed = {m["name"]: m for m in (await http.get("/api/ps")).json()["models"]}
        if set(names) <= set(listed) or time.monotonic() > deadline:
            return listed
        await asyncio.sleep(0.1)


# -- /api/show, /api/tags, /api/ps ------------------------------------------------------------------


async def test_show_relays_the_holders_capabilities_template_parameters_and_details(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=metadata_fleet()) as (base, hosts):
        own = await ollama.AsyncClient(host=hosts.url("a")).show("talker")
        shown = await ollama.AsyncClient(host=base).show("talker")
        bare = await ollama.AsyncClient(host=base).show("plain")
        async with httpx.AsyncClient(base_url=base) as http:
            raw_bare = (await http.post("/api/show", json={"model": "plain"})).json()
    assert shown.capabilities == own.capabilities == ["completion", "tools", "vision", "thinking"]
    assert shown.template == own.template == TEMPLATE
    assert shown.parameters == own.parameters == PARAMETERS
    assert shown.details is not None and own.details is not None
    # Every detail but `parent_model` ("" from Ollama: the fleet relays no parentage).
    unparented = {"parent_model"}
    assert shown.details.model_dump(exclude=unparented) == own.details.model_dump(exclude=unparented)
    assert shown.details.family == "qwen3"
    assert (shown.details.parameter_size, shown.details.quantization_level) == ("8.2B", "Q4_K_M")
    assert shown.modelinfo is not None and own.modelinfo is not None
    assert shown.modelinfo["qwen3.context_length"] == 40960
    assert {k: v for k, v in shown.modelinfo.items() if k != "routeledger.holders"} == own.modelinfo
    assert shown.modelinfo["routeledger.holders"] == ["a"]
    # What the backend does not report is left out, not made up.
    assert bare.capabilities == ["completion"]
    assert bare.details is not None
    assert (bare.details.family, bare.details.parameter_size, bare.details.quantization_level) == (None,) * 3
    assert set(raw_bare["details"]) == {"format"}
    assert raw_bare["model_info"] == {"routeledger.holders": ["a"]}


async def test_list_relays_each_models_real_size_and_details_and_leaves_unknown_ones_out(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=metadata_fleet()) as (base, hosts):
        own = {m.model: m for m in (await ollama.AsyncClient(host=hosts.url("a")).list()).models}
        listed = {m.model: m for m in (await ollama.AsyncClient(host=base).list()).models}
        async with httpx.AsyncClient(base_url=base) as http:
            raw = {m["name"]: m for m in (await http.get("/api/tags")).json()["models"]}
    talker = listed["talker:latest"]
    assert talker.size == own["talker:latest"].size == TALKER_SIZE
    assert talker.details is not None and own["talker:latest"].details is not None
    assert talker.details.model_dump(exclude={"parent_model"}) == own["talker:latest"].details.model_dump(
        exclude={"parent_model"}
    )
    assert talker.modified_at == own["talker:latest"].modified_at
    assert talker.digest == own["talker:latest"].digest
    assert raw["talker:latest"]["capabilities"] == ["completion", "tools", "vision", "thinking"]
    # Ollama's full shape for every entry (clients index it): a size nobody reported is null.
    shape = {"name", "model", "modified_at", "size", "digest", "details"}
    assert all(shape <= set(entry) for entry in raw.values())
    assert raw["plain:latest"]["size"] is None
    assert raw["plain:latest"]["details"] == {"format": "gguf"}
    # The models only routeledger serves are listed too, each with a digest of its own.
    assert {"auto", "pipeline"} <= set(raw)
    assert len({entry["digest"] for entry in raw.values()}) == len(raw)
    assert raw["pipeline"]["capabilities"] == ["completion"]
    assert {"completion", "tools", "vision", "thinking"} <= set(raw["auto"]["capabilities"])


async def test_ps_shows_each_workers_loaded_models_with_their_real_sizes_and_expiry(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=metadata_fleet()) as (base, hosts):
        client = ollama.AsyncClient(host=base)
        await client.chat(model="talker", messages=HI)
        await client.chat(model="plain", messages=HI)
        own = {m.model: m for m in (await ollama.AsyncClient(host=hosts.url("a")).ps()).models}
        async with httpx.AsyncClient(base_url=base) as http:
            raw = await until_loaded(http, "talker:latest", "plain:latest")
        loaded = {m.model: m for m in (await client.ps()).models}
    talker = loaded["talker:latest"]
    assert talker.size == TALKER_SIZE and talker.size_vram == VRAM
    assert talker.details is not None and talker.details.family == "qwen3"
    assert talker.expires_at is not None and own["talker:latest"].expires_at is not None
    # The backend's own expiry (its keep-alive on from the last request), as its worker reported it.
    assert abs((talker.expires_at - own["talker:latest"].expires_at).total_seconds()) < 5
    assert 250 < talker.expires_at.timestamp() - time.time() <= 300
    assert talker.context_length == own["talker:latest"].context_length == 4096
    assert [machine["name"] for machine in raw["talker:latest"]["workers"]] == ["a"]
    # Nobody reported plain's size: no size, no size_vram, rather than 0.
    assert loaded["plain:latest"].size is None
    assert "size" not in raw["plain:latest"] and "size_vram" not in raw["plain:latest"]


async def test_an_openai_compatible_backend_reports_no_metadata_so_none_is_shown(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(
        redis_client, redis_url, time_scale=0, fleet=metadata_fleet(), kind="openai"
    ) as (base, _):
        client = ollama.AsyncClient(host=base)
        shown = await client.show("talker")
        listed = {m.model: m for m in (await client.list()).models}
        await client.chat(model="talker", messages=HI)
        loaded = (await client.ps()).models
        async with httpx.AsyncClient(base_url=base) as http:
            raw = (await http.post("/api/show", json={"model": "talker"})).json()
    assert shown.capabilities is None and shown.template is None and shown.parameters is None
    assert set(raw) == {"modelfile", "details", "model_info"}
    assert raw["details"] == {} and raw["model_info"] == {"routeledger.holders": ["a"]}
    assert set(listed) == {"talker:latest", "plain:latest", "auto", "pipeline"}
    # Ollama's shape still: no size reported is null, no time the moment the fleet began serving it.
    talker = listed["talker:latest"]
    assert talker.size is None and talker.modified_at is not None
    assert abs(talker.modified_at.timestamp() - time.time()) < 60
    # Such a server cannot say what is loaded: nothing is listed, rather than a guess.
    assert loaded == []


# -- the worker's side ------------------------------------------------------------------------------


async def test_the_ollama_adapter_reads_show_once_a_digest_and_keeps_its_facts_and_card() -> None:
    shown: list[str] = []

    async def count(request: httpx.Request) -> None:
        if request.url.path == "/api/show":
            shown.append(json.loads(request.content)["model"])

    async with SimHosts(metadata_fleet(), time_scale=0.0) as sim:
        backend = OllamaBackend(sim.url("a"))
        backend.client.event_hooks["request"].append(count)
        try:
            first = await backend.inventory()
            again = await backend.inventory()
        finally:
            await backend.aclose()
    talker = next(m for m in first.models if m.name == "talker:latest")
    assert (talker.family, talker.families, talker.format) == ("qwen3", ["qwen3"], "gguf")
    assert (talker.parameter_size, talker.quantization, talker.context_length) == ("8.2B", "Q4_K_M", 40960)
    assert talker.size == TALKER_SIZE and talker.modified_at
    assert first.cards[talker.digest].template == TEMPLATE
    assert first.cards[talker.digest].parameters == PARAMETERS
    plain = next(m for m in first.models if m.name == "plain:latest")
    assert (plain.family, plain.parameter_size, plain.quantization, plain.context_length) == (None,) * 4
    assert again.models == first.models and again.cards == first.cards
    assert sorted(shown) == ["plain:latest", "talker:latest"]


async def test_an_openai_compatible_adapter_reports_no_facts_and_no_cards() -> None:
    async with SimHosts(metadata_fleet(), time_scale=0.0) as sim:
        backend = OpenAIBackend(sim.url("a") + "/v1")
        try:
            inventory = await backend.inventory()
        finally:
            await backend.aclose()
    assert inventory.cards == {} and inventory.loaded_models == []
    assert {(m.family, m.format, m.size, m.capabilities) for m in inventory.models} == {(None,) * 4}


async def test_the_worker_writes_its_cards_to_its_own_hash_and_the_lease_stays_small(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=metadata_fleet()) as (_, hosts):
        own = await ollama.AsyncClient(host=hosts.url("a")).list()
        digest = next(m.digest for m in own.models if m.model == "talker:latest")
        assert digest is not None
        card = await read_card(redis_client, Keys(), digest, ["a"])
        lease: Any = await redis_client.get(Keys().live("a"))
    assert card.template == TEMPLATE and card.parameters == PARAMETERS
    assert card.model_info is not None and card.model_info["qwen3.context_length"] == 40960
    # The template and parameters are in the card, not in the lease every decision reads.
    assert TEMPLATE.encode() not in lease and PARAMETERS.encode() not in lease
    assert await read_card(redis_client, Keys(), digest, ["nobody"]) == ModelCard()


async def test_a_worker_under_its_acl_writes_its_own_cards_and_no_others(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    version = redis_version(find_redis_server())
    if version is None or version < (7,):
        pytest.skip(f"worker ACLs need Redis 7 (selectors, %R~); this redis-server is {version}")
    keys = Keys()
    await redis_client.execute_command("ACL", "SETUSER", "a", *worker_acl_rules("a", "pw", keys))  # type: ignore[no-untyped-call]
    parts = urlsplit(redis_url)
    worker = aioredis.Redis.from_url(f"redis://a:pw@{parts.hostname}:{parts.port}/0")
    card = ModelCard(template=TEMPLATE, parameters=PARAMETERS)
    try:
        await publish_cards(worker, keys, "a", {"d" * 64: card})
        # The refusal names itself as the worker's agent looks for it (it says so once, not every beat).
        with pytest.raises(NoPermissionError):
            await publish_cards(worker, keys, "b", {"d" * 64: ModelCard(template="forged")})
    finally:
        await worker.aclose()
        await redis_client.execute_command("ACL", "DELUSER", "a")  # type: ignore[no-untyped-call]
    assert await read_card(redis_client, keys, "d" * 64, ["b", "a"]) == card
    assert not await redis_client.exists(keys.card("b"))


async def test_a_worker_whose_acl_predates_its_cards_says_so_once_and_serves_on(
    redis_client: aioredis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    version = redis_version(find_redis_server())
    if version is None or version < (7,):
        pytest.skip(f"worker ACLs need Redis 7 (selectors, %R~); this redis-server is {version}")
    keys = Keys()
    older = [r for r in worker_acl_rules("a", "pw", keys) if r != f"~{keys.card('a')}"]
    await redis_client.execute_command("ACL", "SETUSER", "a", *older)  # type: ignore[no-untyped-call]
    await load_library(redis_client)
    parts = urlsplit(redis_url)
    limited = aioredis.Redis.from_url(f"redis://a:pw@{parts.hostname}:{parts.port}/0")
    try:
        async with (
            SimHosts(metadata_fleet(), time_scale=0) as hosts,
            running_agent(limited, hosts.url("a"), fast_config("a", inbox=True)),
            serving(AppConfig(redis_url=redis_url)) as base,
        ):
            answer = await ollama.AsyncClient(host=base).chat(model="talker", messages=HI)
            shown = await ollama.AsyncClient(host=base).show("talker")
            await asyncio.sleep(1.0)  # three heartbeats more
    finally:
        await limited.aclose()
        await redis_client.execute_command("ACL", "DELUSER", "a")  # type: ignore[no-untyped-call]
    said = [r for r in caplog.records if "may not write" in r.getMessage()]
    assert answer.message.content and len(said) == 1
    # The lease's facts still reach /api/show; only the card's template is missing.
    assert shown.capabilities == ["completion", "tools", "vision", "thinking"] and shown.template is None


# -- what images and thinking count for -------------------------------------------------------------


def test_each_image_adds_its_tokens_to_the_prompt_term_and_the_breakdown_names_the_figure() -> None:
    est = estimator(snapshot([speed_row("gpu", QWEN, 80.0, 10, prompt=576.0)]))
    fv = view([worker("gpu", {QWEN})])
    text = rank_workers(fv, est, QWEN, NOW, RouteQuery(prompt_tokens=100)).best
    seen = rank_workers(fv, est, QWEN, NOW, RouteQuery(prompt_tokens=100, images=2)).best
    assert seen.terms["prompt_s"] - text.terms["prompt_s"] == pytest.approx(2 * DEFAULT_IMAGE_TOKENS / 576.0)
    assert seen.terms["image_tokens"] == 2 * DEFAULT_IMAGE_TOKENS and "image_tokens" not in text.terms
    figure = seen.fields["image_tokens"]
    assert (figure.value, figure.n) == (DEFAULT_IMAGE_TOKENS, 0)
    assert figure.source.startswith("default")


async def test_an_image_counts_in_the_submitted_prompt_tokens_as_the_backend_counts_it(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    look = "What is in this picture?"
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=metadata_fleet()) as (base, _):
        answer = await ollama.AsyncClient(host=base).chat(
            model="talker", messages=[{"role": "user", "content": look, "images": [PIXEL, PIXEL]}]
        )
        events = await ledger(redis_client)
    submitted = next(e for e in events if isinstance(e, TaskSubmitted))
    routed = next(e for e in events if isinstance(e, TaskRouted))
    completed = next(e for e in events if isinstance(e, TaskCompleted))
    # The estimate's per-image figure is the one the backend charges here.
    assert DEFAULT_IMAGE_TOKENS == IMAGE_TOKENS
    counted = count_tokens(look) + 2 * IMAGE_TOKENS
    assert answer.prompt_eval_count == completed.timings.prompt_eval_count == counted
    assert submitted.prompt_tokens is not None
    assert submitted.prompt_tokens - 2 * DEFAULT_IMAGE_TOKENS == max(1, (len(look.encode()) + 3) // 4)
    shared: Any = routed.breakdown["shared"]
    assert shared["terms"]["image_tokens"] == 2 * DEFAULT_IMAGE_TOKENS
    value, n, source, _ = shared["fields"]["image_tokens"]
    assert (value, n) == (DEFAULT_IMAGE_TOKENS, 0) and source.startswith("default")


@pytest.mark.parametrize("kind", ["ollama", "openai"])
async def test_thinking_tokens_count_in_the_completions_output_and_the_length_and_speed_tables(
    redis_client: aioredis.Redis, redis_url: str, kind: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=metadata_fleet(), kind=kind) as (
        base,
        _,
    ):
        answer = await ollama.AsyncClient(host=base).chat(model="talker", messages=HI, think=True)
        events = await ledger(redis_client)
    assert answer.message.thinking and answer.message.content
    # The answer's 30 tokens and its 15 of thinking, as the backend counts them.
    assert answer.eval_count == 45
    (completed,) = [e for e in events if isinstance(e, TaskCompleted)]
    assert completed.timings.eval_count == 45
    folder = Folder(Tables())
    for event in events:
        folder.apply(event)
    (length,) = folder.tables.length.values()
    assert (length.output_tokens.n, length.output_tokens.sum) == (1, 45.0)
    if kind == "ollama":
        # Decode speed is the backend's eval_count over its eval_duration, thinking included.
        (speed,) = folder.tables.speed.values()
        t = completed.timings
        assert t.eval_duration is not None
        assert speed.decode_tps.sum == pytest.approx(45 / (t.eval_duration / 1e9))


def test_a_model_card_too_large_is_kept_without_its_model_info() -> None:
    tokens = ["x" * 100] * (MAX_CARD_BYTES // 50)
    big = ModelCard(template=TEMPLATE, model_info={"tokenizer.ggml.tokens": tokens})
    kept = msgspec.msgpack.decode(encode_card(big), type=ModelCard)
    assert kept == ModelCard(template=TEMPLATE)
