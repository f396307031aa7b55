"""Dispatch throughput and added latency: submit → worker → completion, on zero-delay sim hosts.

    python -m bench.dispatch [--tasks N] [--latency-samples M] [--workers 4] [--slots 4] [--profile]
        [--redis-url URL] [--json]

Everything runs on this machine as it would in production, as separate processes: an embedded
Redis (AOF on), one `routeledger sim hosts` process with --time-scale 0 (answers at once, reports
simulated timings), one `routeledger worker` process per simulated machine, and this submitter.

- tasks/s: N tasks submitted as fast as possible; completions counted from the ledger.
- first chunk: one task at a time, the time from calling submit to the first output chunk in
  rl:out:{task}; the zero-delay backend adds almost nothing, so this is routeledger's own cost.
- the machine's floor: the median Redis PING round trip back to back and after 10 ms idle (a
  machine whose idle processes wake slowly pays that at each hop of the first chunk's path).
- --profile runs the first worker under cProfile and prints its hottest functions.

The last line is JSON:
{"bench": "dispatch", "tasks_per_s": ..., "first_chunk_p50_ms": ..., "first_chunk_p99_ms": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import redis.asyncio as aioredis

from dispatch.submit import submit_task
from events.connection import redis_client
from events.keys import Keys
from events.ledger import Ledger
from routeledger.embedded import EmbeddedRedis
from tasks.lease import live_workers
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore


def fleet_toml(workers: int, slots: int) -> str:
    lines = [
        'name = "dispatch-bench"',
        '[model."m"]',
        'output = { dist = "fixed", mean = 16 }',
    ]
    for i in range(workers):
        lines += [
            "[[worker]]",
            f'name = "w{i}"',
            f"slots = {slots}",
            '[worker.models."m"]',
            "decode_tps = 100.0",
            "prompt_tps = 1000.0",
            "load_s = 0.0",
        ]
    return "\n".join(lines) + "\n"


def rl(*args: str) -> list[str]:
    return [sys.executable, "-m", "routeledger", *args]


async def wait_live(redis: aioredis.Redis, keys: Keys, n: int, wait_s: float = 60) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if len(await live_workers(redis, keys)) >= n:
            return
        await asyncio.sleep(0.1)
    raise SystemExit(f"only {len(await live_workers(redis, keys))} of {n} workers came up")


async def count_completed(ledger: Ledger, after: str) -> tuple[int, str]:
    n = 0
    last = after
    while True:
        rows = await ledger.read_after(last, count=5000)
        if not rows:
            return n, last
        last = rows[-1][0]
        n += sum(1 for _, fields in rows if b"TaskCompleted" in fields[1:2])


async def throughput(queues: TaskStore, ledger: Ledger, tasks: int, limit_s: float = 300) -> float:
    leases = await live_workers(queues.redis, queues.keys)
    start_id = await ledger.last_id() or "0-0"
    msgs = [Message(role="user", content="Say something short.")]
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(64)

    async def one() -> None:
        async with sem:
            await submit_task(queues, TaskMessage(model="m", messages=msgs), leases=leases)

    await asyncio.gather(*(one() for _ in range(tasks)))
    done = 0
    cursor = start_id
    while done < tasks:
        n, cursor = await count_completed(ledger, cursor)
        done += n
        if n == 0:
            await asyncio.sleep(0.02)
        if time.perf_counter() - t0 > limit_s:
            raise SystemExit(f"only {done} of {tasks} tasks completed in {limit_s:.0f} s")
    return tasks / (time.perf_counter() - t0)


async def first_chunk_latency(queues: TaskStore, samples: int) -> list[float]:
    leases = await live_workers(queues.redis, queues.keys)
    msgs = [Message(role="user", content="Say something short.")]
    out: list[float] = []
    for _ in range(samples):
        t0 = time.perf_counter()
        task = (await submit_task(queues, TaskMessage(model="m", messages=msgs), leases=leases)).task
        reply: Any = await queues.redis.xread({queues.keys.out(task.task_id): "0"}, count=1, block=10_000)
        if not reply:
            raise SystemExit(f"task {task.task_id} produced no output in 10 s")
        out.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(0.01)
    return out


async def ping_ms(redis: aioredis.Redis, gap_s: float, samples: int = 200) -> float:
    """Median Redis PING round trip (ms), each after `gap_s` idle: with a gap, what waking two
    idle processes costs on this machine (every hop of the first chunk's path pays it)."""
    out: list[float] = []
    for _ in range(samples):
        if gap_s:
            await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        await redis.ping()
        out.append((time.perf_counter() - t0) * 1000)
    return statistics.median(out)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    url: str,
    *,
    workers: int,
    slots: int,
    tasks: int,
    latency_samples: int,
    redis_pid: int | None = None,
    prof: Path | None = None,
    limit_s: float = 300,
) -> tuple[float, list[float], dict[str, float], dict[str, float]]:
    """Run the fleet against the Redis (or Redis Cluster) at `url` and measure it: tasks/s, first
    chunk latencies (ms), CPU ms per task by process kind, and PING round trips (ms). `redis_pid`
    adds that server's CPU; `prof` runs the first worker under cProfile, writing there. A run
    whose tasks do not all complete within `limit_s` raises SystemExit."""
    tmp = tempfile.TemporaryDirectory(prefix="rl-dispatch-")
    root = Path(tmp.name)
    fleet = root / "fleet.toml"
    fleet.write_text(fleet_toml(workers, slots))
    env = {**os.environ, "ROUTELEDGER_LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "warning")}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        sim = subprocess.Popen(
            rl("sim", "hosts", "--fleet-file", str(fleet), "--time-scale", "0", "--json"),
            stdout=subprocess.PIPE,
            env=env,
        )
        procs.append(sim)
        assert sim.stdout is not None
        hosts = json.loads(sim.stdout.readline())["hosts"]
        for i, (name, backend) in enumerate(sorted(hosts.items())):
            argv = rl("worker", "--backend", backend, "--id", name, "--slots", str(slots), "--redis-url", url)
            if prof is not None and i == 0:
                argv = [sys.executable, "-m", "cProfile", "-o", str(prof), *argv[1:]]
            procs.append(subprocess.Popen(argv, env=env))

        watched = {
            "workers": [psutil.Process(p.pid) for p in procs[1:]],
            "redis": [psutil.Process(redis_pid)] if redis_pid is not None else [],
            # The backend stand-in and this submitter share the machine's cores with the rest.
            "sim": [psutil.Process(sim.pid)],
            "submitter": [psutil.Process()],
        }

        def cpu_s() -> dict[str, float]:
            return {k: sum(sum(p.cpu_times()[:2]) for p in ps) for k, ps in watched.items()}

        cpu: dict[str, float] = {}
        rtt: dict[str, float] = {}

        async def run() -> tuple[float, list[float]]:
            client = redis_client(url)
            keys = Keys.for_client(client)
            ledger = Ledger(client, keys)
            queues = TaskStore(client, keys, ledger)
            try:
                await wait_live(client, keys, workers)
                await throughput(queues, ledger, 50, limit_s)  # warm-up: connections, models loaded
                # Latency first: right after thousands of tasks Redis rewrites its AOF in the
                # background, which adds over 10 ms to every task for a while.
                lat = await first_chunk_latency(queues, latency_samples)
                # The machine's own floor under that latency, measured beside it.
                rtt["busy"] = await ping_ms(client, 0.0)
                rtt["idle"] = await ping_ms(client, 0.01)
                before = cpu_s()
                tps = await throughput(queues, ledger, tasks, limit_s)
                after = cpu_s()
                cpu.update({k: (after[k] - before[k]) * 1000 / tasks for k in after})
                return tps, lat
            finally:
                await client.aclose()

        tps, lat = asyncio.run(run())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()
    return tps, lat, cpu, rtt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--latency-samples", type=int, default=300)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--gate", choices=["router", "plain"], default="router")
    parser.add_argument("--redis-url", help="a running Redis or Redis Cluster (default: an embedded one)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()

    server: EmbeddedRedis | None = None
    tmp = tempfile.TemporaryDirectory(prefix="rl-dispatch-redis-")
    prof = Path(tmp.name) / "worker.prof"
    try:
        if args.redis_url:
            url = args.redis_url
        else:
            server = EmbeddedRedis(Path(tmp.name) / "redis")
            url = server.start()
        tps, lat, cpu, rtt = measure(
            url,
            workers=args.workers,
            slots=args.slots,
            tasks=args.tasks,
            latency_samples=args.latency_samples,
            redis_pid=server.process.pid if server is not None and server.process else None,
            prof=prof if args.profile else None,
        )
    finally:
        if server is not None:
            server.stop()
    p50, p99 = statistics.median(lat), pct(lat, 0.99)
    if not args.json:
        print(
            f"fleet: {args.workers} workers x {args.slots} slots, zero-delay sim hosts, Redis with AOF,"
            f" gate {args.gate}"
        )
        print(f"throughput: {tps:,.0f} tasks/s over {args.tasks} tasks (goal 300)")
        print(f"submit -> first chunk: p50 {p50:.2f} ms, p99 {p99:.2f} ms over {len(lat)} tasks (goal p50 5)")
        print(
            f"Redis PING round trip on this machine: {rtt['busy']:.3f} ms back to back,"
            f" {rtt['idle']:.3f} ms after 10 ms idle (the first chunk's path wakes an idle process"
            " at each of its hops)"
        )
        print(
            f"CPU per task during the throughput run: workers {cpu['workers']:.2f} ms (all of them),"
            f" Redis {cpu['redis']:.2f} ms, sim hosts {cpu['sim']:.2f} ms, submitter"
            f" {cpu['submitter']:.2f} ms; {os.cpu_count()} cores"
        )
        if args.profile and prof.exists():
            print("\nworker w0 profile, top functions by own time:")
            pstats.Stats(str(prof)).sort_stats("tottime").print_stats(40)
            # routeledger's own code by time spent inside (start-up imports fall outside it).
            print("\nworker w0 profile, routeledger's functions by cumulative time:")
            pstats.Stats(str(prof)).sort_stats("cumulative").print_stats(
                r"/(workers|dispatch|events|router)/", 25
            )
    tmp.cleanup()
    line = {
        "bench": "dispatch",
        "tasks_per_s": round(tps, 1),
        "first_chunk_p50_ms": round(p50, 2),
        "first_chunk_p99_ms": round(p99, 2),
        "worker_cpu_ms_per_task": round(cpu["workers"], 2),
        "redis_cpu_ms_per_task": round(cpu["redis"], 2),
        "sim_cpu_ms_per_task": round(cpu["sim"], 2),
        "submitter_cpu_ms_per_task": round(cpu["submitter"], 2),
        "ping_ms_back_to_back": round(rtt["busy"], 3),
        "ping_ms_after_idle": round(rtt["idle"], 3),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
