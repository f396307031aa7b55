"""Redis killed with SIGKILL mid-run and restarted on its AOF: acknowledged tasks survive, once each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from dispatch.submit import submit_task
from events.keys import Keys
from events.ledger import Ledger
from routeledger.embedded import EmbeddedRedis
from sim.backends.hosts import SimHosts
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import make_test_fleet, wait_until
from tests.reliability.support import (
    counted_completions,
    describe_queues,
    queues_settled,
    reaper_process,
    spawn_worker,
    stop_all,
)

# Appendfsync everysec loses at most about a second of writes: tasks acknowledged this long before
# the kill must survive it.
SAFE_BEFORE_KILL_S = 2.0


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=11) as sim:
        yield sim


async def _submit_for(
    queues: TaskStore, seconds: float, every: float, acked: dict[str, float], label: str
) -> int:
    """Submit a task every `every` s for `seconds` s; record when each submission returned."""
    refused = 0
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        try:
            task = (
                await submit_task(
                    queues,
                    TaskMessage(
                        model="m", messages=[Message(role="user", content=f"{label} {i}")], max_tokens=60
                    ),
                )
            ).task
            acked[task.task_id] = time.monotonic()
        except (RedisError, OSError):
            refused += 1  # Redis is down: not acknowledged, so nothing is promised
        except Exception as exc:
            if type(exc).__name__ != "ModelNotServedError":
                raise
            refused += 1  # just restarted: the workers' leases are back within a heartbeat
        await asyncio.sleep(every)
    return refused


@pytest.mark.slow
async def test_tasks_acknowledged_two_seconds_before_redis_is_killed_complete_once_after_its_restart(
    fresh_server: EmbeddedRedis, hosts: SimHosts, tmp_path: Path
) -> None:
    url = fresh_server.url
    log = tmp_path / "processes.log"
    procs = [spawn_worker(url, hosts.url(name), name, log) for name in ("a", "b")]
    procs.append(reaper_process(url, log))
    client = aioredis.Redis.from_url(url)
    ledger = Ledger(client, Keys())
    queues = TaskStore(client, Keys(), ledger)
    acked: dict[str, float] = {}
    try:
        await wait_until(lambda: _live(client), timeout=60)
        # Submissions go on while Redis dies and comes back.
        submitting = asyncio.create_task(_submit_for(queues, 9.0, 0.1, acked, "task"))
        await asyncio.sleep(4.0)
        killed_at = time.monotonic()
        fresh_server.kill()
        await asyncio.sleep(1.5)
        await asyncio.to_thread(fresh_server.restart)
        refused = await submitting
        must = sorted(t for t, at in acked.items() if at < killed_at - SAFE_BEFORE_KILL_S)
        after = sorted(t for t, at in acked.items() if at > killed_at)

        async def settled() -> bool:
            done = await counted_completions(ledger)
            return set(done) >= set(must) | set(after) and await queues_settled(client, Keys())

        try:
            await wait_until(settled, timeout=90, every=0.25)
        except AssertionError:
            done = await counted_completions(ledger)
            missing = [t for t in [*must, *after] if not done[t]]
            raise AssertionError(
                f"not completed: {missing}; queues: {await describe_queues(client, Keys())}; "
                f"log: {log.read_text()[-3000:]}"
            ) from None
        counted = await counted_completions(ledger)
        alive = [p.poll() is None for p in procs]
    finally:
        await asyncio.to_thread(stop_all, procs)
        await client.aclose()
    window = len(acked) - len(must) - len(after)
    lost = [t for t in must if counted[t] == 0]
    print(
        f"\nredis kill -9: {len(acked)} acknowledged, {len(must)} more than 2 s before the kill, "
        f"{window} within 2 s, {len(after)} after; {refused} refused while down; lost {len(lost)}; "
        f"completed twice {sum(1 for n in counted.values() if n > 1)}"
    )
    assert len(must) >= 10 and after, "the run should straddle the kill"
    assert lost == []
    assert all(n == 1 for n in counted.values())
    assert alive == [True, True, True], "workers and reaper reconnect by themselves"


async def _live(redis: aioredis.Redis) -> bool:
    return all([await redis.exists(Keys().live(n)) for n in ("a", "b")])
