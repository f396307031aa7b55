"""The ingest moves what a worker appends to its inbox into the ledger only when the worker speaks
for itself about runs it holds; anything else goes to the dead letters with the reason."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from events.codec import encode_fields
from events.connection import redis_client as redis_client_for
from events.event import (
    BenchmarkResult,
    Event,
    QualityScored,
    TaskClaimed,
    TaskCompleted,
    TaskExpired,
    TaskFailed,
    TaskSubmitted,
    Timings,
    WorkerOnline,
)
from events.keys import REQUEUED_CONSUMER, WORKERS_GROUP, Keys
from events.ledger import Ledger
from projections.benchset import REFERENCE, benchset
from projections.ingest import CLAIM_TTL_MS, Ingest, decode_claims
from tasks.payload import Message, Result, TaskMessage
from tasks.store import TaskStore
from workers.reaper import Reaper, ReaperConfig

DIGEST = "a" * 64
OTHER = "b" * 64

pytestmark = pytest.mark.cluster_tier


async def _inbox(redis: aioredis.Redis, keys: Keys, worker: str, *events: Event) -> None:
    await redis.sadd(keys.inboxes, worker)
    for event in events:
        await redis.xadd(keys.inbox(worker), encode_fields(event))  # type: ignore[arg-type]


async def _taken(queues: TaskStore, queue: str, worker: str, task_id: str, **fields: Any) -> TaskClaimed:
    """A task queued and taken by `worker`, and the claim it appends for it."""
    task = TaskMessage(
        task_id=task_id, model="m", digest=DIGEST, messages=[Message(role="user", content="hi")], **fields
    )
    await queues.enqueue(queue, task)
    taken = await queues.take(queue, worker)
    return TaskClaimed(
        task_id=task_id,
        worker=worker,
        digest=DIGEST,
        attempt=taken.attempt,
        queue=queue,
        entry_id=taken.entry_id,
    )


def _done(claim: TaskClaimed, **fields: Any) -> TaskCompleted:
    values: dict[str, Any] = {"timings": Timings(eval_count=100, eval_duration=10**9), **fields}
    return TaskCompleted(
        task_id=claim.task_id, worker=claim.worker, digest=claim.digest, attempt=claim.attempt, **values
    )


async def _ledger_events(ledger: Ledger) -> list[Event]:
    return [e async for _, e in ledger.read()]


async def _dead_reasons(redis: aioredis.Redis, keys: Keys) -> list[str]:
    rows: Any = await redis.xrange(keys.dead)
    return [fields[b"reason"].decode() for _, fields in rows if fields.get(b"source") == b"inbox"]


async def test_a_claimed_and_completed_run_is_moved_into_the_ledger_in_order_and_leaves_the_inbox(
    any_redis_url: str, keys: Keys
) -> None:
    redis_client = redis_client_for(any_redis_url)
    try:
        await _moved_in_order(redis_client, keys, Ledger(redis_client, keys))
    finally:
        await redis_client.aclose()


async def _moved_in_order(redis_client: aioredis.Redis, keys: Keys, ledger: Ledger) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    claim = await _taken(queues, keys.queue(DIGEST), "a", "t1")
    online = WorkerOnline(worker="a", slots=1)
    await _inbox(redis_client, keys, "a", online, claim, _done(claim))
    ingest = Ingest(redis_client, keys)
    assert await ingest.catch_up() == 3
    assert [type(e).__name__ for e in await _ledger_events(ledger)] == [
        "WorkerOnline",
        "TaskClaimed",
        "TaskCompleted",
    ]
    assert await redis_client.xlen(keys.inbox("a")) == 0
    assert await _dead_reasons(redis_client, keys) == []
    # Every claimed run of t1 completed: nothing of it is kept.
    assert await redis_client.hexists(keys.claims, "t1") == 0


async def test_an_event_naming_another_worker_is_dead_lettered_and_the_ingest_goes_on(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    claim = await _taken(queues, keys.queue(DIGEST), "a", "t1")
    forged = TaskCompleted(task_id="t1", worker="rtx3070ti", digest=DIGEST, attempt=1)
    await _inbox(redis_client, keys, "a", forged, claim, _done(claim))
    await Ingest(redis_client, keys).catch_up()
    assert [e.worker for e in await _ledger_events(ledger)] == ["a", "a"]  # type: ignore[attr-defined]
    assert await _dead_reasons(redis_client, keys) == [
        "TaskCompleted names worker 'rtx3070ti' but came from the inbox of 'a'"
    ]


async def test_a_completion_without_a_claim_and_a_second_completion_of_one_run_are_refused(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    claim = await _taken(queues, keys.queue(DIGEST), "a", "t1")
    unclaimed = TaskCompleted(task_id="t9", worker="a", digest=DIGEST, attempt=1)
    await _inbox(redis_client, keys, "a", unclaimed, claim, _done(claim), _done(claim, duplicate=True))
    await Ingest(redis_client, keys).catch_up()
    done = [e for e in await _ledger_events(ledger) if isinstance(e, TaskCompleted)]
    assert [(e.task_id, e.duplicate) for e in done] == [("t1", False)]
    reasons = await _dead_reasons(redis_client, keys)
    assert len(reasons) == 2
    assert all("no open claim by a of task" in r for r in reasons), reasons


async def test_a_claim_of_an_entry_another_worker_holds_or_of_a_task_not_in_it_is_refused(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    theirs = await _taken(queues, keys.queue(DIGEST), "b", "t1")
    mine = await _taken(queues, keys.queue(DIGEST), "a", "t2")
    stolen = TaskClaimed(
        task_id="t1", worker="a", digest=DIGEST, attempt=1, queue=theirs.queue, entry_id=theirs.entry_id
    )
    renamed = TaskClaimed(
        task_id="t1", worker="a", digest=DIGEST, attempt=1, queue=mine.queue, entry_id=mine.entry_id
    )
    await _inbox(redis_client, keys, "a", stolen, renamed, _done(stolen))
    await Ingest(redis_client, keys).catch_up()
    assert await _ledger_events(ledger) == []
    reasons = await _dead_reasons(redis_client, keys)
    assert reasons[0] == f"claims entry {theirs.entry_id} of {theirs.queue}, which b holds"
    assert reasons[1] == f"claims task t1 with entry {mine.entry_id}, which holds task t2"
    assert reasons[2].startswith("no open claim by a of task t1")


async def test_a_grade_counts_only_for_a_benchmark_run_the_worker_claimed_and_only_once(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    prompt = benchset()[0]
    bench = await _taken(queues, keys.pinned("a"), "a", "bench-b1-0", bench_id="b1", bench_prompt=prompt.id)
    shared = await _taken(queues, keys.queue(DIGEST), "a", "t1")

    def grade(task_id: str, **fields: Any) -> QualityScored:
        values: dict[str, Any] = {
            "digest": DIGEST,
            "domain": prompt.domain,
            "score": 0.0,
            "grader": REFERENCE,
            "task_id": task_id,
            "bench_id": "b1",
            "worker": "a",
            "prompt_id": prompt.id,
            **fields,
        }
        return QualityScored(**values)

    result = BenchmarkResult(
        bench_id="b1", worker="a", digest=DIGEST, task_id="bench-b1-0", prompt_id=prompt.id
    )
    await _inbox(
        redis_client,
        keys,
        "a",
        bench,
        shared,
        grade("bench-b1-9"),  # a benchmark task it never claimed
        grade("t1", bench_id=""),  # a user's task, not a benchmark's
        grade("bench-b1-0", grader="judge:big"),  # a judge's grade, which only an operator records
        grade("bench-b1-0", digest=OTHER),  # another model than the one it ran
        result,
        grade("bench-b1-0"),
        grade("bench-b1-0"),  # the same answer graded again
    )
    await Ingest(redis_client, keys).catch_up()
    events = await _ledger_events(ledger)
    assert [type(e).__name__ for e in events] == [
        "TaskClaimed",
        "TaskClaimed",
        "BenchmarkResult",
        "QualityScored",
    ]
    reasons = await _dead_reasons(redis_client, keys)
    assert len(reasons) == 5, reasons
    assert "no claim by a of benchmark task bench-b1-9" in reasons[0]
    assert "is not of a benchmark task" in reasons[1]
    assert "reference check" in reasons[2]
    assert "claimed bench-b1-0 for another model" in reasons[3]
    assert reasons[4] == "task bench-b1-0 was graded by reference already"


async def test_a_type_no_worker_writes_and_an_undecodable_entry_are_dead_lettered(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    submitted = TaskSubmitted(task_id="t1", model="m", digest=DIGEST, queue=keys.queue(DIGEST))
    await _inbox(redis_client, keys, "a", submitted, WorkerOnline(worker="a", slots=1))
    await redis_client.xadd(keys.inbox("a"), {"type": "TaskCompleted", "data": "garbage"})
    await Ingest(redis_client, keys).catch_up()
    assert [type(e).__name__ for e in await _ledger_events(ledger)] == ["WorkerOnline"]
    reasons = await _dead_reasons(redis_client, keys)
    assert reasons[0] == "a worker may not append TaskSubmitted"
    assert reasons[1].startswith("undecodable")
    assert await redis_client.xlen(keys.inbox("a")) == 0


async def test_claims_no_completion_closed_are_forgotten_after_a_day_and_others_are_kept(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    old = await _taken(queues, keys.queue(DIGEST), "a", "t1")
    await _inbox(redis_client, keys, "a", old, await _taken(queues, keys.queue(DIGEST), "a", "t2"))
    ingest = Ingest(redis_client, keys)
    await ingest.catch_up()
    assert set(await redis_client.hkeys(keys.claims)) == {b"t1", b"t2"}
    # The two claims may be seen a millisecond or more apart: none is a day old before the first is.
    seen = [c.at for v in await redis_client.hvals(keys.claims) for c in decode_claims(v)]
    assert await ingest.prune(min(seen) + CLAIM_TTL_MS - 1) == 0
    assert await ingest.prune(max(seen) + CLAIM_TTL_MS) == 2
    assert await redis_client.hlen(keys.claims) == 0


async def _pending_owners(redis: aioredis.Redis, queue: str) -> dict[str, str]:
    rows: Any = await redis.xpending_range(queue, WORKERS_GROUP, "-", "+", 100)
    return {r["message_id"].decode(): r["consumer"].decode() for r in rows}


async def test_the_ingest_finishes_the_entry_of_a_run_its_worker_closed_and_only_while_it_holds_it(
    any_redis_url: str, keys: Keys
) -> None:
    redis_client = redis_client_for(any_redis_url)
    try:
        await _finished_by_ingest(redis_client, keys, Ledger(redis_client, keys))
    finally:
        await redis_client.aclose()


async def _finished_by_ingest(redis_client: aioredis.Redis, keys: Keys, ledger: Ledger) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    queue = keys.queue(DIGEST)
    done = await _taken(queues, queue, "a", "t1")
    failed = await _taken(queues, queue, "a", "t2")
    retried = await _taken(queues, queue, "a", "t3")
    expired = await _taken(queues, queue, "a", "t4")
    taken_back = await _taken(queues, queue, "a", "t5")

    def failure(claim: TaskClaimed, retryable: bool) -> TaskFailed:
        return TaskFailed(
            task_id=claim.task_id,
            worker="a",
            digest=DIGEST,
            attempt=claim.attempt,
            kind="backend" if retryable else "bad_request",
            retryable=retryable,
        )

    await _inbox(redis_client, keys, "a", done, failed, retried, taken_back)
    ingest = Ingest(redis_client, keys)
    await ingest.catch_up()
    # A claim finishes nothing: all five are still held.
    assert len(await _pending_owners(redis_client, queue)) == 5
    # The reaper took t5 back (its worker seemed dead) before its completion arrived.
    await queues.requeue(queue, taken_back.entry_id, delivery_limit=3, owner="a")
    gone = TaskExpired(task_id="t4", queue=queue, worker="a", entry_id=expired.entry_id)
    await _inbox(
        redis_client,
        keys,
        "a",
        _done(done),
        failure(failed, retryable=False),
        failure(retried, retryable=True),
        gone,
        _done(taken_back),
    )
    await ingest.catch_up()
    assert ingest.finished == 3
    assert await _dead_reasons(redis_client, keys) == []
    # Completed, failed for good and expired: acknowledged and deleted. The retryable failure's
    # entry waits for its worker's re-queue; the run taken back stays with the re-queued entries.
    assert await _pending_owners(redis_client, queue) == {
        retried.entry_id: "a",
        taken_back.entry_id: REQUEUED_CONSUMER,
    }
    assert await redis_client.xlen(queue) == 2


async def test_an_expiry_of_an_entry_the_worker_does_not_hold_is_refused_and_finishes_nothing(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    queue = keys.queue(DIGEST)
    theirs = await _taken(queues, queue, "b", "t1")
    await queues.enqueue(queue, TaskMessage(task_id="t2", model="m", digest=DIGEST, messages=[]))
    queued: Any = await redis_client.xrange(queue, count=2)
    waiting = queued[1][0].decode()
    forged = [
        TaskExpired(task_id="t1", queue=queue, worker="a", entry_id=theirs.entry_id),
        TaskExpired(task_id="t2", queue=queue, worker="a", entry_id=waiting),
    ]
    await _inbox(redis_client, keys, "a", *forged)
    await Ingest(redis_client, keys).catch_up()
    assert await _ledger_events(ledger) == []
    assert await _dead_reasons(redis_client, keys) == [
        f"expires entry {theirs.entry_id} of {queue}, which b holds",
        f"expires entry {waiting} of {queue}, which nobody holds",
    ]
    assert await redis_client.xlen(queue) == 2


async def test_the_reaper_leaves_a_closed_run_to_the_ingest_and_takes_it_back_after_the_grace(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    queue = keys.queue(DIGEST)
    closed = await _taken(queues, queue, "a", "t1")
    open_run = await _taken(queues, queue, "a", "t2")
    await redis_client.sadd(keys.inboxes, "a")
    # Worker a completed t1 (its result stored, its events appended: the `logged` mark) and died
    # before the ingest moved them; t2 it never finished. Its lease is gone.
    own = TaskStore(redis_client, keys, ledger, writer="a")
    await own.close_run(Result(task_id="t1", status="completed", worker="a", attempt=closed.attempt))
    await redis_client.hset(keys.run_result("a", "t1"), "logged", "1")
    await asyncio.sleep(0.05)
    report = await Reaper(redis_client, keys, ReaperConfig(lease_ms=10, ingest_grace_ms=60_000)).sweep()
    assert (report.reclaimed, report.awaiting_ingest) == (1, 1)
    assert await _pending_owners(redis_client, queue) == {
        closed.entry_id: "a",
        open_run.entry_id: REQUEUED_CONSUMER,
    }
    # Past the grace, the owner's word that it closed the run is not trusted any more.
    report = await Reaper(redis_client, keys, ReaperConfig(lease_ms=10, ingest_grace_ms=20)).sweep()
    assert (report.reclaimed, report.awaiting_ingest) == (1, 0)
    assert set((await _pending_owners(redis_client, queue)).values()) == {REQUEUED_CONSUMER}


async def test_the_reaper_puts_back_an_entry_read_with_noack_on_every_redis(
    any_redis_url: str, keys: Keys
) -> None:
    redis_client = redis_client_for(any_redis_url)
    try:
        queues = TaskStore(redis_client, keys, Ledger(redis_client, keys))
        queue = keys.queue(DIGEST)
        task = TaskMessage(task_id="t1", model="m", digest=DIGEST, messages=[])
        entry = await queues.enqueue(queue, task)
        await redis_client.execute_command(
            "XREADGROUP", "GROUP", WORKERS_GROUP, "x", "NOACK", "STREAMS", queue, ">"
        )
        assert await _pending_owners(redis_client, queue) == {}
        report = await Reaper(redis_client, keys, ReaperConfig()).sweep()
        assert report.revived == 1
        assert await _pending_owners(redis_client, queue) == {entry: REQUEUED_CONSUMER}
        taken = await queues.take(queue, "a")
        assert (taken.entry_id, taken.attempt) == (entry, 2)
        assert (await Reaper(redis_client, keys, ReaperConfig()).sweep()).revived == 0
    finally:
        await redis_client.aclose()
