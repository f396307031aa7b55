"""Liveness lives in leases, the ledger records changes and decisions: agents, the reaper, TaskRouted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import polars as pl
import pytest
import redis.asyncio as aioredis

from dispatch.gateway import Gateway
from dispatch.recent import load_recent
from dispatch.submit import route_and_submit, submit_task
from dispatch.view import LiveView
from events.codec import event_fields
from events.event import (
    Event,
    ModelEntry,
    Resources,
    TaskRouted,
    TaskSubmitted,
    WorkerChanged,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
    now_ms,
)
from events.keys import Keys
from events.ledger import Ledger
from projections import store
from projections.projector import Projector
from projections.reader import snapshot
from replay.rebuild import build
from replay.verify import diff_tables
from router.choose import Decision, RouteQuery, decide
from router.plan import FleetView
from sim.backends.hosts import SimHosts
from tasks.lease import LeaseInfo, Leases, decode_lease, registered
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import MODEL_DIGEST, events_of, fast_config, make_test_fleet, running_agent, wait_until
from tests.router_helpers import NOW, QWEN, estimator, speed_row, worker
from tests.router_helpers import snapshot as router_snapshot
from tests.test_api_support import fleet_and_api
from tests.test_projector import D1, T0, completed
from workers.liveness import Liveness
from workers.reaper import LEASE_EXPIRED, Reaper, ReaperConfig

RL = (sys.executable, "-m", "routeledger")
WORKER_EVENTS = (WorkerOnline, WorkerChanged, WorkerHeartbeat, WorkerOffline)

pytestmark = pytest.mark.cluster_tier


async def worker_events(ledger: Ledger) -> list[Event]:
    return [e async for _, e in ledger.read() if isinstance(e, WORKER_EVENTS)]


# -- the agent ----------------------------------------------------------------------------------


async def test_a_running_worker_appends_no_periodic_events_only_its_online_and_its_changes(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    keys = Keys.for_client(redis_client)
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a", heartbeat_ms=100)):
            first = decode_lease(await redis_client.get(keys.live("a")))
            await asyncio.sleep(1.5)  # about fifteen beats
            later = decode_lease(await redis_client.get(keys.live("a")))
            during = await worker_events(ledger)
    assert later.renewed_at > first.renewed_at
    assert later.resources.mem_total_bytes is not None  # the machine's figures are the lease's
    assert [type(e) for e in during][:1] == [WorkerOnline]
    # Nothing was loaded and nothing changed: WorkerOnline said it all.
    assert [type(e).__name__ for e in during] == ["WorkerOnline"]


async def test_a_change_of_loaded_models_appends_exactly_one_change_event(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    keys = Keys.for_client(redis_client)
    queues = TaskStore(redis_client, keys, ledger)
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a", heartbeat_ms=100)):
            await submit_task(queues, TaskMessage(model="m", messages=[Message(role="user", content="hi")]))

            async def changed() -> bool:
                return bool(await events_of(ledger, WorkerChanged))

            await wait_until(changed, timeout=10)
            await asyncio.sleep(1.0)  # ten more beats with the model still loaded
            during = await worker_events(ledger)
    changes = [e for e in during if isinstance(e, WorkerChanged)]
    assert len(changes) == 1
    assert changes[0].worker == "a" and changes[0].loaded == [MODEL_DIGEST]
    assert {m.digest for m in changes[0].inventory} >= {MODEL_DIGEST}
    assert not [e for e in during if isinstance(e, WorkerHeartbeat)]


async def test_a_worker_whose_lease_lapsed_announces_itself_again_once(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    keys = Keys.for_client(redis_client)
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a", heartbeat_ms=100)):
            await redis_client.delete(keys.live("a"))  # as if Redis or the process stalled past it

            async def again() -> bool:
                return len(await events_of(ledger, WorkerOnline)) >= 2

            await wait_until(again, timeout=5)
            await asyncio.sleep(0.5)
            onlines = await events_of(ledger, WorkerOnline)
    assert len(onlines) == 2 and onlines[1].at > onlines[0].at


def test_liveness_has_news_only_when_inventory_loaded_or_serves_differ_from_what_it_said() -> None:
    m = ModelEntry(name="m", digest=D1)
    n = ModelEntry(name="n", digest=QWEN)
    live = Liveness("w", 2, None)
    live.online(WorkerOnline(at=T0, worker="w", slots=2, inventory=[m, n]))
    assert live.beat(T0 + 1, [n, m], []) is None  # the same models in another order
    loaded = live.beat(T0 + 2, [m, n], [D1])
    assert loaded is not None and loaded.loaded == [D1]
    assert live.beat(T0 + 3, [m, n], [D1]) is not None  # not appended yet: still news
    live.said(loaded)
    assert live.beat(T0 + 4, [m, n], [D1, D1]) is None
    dropped = live.beat(T0 + 5, [m], [D1])
    assert dropped is not None and dropped.inventory == [m]


# -- fleet surfaces -------------------------------------------------------------------------------


async def test_the_fleet_api_shows_resources_and_last_seen_from_the_lease(
    redis_client: aioredis.Redis, redis_url: str, ledger: Ledger
) -> None:
    keys = Keys.for_client(redis_client)
    async with (
        fleet_and_api(redis_client, redis_url, workers=("a",)) as (base, _),
        httpx.AsyncClient(base_url=base) as http,
    ):
        fleet = (await http.get("/v1/fleet")).json()
        lease = decode_lease(await redis_client.get(keys.live("a")))
    row = fleet["workers"][0]
    assert row["seen_from"] == "lease"
    assert set(row["resources"]) == {"value", "at", "age_s"}
    assert lease.resources.mem_total_bytes is not None
    assert row["resources"]["value"]["mem_total_bytes"] == lease.resources.mem_total_bytes
    # The lease's time, on the ledger's clock (through the offset its worker measured).
    assert row["last_heartbeat"] == row["resources"]["at"] <= lease.on_ledger(lease.renewed_at)
    # None of it came from the ledger.
    assert not await events_of(ledger, WorkerHeartbeat)


async def test_status_and_the_dashboard_overview_show_the_lease_s_resources_and_last_seen(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    from dispatch.overview import overview

    keys = Keys.for_client(redis_client)
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a")):
            state = await overview(redis_client, keys)
            done = await asyncio.to_thread(
                subprocess.run,
                [*RL, "status", "--redis-url", redis_url],
                capture_output=True,
                text=True,
                timeout=60,
            )
    (row,) = state["workers"]
    assert row["seen_from"] == "lease" and row["resources"]["mem_total_bytes"] is not None
    assert row["last_heartbeat"] is not None and row["last_heartbeat"] >= row["since"]
    assert done.returncode == 0, done.stderr
    assert "machine" in done.stdout and "mem " in done.stdout


# -- the reaper -----------------------------------------------------------------------------------


async def test_the_reaper_records_an_expired_lease_offline_once_and_the_projected_fleet_says_so(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await ledger.append_many(
        [WorkerOnline(at=T0, worker="ghost", slots=1), WorkerOnline(at=T0, worker="alive", slots=1)]
    )
    await Leases(redis_client, keys).put(LeaseInfo(worker="alive", token="t", slots=1), 60_000)
    projector = Projector(redis_client, keys)
    await projector.start()
    await projector.catch_up()
    config = ReaperConfig(lease_ms=1500)
    reaper = Reaper(redis_client, keys, config)
    first = await reaper.sweep()
    await reaper.sweep()
    # A restarted reaper, before the projector folded the event, does not say it again.
    await Reaper(redis_client, keys, config).sweep()
    offline = await events_of(ledger, WorkerOffline)
    assert first.offline == 1
    assert [(e.worker, e.reason) for e in offline] == [("ghost", LEASE_EXPIRED)]
    await projector.catch_up()
    await Reaper(redis_client, keys, config).sweep()
    snap = await snapshot(redis_client, keys)
    assert snap.fleet["ghost"].status == "offline" and snap.fleet["alive"].status == "online"
    assert len(await events_of(ledger, WorkerOffline)) == 1


async def test_a_worker_back_after_its_death_was_recorded_dies_again_once(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    projector = Projector(redis_client, keys)
    await projector.start()
    reaper = Reaper(redis_client, keys, ReaperConfig(lease_ms=1500))
    await ledger.append(WorkerOnline(at=T0, worker="w", slots=1))
    await projector.catch_up()
    await reaper.sweep()
    # Back (a new life, by its own clock), then gone again without a goodbye.
    await ledger.append(WorkerOnline(at=now_ms() + 1000, worker="w", slots=1))
    await projector.catch_up()
    await reaper.sweep()
    await reaper.sweep()
    assert [e.reason for e in await events_of(ledger, WorkerOffline)] == [LEASE_EXPIRED, LEASE_EXPIRED]


async def test_a_clean_shutdown_says_goodbye_itself_and_the_reaper_adds_nothing(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a")):
            pass
    projector = Projector(redis_client, keys)
    await projector.start()
    await projector.catch_up()
    await Reaper(redis_client, keys, ReaperConfig(lease_ms=1500)).sweep()
    assert [e.reason for e in await events_of(ledger, WorkerOffline)] == ["shutdown"]


async def test_a_goodbye_the_projector_has_not_folded_yet_is_not_followed_by_a_lease_expired(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    # As after a Ctrl-C of `up`: the projector stopped before it folded the workers' goodbyes, and
    # the restarted reaper sweeps before the restarted projector has caught up.
    projector = Projector(redis_client, keys)
    await projector.start()
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a")):
            await projector.catch_up()
    stale = await snapshot(redis_client, keys)
    reaper = Reaper(redis_client, keys, ReaperConfig(lease_ms=1500))
    before = await reaper.sweep()
    await projector.catch_up()
    after = await reaper.sweep()
    assert stale.fleet["a"].status == "online"
    assert before.offline == 0 and after.offline == 0
    assert [e.reason for e in await events_of(ledger, WorkerOffline)] == ["shutdown"]
    assert (await snapshot(redis_client, keys)).fleet["a"].status == "offline"


async def test_a_lease_is_given_up_only_by_the_process_whose_token_holds_it(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    leases = Leases(redis_client, keys)
    assert (await leases.put(LeaseInfo(worker="a", token="mine", slots=1), 60_000)).ok
    # A process that stops after another took its name over leaves that one's lease alone.
    assert not await leases.release("a", "older")
    assert await redis_client.exists(keys.live("a")) and await registered(redis_client, keys) == ["a"]
    assert await leases.release("a", "mine")
    assert not await redis_client.exists(keys.live("a")) and await registered(redis_client, keys) == []
    # A lease that lapsed before the stop: the name still leaves the registry.
    await redis_client.sadd(keys.workers, "b")
    assert await leases.release("b", "mine") and await registered(redis_client, keys) == []


# -- TaskRouted -----------------------------------------------------------------------------------


def five_holders() -> Decision:
    names = ["w1", "w2", "w3", "w4", "w5"]
    snap = router_snapshot(speeds=[speed_row(n, QWEN, 10.0 * (i + 1), 5) for i, n in enumerate(names)])
    view = FleetView(workers=[worker(n, [QWEN]) for n in names])
    return decide(RouteQuery(model="qwen", max_tokens=100), {"qwen": QWEN}, view, estimator(snap), NOW)


async def test_task_routed_keeps_three_candidates_and_counts_the_rest_while_the_task_shows_all(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    decision = five_holders()
    queues = TaskStore(redis_client, keys, ledger)
    sub = await submit_task(
        queues,
        TaskMessage(model="qwen", messages=[Message(role="user", content="hi")]),
        digest=QWEN,
        decision=decision,
    )
    (routed,) = await events_of(ledger, TaskRouted)
    kept = routed.breakdown["candidates"]
    assert isinstance(kept, list) and [c["worker"] for c in kept] == ["w5", "w4", "w3"]
    assert set(kept[0]["terms"]) >= {"wait_s", "decode_s"} and kept[0]["fields"]["decode_tps"][2]
    full = decision.ranking.candidates
    others = routed.breakdown["others"]
    assert isinstance(others, dict) and others["count"] == 2
    assert others["best_finish_s"] == pytest.approx(full[3].expected_finish_s, rel=1e-3)
    assert routed.expected_worker == "w5"
    view = await Gateway(redis_client, keys).view(sub.task_id)
    shown = view["routing"]["candidates"]
    assert [c["worker"] for c in shown] == ["w5", "w4", "w3", "w2", "w1"]
    assert shown[4]["fields"]["decode_tps"]["source"]
    recent, _ = await load_recent(redis_client, keys)
    task = recent.to_dict()["tasks"][0]
    assert [r["worker"] for r in task["ranking"]] == ["w5", "w4", "w3"]
    assert task["others"]["count"] == 2


async def test_a_routed_submission_through_live_workers_records_the_compact_form(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a")):
            req = TaskMessage(model="m", messages=[Message(role="user", content="hi")])
            sub = await route_and_submit(queues, LiveView(redis_client, keys), req)
    (routed,) = await events_of(ledger, TaskRouted)
    assert routed.breakdown["others"] == {"count": 0, "best_finish_s": None}
    assert "digest" not in routed.breakdown and routed.digest == MODEL_DIGEST
    info = await redis_client.hget(keys.task(sub.task_id), "routed")
    assert json.loads(info)["digest"] == MODEL_DIGEST  # the whole breakdown, as before


# -- old ledgers ----------------------------------------------------------------------------------


def old_style_ledger() -> list[Event]:
    """What ledgers written before hold: heartbeats every beat, TaskRouted with every candidate."""
    decision = five_holders()
    inventory = [ModelEntry(name="qwen", digest=QWEN)]
    return [
        WorkerOnline(at=T0, worker="w1", slots=1, inventory=inventory),
        WorkerHeartbeat(
            at=T0 + 2000,
            worker="w1",
            slots=1,
            inventory=inventory,
            loaded=[QWEN],
            resources=Resources(cpu_percent=12.0, mem_total_bytes=8 << 30),
        ),
        TaskSubmitted(at=T0 + 2500, task_id="t1", model="qwen", digest=QWEN, queue="q"),
        TaskRouted(
            at=T0 + 2500,
            task_id="t1",
            digest=QWEN,
            queue="q",
            breakdown=decision.to_dict(),
            expected_worker="w5",
            expected_finish_s=decision.ranking.best.expected_finish_s,
        ),
        completed("t1", "w1"),
        WorkerHeartbeat(at=T0 + 4000, worker="w1", slots=1, inventory=inventory, loaded=[QWEN]),
    ]


async def append_as_old_writers_did(redis: aioredis.Redis, keys: Keys, events: list[Event]) -> None:
    """Every field written, defaults included, as the encoder did before it left them out."""
    for event in events:
        data = msgspec.msgpack.encode(event_fields(event))
        await redis.xadd(keys.events, {b"type": type(event).__name__.encode(), b"v": b"1", b"data": data})


async def test_old_style_entries_still_fold_replay_export_and_show_as_recent_tasks(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys, ledger: Ledger, tmp_path: Path
) -> None:
    old = old_style_ledger()
    await append_as_old_writers_did(redis_client, keys, old)
    assert [e async for _, e in ledger.read()] == old
    projector = Projector(redis_client, keys)
    await projector.start()
    await projector.catch_up()
    ns = await store.current(redis_client, keys)
    assert ns is not None
    live = await store.load(redis_client, keys, ns)
    rebuilt, _ = await build(redis_client, keys)
    assert diff_tables(live, rebuilt) == []
    row = live.fleet["w1"]
    assert (row.last_heartbeat, row.loaded.value) == (T0 + 4000, [QWEN])
    assert row.resources.value is not None and row.resources.at == T0 + 4000
    recent, _ = await load_recent(redis_client, keys)
    task = recent.to_dict()["tasks"][0]
    assert [r["worker"] for r in task["ranking"]] == ["w5", "w4", "w3", "w2", "w1"]
    assert task["others"] == {"count": 0, "best_finish_s": None}
    done = await asyncio.to_thread(
        subprocess.run,
        [*RL, "replay", "export", "--parquet", str(tmp_path), "--redis-url", redis_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    routed = pl.read_parquet(tmp_path / "TaskRouted.parquet")
    assert len(json.loads(routed["breakdown"][0])["candidates"]) == 5
    assert pl.read_parquet(tmp_path / "WorkerHeartbeat.parquet").height == 2


async def test_a_change_after_old_heartbeats_moves_loaded_and_keeps_the_last_resources(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    old = old_style_ledger()
    await ledger.append_many(
        [*old, WorkerChanged(at=T0 + 9000, worker="w1", slots=2, inventory=[], loaded=[D1])]
    )
    projector = Projector(redis_client, keys)
    await projector.start()
    await projector.catch_up()
    snap = await snapshot(redis_client, keys)
    row = snap.fleet["w1"]
    assert (row.slots.value, row.loaded.value, row.last_heartbeat) == (2, [D1], T0 + 9000)
    assert row.inventory.value == {}
    assert row.resources.at == T0 + 4000  # a change carries no resources
    rebuilt, _ = await build(redis_client, keys)
    ns = await store.current(redis_client, keys)
    assert ns is not None
    assert diff_tables(await store.load(redis_client, keys, ns), rebuilt) == []
