"""Embeddings end to end: real clients (`openai`, `ollama`) ask the API for vectors of a simulated
embedding model, whichever API the worker speaks to its backend; the vectors are the backend's
own; the task is ledgered like any other and its embedding rate reaches the speed table; a model
that cannot embed is refused in each surface's error shape; a large batch is split across holders;
a worker benchmarks an embedding model with embeddings.

The simulated model `embedder` has the `embedding` capability (deterministic unit vectors:
sim.backends.embedding); `plain` has not. The hosts run at time scale 0 unless a test needs time.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import os
import struct
import sys
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
import redis.asyncio as aioredis
import tiktoken
from langchain_openai import OpenAIEmbeddings

from dispatch.view import embedding_models
from events.event import (
    BenchmarkRequested,
    BenchmarkResult,
    ModelEntry,
    QualityScored,
    TaskClaimed,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskSubmitted,
)
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from projections.reader import snapshot
from projections.snapshot import Snapshot, SpeedRow, Stat, fold
from sim.backends.hosts import SimHosts
from sim.fleetspec import Fleet, parse_fleet
from tasks.lease import LeaseInfo
from tasks.payload import estimate_tokens, unpack_vector
from tests.helpers import events_of, fast_config, running_agent, wait_until
from tests.test_api_support import fleet_and_api, free_port, stored_results


def _bundled_tiktoken_cache() -> Path | None:
    """litellm ships tiktoken's cache files (cl100k_base among them): a TIKTOKEN_CACHE_DIR that lets
    the tests, and the API they run in this process, load the encoding with no network."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "litellm_core_utils" / "tokenizers"
    return folder if folder.is_dir() else None


# Set before the API loads the encoding (once per process, at the first token array it is sent);
# without litellm, tiktoken downloads the file into its default cache.
_TIKTOKEN_CACHE = _bundled_tiktoken_cache()
if _TIKTOKEN_CACHE is not None and "TIKTOKEN_CACHE_DIR" not in os.environ:
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_TIKTOKEN_CACHE)

EMBED_FLEET = """
name = "embed"
[model."embedder"]
capabilities = ["embedding"]
embedding_dim = 64
[model."plain"]
output = { dist = "fixed", mean = 10 }

[[worker]]
name = "a"
slots = 2
[worker.models."embedder"]
decode_tps = 200.0
prompt_tps = 5000.0
embed_tps = 2000.0
load_s = 0.0
[worker.models."plain"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0

[[worker]]
name = "b"
slots = 2
[worker.models."embedder"]
decode_tps = 200.0
prompt_tps = 5000.0
embed_tps = 2000.0
load_s = 0.0
"""

TEXTS = ["the cat sat", "on the mat", "the cat sat"]
BACKENDS = pytest.mark.parametrize("kind", ["ollama", "openai"])


def embed_fleet() -> Fleet:
    return parse_fleet(EMBED_FLEET, "embed.toml")


async def own_vectors(url: str, texts: list[str], dimensions: int | None = None) -> list[list[float]]:
    """The vectors the simulated machine itself answers for `texts` (the reference)."""
    async with httpx.AsyncClient(base_url=url) as http:
        body: dict[str, Any] = {"model": "embedder", "input": texts}
        if dimensions is not None:
            body["dimensions"] = dimensions
        answer = (await http.post("/api/embed", json=body)).json()
    vectors: list[list[float]] = answer["embeddings"]
    return vectors


def close(got: list[float], want: list[float]) -> bool:
    """Equal as float32s (the precision the vectors travel in)."""
    return len(got) == len(want) and got == pytest.approx(want, abs=1e-6)


# -- the openai client ------------------------------------------------------------------------------


@BACKENDS
async def test_the_openai_client_gets_one_vector_per_input_as_floats_and_as_base64(
    redis_client: aioredis.Redis, redis_url: str, kind: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=embed_fleet(), kind=kind) as (
        base,
        hosts,
    ):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        # The client asks for base64 unless told otherwise, and decodes it itself.
        raw = await client.embeddings.with_raw_response.create(model="embedder", input=TEXTS)
        default = raw.parse()
        floats = await client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
        one = await client.embeddings.create(model="embedder", input="on the mat", dimensions=16)
        async with httpx.AsyncClient(base_url=base) as http:
            b64 = (
                await http.post(
                    "/v1/embeddings", json={"model": "embedder", "input": TEXTS, "encoding_format": "base64"}
                )
            ).json()
        await client.close()
        want = await own_vectors(hosts.url("a"), TEXTS)
        want16 = await own_vectors(hosts.url("a"), ["on the mat"], dimensions=16)
    assert [d.index for d in default.data] == [0, 1, 2]
    assert all(close(list(d.embedding), w) for d, w in zip(default.data, want, strict=True))
    assert all(close(list(d.embedding), w) for d, w in zip(floats.data, want, strict=True))
    assert default.data[0].embedding == default.data[2].embedding
    assert default.model == "embedder" and default.object == "list"
    assert default.usage.prompt_tokens > 0 and default.usage.total_tokens == default.usage.prompt_tokens
    assert raw.headers["x-routeledger-worker"] in ("a", "b")
    # base64 is little-endian float32s, as OpenAI sends it.
    packed = base64.b64decode(b64["data"][1]["embedding"])
    assert close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), want[1])
    assert len(one.data) == 1 and close(list(one.data[0].embedding), want16[0])


async def test_token_arrays_are_decoded_with_cl100k_base_and_get_the_vectors_of_their_texts(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    # What LangChain's OpenAIEmbeddings sends by default for a model name tiktoken does not know:
    # the texts as cl100k_base token ids, which the API decodes for backends that take text.
    encoding = tiktoken.get_encoding("cl100k_base")
    arrays = [encoding.encode(t) for t in TEXTS]
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=embed_fleet()) as (base, hosts):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        many = await client.embeddings.create(model="embedder", input=arrays)
        one = await client.embeddings.create(model="embedder", input=arrays[1], encoding_format="float")
        await client.close()
        langchain = OpenAIEmbeddings(model="embedder", base_url=base + "/v1", api_key="unused", max_retries=0)
        documents = await langchain.aembed_documents(TEXTS)
        query = await langchain.aembed_query(TEXTS[1])
        want = await own_vectors(hosts.url("a"), TEXTS)
    assert len(many.data) == 3
    assert all(close(list(d.embedding), w) for d, w in zip(many.data, want, strict=True))
    assert len(one.data) == 1 and close(list(one.data[0].embedding), want[1])
    assert many.usage.prompt_tokens > 0
    assert all(close(got, w) for got, w in zip(documents, want, strict=True))
    assert close(query, want[1])


async def test_token_arrays_the_api_cannot_decode_for_want_of_the_encoding_are_a_400_that_says_how_to_fix(
    redis_url: str, tmp_path: Path
) -> None:
    # An API process whose tiktoken cache is empty and whose download goes to a proxy that is not
    # there: the encoding cannot be loaded, and fails at once rather than waiting on a network.
    port, nowhere = free_port(), free_port()
    env = {
        **os.environ,
        "ROUTELEDGER_REDIS_URL": redis_url,
        "TIKTOKEN_CACHE_DIR": str(tmp_path),
        "HTTPS_PROXY": f"http://127.0.0.1:{nowhere}",
        "https_proxy": f"http://127.0.0.1:{nowhere}",
        "NO_PROXY": "",
        "no_proxy": "",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "routeledger",
        "api",
        "--port",
        str(port),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:

            async def up() -> bool:
                try:
                    return (await http.get("/healthz")).status_code == 200
                except httpx.HTTPError:
                    return False

            await wait_until(up, timeout=30)
            body = {"model": "embedder", "input": [[1, 2, 3]]}
            first = await http.post("/v1/embeddings", json=body, timeout=30)
            again = await http.post("/v1/embeddings", json=body, timeout=30)
            text = await http.post("/v1/embeddings", json={"model": "embedder", "input": "x"}, timeout=30)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
    error = first.json()["error"]
    assert first.status_code == 400 and error["param"] == "input"
    assert "token arrays in input could not be decoded" in error["message"]
    assert "cl100k_base encoding could not be loaded" in error["message"]
    assert "ProxyError" in error["message"]
    assert "send the inputs as text" in error["message"] and "TIKTOKEN_CACHE_DIR" in error["message"]
    assert "check_embedding_ctx_length=False" in error["message"]
    # A failed load is tried again, and fails the same way; text is not held up by it (no worker
    # serves `embedder` here: the refusal is about the model, not the encoding).
    assert again.status_code == 400 and "could not be loaded" in again.json()["error"]["message"]
    assert text.status_code == 404 and "could not be decoded" not in text.text


# -- the ollama client ------------------------------------------------------------------------------


@BACKENDS
async def test_the_ollama_client_embeds_a_list_and_the_legacy_endpoint_embeds_a_prompt(
    redis_client: aioredis.Redis, redis_url: str, kind: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=embed_fleet(), kind=kind) as (
        base,
        hosts,
    ):
        client = ollama.AsyncClient(host=base)
        many = await client.embed(model="embedder", input=TEXTS, truncate=True, keep_alive="5m")
        single = await client.embed(model="embedder", input="on the mat")
        legacy = await client.embeddings(model="embedder", prompt="on the mat")
        loaded = await client.embed(model="embedder", input=[])
        want = await own_vectors(hosts.url("a"), TEXTS)
    assert len(many.embeddings) == 3
    assert all(close(list(v), w) for v, w in zip(many.embeddings, want, strict=True))
    assert many.model == "embedder"
    assert many.prompt_eval_count is not None and many.prompt_eval_count > 0
    assert many.total_duration is not None and many.total_duration > 0
    assert many.load_duration is not None
    assert close(list(single.embeddings[0]), want[1])
    assert close(list(legacy.embedding), want[1])
    assert list(loaded.embeddings) == []


# -- refusals ---------------------------------------------------------------------------------------


async def test_a_model_that_cannot_embed_is_refused_in_each_surfaces_shape_naming_those_that_can(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=embed_fleet()) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.embeddings.create(model="plain", input=["hello"])
        await client.close()
        ollama_client = ollama.AsyncClient(host=base)
        with pytest.raises(ollama.ResponseError) as refused_embed:
            await ollama_client.embed(model="plain", input=["hello"])
        with pytest.raises(ollama.ResponseError) as refused_legacy:
            await ollama_client.embeddings(model="plain", prompt="hello")
        async with httpx.AsyncClient(base_url=base) as http:
            # 100256 is a gap in cl100k_base's ids, below its special tokens.
            tokens = await http.post(
                "/v1/embeddings", json={"model": "embedder", "input": [[1, 2], [100256]]}
            )
            negative = await http.post("/v1/embeddings", json={"model": "embedder", "input": [5, -1]})
            mixed = await http.post("/v1/embeddings", json={"model": "embedder", "input": [[1, 2], "x"]})
            no_tokens = await http.post("/v1/embeddings", json={"model": "embedder", "input": [[1], []]})
            empty = await http.post("/v1/embeddings", json={"model": "embedder", "input": ""})
            encoding = await http.post(
                "/v1/embeddings", json={"model": "embedder", "input": "x", "encoding_format": "int8"}
            )
            holed = await http.post("/api/embed", json={"model": "embedder", "input": ["x", ""]})
        queued = await stored_results(redis_client)
    assert refused.value.status_code == 400
    assert refused.value.param == "model"
    assert "model 'plain' cannot embed" in refused.value.message
    assert "models that can: embedder" in refused.value.message
    for err in (refused_embed.value, refused_legacy.value):
        assert err.status_code == 400
        assert "model 'plain' cannot embed" in err.error and "embedder" in err.error
    refusals = {r: r.json()["error"] for r in (tokens, negative, mixed, no_tokens)}
    assert all(r.status_code == 400 and e["param"] == "input" for r, e in refusals.items())
    assert (
        "input 1 holds 100256 at position 0, which is not a cl100k_base token id"
        in refusals[tokens]["message"]
    )
    assert "input 0 holds -1 at position 1" in refusals[negative]["message"]
    assert "all texts or all token arrays" in refusals[mixed]["message"]
    assert "input 1 is an empty token array" in refusals[no_tokens]["message"]
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
    assert encoding.status_code == 400 and encoding.json()["error"]["param"] == "encoding_format"
    # One vector per input: an empty one is refused, not silently dropped.
    assert holed.status_code == 400 and "input 1 is an empty string" in holed.json()["error"]
    # Nothing refused ran.
    assert queued == []


# -- the ledger and the speed table -----------------------------------------------------------------


async def test_an_embedding_task_is_ledgered_and_its_embedding_rate_reaches_the_speed_table(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    # Time scale 1: the machines take prompt tokens / embed_tps to answer, as a backend does.
    async with fleet_and_api(redis_client, redis_url, time_scale=1.0, fleet=embed_fleet()) as (base, _):
        client = ollama.AsyncClient(host=base)
        texts = [f"document {i}: " + "words " * 400 for i in range(2)]
        for _ in range(2):
            await client.embed(model="embedder", input=texts)
        async with httpx.AsyncClient(base_url=base) as http:
            projector = Projector(redis_client, Keys())
            await projector.start()
            await projector.catch_up()
            speed_rows = (await http.get("/v1/stats")).json()["speed"]
    ledger = Ledger(redis_client, Keys())
    submitted = await events_of(ledger, TaskSubmitted)
    completed = await events_of(ledger, TaskCompleted)
    routed = await events_of(ledger, TaskRouted)
    assert [e.kind for e in submitted] == ["embed", "embed"]
    assert [e.kind for e in completed] == ["embed", "embed"]
    assert len(routed) == 2
    # The route was costed by the embedding rate: an embedding model decodes nothing.
    best = routed[0].breakdown
    assert "embed_tps" in str(best) and "decode_tps" not in str(best)
    for e in completed:
        t = e.timings
        assert t.prompt_eval_count is not None and t.prompt_eval_count > 0
        assert t.prompt_eval_duration is not None and t.eval_count is None
    snap = await snapshot(redis_client, Keys())
    rows = [r for r in snap.speed.values() if r.embed_tps.n]
    assert sum(r.embed_tps.n for r in rows) == 2
    # No prompt or decode sample: reading the input of an embedding is its own rate.
    assert all(r.decode_tps.n == 0 and r.prompt_tps.n == 0 for r in rows)
    for r in rows:
        assert r.embed_tps.mean is not None
        # The machine's embed_tps (2000/s), as the backend's own timings show it.
        assert 1000 < r.embed_tps.mean < 2100
    shown = [r for r in speed_rows if r["embed_tps"]["n"]]
    assert sum(r["embed_tps"]["n"] for r in shown) == 2


def test_packed_vectors_read_back_as_the_same_float32s() -> None:
    vector = [0.5, -0.25, 1.0 / 3.0]
    packed = struct.pack("<3f", *vector)
    assert unpack_vector(packed) == list(struct.unpack("<3f", packed))
    assert len(packed) == 12


async def test_a_large_batch_runs_as_parts_on_both_holders_recorded_as_a_split_and_answered_in_order(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    # Long enough that reading them, not loading the model, is most of the time.
    texts = [f"passage {i}: " + "words " * 300 for i in range(16)]
    async with fleet_and_api(
        redis_client, redis_url, workers=("a", "b"), time_scale=0, fleet=embed_fleet()
    ) as (base, hosts):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        raw = await client.embeddings.with_raw_response.create(model="embedder", input=texts)
        await client.close()
        want = await own_vectors(hosts.url("b"), texts)
    answer = raw.parse()
    submitted = await events_of(Ledger(redis_client, Keys()), TaskSubmitted)
    # Two holders that read as fast as each other: half the batch each.
    assert [(e.part, e.parts) for e in submitted] == [(0, 2), (1, 2)]
    assert len({e.split_of for e in submitted}) == 1 and submitted[0].split_of is not None
    assert [e.prompt_tokens for e in submitted] == [
        sum(estimate_tokens(t) for t in texts[:8]),
        sum(estimate_tokens(t) for t in texts[8:]),
    ]
    assert raw.headers["x-routeledger-task"] == ",".join(e.task_id for e in submitted)
    assert [d.index for d in answer.data] == list(range(16))
    assert all(close(list(d.embedding), w) for d, w in zip(answer.data, want, strict=True))
    assert answer.usage.prompt_tokens > 0


async def test_a_worker_benchmarks_an_embedding_model_with_embeddings_and_grades_nothing(
    redis_client: aioredis.Redis,
) -> None:
    ledger = Ledger(redis_client, Keys())
    async with SimHosts(embed_fleet(), time_scale=1.0, seed=5) as sim:
        config = fast_config("b", auto_bench=True, bench_min_samples=2, bench_check_s=0.2)
        async with running_agent(redis_client, sim.url("b"), config):

            async def benched() -> bool:
                return len(await events_of(ledger, BenchmarkResult)) >= 2

            await wait_until(benched, timeout=30)
    results = await events_of(ledger, BenchmarkResult)
    assert {r.kind for r in results} == {"embed"}
    assert all(r.timings.prompt_eval_count and r.timings.prompt_eval_duration for r in results)
    # An embedding model answers no text: no grade, and no failed chat against it.
    assert await events_of(ledger, QualityScored) == []
    assert await events_of(ledger, TaskFailed) == []
    requested = await events_of(ledger, BenchmarkRequested)
    assert [r.reason for r in requested] == ["joined"]
    projector = Projector(redis_client, Keys())
    await projector.start()
    await projector.catch_up()
    row = (await snapshot(redis_client, Keys())).speed[("b", results[0].digest)]
    assert row.embed_tps.n == len(results) and row.decode_tps.n == 0


def test_a_model_is_costed_as_an_embedding_model_when_its_holders_say_so_or_it_has_only_ever_embedded() -> (
    None
):
    said, silent, chats, mixed = "s" * 64, "q" * 64, "c" * 64, "m" * 64
    leases = {
        "ollama": LeaseInfo(
            worker="ollama",
            token="t",
            slots=1,
            inventory=[
                ModelEntry(name="said", digest=said, capabilities=["embedding"]),
                ModelEntry(name="mixed", digest=mixed, capabilities=["completion", "embedding"]),
            ],
        ),
        "openai": LeaseInfo(
            worker="openai",
            token="t",
            slots=1,
            inventory=[ModelEntry(name="silent", digest=silent), ModelEntry(name="chats", digest=chats)],
        ),
    }
    snap = Snapshot()
    sample = fold(Stat(), 1000.0, 1, 3600.0)
    snap.speed[("openai", silent)] = SpeedRow(worker="openai", digest=silent, embed_tps=sample)
    snap.speed[("openai", chats)] = SpeedRow(
        worker="openai", digest=chats, embed_tps=sample, decode_tps=sample
    )
    snap.speed[("ollama", mixed)] = SpeedRow(worker="ollama", digest=mixed, embed_tps=sample)
    # `mixed` says it completes: its embeddings are no evidence that it only embeds.
    assert embedding_models(leases, snap) == {said, silent}


# A chat model on one machine whose OpenAI-compatible server was started without embeddings
# (llama-server without --embeddings answers 501).
CHAT_ONLY = """
name = "chat-only"
[model."smol"]
output = { dist = "fixed", mean = 10 }

[[worker]]
name = "a"
slots = 1
openai_embeddings = false
[worker.models."smol"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
"""


async def test_a_server_that_cannot_embed_is_the_clients_error_at_once_and_the_next_is_refused_early(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    fleet = parse_fleet(CHAT_ONLY, "chat-only.toml")
    async with fleet_and_api(redis_client, redis_url, time_scale=0, fleet=fleet, kind="openai") as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            first = await http.post("/v1/embeddings", json={"model": "smol:latest", "input": "hello"})
            # The API reads leases at most 0.5 s old: past that, it knows.
            await asyncio.sleep(0.6)
            claims = len(await events_of(ledger, TaskClaimed))
            ollama_shape = await http.post("/api/embed", json={"model": "smol:latest", "input": "hello"})
            again = await http.post("/v1/embeddings", json={"model": "smol:latest", "input": "again"})
            chat = await http.post(
                "/v1/chat/completions",
                json={"model": "smol:latest", "messages": [{"role": "user", "content": "hi"}]},
            )
        failed = await events_of(ledger, TaskFailed)
        after = len(await events_of(ledger, TaskClaimed))
    # The first: the server's 501, in the client's shape, with its words; nothing retried.
    assert first.status_code == 400, first.text
    assert "does not support embeddings" in first.json()["error"]["message"]
    assert [(e.kind, e.retryable) for e in failed] == [("unsupported", False)]
    # Learned before that answer came: the next ones are refused at submission, in each shape.
    assert ollama_shape.status_code == 400 and "cannot embed" in ollama_shape.json()["error"]
    assert again.status_code == 400 and "cannot embed" in again.json()["error"]["message"]
    assert "--embeddings" in again.json()["error"]["message"]
    assert after == claims + 1  # only the chat was claimed after the first refusal
    assert chat.status_code == 200
