"""The queue scripts that make dispatch exact: take one, re-queue in place, submit once, finish only
what is one's own, cancel by the task's index, and a dead letter that gives way to a late success."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from dispatch.submit import submit_task
from events.event import Event, TaskCompleted, TaskSubmitted, now_ms
from events.keys import REQUEUED_CONSUMER, Keys
from events.ledger import Ledger
from router.choose import learned_tokens
from tasks.payload import (
    F_TASK,
    Chunk,
    Message,
    Result,
    TaskMessage,
    chunk_decoder,
    decode_task,
    estimate_tokens,
)
from tasks.store import (
    CANCEL_REMOVED,
    CANCEL_RUNNING,
    NOT_OURS,
    OVER_LIMIT,
    REQUEUED,
    Completion,
    QueueEntry,
    TaskStore,
    parse_entry,
)
from tests.helpers import events_of

DIGEST = "ab" * 32
# A prompt router.choose.classify_domain reads as code.
CODE = "def add(a, b):\n    return a + b  # fix this Python function"

pytestmark = pytest.mark.cluster_tier


def _task(n: int) -> TaskMessage:
    return TaskMessage(
        task_id=f"t{n}", model="m", digest=DIGEST, messages=[Message(role="user", content=f"hi {n}")]
    )


async def _submit(queues: TaskStore, n: int) -> str:
    queue = queues.keys.queue(DIGEST)
    task = _task(n)
    event = TaskSubmitted(task_id=task.task_id, model="m", digest=DIGEST, queue=queue)
    created, entry = await queues.submit(queue, task, [event], {"queue": queue})
    assert created
    return entry


async def test_a_task_submitted_twice_under_one_id_is_queued_and_recorded_once(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    queue = keys.queue(DIGEST)
    task = _task(1)
    event = TaskSubmitted(task_id=task.task_id, model="m", digest=DIGEST, queue=queue)
    first = await queues.submit(queue, task, [event], {"queue": queue})
    again = await queues.submit(queue, task, [event], {"queue": queue})
    assert first[0] is True and again == (False, first[1])
    assert await redis_client.xlen(queue) == 1
    assert len(await events_of(ledger, TaskSubmitted)) == 1
    assert (await redis_client.hget(keys.task("t1"), "entry")).decode() == first[1]
    assert await redis_client.sismember(keys.queues, queue)


async def test_a_worker_takes_exactly_the_head_its_gate_decided_on_and_nothing_else(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    queues = TaskStore(redis_client, keys)
    queue = keys.queue(DIGEST)
    first, second = await _submit(queues, 1), await _submit(queues, 2)
    # The gate decided on the second entry, but the first is still the head: nothing is taken.
    stale = await queues.take(queue, "w1", expected=second)
    assert stale.entry_id == "" and stale.cursor == second
    taken = await queues.take(queue, "w1", expected=first)
    assert (taken.entry_id, taken.attempt) == (first, 1)
    # Another worker that decided on the first too finds it gone and takes nothing.
    assert (await queues.take(queue, "w2", expected=first)).entry_id == ""
    assert (await queues.take(queue, "w2", expected=second)).entry_id == second
    assert (await queues.take(queue, "w2")).entry_id == ""


async def test_a_requeued_task_keeps_its_place_ahead_of_newer_work_with_its_next_attempt(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    queues = TaskStore(redis_client, keys)
    queue = keys.queue(DIGEST)
    first = await _submit(queues, 1)
    assert (await queues.take(queue, "w1")).entry_id == first
    second = await _submit(queues, 2)
    moved = await queues.requeue(queue, first, delivery_limit=3, owner="w1", attempt=1)
    assert (moved.status, moved.new_entry, moved.attempt, moved.task_id) == (REQUEUED, first, 2, "t1")
    # The re-queued task is the head again, before the newer one.
    assert (await queues.take(queue, "w2", expected=second)).entry_id == ""
    again = await queues.take(queue, "w2", expected=first)
    assert (again.entry_id, again.attempt) == (first, 2)
    assert (await queues.take(queue, "w2")).entry_id == second


async def test_a_requeue_sent_again_after_its_reply_was_lost_reports_the_same_move(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    queues = TaskStore(redis_client, keys)
    queue = keys.queue(DIGEST)
    entry = await _submit(queues, 1)
    await queues.take(queue, "w1")
    first = await queues.requeue(queue, entry, delivery_limit=3, owner="w1", attempt=1)
    again = await queues.requeue(queue, entry, delivery_limit=3, owner="w1", attempt=1)
    assert first == again and first.status == REQUEUED
    # Taken again by another worker meanwhile: the re-send still reports the move it made.
    await queues.take(queue, "w2")
    assert (await queues.requeue(queue, entry, delivery_limit=3, owner="w1", attempt=1)).status == REQUEUED
    # Without the attempt it ran, a caller that does not hold the entry is told so.
    assert (await queues.requeue(queue, entry, delivery_limit=3, owner="w1")).status == NOT_OURS


async def test_a_task_past_its_delivery_limit_is_not_moved(redis_client: aioredis.Redis, keys: Keys) -> None:
    queues = TaskStore(redis_client, keys)
    queue = keys.queue(DIGEST)
    entry = await _submit(queues, 1)
    for attempt, worker in ((1, "w1"), (2, "w2")):
        assert (await queues.take(queue, worker)).attempt == attempt
        assert (
            await queues.requeue(queue, entry, delivery_limit=3, owner=worker, attempt=attempt)
        ).status == 1
    assert (await queues.take(queue, "w3")).attempt == 3
    over = await queues.requeue(queue, entry, delivery_limit=3, owner="w3", attempt=3)
    assert (over.status, over.attempt) == (OVER_LIMIT, 3)


async def test_a_run_that_lost_its_entry_cannot_remove_it_from_the_queue(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    queues = TaskStore(redis_client, keys)
    queue = keys.queue(DIGEST)
    entry = await _submit(queues, 1)
    await queues.take(queue, "w1")
    await queues.requeue(queue, entry, delivery_limit=3, owner="w1", attempt=1)
    # w1's late finish: the entry waits re-queued, and stays.
    assert await queues.finish(queue, entry, "w1") == 0
    assert (await queues.take(queue, "w2")).entry_id == entry
    assert await queues.finish(queue, entry, "w2") == 1
    assert await redis_client.xlen(queue) == 0


async def test_cancelling_finds_the_entry_by_its_index_and_spares_a_running_one(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    queues = TaskStore(redis_client, keys)
    queue = keys.queue(DIGEST)
    waiting, running, requeued = await _submit(queues, 1), await _submit(queues, 2), await _submit(queues, 3)
    await queues.take(queue, "w1", expected=waiting)
    await queues.take(queue, "w1", expected=running)
    await queues.take(queue, "w1", expected=requeued)
    await queues.requeue(queue, requeued, delivery_limit=3, owner="w1", attempt=1)
    await queues.requeue(queue, waiting, delivery_limit=3, owner="w1", bump=False, attempt=1)
    assert (await queues.cancel_queued(queue, running))[0] == CANCEL_RUNNING
    assert await queues.cancel_queued(queue, requeued) == (CANCEL_REMOVED, requeued, 2)
    assert await queues.cancel_queued(queue, waiting) == (CANCEL_REMOVED, waiting, 1)
    assert (await queues.cancel_queued(queue, waiting))[0] == 0
    pending = await redis_client.xpending(queue, "workers")
    assert pending["pending"] == 1
    assert [c["name"] for c in pending["consumers"]] == [b"w1"]
    assert REQUEUED_CONSUMER not in {c["name"].decode() for c in pending["consumers"]}


async def test_a_genuine_completion_replaces_a_dead_letter_but_nothing_else(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    queues = TaskStore(redis_client, keys)
    dead = Result(task_id="t1", status="dead", attempt=3, error="delivery limit 3 reached")
    late = Result(task_id="t1", status="completed", worker="w1", attempt=1, text="ok", run="r1")
    assert await queues.record_result(dead)
    assert await queues.close_run(late, only_over_dead=True)
    # A second completion, and a lost run's completion over a completion, count for nothing.
    assert not await queues.close_run(Result(task_id="t1", status="completed", attempt=2, text="x"))
    assert not await queues.close_run(late, only_over_dead=True)
    # A lost run stores nothing where no outcome is: the task's new run answers.
    assert not await queues.close_run(
        Result(task_id="t2", status="completed", attempt=1, text="y"), only_over_dead=True
    )
    assert await redis_client.hget(keys.result("t1"), "status") == b"completed"
    assert not await redis_client.exists(keys.result("t2"))


async def test_a_worker_the_plan_gave_task_k_takes_the_head_if_at_most_k_minus_1_went_to_others(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    queues = TaskStore(redis_client, keys)
    queue = keys.queue(DIGEST)
    first, second, third, _ = [await _submit(queues, n) for n in range(4)]
    # w2 decided on the head `first` with the plan giving it task #2; w1 took `first` meanwhile.
    assert (await queues.take(queue, "w1")).entry_id == first
    assert (await queues.take(queue, "w2", expected=first, slack=0)).entry_id == ""
    assert (await queues.take(queue, "w2", expected=first, slack=1)).entry_id == second
    # Given task #2 when `second` was the head, but two were taken since: its place is gone.
    assert (await queues.take(queue, "w1")).entry_id == third
    assert (await queues.take(queue, "w3", expected=second, slack=1)).entry_id == ""
    # A decision about an entry behind the head is never taken for the head.
    assert (await queues.take(queue, "w3", expected="9999999999999-0", slack=3)).entry_id == ""


async def test_a_models_depth_counts_the_entries_of_its_plain_queue_and_of_every_band_queue(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    queues = TaskStore(redis_client, keys)
    assert await queues.depth(DIGEST) == 0
    # Priority 0 in round 0 joins the plain queue; the others join band queues of the model.
    for name, priority, share_round in [("plain", 0, 0), ("high", 9, 0), ("late", 0, 2), ("low", -3, 0)]:
        req = TaskMessage(
            model="m",
            messages=[Message(role="user", content=name)],
            task_id=name,
            priority=priority,
            share_round=share_round,
        )
        await submit_task(queues, req, digest=DIGEST)
    assert await redis_client.zcard(keys.bands(DIGEST)) == 3
    assert await queues.depth(DIGEST) == 4
    # A taken entry is still held until it is finished; a finished one is gone.
    high = keys.band_queue(DIGEST, 9, 0)
    taken = await queues.take(high, "w1")
    assert await queues.depth(DIGEST) == 4
    assert await queues.finish(high, taken.entry_id, "w1") == 1
    assert await queues.depth(DIGEST) == 3
    assert await queues.depth("cd" * 32) == 0  # another model's


async def _taken(queues: TaskStore, n: int, owner: str) -> QueueEntry:
    entry = await _submit(queues, n)
    queue = queues.keys.queue(DIGEST)
    taken = await queues.take(queue, owner, expected=entry)
    assert taken.entry_id == entry
    return parse_entry(queue, taken.entry_id, taken.fields, taken.attempt)


def _completed(n: int, attempt: int, counts: bool) -> list[Event]:
    return [TaskCompleted(task_id=f"t{n}", worker="w1", digest=DIGEST, attempt=attempt)] if counts else []


async def test_a_run_closes_in_one_call_its_outcome_its_completion_its_done_chunk_and_its_entry(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    entry = await _taken(queues, 1, "w1")
    steps: list[str] = []
    result = Result(task_id="t1", status="completed", worker="w1", attempt=1, text="hello", run="r1")

    async def no_room(what: str, rounds: int) -> None:
        raise AssertionError(f"Redis had room, yet {what} waited")

    closed = await queues.complete(
        result,
        rest="lo",
        done=Chunk(attempt=1, done=True, run="r1"),
        closing=lambda counts: _completed(1, 1, counts),
        entry=entry,
        owner="w1",
        wait_for_room=no_room,
        at=steps.append,
    )
    assert closed.counts and closed.acked == 1
    assert steps == ["result", "ack"]
    assert (await queues.result("t1")) == result
    assert await redis_client.hget(keys.result("t1"), "logged") == b"1"
    assert [e.task_id for e in await events_of(ledger, TaskCompleted)] == ["t1"]
    rows: Any = await redis_client.xrange(keys.out("t1"))
    chunks = [chunk_decoder.decode(fields[b"c"]) for _, fields in rows]
    assert [(c.text, c.done) for c in chunks] == [("lo", False), ("", True)]
    assert await redis_client.xlen(keys.queue(DIGEST)) == 0


async def test_a_close_that_finds_an_outcome_logged_by_nobody_counts_its_own_completion_once(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    entry = await _taken(queues, 1, "w1")
    # An earlier run stored its outcome and died before it appended its TaskCompleted.
    assert await queues.close_run(Result(task_id="t1", status="completed", worker="w0", attempt=1, text="a"))

    async def no_room(what: str, rounds: int) -> None:
        raise AssertionError(what)

    async def close(attempt: int, acknowledge: bool) -> Completion:
        return await queues.complete(
            Result(task_id="t1", status="completed", worker="w1", attempt=attempt, text="b"),
            rest="",
            done=Chunk(attempt=attempt, done=True),
            closing=lambda counts: _completed(1, attempt, counts),
            entry=entry,
            owner="w1",
            acknowledge=acknowledge,
            wait_for_room=no_room,
        )

    first = await close(1, acknowledge=True)
    assert first.counts and first.acked == 1
    # The run's outcome never replaces the stored one, and a later close counts nothing more.
    again = await close(1, acknowledge=False)
    assert not again.counts and again.acked is None
    assert (await queues.result("t1")).text == "a"  # type: ignore[union-attr]
    assert len(await events_of(ledger, TaskCompleted)) == 1


async def test_a_submitted_task_is_queued_filled_in_and_without_what_only_its_submission_reads(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    req = TaskMessage(
        model="m",
        messages=[
            Message(role="user", content="def add(a, b):\n    return a + b  # fix this Python function")
        ],
        client="cli",
        runtime_options=True,
        key="team-a",
        split_of="whole",
        part=1,
        parts=3,
        bytes_per_token=2.0,
        submitted_at=1,
    )
    before = now_ms()
    sub = await submit_task(queues, req, digest=DIGEST)
    queued = decode_task((await redis_client.xrange(sub.queue))[0][1][F_TASK])
    # Filled in: a drawn id, the digest, the classified domain, the size (at the learned ratio),
    # and the time of submission, not of the request's making.
    assert queued == sub.task and len(queued.task_id) == 32 and queued.digest == DIGEST
    assert queued.domain == "code" and queued.submitted_at >= before
    assert queued.prompt_tokens == learned_tokens(len(CODE.encode()), 2.0) != estimate_tokens(CODE)
    # Cleared: its entry holds what a worker reads, no more.
    assert (queued.client, queued.runtime_options, queued.key, queued.split_of) == (None, False, None, None)
    assert (queued.part, queued.parts, queued.bytes_per_token) == (0, 1, None)
    (submitted,) = await events_of(ledger, TaskSubmitted)
    assert (submitted.client, submitted.runtime_options, submitted.key) == ("cli", True, "team-a")
    assert (submitted.split_of, submitted.part, submitted.parts) == ("whole", 1, 3)
    assert submitted.domain == "code" and sub.key == "team-a"


async def test_an_explicit_domain_is_kept_general_included(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    code = [Message(role="user", content=CODE)]
    sub = await submit_task(queues, TaskMessage(model="m", messages=code, domain="general"), digest=DIGEST)
    assert sub.task.domain == "general"
    assert decode_task((await redis_client.xrange(sub.queue))[0][1][F_TASK]).domain == "general"
