"""API keys and their limits (rpm, tokens per day, tasks queued, priority ceiling), and the order
a model's band queues are served in (priority first, then the fair-share round)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from dispatch.submit import submit_task
from dispatch.view import LiveView
from events.event import TaskCompleted, TaskFailed, TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from projections import store
from projections.projector import Projector
from tasks.errors import QuotaExceededError
from tasks.payload import Message, TaskMessage
from tasks.quota import FAIR_QUANTUM, FAIR_ROUNDS, ApiKey, Quotas, band_of, named_keys, round_of
from tasks.store import TaskStore
from tests.helpers import MODEL_DIGEST, events_of, wait_until
from tests.test_api_native import has_output
from tests.test_api_support import fleet_and_api, ghost_worker, serving, stored_result


async def fold(redis: aioredis.Redis) -> None:
    """A live projector takes over and folds what the ledger holds (the inboxes moved first)."""
    projector = Projector(redis, Keys())
    await projector.start()
    await projector.catch_up()


async def current_ns(redis: aioredis.Redis) -> str:
    ns = await store.current(redis, Keys())
    assert ns is not None
    return ns


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def quotas(redis: aioredis.Redis) -> Quotas:
    return Quotas(redis, Keys(), open_ttl_s=3600)


async def refusal(q: Quotas, key: ApiKey, task_id: str) -> QuotaExceededError:
    with pytest.raises(QuotaExceededError) as caught:
        await q.admit(key, task_id, 0)
    return caught.value


async def test_a_key_gets_its_rpm_at_once_and_then_a_refusal_that_says_when_to_retry(
    redis_client: aioredis.Redis,
) -> None:
    q = quotas(redis_client)
    key = ApiKey(name="alice", key="k", rpm=3)
    for i in range(3):
        await q.admit(key, f"t{i}", 0)
    refused = await refusal(q, key, "t3")
    assert refused.limit == "rpm"
    # One request every 20 s once the burst of 3 is spent.
    assert 1 <= refused.retry_after_s <= 20
    assert "rpm=3" in refused.message
    usage = (await q.usage([key]))[0]
    assert usage.requests == 3 and usage.refused == 1 and usage.refused_by["rpm"] == 1


async def test_a_key_over_its_tokens_for_the_day_is_refused_until_midnight(
    redis_client: aioredis.Redis,
) -> None:
    q = quotas(redis_client)
    key = ApiKey(name="bob", key="k", tokens_per_day=100)
    await q.admit(key, "t1", 0)
    assert await q.settle("bob", "t1", 120)
    refused = await refusal(q, key, "t2")
    assert refused.limit == "tokens_per_day"
    assert 1 <= refused.retry_after_s <= 86_400
    usage = (await q.usage([key]))[0]
    assert usage.tokens_today == 120 and usage.tokens_total == 120 and usage.queued == 0


async def test_a_task_is_charged_once_however_often_it_is_settled(redis_client: aioredis.Redis) -> None:
    q = quotas(redis_client)
    key = ApiKey(name="carol", key="k")
    await q.admit(key, "t1", 0)
    assert await q.settle("carol", "t1", 50)
    assert not await q.settle("carol", "t1", 50)
    assert (await q.usage([key]))[0].tokens_today == 50


async def test_a_key_at_max_queued_is_refused_until_one_of_its_tasks_is_settled(
    redis_client: aioredis.Redis,
) -> None:
    q = quotas(redis_client)
    key = ApiKey(name="dave", key="k", max_queued=2)
    await q.admit(key, "t1", 0)
    await q.admit(key, "t2", 0)
    assert (await refusal(q, key, "t3")).limit == "max_queued"
    await q.settle("dave", "t1", 0)
    await q.admit(key, "t3", 0)
    assert (await q.usage([key]))[0].queued == 2


async def test_an_admission_sent_again_for_the_same_task_counts_once(redis_client: aioredis.Redis) -> None:
    q = quotas(redis_client)
    key = ApiKey(name="erin", key="k", max_queued=1)
    first = await q.admit(key, "t1", 0)
    again = await q.admit(key, "t1", 0)
    assert first == again
    assert (await q.usage([key]))[0].requests == 1


async def test_a_priority_above_the_keys_ceiling_is_lowered_to_it_not_refused(
    redis_client: aioredis.Redis,
) -> None:
    key = ApiKey(name="frank", key="k", max_priority=5)
    admitted = await quotas(redis_client).admit(key, "t1", 9)
    assert admitted.priority == 5
    assert band_of(3, key) == 3 and band_of(9, None) == 9


async def test_a_keys_round_grows_with_its_open_tasks_up_to_the_last() -> None:
    assert [round_of(n) for n in (0, FAIR_QUANTUM - 1, FAIR_QUANTUM, 100)] == [0, 0, 1, FAIR_ROUNDS - 1]


def test_plain_keys_get_generated_names_and_repeated_names_are_refused() -> None:
    keys = named_keys(["aaaa", "bbbb"], [ApiKey(name="alice", key="cccc", rpm=60)])
    assert [k.name for k in keys] == ["key-1", "key-2", "alice"]
    with pytest.raises(ValueError, match="repeated"):
        named_keys([], [ApiKey(name="x", key="1"), ApiKey(name="x", key="2")])
    with pytest.raises(ValueError, match="at least 1"):
        named_keys([], [ApiKey(name="x", key="1", rpm=0)])


async def queue(queues: TaskStore, name: str, priority: int = 0, share_round: int = 0) -> None:
    req = TaskMessage(
        model="m",
        messages=[Message(role="user", content=name)],
        task_id=name,
        priority=priority,
        share_round=share_round,
    )
    await submit_task(queues, req, digest=MODEL_DIGEST)


async def test_a_models_backlog_lists_higher_priority_first_then_earlier_rounds_then_arrival(
    redis_client: aioredis.Redis,
) -> None:
    keys = Keys()
    queues = TaskStore(redis_client, keys)
    await queue(queues, "low-r1", 0, 1)
    await queue(queues, "low-1", 0, 0)
    await queue(queues, "background", -3, 0)
    await queue(queues, "high", 9, 2)
    await queue(queues, "low-2", 0, 0)
    await queue(queues, "urgent", 40, 0)
    backlog = await LiveView(redis_client, keys).backlog(MODEL_DIGEST)
    # Priorities above 9 share band 9, where the earlier round comes first.
    assert [e.task_id for e in backlog] == ["urgent", "high", "low-1", "low-2", "low-r1", "background"]
    assert backlog[2].queue == keys.queue(MODEL_DIGEST)
    assert await queues.depth(MODEL_DIGEST) == 6


async def test_a_take_of_the_head_takes_from_the_band_queue_that_holds_it(
    redis_client: aioredis.Redis,
) -> None:
    keys = Keys()
    queues = TaskStore(redis_client, keys)
    await queue(queues, "low", 0, 0)
    await queue(queues, "high", 9, 0)
    head = (await LiveView(redis_client, keys).backlog(MODEL_DIGEST))[0]
    assert head.task_id == "high"
    taken = await queues.take(head.queue, "w", head.entry_id)
    assert taken.entry_id == head.entry_id
    # Taken once: the next look starts at the plain queue.
    assert [e.task_id for e in await LiveView(redis_client, keys).backlog(MODEL_DIGEST)] == ["low"]
    assert (await queues.take(head.queue, "w2", head.entry_id)).entry_id == ""


async def test_a_request_over_a_limit_is_a_429_naming_it_with_retry_after(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    await ghost_worker(redis_client)
    config = AppConfig(redis_url=redis_url, keys=[ApiKey(name="alice", key="secret-a", max_queued=1)])
    auth = {"Authorization": "Bearer secret-a"}
    async with serving(config) as base, httpx.AsyncClient(base_url=base, headers=auth) as http:
        first = await http.post("/v1/tasks", json=CHAT)
        native = await http.post("/v1/tasks", json=CHAT)
        openai = await http.post("/v1/chat/completions", json=CHAT)
        stats = (await http.get("/v1/stats")).json()
        metrics = (await http.get("/metrics")).text
        panel = (await http.get("/v1/dashboard/keys")).json()
    assert first.status_code == 202
    assert native.status_code == 429 and native.headers["Retry-After"] == "1"
    assert (
        native.json()["error"]["limit"] == "max_queued" and native.json()["error"]["type"] == "rate_limited"
    )
    assert openai.status_code == 429 and openai.json()["error"]["code"] == "rate_limit_exceeded"
    assert openai.json()["error"]["param"] == "max_queued"
    (alice,) = stats["keys"]
    assert (
        alice["name"] == "alice" and alice["requests"] == 1 and alice["queued"] == 1 and alice["refused"] == 2
    )
    assert "secret-a" not in str(stats) and "secret-a" not in metrics and "secret-a" not in str(panel)
    assert 'routeledger_key_refused{key="alice",limit="max_queued"} 2.0' in metrics
    assert panel["keys"][0]["name"] == "alice"


async def test_the_key_name_never_the_key_is_recorded_on_the_submission(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    await ghost_worker(redis_client)
    config = AppConfig(redis_url=redis_url, api_keys=["plain-key"])
    async with serving(config) as base, httpx.AsyncClient(base_url=base) as http:
        accepted = await http.post("/v1/tasks", json=CHAT, headers={"Authorization": "Bearer plain-key"})
        history = (
            await http.get(
                f"/v1/tasks/{accepted.json()['task_id']}/events",
                headers={"Authorization": "Bearer plain-key"},
            )
        ).json()
    submitted = history["events"][0]
    assert submitted["type"] == "TaskSubmitted" and submitted["key"] == "key-1"
    assert "plain-key" not in str(history)


async def test_a_model_queue_at_its_depth_cap_refuses_with_a_503_naming_the_cap(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    await ghost_worker(redis_client)
    async with (
        serving(AppConfig(redis_url=redis_url, max_queue_depth=2)) as base,
        httpx.AsyncClient(base_url=base) as http,
    ):
        codes = [(await http.post("/v1/tasks", json=CHAT)).status_code for _ in range(2)]
        full = await http.post("/v1/tasks", json={**CHAT, "priority": 9})
    assert codes == [202, 202]
    assert full.status_code == 503 and full.headers["Retry-After"] == "5"
    body = full.json()["error"]
    assert body["type"] == "queue_full" and body["cap"] == 2 and "max_queue_depth=2" in body["message"]


async def test_a_completion_is_charged_once_even_after_its_open_place_expired(
    redis_client: aioredis.Redis,
) -> None:
    q = Quotas(redis_client, Keys(), open_ttl_s=0.001)
    key = ApiKey(name="gina", key="k", tokens_per_day=1000)
    await q.admit(key, "t1", 0)
    await asyncio.sleep(0.01)
    await q.admit(key, "t2", 0)  # drops t1 from the open set: it is older than open_ttl_s
    assert await q.settle("gina", "t1", 70)
    assert not await q.settle("gina", "t1", 70)
    assert (await q.usage([key]))[0].tokens_today == 70


async def test_a_settlement_with_no_tokens_gives_back_the_place_and_a_later_charge_still_counts(
    redis_client: aioredis.Redis,
) -> None:
    q = quotas(redis_client)
    key = ApiKey(name="hank", key="k", max_queued=1)
    await q.admit(key, "t1", 0)
    assert await q.settle("hank", "t1", 0)  # a cancel: its place is given back
    assert await q.settle("hank", "t1", 30)  # what the cancelled run had done, from the ledger
    assert not await q.settle("hank", "t1", 30)
    usage = (await q.usage([key]))[0]
    assert usage.tokens_today == 30 and usage.queued == 0


async def test_a_pipelines_child_is_held_to_max_queued_but_not_to_rpm(redis_client: aioredis.Redis) -> None:
    q = quotas(redis_client)
    key = ApiKey(name="iris", key="k", rpm=1, max_queued=3)
    await q.admit(key, "first", 0)
    await q.admit(key, "child-1", 0, child=True)
    await q.admit(key, "child-2", 0, child=True)
    assert (await refusal(q, key, "other")).limit == "max_queued"
    await q.settle("iris", "first", 0)
    assert (await refusal(q, key, "other")).limit == "rpm"


async def until_result(redis: aioredis.Redis, task_id: str, status: str = "completed") -> None:
    async def done() -> bool:
        result = await stored_result(redis, task_id)
        return result is not None and result.status == status

    await wait_until(done, timeout=20)


async def test_a_result_nobody_collects_is_charged_to_its_key_when_the_projector_folds_it(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    key = ApiKey(name="jack", key="jack-key", tokens_per_day=100_000)
    auth = {"Authorization": "Bearer jack-key"}
    async with (
        fleet_and_api(redis_client, redis_url, keys=[key]) as (base, _),
        httpx.AsyncClient(base_url=base, headers=auth) as http,
    ):
        task_id = (await http.post("/v1/tasks", json=CHAT)).json()["task_id"]
        await until_result(redis_client, task_id)
        await fold(redis_client)
        # A projector that takes over folds the same completion again: charged once all the same.
        await redis_client.delete(Keys().checkpoint(await current_ns(redis_client)))
        await fold(redis_client)
        usage = (await http.get("/v1/stats")).json()["keys"][0]
    (completed,) = await events_of(Ledger(redis_client, Keys()), TaskCompleted)
    t = completed.timings
    assert usage["name"] == "jack" and usage["queued"] == 0
    assert usage["tokens_today"] == (t.prompt_eval_count or 0) + (t.eval_count or 0) > 0


async def test_a_task_cancelled_while_running_is_charged_for_the_prompt_and_the_output_it_made(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    key = ApiKey(name="kate", key="kate-key")
    auth = {"Authorization": "Bearer kate-key"}
    # time_scale 20: a 4 s generation, so the cancel lands mid-run.
    async with (
        fleet_and_api(redis_client, redis_url, time_scale=20.0, keys=[key]) as (base, _),
        httpx.AsyncClient(base_url=base, headers=auth) as http,
    ):
        task_id = (await http.post("/v1/tasks", json=CHAT)).json()["task_id"]
        await wait_until(lambda: has_output(redis_client, task_id), timeout=10)
        await asyncio.sleep(1.0)
        assert (await http.delete(f"/v1/tasks/{task_id}")).status_code == 202
        await until_result(redis_client, task_id, "cancelled")
        await fold(redis_client)
        usage = (await http.get("/v1/stats")).json()["keys"][0]
    (failed,) = await events_of(Ledger(redis_client, Keys()), TaskFailed)
    (submitted,) = await events_of(Ledger(redis_client, Keys()), TaskSubmitted)
    assert failed.kind == "cancelled" and failed.timings.prompt_eval_count == submitted.prompt_tokens
    made = failed.timings.eval_count or 0
    # Some of the 40 output tokens, not all: it stopped mid-run.
    assert 0 < made < 40
    assert usage["tokens_today"] == (submitted.prompt_tokens or 0) + made
    assert usage["queued"] == 0


async def test_a_pipelines_children_carry_its_key_and_are_charged_to_it(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    key = ApiKey(name="liam", key="liam-key", rpm=1)
    auth = {"Authorization": "Bearer liam-key"}
    body = {"children": [{"prompt": f"part {i}"} for i in (1, 2)], "model": "m", "integration_max_tokens": 5}
    async with (
        fleet_and_api(redis_client, redis_url, keys=[key]) as (base, _),
        httpx.AsyncClient(base_url=base, headers=auth, timeout=60) as http,
    ):
        reply = await http.post("/v1/pipelines", json=body)
        await fold(redis_client)
        usage = (await http.get("/v1/stats")).json()["keys"][0]
    assert reply.status_code == 200, reply.text
    submitted = await events_of(Ledger(redis_client, Keys()), TaskSubmitted)
    # Two children and the integration, all on the key, none refused by its rpm of 1.
    assert len(submitted) == 3 and {e.key for e in submitted} == {"liam"}
    completed = await events_of(Ledger(redis_client, Keys()), TaskCompleted)
    spent = sum((e.timings.prompt_eval_count or 0) + (e.timings.eval_count or 0) for e in completed)
    assert usage["tokens_today"] == spent > 0 and usage["queued"] == 0 and usage["refused"] == 0
