"""One dispatch, two clocks: real worker processes and the scheduling simulator, given the same
fleet, the same measured speeds, the same settings and the same arrivals, share the tasks out alike.

A 4-slot slow server and a 1-slot PC five times faster per task serve one model, as simulated
Ollama hosts. Both workers are real `routeledger worker` processes with the router's gate; a
projector folds the ledger beside them. They benchmark themselves on joining; the snapshot the
projector then holds (its tables and the half-lives they are folded with) is what the simulator
starts from. A seeded Poisson workload at a load the PC alone cannot carry is submitted through
the one submission path, and the simulator replays the same tasks at the times the ledger recorded
them, in simulated time on the same clock.

The hosts run at time scale 1: every clock the decision reads (arrival times, lease start times,
the demand table's decay) is the wall clock, and the speeds the hosts report are per second of it,
so the fleet's tasks are made short instead of scaling time. For the same reason the demand
half-life is shortened with them: at the default 300 s the arrival rate would hardly move within
the run, and the part of the gate that counts expected arrivals would go untested.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from dispatch.submit import route_and_submit
from dispatch.view import LiveView
from events.event import TaskClaimed, TaskCompleted, TaskSubmitted, now_ms
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from projections.reader import snapshot
from sim.backends.hosts import SimHosts
from sim.fleetspec import parse_fleet
from sim.scheduling.policies import Routeledger
from sim.scheduling.schedule import simulate
from sim.scheduling.workload import Job, WorkloadSpec, generate
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import events_of, wait_until
from tests.reliability.support import spawn_worker, stop_all

DIGEST = "0d15ba7c40d15ba7c40d15ba7c40d15ba7c40d15ba7c40d15ba7c40d15ba7c4aa"
OUTPUT_TOKENS = 40
# Per task: 40 tokens at 10 tok/s = 4 s on each server slot, at 50 tok/s = 0.8 s on the PC (40
# tokens: a speed sample, projections.folder.MIN_DECODE_TOKENS). The
# server's four slots do not slow each other (parallel_exponent 1), so the fleet serves 1 + 1.25
# tasks/s; at load 0.75 (1.7 tasks/s) the PC alone cannot keep up and the server must help. The
# real path costs each task 25-40 ms the simulator does not count (claim, backend call,
# completion, the next decision); at 0.8 s per task that is a few per cent of the PC's speed. The
# PC's share follows its speed closely: at 0.4 s per task it moved the shares by 3-8 points.
FLEET = f"""
name = "server-and-pc"
[model."m"]
digest = "{DIGEST}"
output = {{ dist = "fixed", mean = {OUTPUT_TOKENS} }}

[[worker]]
name = "server"
slots = 4
parallel_exponent = 1.0
[worker.models."m"]
decode_tps = 10.0
prompt_tps = 50000.0
load_s = 0.01

[[worker]]
name = "pc"
slots = 1
[worker.models."m"]
decode_tps = 50.0
prompt_tps = 50000.0
load_s = 0.01
"""
LOAD = 0.75
TASKS = 70
SEED = 5
# The run lasts about 40 s: a demand half-life of 10 s lets the arrival rate follow it (both sides
# read it from the projection snapshot, where the projector records the one it folds with).
DEMAND_HALF_LIFE_S = 10.0
# Share of tasks per machine, real vs simulated, in percentage points.
SHARE_TOLERANCE_PP = 5.0
# The PC counts as starved when, between two of its tasks, some task waited unclaimed for longer
# than this in all: its reaction time (a completion, a gate decision, a claim) is tens of ms; a gate
# that held it back would leave it idle until the next news, a recheck of up to a second.
STARVED_AFTER_S = 0.3

# Not on the cluster tier: this is a 40 s real-time comparison of the scheduler with its simulator,
# which the key layout does not change, and its cluster half doubled its cost in the suite. Worker
# processes dispatching on a cluster run in test_bench_scripts (bench/cluster.py), and every script
# they use runs on the cluster in the tier (tests/cluster_coverage.py checks it).


def idle_spells(start: int, claimed: dict[str, int], done: dict[str, int]) -> list[tuple[int, int]]:
    """A worker's idle intervals (ms) from `start` to its last claim: the gaps between its runs,
    each run from its claim to its completion (any task it ran, the workload's or its own)."""
    runs = sorted((at, done.get(task, at)) for task, at in claimed.items() if at >= start)
    out, edge = [], start
    for begin, end in runs:
        if begin > edge:
            out.append((edge, begin))
        edge = max(edge, end)
    return out


def waiting_while_idle(
    submitted: dict[str, int], claimed: dict[str, int], idle: list[tuple[int, int]]
) -> list[float]:
    """For each idle interval of a worker (ms), the seconds during it when at least one task had
    been submitted and not yet claimed by anyone."""
    waits = sorted((submitted[t], claimed[t]) for t in submitted if t in claimed)
    out = []
    for lo, hi in idle:
        covered, edge = 0, lo
        for a, b in waits:
            a, b = max(a, edge), min(b, hi)
            if b > a:
                covered += b - a
                edge = b
        out.append(covered / 1000.0)
    return out


async def _speeds_measured(redis: aioredis.Redis, names: list[str], samples: int) -> bool:
    snap = await snapshot(redis)
    rows = [snap.speed.get((n, DIGEST)) for n in names]
    return all(r is not None and r.decode_tps.n >= samples for r in rows)


@pytest.mark.slow
async def test_real_workers_and_the_simulator_share_tasks_alike_and_the_fast_pc_never_starves(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, tmp_path: Path
) -> None:
    fleet = parse_fleet(FLEET, "server-and-pc.toml")
    keys = Keys.for_client(redis_client)
    plan = generate(fleet, "m", WorkloadSpec(load=LOAD, tasks=TASKS, seed=SEED))
    stop = asyncio.Event()
    projector = asyncio.create_task(
        Projector(redis_client, keys, lease_ms=2000, demand_half_life_s=DEMAND_HALF_LIFE_S).run(stop)
    )
    log = tmp_path / "workers.log"
    procs = []
    async with SimHosts(fleet, time_scale=1.0, seed=SEED) as hosts:
        try:
            for spec in fleet.worker:
                procs.append(
                    spawn_worker(
                        redis_url, hosts.url(spec.name), spec.name, log, slots=spec.slots, bench=True
                    )
                )
            # Both benchmark themselves on joining (the worker's rule: three samples each, one at a
            # time in the background: 3 x 12.8 s on the server).
            await wait_until(lambda: _speeds_measured(redis_client, ["server", "pc"], 3), timeout=90)
            # What the projection knows when the workload starts is where the simulator starts.
            t0 = now_ms() + 500
            seed = await snapshot(redis_client, keys)
            queues = TaskStore(redis_client, keys, ledger)
            view = LiveView(redis_client, keys)
            start = time.monotonic() + (t0 - now_ms()) / 1000.0
            for job in plan:
                await asyncio.sleep(max(0.0, start + job.arrival - time.monotonic()))
                await route_and_submit(
                    queues,
                    view,
                    TaskMessage(
                        model="m",
                        messages=[Message(role="user", content="Tell me a story.")],
                        domain="general",
                        stream=False,
                    ),
                )

            async def all_done() -> bool:
                done = await events_of(ledger, TaskCompleted)
                return sum(1 for e in done if e.bench_id is None and not e.duplicate) >= TASKS

            await wait_until(all_done, timeout=60)
        finally:
            stop_all(procs)
            stop.set()
            await asyncio.wait_for(projector, 10)

    submitted = {e.task_id: e for e in await events_of(ledger, TaskSubmitted)}
    completed = [
        e for e in await events_of(ledger, TaskCompleted) if e.task_id in submitted and not e.duplicate
    ]
    claims = [e for e in await events_of(ledger, TaskClaimed) if e.task_id in submitted]
    assert len(completed) == TASKS
    assert all(e.attempt == 1 for e in claims), "a task ran twice: the comparison would not be like for like"
    real = Counter(e.worker for e in completed)

    # The same tasks in the simulator, at the times the ledger recorded them.
    order = sorted(submitted.values(), key=lambda e: e.at)
    jobs = [
        Job(
            index=i,
            arrival=(e.at - t0) / 1000.0,
            prompt_tokens=e.prompt_tokens or 0,
            output_tokens=OUTPUT_TOKENS,
        )
        for i, e in enumerate(order)
    ]
    result = simulate(fleet, "m", WorkloadSpec(tasks=TASKS), Routeledger(snapshot=seed), jobs, epoch_ms=t0)
    simulated = Counter(result.worker_of)
    assert sum(simulated.values()) == TASKS

    shares = {w: (100.0 * real[w] / TASKS, 100.0 * simulated[w] / TASKS) for w in ("server", "pc")}
    print(f"share of tasks (real, simulated), %: {shares}")
    # The server must have helped in both, or the comparison says nothing about the gate.
    assert real["server"] > 0 and simulated["server"] > 0, shares
    for worker, (got, want) in shares.items():
        assert abs(got - want) <= SHARE_TOLERANCE_PP, f"{worker}: real {got:.1f}% vs simulated {want:.1f}%"

    # Never starved: between its tasks the PC never sat idle while a task waited unclaimed. Its
    # own benchmark and probe runs (on its background stream, not in the workload) are not idle time.
    idle = idle_spells(
        t0,
        {e.task_id: e.at for e in await events_of(ledger, TaskClaimed) if e.worker == "pc"},
        {e.task_id: e.at for e in await events_of(ledger, TaskCompleted) if e.worker == "pc"},
    )
    first_claim = {e.task_id: e.at for e in claims}
    waits = waiting_while_idle({t: e.at for t, e in submitted.items()}, first_claim, idle)
    starved = [w for w in waits if w > STARVED_AFTER_S]
    print(f"pc idle with work waiting: longest {max(waits):.3f} s over {len(waits)} idle spells")
    assert not starved, f"the PC sat idle for {starved} s while tasks waited"
