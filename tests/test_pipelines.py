"""Pipelines on a simulated fleet: children spread as the plan says, survive a killed worker, run
above capacity, and a decomposer that cannot answer JSON queues nothing."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import redis.asyncio as aioredis

from api.app import AppConfig
from events.event import (
    Event,
    PipelineChildAdded,
    PipelineCompleted,
    PipelineStarted,
    TaskClaimed,
    TaskCompleted,
    TaskReclaimed,
    TaskSubmitted,
    Timings,
    now_ms,
)
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from sim.backends.hosts import SimHosts
from sim.fleetspec import Fleet, load_fleet, parse_fleet
from tasks.payload import F_TASK, TaskMessage, decode_task
from tests.helpers import (
    MODEL_DIGEST,
    events_of,
    fast_config,
    rl,
    running_agent,
    running_reaper,
    wait_until,
    worker_process,
)
from tests.test_api_support import fleet_and_api, ghost_worker, serving, stored_result
from workers.admission import RouterGate

SEED = load_fleet("seed")
QWEN = SEED.model["qwen3:8b"].digest
STORY_WORKERS = ("macbookair", "rtx3070ti")


def _fleet(name: str, *, output: int, follows_format: bool = True) -> Fleet:
    """Two equal machines holding model `m`, whose answers are `output` tokens long."""
    return parse_fleet(
        f"""
name = "{name}"
[model."m"]
digest = "{"ab" * 32}"
output = {{ dist = "fixed", mean = {output} }}
follows_format = {"true" if follows_format else "false"}
[[worker]]
name = "a"
[worker.models."m"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
[[worker]]
name = "b"
[worker.models."m"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
""",
        f"{name}.toml",
    )


def _measured_history(now_ms: int) -> list[Event]:
    """Both story machines already measured on qwen3:8b at their preset speeds, as benchmarks leave them."""
    events: list[Event] = []
    for worker in STORY_WORKERS:
        speed = SEED.worker[STORY_WORKERS.index(worker)].models["qwen3:8b"]
        for i in range(10):
            tokens = 200
            events.append(
                TaskCompleted(
                    at=now_ms - (10 - i) * 1000,
                    task_id=f"old-{worker}-{i}",
                    worker=worker,
                    digest=QWEN,
                    attempt=1,
                    timings=Timings(
                        prompt_eval_count=40,
                        prompt_eval_duration=int(40 / speed.prompt_tps * 1e9),
                        eval_count=tokens,
                        eval_duration=int(tokens / speed.decode_tps * 1e9),
                        load_duration=0,
                        total_duration=int((tokens / speed.decode_tps + 40 / speed.prompt_tps) * 1e9),
                    ),
                )
            )
    return events


async def _fold(redis: aioredis.Redis) -> None:
    projector = Projector(redis, Keys())
    assert await projector.acquire()
    await projector.start()
    await projector.catch_up()
    await projector.release()


@contextlib.asynccontextmanager
async def _api(redis_url: str, **config: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        serving(AppConfig(redis_url=redis_url, **config)) as base,
        httpx.AsyncClient(base_url=base, timeout=60) as http,
    ):
        yield http


def _brute_force_makespan(times: list[list[float]], load_s: list[float]) -> float:
    """Best makespan of jobs all present at once, over every assignment of jobs to one-slot machines."""
    best = float("inf")
    for assignment in itertools.product(range(len(load_s)), repeat=len(times)):
        busy = [0.0] * len(load_s)
        for job, machine in enumerate(assignment):
            busy[machine] += times[job][machine]
        best = min(best, max(b + (load_s[m] if b else 0.0) for m, b in enumerate(busy)))
    return best


async def test_the_story_pipeline_runs_where_the_plan_says_within_a_tenth_of_the_best_makespan(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    time_scale = 0.2
    max_tokens = 100
    await ledger.append_many(_measured_history(now_ms()))
    await _fold(redis_client)
    async with (
        SimHosts(SEED, time_scale=time_scale, seed=3) as hosts,
        running_agent(
            redis_client,
            hosts.url("macbookair"),
            fast_config("macbookair"),
            gate=RouterGate(redis_client, Keys()),
        ),
        running_agent(
            redis_client,
            hosts.url("rtx3070ti"),
            fast_config("rtx3070ti"),
            gate=RouterGate(redis_client, Keys()),
        ),
        _api(redis_url) as http,
    ):
        reply = await http.post(
            "/v1/pipelines",
            json={
                "children": [{"prompt": f"Summarise chapter {i} of the report."} for i in (1, 2, 3)],
                "model": "qwen3:8b",
                "max_tokens": max_tokens,
                "integration_max_tokens": 10,
            },
        )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["status"] == "completed"
    assert body["fan_out"] == 3 and body["capacity"] == 2 and body["fan_out_vs_capacity"] == "3 vs 2"
    children = body["children"]
    assert [c["worker"] for c in children] == [c["expected_worker"] for c in children]

    results = [await stored_result(redis_client, c["task_id"]) for c in children]
    assert all(r is not None and r.timings.eval_count == max_tokens for r in results)
    speeds = {w.name: w.models["qwen3:8b"] for w in SEED.worker if w.name in STORY_WORKERS}
    times = [
        [
            (r.timings.prompt_eval_count or 0) / speeds[w].prompt_tps + max_tokens / speeds[w].decode_tps
            for w in STORY_WORKERS
        ]
        for r in results
        if r is not None
    ]
    best = _brute_force_makespan(times, [speeds[w].load_s for w in STORY_WORKERS])
    # The machines' own (simulated, unscaled) durations: what each spent on the children it ran.
    busy = dict.fromkeys(STORY_WORKERS, 0.0)
    for r in results:
        assert r is not None and r.worker is not None and r.timings.total_duration is not None
        busy[r.worker] += r.timings.total_duration / 1e9
    makespan = max(busy.values())
    wall = body["makespan_s"] / time_scale
    print(f"story pipeline: makespan {makespan:.2f}s (wall {wall:.2f}s) vs optimum {best:.2f}s")
    assert makespan <= 1.1 * best
    # Waiting between children (a gate that held back, a slow claim) shows only on the wall clock.
    assert wall <= 1.5 * best


async def test_a_child_whose_worker_is_killed_is_reclaimed_and_the_pipeline_still_completes(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with SimHosts(_fleet("kill", output=400), time_scale=1.0, seed=4) as hosts:
        proc = worker_process(redis_url, hosts.url("a"), "a")
        try:
            await wait_until(lambda: _exists(redis_client, Keys().live("a")), timeout=30)
            async with (
                running_agent(redis_client, hosts.url("b"), fast_config("b")),
                running_reaper(redis_client, lease_ms=1500),
                _api(redis_url) as http,
            ):
                reply = await http.post(
                    "/v1/pipelines",
                    json={
                        "children": [{"prompt": "first half"}, {"prompt": "second half"}],
                        "model": "m",
                        "integration_max_tokens": 10,
                        "wait": False,
                    },
                )
                assert reply.status_code == 202, reply.text
                pid = reply.json()["pipeline_id"]
                child_ids = {c["task_id"] for c in reply.json()["children"]}

                async def a_runs_a_child() -> bool:
                    claims = await events_of(ledger, TaskClaimed)
                    return any(c.worker == "a" and c.task_id in child_ids for c in claims)

                await wait_until(a_runs_a_child, timeout=30)
                os.kill(proc.pid, signal.SIGKILL)

                async def finished() -> bool:
                    view = (await http.get(f"/v1/pipelines/{pid}")).json()
                    return bool(view["status"] in ("completed", "failed"))

                await wait_until(finished, timeout=40, every=0.2)
                view = (await http.get(f"/v1/pipelines/{pid}")).json()
        finally:
            proc.kill()
            proc.wait(10)
    assert view["status"] == "completed", view["error"]
    killed = [
        c.task_id for c in await events_of(ledger, TaskClaimed) if c.worker == "a" and c.task_id in child_ids
    ]
    reclaimed = {r.task_id for r in await events_of(ledger, TaskReclaimed)}
    assert killed and set(killed) <= reclaimed
    rerun = next(c for c in view["children"] if c["task_id"] == killed[0])
    assert rerun["worker"] == "b" and rerun["attempt"] >= 2


async def _exists(redis: aioredis.Redis, key: str) -> bool:
    return bool(await redis.exists(key))


async def test_a_fan_out_of_six_on_two_slots_completes_and_says_six_vs_two(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url, workers=("a", "b"), time_scale=0.5) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=60) as http,
    ):
        reply = await http.post(
            "/v1/pipelines",
            json={
                "children": [{"prompt": f"part {i}"} for i in range(6)],
                "model": "m",
                "policy": "best_effort",
            },
        )
        again = (await http.get(f"/v1/pipelines/{reply.json()['pipeline_id']}")).json()
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert (body["fan_out"], body["capacity"], body["fan_out_vs_capacity"]) == (6, 2, "6 vs 2")
    assert body["over_capacity"] is True and body["status"] == "completed"
    assert {c["status"] for c in body["children"]} == {"completed"}
    assert {c["worker"] for c in body["children"]} <= {"a", "b"}
    assert body["expected_makespan_s"] > 0 and body["result"]["text"]
    assert again["children"] == body["children"]
    started = [e for e in await events_of(ledger, PipelineStarted) if e.pipeline_id == body["pipeline_id"]]
    added = [e for e in await events_of(ledger, PipelineChildAdded) if e.pipeline_id == body["pipeline_id"]]
    assert [(s.fan_out, s.capacity) for s in started] == [(6, 2)]
    assert sorted(e.role for e in added) == ["child"] * 6 + ["integration"]

    pid = body["pipeline_id"]
    shown = await asyncio.to_thread(rl, "pipeline", "show", pid, "--redis-url", redis_url)
    assert shown.returncode == 0, shown.stderr
    assert "6 vs 2" in shown.stdout and shown.stdout.count("child ") == 6 and "integration" in shown.stdout
    # Once the hash has expired, the ledger still tells the tree.
    await redis_client.delete(Keys().pipeline(pid))
    told = await asyncio.to_thread(rl, "pipeline", "show", pid, "--redis-url", redis_url, "--json")
    assert told.returncode == 0, told.stderr
    from_ledger = json.loads(told.stdout)
    assert from_ledger["from_ledger"] and from_ledger["status"] == "completed"
    assert [c["worker"] for c in from_ledger["children"]] == [c["worker"] for c in body["children"]]


async def test_a_decomposer_that_answers_garbage_twice_fails_the_request_and_queues_no_child(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with (
        SimHosts(_fleet("babble", output=30, follows_format=False), time_scale=0.1, seed=5) as hosts,
        running_agent(redis_client, hosts.url("a"), fast_config("a")),
        _api(redis_url) as http,
    ):
        reply = await http.post("/v1/pipelines", json={"prompt": "Plan a trip to Kyoto.", "model": "m"})
    assert reply.status_code == 502, reply.text
    error = reply.json()["error"]
    assert "decomposer" in error["message"] and "not JSON" in error["message"]
    assert "attempt 1" in error["message"] and "attempt 2" in error["message"]
    pid = error["pipeline_id"]
    submitted = [e.task_id for e in await events_of(ledger, TaskSubmitted) if e.pipeline_id == pid]
    assert submitted == error["decomposer_tasks"] and len(submitted) == 2
    assert await redis_client.xlen(Keys().queue("ab" * 32)) == 0
    done = [e for e in await events_of(ledger, PipelineCompleted) if e.pipeline_id == pid]
    assert [d.ok for d in done] == [False]


async def test_the_pipeline_model_is_listed_and_streams_its_integration_through_the_chat_surfaces(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    async with (
        fleet_and_api(redis_client, redis_url, workers=("a", "b"), time_scale=0.1) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=60) as http,
    ):
        models = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        tags = [m["name"] for m in (await http.get("/api/tags")).json()["models"]]
        pieces: list[str] = []
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": "pipeline",
                "stream": True,
                "messages": [{"role": "user", "content": "Plan a trip."}],
            },
        ) as resp:
            pid = resp.headers["x-routeledger-pipeline"]
            lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        for line in lines[:-1]:
            for choice in msgspec.json.decode(line[6:])["choices"]:
                pieces.append(choice["delta"].get("content") or "")
        view = (await http.get(f"/v1/pipelines/{pid}")).json()
        ollama = await http.post(
            "/api/chat",
            json={
                "model": "pipeline",
                "stream": False,
                "messages": [{"role": "user", "content": "Plan a week."}],
            },
        )
    assert "pipeline" in models and "pipeline" in tags
    assert lines[-1] == "data: [DONE]" and "".join(pieces)
    assert view["status"] == "completed" and view["fan_out"] == 3 and len(view["decomposer"]) == 1
    assert "".join(pieces) == view["result"]["text"]
    assert ollama.status_code == 200 and ollama.json()["done"] and ollama.json()["message"]["content"]


BROKEN_FLEET = f"""
name = "broken"
[model."m"]
digest = "{"cd" * 32}"
output = {{ dist = "fixed", mean = 20 }}
[model."bad"]
digest = "{"ef" * 32}"
output = {{ dist = "fixed", mean = 20 }}
[[worker]]
name = "a"
[worker.models."m"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
[[worker]]
name = "b"
error_rate = 1.0
[worker.models."bad"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0
"""


async def test_best_effort_integrates_what_succeeded_and_fail_fast_fails_naming_the_failed_child(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    children = [{"prompt": "works", "model": "m"}, {"prompt": "breaks", "model": "bad"}]
    async with (
        SimHosts(parse_fleet(BROKEN_FLEET, "broken.toml"), time_scale=0.1, seed=6) as hosts,
        running_agent(redis_client, hosts.url("a"), fast_config("a")),
        running_agent(redis_client, hosts.url("b"), fast_config("b", delivery_limit=1)),
        _api(redis_url) as http,
    ):
        lenient = await http.post(
            "/v1/pipelines", json={"children": children, "integration_model": "m", "policy": "best_effort"}
        )
        strict = await http.post("/v1/pipelines", json={"children": children, "integration_model": "m"})
        strict_view = (await http.get(f"/v1/pipelines/{strict.json()['error']['pipeline_id']}")).json()
    assert lenient.status_code == 200, lenient.text
    body = lenient.json()
    assert body["status"] == "completed" and body["failed_children"] == [body["children"][1]["task_id"]]
    assert [c["status"] for c in body["children"]] == ["completed", "dead"]
    assert strict.status_code == 502 and "child 1" in strict.json()["error"]["message"]
    assert strict_view["status"] == "failed" and strict_view["integration"] is None


async def test_every_task_of_a_pipeline_carries_the_pipelines_deadline_so_a_late_taker_expires_it(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    # Nobody takes model m's tasks (a lease with no agent behind it): the children wait in the
    # queue, and what they carry is what a worker would judge them by when it took them.
    await ghost_worker(redis_client)
    config = AppConfig(redis_url=redis_url)
    body = {
        "model": "m",
        "children": [{"prompt": "one"}, {"prompt": "two"}],
        "wait": False,
        "timeout_s": 30,
    }
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as http:
        before = now_ms()
        answer = await http.post("/v1/pipelines", json=body)
        after = now_ms()
        assert answer.status_code == 202, answer.text
        pipeline_id = answer.json()["pipeline_id"]

        async def queued() -> bool:
            return len(await children_of(redis_client, pipeline_id)) == 2

        await wait_until(queued, timeout=10)
    children = await children_of(redis_client, pipeline_id)
    for child in children:
        # The pipeline's own deadline (when it gives up on them), not none: before, a child whose
        # pipeline had ended ran whenever a worker got to it.
        assert child.deadline_ms is not None
        assert before + 30_000 - 50 <= child.deadline_ms <= after + 30_000 + 50
    assert len({child.deadline_ms for child in children}) == 1


async def test_a_pipeline_whose_model_queue_is_at_its_depth_cap_is_refused_and_queues_nothing(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    await ghost_worker(redis_client)
    config = AppConfig(redis_url=redis_url, max_queue_depth=1)
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as http:
        first = await http.post("/v1/tasks", json={"model": "m", "prompt": "fill the queue", "wait": False})
        assert first.status_code == 202, first.text
        refused = await http.post(
            "/v1/pipelines", json={"model": "m", "children": [{"prompt": "one"}], "wait": False}
        )
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["type"] == "queue_full" and "max_queue_depth" in error["message"], error
        assert refused.headers["retry-after"]
    submitted = await events_of(ledger, TaskSubmitted)
    assert [e.task_id for e in submitted if isinstance(e, TaskSubmitted)] == [first.json()["task_id"]]


async def children_of(redis: aioredis.Redis, pipeline_id: str) -> list[TaskMessage]:
    """Each task the pipeline queued so far, as it waits in model m's queue."""
    rows: Any = await redis.xrange(Keys().queue(MODEL_DIGEST), "-", "+")
    tasks = [decode_task(fields[F_TASK]) for _, fields in rows]
    return [task for task in tasks if task.pipeline_id == pipeline_id]
