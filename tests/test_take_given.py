"""Taking a queued task that is not the head (size-aware dispatch on real workers): the entry moves
to the worker's pinned stream and is delivered there in one script (TaskStore.take_given)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from dispatch.submit import submit_task
from events.connection import redis_client as redis_client_for
from events.event import ModelEntry, TaskClaimed, TaskCompleted, TaskReclaimed
from events.keys import REQUEUED_CONSUMER, Keys
from events.ledger import Ledger
from router.gate import GateDecision, GateParams
from sim.backends.hosts import SimHosts
from tasks.payload import Message, TaskMessage
from tasks.store import CANCEL_RUNNING, TaskStore
from tests.helpers import (
    MODEL_DIGEST,
    events_of,
    fast_config,
    make_test_fleet,
    running_agent,
    running_reaper,
    wait_until,
)
from workers import admission
from workers.admission import Admission, Applicant, RouterGate
from workers.agent import WorkerAgent
from workers.backend import Inventory, OllamaBackend
from workers.reaper import Reaper, ReaperConfig

pytestmark = pytest.mark.cluster_tier


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=3) as sim:
        yield sim


async def _queued(queues: TaskStore, n: int) -> list[tuple[str, str]]:
    """`n` tasks of model `m` on its shared queue: (task id, entry id) of each, head first."""
    for i in range(n):
        req = TaskMessage(model="m", messages=[Message(role="user", content=f"q{i}")], task_id=f"t{i}")
        await submit_task(queues, req, digest=MODEL_DIGEST)
    rows: Any = await queues.redis.xrange(queues.keys.queue(MODEL_DIGEST))
    return [(fields[b"id"].decode(), entry.decode()) for entry, fields in rows]


async def _ids(redis: aioredis.Redis, stream: str) -> list[bytes]:
    rows: Any = await redis.xrange(stream)
    return [fields[b"id"] for _, fields in rows]


async def test_a_later_task_moves_to_the_workers_pinned_stream_and_is_delivered_there_at_once(
    any_redis_url: str, keys: Keys
) -> None:
    redis_client = redis_client_for(any_redis_url)
    try:
        await _moves(redis_client, keys)
    finally:
        await redis_client.aclose()


async def _moves(redis_client: aioredis.Redis, keys: Keys) -> None:
    queues = TaskStore(redis_client, keys, Ledger(redis_client, keys))
    (t0, _), (t1, e1), _ = await _queued(queues, 3)
    shared, pinned = keys.queue(MODEL_DIGEST), keys.pinned("w")
    taken = await queues.take_given(shared, pinned, "w", e1, t1)
    assert taken.entry_id and taken.attempt == 1 and taken.fields[b"id"] == t1.encode()
    assert await _ids(redis_client, shared) == [b"t0", b"t2"]
    held: Any = await redis_client.xpending_range(pinned, "workers", "-", "+", 10)
    assert [(h["message_id"], h["consumer"]) for h in held] == [(taken.entry_id.encode(), b"w")]
    task = await redis_client.hgetall(keys.task(t1))
    assert task[b"entry"] == taken.entry_id.encode() and task[b"queue"] == pinned.encode()
    assert task[b"fallback"] == shared.encode()
    assert pinned.encode() in await redis_client.smembers(keys.queues)
    # The head stays for the others; a cancel finds the moved task where it runs.
    assert (await queues.take(shared, "other")).fields[b"id"] == t0.encode()
    found = (task[b"queue"].decode(), task[b"entry"].decode())
    assert (await queues.cancel_queued(*found))[0] == CANCEL_RUNNING


async def test_a_later_task_taken_or_removed_meanwhile_is_not_taken(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    (_, e0), (t1, e1), (t2, e2), (t3, e3) = await _queued(queues, 4)
    shared, pinned = keys.queue(MODEL_DIGEST), keys.pinned("w")
    # Another worker read the head and the next: the second is delivered, not queued.
    assert (await queues.take(shared, "x")).entry_id == e0
    assert (await queues.take(shared, "x")).entry_id == e1
    assert not (await queues.take_given(shared, pinned, "w", e1, t1)).entry_id
    # Cancelled while queued.
    await queues.cancel_queued(shared, e2)
    assert not (await queues.take_given(shared, pinned, "w", e2, t2)).entry_id
    # Moved to another worker first.
    assert (await queues.take_given(shared, keys.pinned("y"), "y", e3, t3)).entry_id
    missed = await queues.take_given(shared, pinned, "w", e3, t3)
    assert not missed.entry_id and missed.cursor == e1
    assert await redis_client.xlen(pinned) == 0


async def test_a_worker_with_work_on_its_pinned_stream_takes_no_later_task(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    _, (t1, e1) = await _queued(queues, 2)
    shared, pinned = keys.queue(MODEL_DIGEST), keys.pinned("w")
    await queues.enqueue(pinned, TaskMessage(task_id="bench", model="m", digest=MODEL_DIGEST, bench_id="x"))
    assert not (await queues.take_given(shared, pinned, "w", e1, t1)).entry_id
    assert await _ids(redis_client, shared) == [b"t0", b"t1"]
    # Once that is taken, the later task moves.
    assert (await queues.take(pinned, "w")).entry_id
    assert (await queues.take_given(shared, pinned, "w", e1, t1)).entry_id


async def test_a_re_queued_later_task_moves_as_its_next_attempt(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    (_, e0), (t1, e1) = await _queued(queues, 2)
    shared, pinned = keys.queue(MODEL_DIGEST), keys.pinned("w")
    for entry in (e0, e1):
        assert (await queues.take(shared, "x")).entry_id == entry
    for entry in (e0, e1):
        await queues.requeue(shared, entry, delivery_limit=3, owner="x", attempt=1)
    taken = await queues.take_given(shared, pinned, "w", e1, t1)
    assert taken.attempt == 2 and taken.fields[b"attempt"] == b"2"
    assert await _ids(redis_client, shared) == [b"t0"]
    assert await redis_client.xpending(shared, "workers") == {
        "pending": 1,
        "min": e0.encode(),
        "max": e0.encode(),
        "consumers": [{"name": REQUEUED_CONSUMER.encode(), "pending": 1}],
    }


async def test_a_moved_task_whose_worker_died_goes_back_to_the_shared_queue_as_its_next_attempt(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    _, (t1, e1) = await _queued(queues, 2)
    shared, pinned = keys.queue(MODEL_DIGEST), keys.pinned("dead")
    assert (await queues.take_given(shared, pinned, "dead", e1, t1)).entry_id
    await asyncio.sleep(0.05)
    report = await Reaper(redis_client, keys, ReaperConfig(lease_ms=10)).sweep()
    assert report.reclaimed == 1 and report.handed_back == 1
    assert await redis_client.xlen(pinned) == 0
    assert await _ids(redis_client, shared) == [b"t0", b"t1"]
    assert (await queues.take(shared, "other")).entry_id  # the head, t0
    again = await queues.take(shared, "other")
    assert again.fields[b"id"] == b"t1" and again.attempt == 2


class _Given:
    """decide_take's stand-in: the decisions a test gives the worker's RouterGate, one per ask, then
    a "leave" for every later ask."""

    def __init__(self, decisions: Sequence[tuple[str, str]]) -> None:
        self.decisions = list(decisions)
        self.asked = 0

    def __call__(self, worker: str, *_: Any) -> GateDecision:
        self.asked += 1
        if not self.decisions:
            return GateDecision(take=False, worker=worker, reason="test: nothing more")
        task_id, entry_id = self.decisions.pop(0)
        return GateDecision(
            take=True,
            worker=worker,
            reason="test",
            digest=MODEL_DIGEST,
            task_id=task_id,
            entry_id=entry_id,
            position=2,
        )


async def _one_each(ledger: Ledger, kind: type, n: int) -> bool:
    return len([e for e in await events_of(ledger, kind) if not getattr(e, "duplicate", False)]) >= n


async def test_a_worker_given_the_second_task_runs_exactly_that_one_and_leaves_the_head_to_others(
    redis_client: aioredis.Redis,
    keys: Keys,
    ledger: Ledger,
    hosts: SimHosts,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    (t0, _), (t1, e1) = await _queued(queues, 2)
    given = _Given([(t1, e1)])
    monkeypatch.setattr(admission, "decide_take", given)
    async with running_agent(
        redis_client, hosts.url("a"), fast_config("a"), gate=RouterGate(redis_client, keys)
    ):
        await wait_until(lambda: _one_each(ledger, TaskCompleted, 1), timeout=5)
        assert await _ids(redis_client, keys.queue(MODEL_DIGEST)) == [t0.encode()]
    async with running_agent(redis_client, hosts.url("b"), fast_config("b")):
        await wait_until(lambda: _one_each(ledger, TaskCompleted, 2), timeout=5)
    claims = await events_of(ledger, TaskClaimed)
    assert sorted((c.task_id, c.worker, c.queue) for c in claims) == [
        (t0, "b", keys.queue(MODEL_DIGEST)),
        (t1, "a", keys.pinned("a")),
    ]
    done = await events_of(ledger, TaskCompleted)
    assert sorted((c.task_id, c.worker, c.duplicate) for c in done) == [(t0, "b", False), (t1, "a", False)]
    assert await redis_client.xlen(keys.pinned("a")) == 0
    assert await redis_client.xlen(keys.queue(MODEL_DIGEST)) == 0


async def test_a_worker_whose_given_task_was_removed_takes_nothing_and_asks_again(
    redis_client: aioredis.Redis,
    keys: Keys,
    ledger: Ledger,
    hosts: SimHosts,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    (t0, _), (t1, e1), (t2, e2) = await _queued(queues, 3)
    given = _Given([(t1, e1), (t2, e2)])
    monkeypatch.setattr(admission, "decide_take", given)
    gate = RouterGate(redis_client, keys)

    class CancelledMeanwhile:
        """The gate decides on t1; t1 is cancelled between that decision and the take."""

        async def admit(self, agent: Applicant, queues_: Sequence[str]) -> Admission:
            decided = await gate.admit(agent, queues_)
            if decided.task_id == t1:
                await queues.cancel_queued(keys.queue(MODEL_DIGEST), e1)
            return decided

    async with running_agent(redis_client, hosts.url("a"), fast_config("a"), gate=CancelledMeanwhile()):
        await wait_until(lambda: _one_each(ledger, TaskCompleted, 1), timeout=5)
    claims = await events_of(ledger, TaskClaimed)
    assert [(c.task_id, c.worker) for c in claims] == [(t2, "a")]
    assert given.asked >= 2
    assert await _ids(redis_client, keys.queue(MODEL_DIGEST)) == [t0.encode()]


class _Recorded(_Given):
    """_Given that keeps the gate parameters each decision was made with."""

    def __init__(self, decisions: Sequence[tuple[str, str]]) -> None:
        super().__init__(decisions)
        self.params: list[GateParams] = []

    def __call__(self, worker: str, *args: Any) -> GateDecision:
        self.params.append(args[-1])
        return super().__call__(worker, *args)


def _idle_agent(redis: aioredis.Redis, keys: Keys, name: str, *, inbox: bool) -> WorkerAgent:
    agent = WorkerAgent(redis, keys, OllamaBackend("http://127.0.0.1:9"), fast_config(name, inbox=inbox))
    agent.backend_ok = True
    agent.inventory = Inventory(models=[ModelEntry(name="m", digest=MODEL_DIGEST)], loaded=[])
    return agent


async def test_the_gate_admits_a_later_task_to_be_moved_and_the_head_to_be_taken_in_place(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    (t0, e0), (t1, e1) = await _queued(queues, 2)
    given = _Recorded([(t1, e1), (t0, e0)])
    monkeypatch.setattr(admission, "decide_take", given)
    gate = RouterGate(redis_client, keys)
    agent = _idle_agent(redis_client, keys, "w", inbox=False)
    shared = keys.queue(MODEL_DIGEST)
    later = await gate.admit(agent, [shared])
    assert (later.queue, later.entry_id, later.task_id, later.ahead) == (shared, e1, t1, True)
    head = await gate.admit(agent, [shared])
    assert (head.queue, head.entry_id, head.ahead, head.slack) == (shared, e0, False, 1)
    assert [p.skip_ahead for p in given.params] == [True, True]


async def test_a_worker_that_writes_to_an_inbox_is_gated_by_the_size_blind_rule(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its ACL may not delete a queue entry: it cannot move a later task to its pinned stream.
    queues = TaskStore(redis_client, keys, ledger)
    (t0, e0), _ = await _queued(queues, 2)
    given = _Recorded([(t0, e0)])
    monkeypatch.setattr(admission, "decide_take", given)
    gate = RouterGate(redis_client, keys)
    taken = await gate.admit(_idle_agent(redis_client, keys, "w", inbox=True), [keys.queue(MODEL_DIGEST)])
    assert taken.entry_id == e0 and not taken.ahead
    assert [p.skip_ahead for p in given.params] == [False]


async def test_a_lone_worker_runs_a_small_task_queued_behind_a_big_one_first_through_its_pinned_stream(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger, hosts: SimHosts
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    for task_id, max_tokens in (("big", None), ("small", 2)):
        req = TaskMessage(
            model="m", messages=[Message(role="user", content="x")], max_tokens=max_tokens, task_id=task_id
        )
        await submit_task(queues, req, digest=MODEL_DIGEST)
    gate = RouterGate(redis_client, keys)
    async with running_agent(redis_client, hosts.url("a"), fast_config("a"), gate=gate):
        await wait_until(lambda: _one_each(ledger, TaskCompleted, 2), timeout=5)
    claims = await events_of(ledger, TaskClaimed)
    assert [(c.task_id, c.queue) for c in claims] == [
        ("small", keys.pinned("a")),
        ("big", keys.queue(MODEL_DIGEST)),
    ]


async def test_tasks_waiting_in_several_priority_bands_are_gated_by_the_size_blind_rule(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bands are served highest priority first; a size-aware order across them would not keep that.
    queues = TaskStore(redis_client, keys, ledger)
    for task_id, priority in (("low", 0), ("high", 5)):
        req = TaskMessage(
            model="m", messages=[Message(role="user", content="x")], task_id=task_id, priority=priority
        )
        await submit_task(queues, req, digest=MODEL_DIGEST)
    given = _Recorded([])
    monkeypatch.setattr(admission, "decide_take", given)
    gate = RouterGate(redis_client, keys)
    await gate.admit(_idle_agent(redis_client, keys, "w", inbox=False), [keys.queue(MODEL_DIGEST)])
    assert [p.skip_ahead for p in given.params] == [False]


async def test_a_moved_task_whose_worker_died_is_run_by_another_worker_and_completed_once(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger, hosts: SimHosts
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    (t0, _), (t1, e1) = await _queued(queues, 2)
    # A worker with no lease (it died) moved t1 to its pinned stream and took it there.
    assert (await queues.take_given(keys.queue(MODEL_DIGEST), keys.pinned("gone"), "gone", e1, t1)).entry_id
    # A reaper lease shorter than the live worker's: the dead owner's task is reclaimed at once,
    # while the live worker's runs are judged by its own (a run outlasting 200 ms stays its own).
    async with (
        running_reaper(redis_client, lease_ms=100),
        running_agent(redis_client, hosts.url("b"), fast_config("b")),
    ):
        await wait_until(lambda: _one_each(ledger, TaskCompleted, 2), timeout=5)
    done = await events_of(ledger, TaskCompleted)
    assert sorted((c.task_id, c.worker, c.attempt, c.duplicate) for c in done) == [
        (t0, "b", 1, False),
        (t1, "b", 2, False),
    ]
    reclaims = await events_of(ledger, TaskReclaimed)
    assert [(r.task_id, r.owner) for r in reclaims] == [(t1, "gone")]
    assert await redis_client.xlen(keys.pinned("gone")) == 0
