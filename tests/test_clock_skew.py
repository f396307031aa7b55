"""A worker whose clock runs 90 s ahead: the tables and every age keep their meaning, and the fleet
flags that one worker."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import AppConfig
from dispatch.submit import submit_task
from dispatch.view import LiveView
from events.clock import redis_ms
from events.event import TaskClaimed, TaskCompleted, TaskExpired
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from projections.reader import get_tasks, snapshot
from sim.backends.hosts import SimHosts
from tasks.lease import decode_lease
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import MODEL_DIGEST, events_of, make_test_fleet, wait_until, worker_process
from tests.test_api_support import serving

AHEAD_MS = 90_000
TASKS = 8


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=3) as sim:
        yield sim


async def _entries(ledger: Ledger) -> list[tuple[int, Any]]:
    return [(int(entry_id.split("-")[0]), e) async for entry_id, e in ledger.read()]


async def test_a_worker_90_s_ahead_changes_no_age_in_the_tables_and_only_it_is_flagged_in_the_fleet(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts
) -> None:
    keys = Keys()
    queues = TaskStore(redis_client, keys, ledger)
    procs = {
        "a": worker_process(redis_url, hosts.url("a"), "a", clock_offset_ms=AHEAD_MS),
        "b": worker_process(redis_url, hosts.url("b"), "b"),
    }
    view = LiveView(redis_client, keys)
    started: list[int] = []

    async def a_runs_something() -> bool:
        # While `a` runs a task, the router reads its start on the ledger's clock: not 90 s ahead
        # (a running task that looks just started forever), not before the ledger recorded it.
        leases = await view.leases(fresh=True)
        now = await redis_ms(redis_client)
        for w in view.worker_views(leases):
            if w.name == "a" and w.running:
                started.append(now - w.running[0].started_at_ms)
        return bool(started)

    try:
        await wait_until(lambda: _live(redis_client, ("a", "b")), timeout=20)
        # Every task's deadline is 30 s of the ledger's clock away: a worker that judged it by
        # its own clock, 90 s ahead, would expire each one it took instead of running it.
        deadline = await redis_ms(redis_client) + 30_000
        for i in range(TASKS):
            request = TaskMessage(
                model="m",
                messages=[Message(role="user", content=f"question {i}")],
                max_tokens=200,  # 1 s each at the simulated 200 tok/s
                deadline_ms=deadline,
            )
            await submit_task(queues, request)
        await wait_until(a_runs_something, timeout=15, every=0.02)
        await wait_until(lambda: _done(ledger, TASKS), timeout=20)
        projector = Projector(redis_client, keys)
        await projector.start()
        await projector.catch_up()
        now = await redis_ms(redis_client)
        snap = await snapshot(redis_client, keys, now_ms=now)
        rows = await get_tasks(redis_client, keys, [e.task_id for e in await events_of(ledger, TaskClaimed)])
        async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as http:
            fleet = {w["id"]: w for w in (await http.get("/v1/fleet")).json()["workers"]}
            preview = (await http.get("/v1/route/preview", params={"model": "m", "tokens": 200})).json()
            seen = await redis_ms(redis_client)
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.wait(30)

    entries = await _entries(ledger)
    claims = [(ms, e) for ms, e in entries if isinstance(e, TaskClaimed)]
    assert not [e for _, e in entries if isinstance(e, TaskExpired)]
    assert {e.worker for _, e in claims} == {"a", "b"}
    # The shift is real: `a` stamps its events 90 s ahead of the stream ids; `b` does not.
    assert all(abs(e.at - ms - AHEAD_MS) < 5_000 for ms, e in claims if e.worker == "a")
    assert all(abs(e.at - ms) < 5_000 for ms, e in claims if e.worker == "b")
    assert started and all(0 <= s < 5_000 for s in started)

    for worker in ("a", "b"):
        decode = snap.speed[(worker, MODEL_DIGEST)].decode_tps
        assert decode.n >= 1 and decode.updated_at is not None
        # Sample times are the ledger's: seconds old, neither 90 s in the future nor stale.
        assert 0 <= now - decode.updated_at < 30_000
    # A task `a` ran is not claimed or finished 90 s from now in its row.
    assert {r.worker for r in rows.values()} == {"a", "b"}
    for r in rows.values():
        assert r.claimed_at is not None and r.finished_at is not None
        assert r.claimed_at <= r.finished_at <= now
    assert abs(snap.fleet["a"].clock_skew.value - AHEAD_MS) < 5_000  # type: ignore[operator]
    assert abs(snap.fleet["b"].clock_skew.value) < 5_000  # type: ignore[arg-type]

    assert fleet["a"]["clock_skewed"] is True and abs(fleet["a"]["clock_skew_s"] - 90) < 5
    assert fleet["b"]["clock_skewed"] is False and abs(fleet["b"]["clock_skew_s"]) < 5
    for worker in ("a", "b"):
        # Its lease's times, read on the ledger's clock: last seen seconds ago, not 90 s from now.
        assert fleet[worker]["status"] == "online"
        assert 0 <= seen - fleet[worker]["last_heartbeat"] < 5_000
        assert fleet[worker]["since"] <= seen
    # Both equally fast machines are ranked on their own fresh samples, alike: the shifted clock
    # neither ages `a`'s evidence away nor makes it look newer than `b`'s.
    fields = {c["worker"]: c["fields"]["decode_tps"] for c in preview["candidates"]}
    assert set(fields) == {"a", "b"}
    for f in fields.values():
        assert f["n"] >= 1 and 0 <= f["age_s"] < 30
    assert abs(fields["a"]["value"] - fields["b"]["value"]) < 0.2 * fields["b"]["value"]


async def _live(redis: aioredis.Redis, names: tuple[str, ...]) -> bool:
    for name in names:
        raw: Any = await redis.get(Keys().live(name))
        if raw is None or decode_lease(raw).ledger_offset_ms is None:
            return False
    return True


async def _done(ledger: Ledger, n: int) -> bool:
    return len([e async for _, e in ledger.read() if isinstance(e, TaskCompleted) and not e.duplicate]) >= n
