"""The pinned hand-off: a turn goes straight to the worker whose slot holds its conversation only
when the plan's lead is wide, and the reaper moves it back to the shared queue when that worker
does not take it."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from dispatch.prefix import render_messages
from dispatch.submit import route_and_submit, submit_task
from dispatch.view import LiveView
from events.event import ModelEntry
from events.keys import Keys
from events.ledger import Ledger
from router.choose import RouteQuery, decide
from router.handoff import HANDOFF_RATIO, handoff_worker
from router.plan import WorkerView
from router.prefix import SlotCache, block_hashes, chain_of, marks_of
from tasks.lease import LeaseInfo, Leases
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.router_helpers import NOW, QWEN, busy, estimator, snapshot, speed_row, view
from workers.reaper import Reaper, ReaperConfig

pytestmark = pytest.mark.cluster_tier

DIGEST = QWEN


def _conversation() -> str:
    return render_messages(
        [
            Message(role="user", content="question " + "lorem ipsum " * 500),
            Message(role="assistant", content="answer " + "dolor sit " * 500),
        ]
    )


def _decision(  # type: ignore[no-untyped-def]
    speeds: dict[str, tuple[float, float]],
    cached_on: str,
    busy_on: str | None = None,
    paced: bool = False,
    busy_s: float = 600.0,
):
    text = _conversation()
    est = estimator(snapshot([speed_row(w, QWEN, d, 30, prompt=p, load=3.0) for w, (d, p) in speeds.items()]))
    workers = []
    for name in speeds:
        cache = [SlotCache(marks=marks_of(block_hashes(text)), used_ms=NOW)] if name == cached_on else []
        w = WorkerView(name=name, slots=2 if name == busy_on else 1, holds={QWEN}, loaded={QWEN}, cache=cache)
        if name == busy_on:
            busy(w, QWEN, started_s_ago=0.0, expected_s=busy_s)
            busy(w, QWEN, started_s_ago=0.0, expected_s=busy_s)
        workers.append(w)
    query = RouteQuery(
        model="m", prompt_tokens=3000, prefix=chain_of(text + "and the next question"), paced=paced
    )
    return decide(query, {"m": QWEN}, view(workers), est, NOW)


def test_a_turn_is_handed_off_only_when_the_slot_holding_it_wins_by_a_wide_margin() -> None:
    # Equal machines: the cache makes the lead (3,000 prompt tokens at 100 tok/s is 30 s saved).
    wide = _decision({"a": (20.0, 100.0), "b": (20.0, 100.0)}, cached_on="b")
    assert handoff_worker(wide) == "b"
    # The cache is on a machine so slow that the other finishes first anyway: no hand-off.
    slow = _decision({"a": (40.0, 3000.0), "b": (2.0, 100.0)}, cached_on="b")
    assert slow.ranking.best.worker == "a"
    assert handoff_worker(slow) is None
    # No cache anywhere: nothing a pin would keep.
    bare = _decision({"a": (20.0, 100.0), "b": (25.0, 100.0)}, cached_on="nobody")
    assert handoff_worker(bare) is None


def test_a_streamed_turn_never_leaves_a_free_faster_machine_for_the_slot_holding_it() -> None:
    # The cache is on a machine that decodes 8 tok/s, faster than its reader reads: its reader
    # would start at once there and wait 1 s for the prompt on the other. But the other is free and
    # finishes sooner: pacing never hands the turn to the slower machine (design rule 13).
    speeds = {"a": (40.0, 3000.0), "b": (8.0, 100.0)}
    plain = _decision(speeds, cached_on="b")
    assert plain.ranking.best.worker == "a" and handoff_worker(plain) is None
    read = _decision(speeds, cached_on="b", paced=True)
    assert read.ranking.best.worker == "a" and handoff_worker(read) is None


def test_a_streamed_turn_is_handed_to_the_slot_holding_it_when_the_faster_machine_is_busy() -> None:
    # The faster machine is busy for a few seconds: placed by finish the turn waits for it; paced,
    # its reader starts at once on the free machine holding its conversation.
    speeds = {"a": (40.0, 3000.0), "b": (8.0, 100.0)}
    plain = _decision(speeds, cached_on="b", busy_on="a", busy_s=8.0)
    assert plain.ranking.best.worker == "a" and handoff_worker(plain) is None
    read = _decision(speeds, cached_on="b", busy_on="a", busy_s=8.0, paced=True)
    assert read.ranking.best.worker == "b" and handoff_worker(read) == "b"


def test_a_narrow_lead_or_a_wait_keeps_the_turn_on_the_shared_queue() -> None:
    close = _decision({"a": (20.0, 100.0), "b": (20.0, 100.0)}, cached_on="b")
    best = close.ranking.best
    rest = close.ranking.best_finish_after(1)
    assert rest is not None
    # The same decision with a demanded lead just above the one it has.
    assert handoff_worker(close, ratio=rest / best.expected_finish_s * 1.01) is None
    assert HANDOFF_RATIO > 1.0
    # Its slots are all busy: it would wait, so the shared queue keeps the turn.
    waiting = _decision({"a": (20.0, 100.0), "b": (20.0, 100.0)}, cached_on="b", busy_on="b")
    assert handoff_worker(waiting) is None


async def _pinned(queues: TaskStore, task_id: str, worker: str) -> str:
    req = TaskMessage(model="m", messages=[Message(role="user", content="hello " * 100)], task_id=task_id)
    submitted = await submit_task(queues, req, digest=DIGEST, pin=worker)
    assert submitted.queue == queues.keys.pinned(worker)
    return submitted.queue


async def _live(redis: aioredis.Redis, keys: Keys, name: str) -> None:
    await Leases(redis, keys).put(LeaseInfo(worker=name, token="t", slots=1), 60_000)


async def test_a_hand_off_its_worker_never_takes_goes_back_to_the_shared_queue_once(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    pinned = await _pinned(queues, "t-dead", "gone")
    assert await redis_client.hget(keys.task("t-dead"), "fallback") == keys.queue(DIGEST).encode()
    reaper = Reaper(redis_client, keys, ReaperConfig(lease_ms=10))
    report = await reaper.sweep()
    assert report.handed_back == 1
    assert await redis_client.xlen(pinned) == 0
    shared: Any = await redis_client.xrange(keys.queue(DIGEST))
    assert [fields[b"id"] for _, fields in shared] == [b"t-dead"]
    # The task's index follows it: a cancel or a lookup finds it where it is now.
    assert await redis_client.hget(keys.task("t-dead"), "entry") == shared[0][0]
    assert await redis_client.hget(keys.task("t-dead"), "queue") == keys.queue(DIGEST).encode()
    assert (await reaper.sweep()).handed_back == 0
    assert await redis_client.xlen(keys.queue(DIGEST)) == 1


async def test_a_live_worker_keeps_a_fresh_hand_off_and_one_it_took_is_never_moved(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    await _live(redis_client, keys, "busy")
    pinned = await _pinned(queues, "t-fresh", "busy")
    reaper = Reaper(redis_client, keys, ReaperConfig(lease_ms=60_000, handoff_wait_ms=60_000))
    assert (await reaper.sweep()).handed_back == 0
    assert await redis_client.xlen(pinned) == 1
    taken = await queues.take(pinned, "busy")
    assert taken.entry_id
    # Taken, then waited past the bound: it runs where it is.
    late = Reaper(redis_client, keys, ReaperConfig(lease_ms=60_000, handoff_wait_ms=0))
    assert (await late.sweep()).handed_back == 0
    assert await redis_client.xlen(keys.queue(DIGEST)) == 0


async def test_a_live_worker_that_does_not_take_its_hand_off_in_time_loses_it_to_the_shared_queue(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    await _live(redis_client, keys, "stuck")
    await _pinned(queues, "t-stuck", "stuck")
    report = await Reaper(redis_client, keys, ReaperConfig(lease_ms=60_000, handoff_wait_ms=0)).sweep()
    assert report.handed_back == 1
    assert await redis_client.xlen(keys.queue(DIGEST)) == 1


async def test_a_benchmark_on_a_dead_workers_pinned_stream_stays_there(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    req = TaskMessage(model="m", messages=[Message(role="user", content="bench")], task_id="b1")
    await submit_task(queues, req, digest=DIGEST)  # the shared queue: untouched by hand-backs
    pinned = keys.pinned("gone")
    await queues.enqueue(pinned, TaskMessage(task_id="bench-1", model="m", digest=DIGEST, bench_id="x"))
    assert (await Reaper(redis_client, keys, ReaperConfig(lease_ms=10)).sweep()).handed_back == 0
    assert await redis_client.xlen(pinned) == 1


async def test_a_hand_off_its_worker_gave_back_goes_to_the_shared_queue_as_its_next_attempt(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    await _live(redis_client, keys, "flaky")
    pinned = await _pinned(queues, "t-back", "flaky")
    taken = await queues.take(pinned, "flaky")
    assert taken.entry_id
    # A retryable failure: the worker re-queues it in place, on its own pinned stream.
    await queues.requeue(pinned, taken.entry_id, delivery_limit=3, owner="flaky", attempt=1)
    report = await Reaper(redis_client, keys, ReaperConfig(lease_ms=60_000, handoff_wait_ms=60_000)).sweep()
    assert report.handed_back == 1
    assert await redis_client.xlen(pinned) == 0
    # Another worker takes it from the shared queue, as attempt 2.
    again = await queues.take(keys.queue(DIGEST), "other")
    assert again.entry_id and again.attempt == 2
    assert await redis_client.hget(keys.task("t-back"), "entry") == again.entry_id.encode()


async def test_a_hand_off_taken_by_a_worker_that_died_is_reclaimed_into_the_shared_queue(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    pinned = await _pinned(queues, "t-died", "dead")
    assert (await queues.take(pinned, "dead")).entry_id
    await asyncio.sleep(0.05)
    report = await Reaper(redis_client, keys, ReaperConfig(lease_ms=10)).sweep()
    assert report.reclaimed == 1 and report.handed_back == 1
    assert await redis_client.xlen(pinned) == 0
    again = await queues.take(keys.queue(DIGEST), "other")
    assert again.entry_id and again.attempt == 2


async def test_a_worker_handed_a_turn_gets_no_other_until_its_lease_says_it_took_it(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    leases = Leases(redis_client, keys)
    text = _conversation()
    slot = SlotCache(marks=marks_of(block_hashes(text)), used_ms=NOW)
    model = [ModelEntry(name="m", digest=DIGEST)]
    holder = LeaseInfo(worker="holder", token="t", slots=1, inventory=model, loaded=[DIGEST], cache=[slot])
    other = LeaseInfo(worker="other", token="t", slots=1, inventory=model, loaded=[DIGEST])
    await leases.put(other, 60_000)
    await leases.put(holder, 60_000)
    view = LiveView(redis_client, keys)
    turn = [
        Message(role="user", content="question " + "lorem ipsum " * 500),
        Message(role="assistant", content="answer " + "dolor sit " * 500),
        Message(role="user", content="and then?"),
    ]

    async def send(n: int) -> str:
        sub = await route_and_submit(queues, view, TaskMessage(model="m", messages=turn, task_id=f"turn{n}"))
        return sub.queue

    # Equal machines by their priors: the one whose slot holds the conversation wins by far.
    assert await send(1) == keys.pinned("holder")
    # Its lease still says what it said: it has not taken the first yet.
    assert await send(2) == keys.queue(DIGEST)
    # It took it (and its lease was written again), and the second went elsewhere (else the plan
    # gives it that slot first): the next may go straight to it.
    await redis_client.delete(keys.queue(DIGEST))
    await asyncio.sleep(0.06)
    await leases.put(msgspec.structs.replace(holder, renewed_at=holder.renewed_at + 1000), 60_000)
    assert await send(3) == keys.pinned("holder")
