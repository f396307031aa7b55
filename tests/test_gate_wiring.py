"""The router's gate wired into the worker: the slow machine leaves work the fast one will do sooner."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from dispatch.submit import submit_task
from events.event import TaskClaimed, TaskCompleted
from events.keys import Keys
from events.ledger import Ledger
from sim.backends.hosts import SimHosts
from sim.fleetspec import parse_fleet
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import events_of, fast_config, running_agent, wait_until
from workers.admission import RouterGate

# One fast and one slow machine, both already measured, so the plan knows who is who.
FLEET = """
name = "two"
[model."m"]
digest = "7777777777777777777777777777777777777777777777777777777777777777"
output = { dist = "fixed", mean = 40 }
[[worker]]
name = "fast"
[worker.models."m"]
decode_tps = 400.0
prompt_tps = 5000.0
load_s = 0.0
[[worker]]
name = "slow"
[worker.models."m"]
decode_tps = 40.0
prompt_tps = 500.0
load_s = 0.0
"""


async def _measure(redis: aioredis.Redis, hosts: SimHosts, ledger: Ledger) -> None:
    """Run benchmark samples on both machines and fold them, as the projector would."""
    from projections.projector import Projector

    async with (
        running_agent(redis, hosts.url("fast"), fast_config("fast", auto_bench=True)),
        running_agent(redis, hosts.url("slow"), fast_config("slow", auto_bench=True)),
    ):
        await wait_until(lambda: _count(ledger, TaskCompleted, 6), timeout=30)
    projector = Projector(redis, Keys())
    assert await projector.acquire()
    await projector.start()
    await projector.catch_up()
    await projector.release()


async def _count(ledger: Ledger, kind: type, n: int) -> bool:
    return len(await events_of(ledger, kind)) >= n


async def test_with_one_task_and_the_fast_worker_free_soon_the_slow_worker_leaves_it(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, Keys(), ledger)
    async with SimHosts(parse_fleet(FLEET, "two.toml"), time_scale=1.0, seed=1) as hosts:
        await _measure(redis_client, hosts, ledger)
        before = len(await events_of(ledger, TaskClaimed))
        slow_gate = RouterGate(redis_client, Keys())
        fast_gate = RouterGate(redis_client, Keys())
        async with (
            running_agent(redis_client, hosts.url("slow"), fast_config("slow"), gate=slow_gate),
            running_agent(redis_client, hosts.url("fast"), fast_config("fast"), gate=fast_gate),
        ):
            for _ in range(3):
                await submit_task(
                    queues,
                    TaskMessage(model="m", messages=[Message(role="user", content="x")], max_tokens=40),
                )
                before += 1
                await wait_until(lambda n=before: _count(ledger, TaskClaimed, n), timeout=20)
                await asyncio.sleep(0.3)
        claims = (await events_of(ledger, TaskClaimed))[-3:]
    assert [c.worker for c in claims] == ["fast", "fast", "fast"]
    assert slow_gate.last is not None and not slow_gate.last.take


async def test_with_a_long_enough_backlog_the_slow_worker_takes_a_share(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, Keys(), ledger)
    async with SimHosts(parse_fleet(FLEET, "two.toml"), time_scale=1.0, seed=1) as hosts:
        await _measure(redis_client, hosts, ledger)
        before = len(await events_of(ledger, TaskClaimed))
        async with (
            running_agent(
                redis_client, hosts.url("slow"), fast_config("slow"), gate=RouterGate(redis_client, Keys())
            ),
            running_agent(
                redis_client, hosts.url("fast"), fast_config("fast"), gate=RouterGate(redis_client, Keys())
            ),
        ):
            msgs = [Message(role="user", content="x")]
            # The fast machine alone would need 2.4 s for these; the slow one finishes one in 1 s.
            await asyncio.gather(
                *(
                    submit_task(queues, TaskMessage(model="m", messages=msgs, max_tokens=40))
                    for _ in range(24)
                )
            )
            await wait_until(lambda: _count(ledger, TaskClaimed, before + 24), timeout=30)
        claims = (await events_of(ledger, TaskClaimed))[before:]
    by_worker = {w: sum(1 for c in claims if c.worker == w) for w in ("fast", "slow")}
    assert by_worker["slow"] >= 1, by_worker
    assert by_worker["fast"] > 3 * by_worker["slow"], by_worker
