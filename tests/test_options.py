"""Request options and domains: sampling passes, what changes the runtime is refused (or, where
allowed, its run is marked and never a speed sample), anything unknown is refused with the list."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from dispatch.errors import RequestRefusedError
from dispatch.options import DEFAULT_DOMAINS, SAMPLING_OPTIONS, OptionsPolicy
from events.event import TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from projections import store
from projections.reader import snapshot
from replay.rebuild import build
from replay.verify import diff_tables
from tests.helpers import events_of
from tests.test_api_support import fleet_and_api, ghost_worker, serving
from tests.test_projector import D1, T0, completed, fold_all, timings

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def http(redis_client: aioredis.Redis, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The API with the default rules over a fleet of one lease (nothing runs the tasks)."""
    await ghost_worker(redis_client)
    async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as client:
        yield client


def test_sampling_options_pass_and_a_small_context_is_no_runtime_change() -> None:
    policy = OptionsPolicy()
    assert policy.check_options(dict.fromkeys(SAMPLING_OPTIONS, 1)) is False
    assert policy.check_options({"num_ctx": 4096, "temperature": 0.3}) is False


@pytest.mark.parametrize(
    "options",
    [{"num_gpu": 0}, {"num_ctx": 131072}, {"num_ctx": 4096.0}, {"num_thread": 2}, {"use_mmap": False}],
)
def test_a_runtime_option_is_refused_by_default_and_marks_the_task_where_allowed(
    options: dict[str, Any],
) -> None:
    with pytest.raises(RequestRefusedError) as refused:
        OptionsPolicy().check_options(options)
    name = next(iter(options))
    assert refused.value.param == f"options.{name}" and repr(name) in refused.value.message
    assert OptionsPolicy(allow_runtime_options=True).check_options(options) is True


def test_an_unknown_option_is_refused_with_the_allowed_ones_even_where_runtime_options_are_allowed() -> None:
    with pytest.raises(RequestRefusedError) as refused:
        OptionsPolicy(allow_runtime_options=True).check_options({"temprature": 0.5})
    assert "'temprature'" in refused.value.message and "temperature" in refused.value.message
    assert refused.value.extra["allowed"] == sorted(SAMPLING_OPTIONS)


def test_a_domain_is_one_of_the_configured_ones_and_the_default_list_holds_the_projects_own() -> None:
    policy = OptionsPolicy()
    assert {"general", "code", "japanese", "ja"} <= set(DEFAULT_DOMAINS)
    for domain in (None, "general", "code", "japanese"):
        policy.check_domain(domain)
    for bad in ("astrology", "x" * 5000, "General", "ja\x00", ""):
        with pytest.raises(RequestRefusedError) as refused:
            policy.check_domain(bad)
        assert refused.value.param == "domain" and "general, code, japanese" in refused.value.message
        assert len(refused.value.message) < 300


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v1/tasks", {"model": "m", "messages": HI, "options": {"num_gpu": 0}}, "num_gpu"),
        ("/v1/tasks", {"model": "m", "messages": HI, "options": {"num_ctx": 131072}}, "num_ctx"),
        ("/v1/tasks", {"model": "m", "messages": HI, "options": {"bogus": 1}}, "bogus"),
        ("/v1/tasks", {"model": "m", "messages": HI, "domain": "astrology"}, "astrology"),
        ("/api/chat", {"model": "m", "messages": HI, "options": {"num_gpu": 0}}, "num_gpu"),
        ("/api/generate", {"model": "m", "prompt": "hi", "options": {"low_vram": True}}, "low_vram"),
        ("/v1/chat/completions", {"model": "m", "messages": HI, "domain": "z" * 300}, "domain"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "domain": "astrology"}, "astrology"),
        ("/v1/pipelines", {"children": [{"prompt": "hi", "model": "m", "domain": "astrology"}]}, "astrology"),
    ],
)
async def test_a_refused_option_or_domain_is_a_400_naming_it_and_queues_nothing(
    http: httpx.AsyncClient, ledger: Ledger, path: str, body: dict[str, Any], named: str
) -> None:
    before = await ledger.length()
    response = await http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert named in response.text
    assert await ledger.length() == before


async def test_a_route_preview_for_an_unknown_domain_is_a_400_too(http: httpx.AsyncClient) -> None:
    refused = await http.get("/v1/route/preview", params={"model": "m", "domain": "x" * 500})
    known = await http.get("/v1/route/preview", params={"model": "m", "domain": "code"})
    assert refused.status_code == 400 and "allowed: general" in refused.text
    assert known.status_code == 200, known.text


async def test_sampling_options_and_a_configured_domain_are_accepted(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    options = {
        "temperature": 0.1,
        "top_k": 10,
        "min_p": 0.05,
        "stop": ["\n"],
        "num_predict": 20,
        "mirostat": 0,
    }
    response = await http.post(
        "/v1/tasks", json={"model": "m", "messages": HI, "options": options, "domain": "code"}
    )
    assert response.status_code == 202, response.text
    [sub] = await events_of(ledger, TaskSubmitted)
    assert sub.domain == "code" and sub.runtime_options is False


async def test_where_allowed_a_runtime_option_runs_marked_and_leaves_the_speed_table_alone(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url, allow_runtime_options=True) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        done = await http.post(
            "/v1/tasks", json={"model": "m", "messages": HI, "options": {"num_gpu": 0}, "wait": True}
        )
        assert done.status_code == 200, done.text
    [sub] = await events_of(ledger, TaskSubmitted)
    assert sub.runtime_options is True


async def test_the_projector_and_a_rebuild_fold_no_speed_from_a_marked_run_but_its_task_row_all_the_same(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    def submitted(task: str, marked: bool) -> TaskSubmitted:
        return TaskSubmitted(at=T0, task_id=task, model="m", digest=D1, queue="q", runtime_options=marked)

    await fold_all(
        redis_client,
        keys,
        [
            submitted("cpu", True),
            completed("cpu", "gpu-pc", timings=timings(tps=2.0)),
            submitted("normal", False),
            completed("normal", "gpu-pc", timings=timings(tps=80.0)),
        ],
    )
    snap = await snapshot(redis_client, keys)
    ns = await store.current(redis_client, keys)
    assert ns is not None
    live = await store.load(redis_client, keys, ns)
    rebuilt, _ = await build(redis_client, keys)
    assert snap.speed["gpu-pc", D1].decode_tps.n == 1
    assert snap.speed["gpu-pc", D1].decode_tps.mean == pytest.approx(80.0)
    assert live.tasks["cpu"].runtime_options and live.tasks["cpu"].status == "completed"
    assert diff_tables(live, rebuilt) == []
