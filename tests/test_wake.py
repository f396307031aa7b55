"""Sleeping machines, end to end: the story's fleet with the GPU PC asleep. Real Redis, simulated hosts
(the GPU PC's network card listens on a loopback UDP port: nothing is sent anywhere else), worker
processes, the projector and the reaper with its waker.

A burst of ten qwen3:8b tasks wakes the GPU PC with one magic packet, it powers on after its wake
time, and the burst ends sooner than the laptop alone would have ended it; a single short task that
the laptop finishes first wakes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import redis.asyncio as aioredis

from dispatch.submit import preview_request, route_and_submit
from dispatch.view import LiveView
from dispatch.wake import (
    CONFIGURED,
    MEASURED,
    SleepRecord,
    WakeTime,
    read_record,
    wake,
    write_record,
)
from events.event import Event, TaskCompleted, Timings, WakeFailed, WakeRequested, WorkerOnline
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from projections.reader import snapshot
from router.choose import RouteQuery
from router.plan import BacklogEntry
from router.wake import Sleeper, decide_wake
from sim.backends.hosts import SimHosts
from sim.fleetspec import Fleet, load_fleet
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import events_of, rl, wait_until, worker_process
from workers.reaper import Reaper, ReaperConfig
from workers.waker import Waker, WakerConfig

SEED = load_fleet("seed")
QWEN = SEED.model["qwen3:8b"].digest
MAC = "0A:1B:2C:3D:4E:5F"
# Simulated seconds from the packet to power on (the GPU PC's configured wake time too).
WAKE_S = 90.0
SCALE = 0.05
LAPTOP_DECODE = 11.4
LAPTOP_PROMPT = 120.0
LAPTOP_LOAD = 8.0


def _fleet() -> Fleet:
    """The seed fleet with the GPU PC asleep, woken by MAC's magic packet."""
    workers = [
        msgspec.structs.replace(w, asleep=True, mac=MAC, wake_s=WAKE_S) if w.name == "rtx3070ti" else w
        for w in SEED.worker
    ]
    return msgspec.structs.replace(SEED, worker=workers)


def _expected_packet() -> bytes:
    return b"\xff" * 6 + bytes.fromhex(MAC.replace(":", "")) * 16


def _history(now_ms: int) -> list[Event]:
    """What the tables remember of both machines from the times they were online: 30 runs each."""
    events: list[Event] = []
    for i in range(30):
        at = now_ms - (30 - i) * 60_000
        for worker, tps, prompt_tps in (("macbookair", 11.4, 120.0), ("rtx3070ti", 83.0, 2000.0)):
            tokens = 600
            events.append(
                TaskCompleted(
                    at=at,
                    task_id=f"old-{worker}-{i}",
                    worker=worker,
                    digest=QWEN,
                    attempt=1,
                    timings=Timings(
                        prompt_eval_count=40,
                        prompt_eval_duration=int(40 / prompt_tps * 1e9),
                        eval_count=tokens,
                        eval_duration=int(tokens / tps * 1e9),
                        load_duration=0,
                        total_duration=int((tokens / tps + 0.1) * 1e9),
                    ),
                    cold=False,
                )
            )
    return events


@contextlib.asynccontextmanager
async def _projector(redis: aioredis.Redis) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(Projector(redis, Keys(), lease_ms=2000).run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def _reaper(redis: aioredis.Redis) -> AsyncIterator[None]:
    stop = asyncio.Event()
    config = ReaperConfig(lease_ms=1500, interval_s=0.1, wake_interval_s=0.2)
    task = asyncio.create_task(Reaper(redis, Keys(), config).run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _gpu_worker(redis_url: str, backend: str, wake_port: int) -> subprocess.Popen[bytes]:
    """The GPU PC's worker, as it runs on that machine once it has booted."""
    env = {
        **os.environ,
        "ROUTELEDGER_LEASE_MS": "1500",
        "ROUTELEDGER_HEARTBEAT_MS": "300",
        "ROUTELEDGER_LOG_LEVEL": "warning",
    }
    argv = [sys.executable, "-m", "routeledger", "worker", "--backend", backend, "--id", "rtx3070ti"]
    argv += ["--redis-url", redis_url, "--no-bench", "--wake-mac", MAC, "--wake-broadcast", "127.0.0.1"]
    argv += ["--wake-port", str(wake_port), "--wake-s", str(WAKE_S)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _setup(redis: aioredis.Redis, sim: SimHosts) -> None:
    """History in the ledger, folded; the GPU PC's record as its worker left it when it last ran."""
    keys = Keys()
    await Ledger(redis, keys).append_many(_history(int(time.time() * 1000)))
    await write_record(
        redis,
        keys,
        SleepRecord(
            worker="rtx3070ti",
            mac=MAC,
            broadcast="127.0.0.1",
            port=sim.wake_port("rtx3070ti"),
            wake_s=WAKE_S,
            slots=1,
            holds=[QWEN],
            models=["qwen3:8b"],
        ),
    )

    async def folded() -> bool:
        snap = await snapshot(redis, keys)
        return ("rtx3070ti", QWEN) in snap.speed and ("macbookair", QWEN) in snap.speed

    await wait_until(folded, timeout=20)


async def _submit(redis: aioredis.Redis, view: LiveView, text: str, max_tokens: int | None = None) -> str:
    req = TaskMessage(
        model="qwen3:8b", messages=[Message(role="user", content=text)], max_tokens=max_tokens, client="test"
    )
    sub = await route_and_submit(TaskStore(redis, Keys()), view, req)
    return sub.task.task_id


async def test_a_burst_wakes_the_sleeping_gpu_pc_once_and_ends_sooner_than_the_laptop_alone(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    redis, keys = redis_client, Keys()
    ledger = Ledger(redis, keys)
    async with SimHosts(_fleet(), time_scale=SCALE, seed=3) as sim, _projector(redis):
        assert not sim.is_online("rtx3070ti")
        await _setup(redis, sim)
        laptop = worker_process(redis_url, sim.url("macbookair"), "macbookair")
        gpu: subprocess.Popen[bytes] | None = None
        try:
            await wait_until(lambda: _exists(redis, keys.live("macbookair")), timeout=30)
            view = LiveView(redis, keys, snapshot_every_s=0.2)
            async with _reaper(redis):
                started = time.monotonic()
                ids = [await _submit(redis, view, f"question {i} about the fleet") for i in range(10)]
                # The harness plays the machine's boot: its worker starts once it has powered on.
                await asyncio.wait_for(sim.woken["rtx3070ti"].wait(), 60)
                online_at = time.time()
                gpu = _gpu_worker(redis_url, sim.url("rtx3070ti"), sim.wake_port("rtx3070ti"))

                async def all_done() -> bool:
                    return all([await TaskStore(redis, keys).result(t) is not None for t in ids])

                await wait_until(all_done, timeout=120, every=0.1)
                makespan_s = (time.monotonic() - started) / SCALE
                # The projector measures the wake from the ledger: WakeRequested to WorkerOnline.
                await wait_until(lambda: _measured(redis), timeout=20)
                snap = await snapshot(redis, keys)
        finally:
            await _stop(laptop)
            if gpu is not None:
                await _stop(gpu)

    # One magic packet, with the MAC's payload, and one WakeRequested saying why.
    assert sim.packets("rtx3070ti") == [_expected_packet()]
    (req,) = await events_of(ledger, WakeRequested)
    assert req.worker == "rtx3070ti" and req.why == "plan" and req.digest == QWEN
    assert req.gain_s is not None and req.gain_s > 0
    assert req.wake_s == WAKE_S and req.wake_source == CONFIGURED
    assert not await events_of(ledger, WakeFailed)
    # It powered on no sooner than its wake time after the packet.
    assert online_at - req.at / 1000 >= WAKE_S * SCALE * 0.95
    done = [e for e in await events_of(ledger, TaskCompleted) if e.task_id in ids and not e.duplicate]
    assert {e.task_id for e in done} == set(ids)
    assert any(e.worker == "rtx3070ti" for e in done)
    # The laptop alone: the same answers, one at a time at its speeds, after one load.
    alone_s = LAPTOP_LOAD + sum(
        (e.timings.eval_count or 0) / LAPTOP_DECODE + (e.timings.prompt_eval_count or 0) / LAPTOP_PROMPT
        for e in done
    )
    assert makespan_s < alone_s, (makespan_s, alone_s)
    online = [e for e in await events_of(ledger, WorkerOnline) if e.worker == "rtx3070ti"]
    rec = await read_record(redis, keys, "rtx3070ti")
    assert rec is not None
    counted = rec.wake_time(snap.fleet["rtx3070ti"], int(time.time() * 1000))
    assert counted.source == MEASURED
    # Measured on the ledger's clock: from the request's stream id to its answer's.
    entries = [(int(i.split("-")[0]), e) async for i, e in ledger.read()]
    requested_ms = next(ms for ms, e in entries if isinstance(e, WakeRequested))
    online_ms = next(ms for ms, e in entries if e == online[0])
    assert counted.seconds == (online_ms - requested_ms) / 1000
    # The machine's real seconds (the harness started its worker after the scaled boot).
    assert counted.seconds >= WAKE_S * SCALE * 0.95


async def test_a_short_task_the_awake_laptop_finishes_sooner_wakes_nothing(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    redis, keys = redis_client, Keys()
    ledger = Ledger(redis, keys)
    async with SimHosts(_fleet(), time_scale=SCALE, seed=3) as sim, _projector(redis):
        await _setup(redis, sim)
        laptop = worker_process(redis_url, sim.url("macbookair"), "macbookair")
        try:
            await wait_until(lambda: _exists(redis, keys.live("macbookair")), timeout=30)
            view = LiveView(redis, keys, snapshot_every_s=0.2)
            # What the waker weighs while the task waits: the live fleet and estimates, that task queued.
            fleet, est, now, _ = await view.fleet([QWEN])
            queued = [BacklogEntry(task_id="short", digest=QWEN, enqueued_at_ms=now, max_tokens=8)]
            sleeper = Sleeper(name="rtx3070ti", slots=1, holds=frozenset({QWEN}), wake_s=WAKE_S)
            d = decide_wake(fleet, est, QWEN, sleeper, now, backlog=queued)
            assert not d.wake and d.given == 0, d
            # The preview lists the sleeping machine beside the live one, its wake time in its terms.
            shown: dict[str, Any] = await preview_request(view, RouteQuery(model="qwen3:8b", max_tokens=8))
            assert [c["worker"] for c in shown["candidates"]] == ["macbookair"]
            (asleep,) = shown["sleeping"]
            assert asleep["worker"] == "rtx3070ti" and asleep["asleep"] is True
            assert asleep["terms"]["wake_s"] == WAKE_S and asleep["terms"]["wait_s"] >= WAKE_S
            assert asleep["fields"]["wake_s"]["source"] == CONFIGURED
            assert asleep["wake"]["wake"] is False
            async with _reaper(redis):
                task_id = await _submit(redis, view, "a quick one", max_tokens=8)
                await wait_until(lambda: _result(redis, task_id), timeout=60, every=0.1)
                # A few more of the waker's looks (every 0.2 s) after the task is done.
                await asyncio.sleep(1.0)
        finally:
            await _stop(laptop)
        assert sim.packets("rtx3070ti") == []
        assert not sim.is_online("rtx3070ti")
    assert not await events_of(ledger, WakeRequested)
    (done,) = [e for e in await events_of(ledger, TaskCompleted) if e.task_id == task_id]
    assert done.worker == "macbookair"


async def test_a_machine_that_does_not_come_online_within_the_bound_is_recorded_as_failed(
    redis_client: aioredis.Redis,
) -> None:
    redis, keys = redis_client, Keys()
    ledger = Ledger(redis, keys)
    # A card that hears the packet but whose machine never boots.
    fleet = msgspec.structs.replace(_fleet(), worker=[w for w in _fleet().worker if w.name == "rtx3070ti"])
    fleet = msgspec.structs.replace(fleet, worker=[msgspec.structs.replace(fleet.worker[0], wake_s=10_000.0)])
    async with SimHosts(fleet, time_scale=SCALE) as sim:
        rec = SleepRecord(
            worker="rtx3070ti", mac=MAC, broadcast="127.0.0.1", port=sim.wake_port("rtx3070ti"), wake_s=0.1
        )
        await write_record(redis, keys, rec)
        first = await wake(redis, keys, rec, why="manual")
        assert first is not None and first.why == "manual"
        # The window holds a second packet back.
        assert await wake(redis, keys, rec, why="manual") is None
        waker = Waker(redis, keys, WakerConfig(min_bound_s=0.5))
        await waker.tick()
        assert not await events_of(ledger, WakeFailed)
        await asyncio.sleep(0.7)
        await waker.tick()
        await waker.tick()
        await wait_until(lambda: _delivered(sim), timeout=5)
    (failed,) = await events_of(ledger, WakeFailed)
    assert failed.worker == "rtx3070ti" and failed.waited_s >= 0.5
    assert sim.packets("rtx3070ti") == [_expected_packet()]


async def test_a_worker_started_with_a_wake_mac_keeps_its_record_from_its_lease(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    redis, keys = redis_client, Keys()
    async with SimHosts(SEED, time_scale=SCALE) as sim:
        proc = _gpu_worker(redis_url, sim.url("rtx3070ti"), 40009)
        try:

            async def recorded() -> bool:
                return await read_record(redis, keys, "rtx3070ti") is not None

            await wait_until(recorded, timeout=30)
        finally:
            await _stop(proc)
    rec = await read_record(redis, keys, "rtx3070ti")
    assert rec is not None
    assert rec.mac == MAC and rec.broadcast == "127.0.0.1" and rec.port == 40009
    assert (rec.holds == [QWEN] and rec.models == ["qwen3:8b:latest"]) or rec.models == ["qwen3:8b"]
    assert rec.wake_time() == WakeTime(seconds=WAKE_S, source=CONFIGURED)
    assert await redis.sismember(keys.sleepers, "rtx3070ti")


async def test_routeledger_wake_sends_by_hand_once_per_window_and_a_bad_name_exits_2(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    redis, keys = redis_client, Keys()
    async with SimHosts(_fleet(), time_scale=SCALE) as sim:
        port = str(sim.wake_port("rtx3070ti"))
        unknown = await asyncio.to_thread(rl, "wake", "nosuch", "--redis-url", redis_url)
        assert unknown.returncode == 2
        assert "no sleeping machine named 'nosuch'" in unknown.stderr
        bad = await asyncio.to_thread(rl, "wake", "no/such", "--redis-url", redis_url)
        assert bad.returncode == 2 and "not a worker name" in bad.stderr
        badmac = await asyncio.to_thread(rl, "wake", "rtx3070ti", "--mac", "zz", "--redis-url", redis_url)
        assert badmac.returncode == 2 and "not a MAC address" in badmac.stderr
        args = ["--mac", MAC.lower(), "--broadcast", "127.0.0.1", "--port", port, "--wake-s", "1"]
        sent = await asyncio.to_thread(rl, "wake", "rtx3070ti", *args, "--json", "--redis-url", redis_url)
        assert sent.returncode == 0, sent.stderr
        assert msgspec.json.decode(sent.stdout)["status"] == "sent"
        again = await asyncio.to_thread(rl, "wake", "rtx3070ti", "--json", "--redis-url", redis_url)
        assert again.returncode == 0 and msgspec.json.decode(again.stdout)["status"] == "rate-limited"
        await wait_until(lambda: _delivered(sim), timeout=5)
        await asyncio.wait_for(sim.woken["rtx3070ti"].wait(), 30)
        assert sim.packets("rtx3070ti") == [_expected_packet()]
        assert sim.is_online("rtx3070ti")
    (req,) = await events_of(Ledger(redis, keys), WakeRequested)
    assert req.why == "manual" and req.worker == "rtx3070ti" and req.gain_s is None
    rec = await read_record(redis, keys, "rtx3070ti")
    assert rec is not None and rec.mac == MAC and rec.wake_s == 1.0


async def _exists(redis: aioredis.Redis, key: str) -> bool:
    return bool(await redis.exists(key))


async def _result(redis: aioredis.Redis, task_id: str) -> bool:
    return await TaskStore(redis, Keys()).result(task_id) is not None


async def _measured(redis: aioredis.Redis) -> bool:
    row = (await snapshot(redis, Keys())).fleet.get("rtx3070ti")
    return row is not None and row.wake_s.value is not None


async def _delivered(sim: SimHosts) -> bool:
    return bool(sim.packets("rtx3070ti"))
