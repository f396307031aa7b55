"""Workers killed with SIGKILL at every step of a task: no task is lost, each completes once.

The kills come from the worker's own test hook (ROUTELEDGER_TEST_CRASH=POINT@N, see
workers/crash.py) rather than from outside at random times: an outside kill lands wherever the
scheduler happens to be, and on a loaded machine it rarely lands in the narrow windows that matter
(between storing the result and appending TaskCompleted, between TaskCompleted and the ack). The
hook hits each of them on purpose; which task of an incarnation dies is drawn at random.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from dispatch.submit import submit_task
from events.event import TaskClaimed, TaskCompleted, TaskDeadLettered, TaskFailed, TaskReclaimed
from events.keys import Keys
from events.ledger import Ledger
from projections.index import task_events
from sim.backends.hosts import SimHosts
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import events_of, make_test_fleet, running_projector, running_reaper, wait_until
from tests.reliability.support import counted_completions, queues_settled, spawn_worker, stop_all
from workers.crash import CRASH_POINTS

TASKS = 50
LIMIT = 10  # deliveries: high enough that a task crashed on again and again is never dead-lettered


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=7) as sim:
        yield sim


async def _live(redis: aioredis.Redis, *names: str) -> bool:
    return all([await redis.exists(Keys().live(n)) for n in names])


@pytest.mark.slow
async def test_workers_killed_at_every_step_of_fifty_tasks_lose_none_and_complete_each_once(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts, tmp_path: Path
) -> None:
    rng = random.Random(20240610)
    # Two rounds of every crash point, each on a random one of the incarnation's first four tasks.
    plans = [
        f"{CRASH_POINTS[i % len(CRASH_POINTS)]}@{rng.randint(1, 4)}" for i in range(2 * len(CRASH_POINTS))
    ]
    log = tmp_path / "workers.log"
    every: list[subprocess.Popen[bytes]] = []

    def spawn(name: str) -> subprocess.Popen[bytes]:
        proc = spawn_worker(
            redis_url, hosts.url(name), name, log, crash=plans.pop(0) if plans else None, delivery_limit=LIMIT
        )
        every.append(proc)
        return proc

    procs = {name: spawn(name) for name in ("a", "b")}
    restarts = 0
    try:
        await wait_until(lambda: _live(redis_client, "a", "b"), timeout=60)
        queues = TaskStore(redis_client, Keys(), ledger)
        async with running_reaper(redis_client, lease_ms=1500, delivery_limit=LIMIT):
            ids = []
            for i in range(TASKS):
                task = (
                    await submit_task(
                        queues,
                        TaskMessage(
                            model="m", messages=[Message(role="user", content=f"task {i}")], max_tokens=20
                        ),
                    )
                ).task
                ids.append(task.task_id)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                for name, proc in procs.items():
                    if proc.poll() is not None:
                        restarts += 1
                        procs[name] = spawn(name)  # as a supervisor would
                done = await counted_completions(ledger)
                if set(done) >= set(ids) and await queues_settled(redis_client, Keys()):
                    break
                await asyncio.sleep(0.2)
    finally:
        await asyncio.to_thread(stop_all, every)
    crashes = [
        line.split(" at ")[1].split()[0] for line in log.read_text().splitlines() if "test hook" in line
    ]
    counted = await counted_completions(ledger)
    lost = [t for t in ids if counted[t] == 0]
    twice = {t: n for t, n in counted.items() if n > 1}
    reclaims = await events_of(ledger, TaskReclaimed)
    print(
        f"\nworker kills: {len(crashes)} ({sorted(crashes)}), restarts {restarts}, reclaims {len(reclaims)}"
    )
    print(f"tasks {TASKS}: lost {len(lost)}, completed twice {len(twice)}")
    assert sorted(set(crashes)) == sorted(CRASH_POINTS), f"the hook fired at {crashes}"
    assert lost == [] and twice == {}
    assert set(counted) == set(ids)
    assert await events_of(ledger, TaskDeadLettered) == []


async def test_a_worker_killed_mid_task_and_restarted_says_in_the_tasks_history_why_it_runs_again(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts, tmp_path: Path
) -> None:
    # No reaper runs: the restarted worker re-queues what its previous life left (its pending
    # entry), and that re-run's reason must be in the ledger ahead of its claim.
    log = tmp_path / "workers.log"
    procs = [spawn_worker(redis_url, hosts.url("a"), "a", log, crash="stream@1")]
    try:
        await wait_until(lambda: _live(redis_client, "a"), timeout=60)
        queues = TaskStore(redis_client, Keys(), ledger)
        message = TaskMessage(
            model="m", messages=[Message(role="user", content="killed mid-task")], max_tokens=20
        )
        task_id = (await submit_task(queues, message)).task.task_id
        async with running_projector(redis_client):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (await counted_completions(ledger))[task_id]:
                if procs[-1].poll() is not None:
                    procs.append(spawn_worker(redis_url, hosts.url("a"), "a", log))  # as a supervisor would
                await asyncio.sleep(0.2)
            history = [event for _, event in (await task_events(redis_client, Keys(), task_id)).events]
    finally:
        await asyncio.to_thread(stop_all, procs)
    assert "kill -9 at stream of task #1" in log.read_text()
    claims = [i for i, e in enumerate(history) if isinstance(e, TaskClaimed)]
    assert [history[i].attempt for i in claims] == [1, 2]  # type: ignore[attr-defined]
    between = history[claims[0] + 1 : claims[1]]
    reasons = [e for e in between if isinstance(e, TaskFailed)]
    assert [(e.kind, e.retryable, e.attempt) for e in reasons] == [("interrupted", True, 1)]
    assert "restarted" in reasons[0].message
    assert not [e for e in history if isinstance(e, TaskReclaimed)]
    assert isinstance(history[-1], TaskCompleted)
