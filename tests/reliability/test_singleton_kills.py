"""The projector and the reaper killed with SIGKILL while work flows, then restarted: the tables
equal a fresh rebuild (`routeledger replay verify` exits 0)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from dispatch.submit import submit_task
from events.event import TaskClaimed, TaskCompleted, TaskReclaimed
from events.keys import Keys
from events.ledger import Ledger
from projections import store
from projections.reader import lag
from sim.backends.hosts import SimHosts
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import events_of, fast_config, make_test_fleet, running_agent, wait_until
from tests.reliability.support import (
    counted_completions,
    describe_queues,
    queues_settled,
    spawn_worker,
    stop_all,
)

ROUNDS = 3
TASKS_PER_ROUND = 10


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    # Four times slower than real: 0.8 s a task, so that a kill lands mid-run.
    async with SimHosts(make_test_fleet(), time_scale=4.0, seed=13) as sim:
        yield sim


def singleton(role: str, redis_url: str, log: Path) -> subprocess.Popen[bytes]:
    """`routeledger projector` or `routeledger reaper`, with short leases."""
    env = {
        **os.environ,
        "ROUTELEDGER_LEASE_MS": "1500",
        "ROUTELEDGER_HEARTBEAT_MS": "300",
        "ROUTELEDGER_LOG_LEVEL": "warning",
    }
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "routeledger", role, "--redis-url", redis_url],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )


async def _caught_up(redis: aioredis.Redis) -> bool:
    return await store.current(redis, Keys()) is not None and await lag(redis, Keys()) == (0, 0)


@pytest.mark.slow
async def test_the_projector_and_reaper_killed_and_restarted_leave_tables_equal_to_a_rebuild(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts, tmp_path: Path
) -> None:
    rng = random.Random(4242)
    log = tmp_path / "singletons.log"
    queues = TaskStore(redis_client, Keys(), ledger)
    every: list[subprocess.Popen[bytes]] = []
    ids: list[str] = []
    kills = 0
    # Worker `a` is a process, killed once mid-run so that the reaper has something to reclaim.
    victim = spawn_worker(redis_url, hosts.url("a"), "a", log)
    every.append(victim)
    try:
        async with running_agent(redis_client, hosts.url("b"), fast_config("b")):
            await wait_until(lambda: _exists(redis_client, Keys().live("a")), timeout=60)
            for round_ in range(ROUNDS):
                procs = [singleton("projector", redis_url, log), singleton("reaper", redis_url, log)]
                every += procs
                for i in range(TASKS_PER_ROUND):
                    task = (
                        await submit_task(
                            queues,
                            TaskMessage(
                                model="m",
                                messages=[Message(role="user", content=f"round {round_} task {i}")],
                                max_tokens=60,
                            ),
                        )
                    ).task
                    ids.append(task.task_id)
                    await asyncio.sleep(rng.uniform(0.05, 0.25))
                    if victim.poll() is None and await _running_on(ledger, "a"):
                        victim.send_signal(signal.SIGKILL)
                for proc in procs:
                    await asyncio.sleep(rng.uniform(0.0, 0.5))
                    proc.send_signal(signal.SIGKILL)
                    kills += 1
                for proc in procs:
                    await asyncio.to_thread(proc.wait, 10)
            final = [singleton("projector", redis_url, log), singleton("reaper", redis_url, log)]
            every += final

            async def settled() -> bool:
                done = await counted_completions(ledger)
                return set(done) >= set(ids) and await queues_settled(redis_client, Keys())

            try:
                await wait_until(settled, timeout=90, every=0.25)
            except AssertionError:
                queues_now = await describe_queues(redis_client, Keys())
                raise AssertionError(
                    f"tasks unsettled: {queues_now}; log: {log.read_text()[-2000:]}"
                ) from None
        # The worker's offline event and the last heartbeats are folded too.
        try:
            await wait_until(lambda: _caught_up(redis_client), timeout=60, every=0.1)
        except AssertionError:
            behind = await lag(redis_client, Keys()) if await store.current(redis_client, Keys()) else None
            raise AssertionError(f"projector lag {behind}; log: {log.read_text()[-2000:]}") from None
        verify = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "routeledger", "replay", "verify", "--redis-url", redis_url,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(verify.communicate(), 120)
    finally:
        await asyncio.to_thread(stop_all, every)
    reclaims = await events_of(ledger, TaskReclaimed)
    print(f"\nprojector and reaper kills: {kills}; tasks {len(ids)}; reclaims {len(reclaims)}")
    assert verify.returncode == 0, out.decode()
    # The task `a` died with ran again elsewhere. (Its TaskReclaimed may be missing: a reaper killed
    # between the re-queue script and the append leaves the move done and unrecorded.)
    reruns = [e for e in await events_of(ledger, TaskCompleted) if e.worker == "b" and e.attempt >= 2]
    assert victim.returncode == -signal.SIGKILL
    assert reruns, "the killed worker's task was reclaimed and run again"
    counted = await counted_completions(ledger)
    assert all(counted[t] == 1 for t in ids)


async def _exists(redis: aioredis.Redis, key: str) -> bool:
    return bool(await redis.exists(key))


async def _running_on(ledger: Ledger, worker: str) -> bool:
    claimed = {c.task_id for c in await events_of(ledger, TaskClaimed) if c.worker == worker}
    return bool(claimed - {e.task_id for e in await events_of(ledger, TaskCompleted)})
