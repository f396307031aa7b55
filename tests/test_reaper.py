"""The reaper's rule for a live worker's entries: judged by the longer of its lease and the worker's."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from events.event import TaskReclaimed
from events.keys import Keys
from events.ledger import Ledger
from tasks.lease import LeaseInfo, Leases
from tasks.payload import TaskMessage
from tasks.store import TaskStore
from tests.helpers import MODEL_DIGEST, events_of
from workers.reaper import Reaper, ReaperConfig

pytestmark = pytest.mark.cluster_tier

REAPER_LEASE_MS = 100


async def _taken_by_a_live_worker(
    redis: aioredis.Redis, keys: Keys, ledger: Ledger, worker_lease_ms: int | None
) -> tuple[str, str]:
    """A task taken by live worker `w` whose lease record does not list it yet (a plain-gate
    worker lists a run from its next heartbeat); (queue, entry id)."""
    queues = TaskStore(redis, keys, ledger)
    queue = keys.queue(MODEL_DIGEST)
    await queues.enqueue(queue, TaskMessage(task_id="t", model="m", digest=MODEL_DIGEST))
    info = LeaseInfo(worker="w", token="tok", slots=1, lease_ms=worker_lease_ms)
    assert (await Leases(redis, keys).put(info, 60_000)).ok
    taken = await queues.take(queue, "w")
    assert taken.entry_id
    return queue, taken.entry_id


async def test_a_live_workers_run_is_not_taken_by_a_reaper_whose_lease_is_shorter_than_the_workers(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queue, _ = await _taken_by_a_live_worker(redis_client, keys, ledger, worker_lease_ms=1500)
    await asyncio.sleep(3 * REAPER_LEASE_MS / 1000)  # past two of the reaper's leases, within the worker's
    report = await Reaper(redis_client, keys, ReaperConfig(lease_ms=REAPER_LEASE_MS)).sweep()
    assert report.reclaimed == 0
    assert await events_of(ledger, TaskReclaimed) == []
    assert len(await ledger.pending(queue, consumer="w")) == 1


@pytest.mark.parametrize("worker_lease_ms", [None, REAPER_LEASE_MS])
async def test_an_entry_a_live_worker_let_go_is_reclaimed_after_two_of_the_longer_lease(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger, worker_lease_ms: int | None
) -> None:
    # None: a worker from before leases carried their length is judged by the reaper's own.
    queue, entry_id = await _taken_by_a_live_worker(redis_client, keys, ledger, worker_lease_ms)
    await asyncio.sleep(3 * REAPER_LEASE_MS / 1000)
    report = await Reaper(redis_client, keys, ReaperConfig(lease_ms=REAPER_LEASE_MS)).sweep()
    assert report.reclaimed == 1
    reclaims = await events_of(ledger, TaskReclaimed)
    assert [(r.task_id, r.owner, r.old_entry) for r in reclaims] == [("t", "w", entry_id)]
    assert await ledger.pending(queue, consumer="w") == []


async def test_a_dead_workers_entry_is_reclaimed_with_its_reason_in_the_ledger(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    queue = keys.queue(MODEL_DIGEST)
    await queues.enqueue(queue, TaskMessage(task_id="t", model="m", digest=MODEL_DIGEST))
    assert (await queues.take(queue, "gone")).entry_id  # taken by a worker with no lease: dead
    await asyncio.sleep(3 * REAPER_LEASE_MS / 1000)
    report = await Reaper(redis_client, keys, ReaperConfig(lease_ms=REAPER_LEASE_MS)).sweep()
    assert report.reclaimed == 1
    (reclaim,) = await events_of(ledger, TaskReclaimed)
    assert reclaim.attempt == 2 and "its worker gone died (lease expired" in reclaim.reason


async def test_a_dead_workers_entry_whose_client_withdrew_it_is_finished_not_reclaimed(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    queue = keys.queue(MODEL_DIGEST)
    await queues.enqueue(queue, TaskMessage(task_id="t", model="m", digest=MODEL_DIGEST))
    assert (await queues.take(queue, "gone")).entry_id
    await redis_client.set(keys.cancel("t"), b"1")  # its client cancelled it while it ran
    await asyncio.sleep(3 * REAPER_LEASE_MS / 1000)
    report = await Reaper(redis_client, keys, ReaperConfig(lease_ms=REAPER_LEASE_MS)).sweep()
    assert (report.reclaimed, report.withdrawn) == (0, 1)
    assert await events_of(ledger, TaskReclaimed) == []
    assert await redis_client.xlen(queue) == 0 and await ledger.pending(queue) == []
    result = await queues.result("t")
    assert result is not None and result.status == "cancelled"
