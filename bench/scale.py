"""What dispatch costs as the fleet grows: routing decision time at 50 workers x backlog 100 and
500 x 1,000, and the Redis commands an idle worker costs at 10 and 200 workers.

    python -m bench.scale [--sizes 50x100,500x1000] [--models 20] [--decisions 2000,300]
                          [--rounds 3] [--idle 10,200] [--idle-seconds 20] [--result-keys 27000] [--chat]
                          [--gate aware|blind] [--json]

A decision is what bench/router.py times: a request with model=auto (every model's holders ranked
on the plan of its queue, each model's utility scored) plus one worker's gate check, on a random
fleet of sim/random_fleet.py (`--models` models, each worker serving 6; the backlog favours a
popular model) with the snapshot's estimates already cached. The gate check is the one a worker's
`RouterGate` makes (size-aware, `GateParams(skip_ahead=True)`); `--gate blind` times the size-blind
one it made before. `--decisions` gives how many are
timed at each size, after a few untimed ones, in each of `--rounds` rounds; the figures are the
median over rounds of each round's p50 and p99 (every round's p99 is printed too).

An idle worker is a real WorkerAgent (router gate, default intervals, benchmarks off) with a client
of its own, beside a zero-delay sim host, on an embedded Redis holding `--result-keys` result keys
of finished tasks (a day's worth: nothing it does may depend on the keyspace's size). Every command
Redis runs is counted (INFO commandstats, so each command a script runs counts too) over
`--idle-seconds`, after the workers are up, and divided by workers and seconds.

Each measurement is one function that returns its figures; `main` puts them together. The last
line is JSON:

    {"bench": "scale", "idle_worker_redis_cmds_per_s": ..., "decision_p99_us_50x100": ...,
     "decision_p99_us_500x1000": ..., "decision_p50_us_50x100": ..., "decision_p50_us_500x1000": ...,
     "gate": "aware", "idle_worker_redis_cmds_per_s_10": ..., "idle_worker_scripts_per_s_10": ..., ...}

`idle_worker_redis_cmds_per_s` is the largest of the per-size figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis

from events.connection import redis_client
from events.keys import Keys
from routeledger.embedded import EmbeddedRedis
from router.choose import RouteQuery, decide
from router.estimate import Estimator, build_estimator
from router.gate import GateParams, should_take
from router.plan import FleetView
from router.prefix import PromptChain, SlotCache, marks_of
from sim.backends.hosts import SimHosts
from sim.fleetspec import parse_fleet
from sim.random_fleet import DOMAINS, NOW_MS, FleetShape, random_fleet
from workers.admission import RouterGate
from workers.agent import WorkerAgent
from workers.backend import OllamaBackend
from workers.config import WorkerConfig

WARMUP = 5


def times_us(
    step: Callable[[int], object], count: int, before: Callable[[], object] | None = None
) -> list[float]:
    """Microseconds of `step(i)` for i in 0 … count-1, sorted, the collector off; `before()`, when
    given, runs untimed ahead of each step."""
    times: list[float] = []
    gc.disable()
    try:
        for i in range(count):
            if before is not None:
                before()
            t = time.perf_counter()
            step(i)
            times.append((time.perf_counter() - t) * 1e6)
    finally:
        gc.enable()
    times.sort()
    return times


def decision_times(
    fleet: FleetView,
    models: dict[str, str],
    est: Estimator,
    decisions: int,
    *,
    rng: random.Random,
    cold: bool = False,
    gate: GateParams | None = None,
) -> tuple[float, float]:
    """(p50, p99) in microseconds of `decisions` decisions, each an `auto` request of a random
    domain and prompt size and the gate check of one of the workers with a free slot (in turn).
    `cold`: the estimator forgets its looked-up estimates before each (the first decision on a
    new snapshot); `gate`: the gate's parameters (RouterGate's: size-aware)."""
    # Workers with a free slot get past the gate's first checks; a fleet without one asks them all.
    free = [w.name for w in fleet.workers if len(w.running) < w.slots] or [w.name for w in fleet.workers]
    queries = [
        RouteQuery(model="auto", domain=DOMAINS[i % 3], prompt_tokens=rng.randint(20, 2000))
        for i in range(decisions)
    ]

    def step(i: int) -> None:
        decide(queries[i], models, fleet, est, NOW_MS)
        should_take(free[i % len(free)], fleet, est, NOW_MS, gate)

    times = times_us(step, decisions, est.clear_cache if cold else None)
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def with_conversations(fleet: FleetView, seed: int = 3, conversations: int = 200) -> FleetView:
    """`fleet` as a chat fleet: every worker's slots hold one of `conversations` conversations each
    (the whole of it or its start), half the queued tasks continue one of them, and every queued
    task is streamed to its reader (paced), as a chat client's are."""
    rng = random.Random(seed)
    chains = [
        PromptChain(hashes=tuple(rng.getrandbits(48) for _ in range(24)), chars=24 * 256)
        for _ in range(conversations)
    ]
    workers = [
        msgspec.structs.replace(
            w,
            cache=[
                SlotCache(marks=marks_of(rng.choice(chains).hashes[: rng.randint(4, 24)]))
                for _ in range(w.slots)
            ],
        )
        for w in fleet.workers
    ]
    backlog = {
        d: [
            msgspec.structs.replace(e, prefix=rng.choice(chains), paced=True)
            if k % 2
            else msgspec.structs.replace(e, paced=True)
            for k, e in enumerate(q)
        ]
        for d, q in fleet.backlog.items()
    }
    return FleetView(workers=workers, backlog=backlog, arrival_rate=fleet.arrival_rate)


def measure_decisions(
    sizes: list[tuple[int, int]],
    models: int,
    decisions: list[int],
    rounds: int = 1,
    chat: bool = False,
    gate: GateParams | None = None,
) -> dict[str, Any]:
    """Decision p50 and p99 (us) at each (workers, backlog) size, as `decision_p50_us_{w}x{b}` and
    `decision_p99_us_{w}x{b}`: the median over `rounds` rounds (the same decisions each round, on
    the same fleet) of each round's figure, with every round's in `..._rounds`. A shared machine
    stalls a process now and then; one stall among 300 decisions is the p99 of a round, and the
    median of rounds leaves it out unless it comes back round after round. `chat`: on the same
    fleets with every slot holding a conversation and half the queue continuing one
    (`with_conversations`), as `..._chat`."""
    p99: dict[str, float] = {}
    p50: dict[str, float] = {}
    each: dict[str, list[float]] = {}
    for (workers, backlog), count in zip(sizes, decisions, strict=True):
        snap, fleet, digests = random_fleet(FleetShape(workers=workers, models=models, backlog=backlog))
        if chat:
            fleet = with_conversations(fleet)
        est = build_estimator(snap, NOW_MS)
        p50s: list[float] = []
        p99s: list[float] = []
        for _ in range(rounds):
            rng = random.Random(2)
            decision_times(fleet, digests, est, WARMUP, rng=rng, gate=gate)
            mid, tail = decision_times(fleet, digests, est, count, rng=rng, gate=gate)
            p50s.append(round(mid, 1))
            p99s.append(round(tail, 1))
        size = f"{workers}x{backlog}" + ("_chat" if chat else "")
        p99[f"decision_p99_us_{size}"] = statistics.median(p99s)
        p50[f"decision_p50_us_{size}"] = statistics.median(p50s)
        each[f"decision_p99_us_{size}_rounds"] = p99s
        each[f"decision_p50_us_{size}_rounds"] = p50s
    return {**p99, **p50, **each}


_FLEET = """
name = "idle"
[model."m"]
digest = "5555555555555555555555555555555555555555555555555555555555555555"
[[worker]]
name = "host"
[worker.models."m"]
decode_tps = 50.0
"""


async def _commandstats(redis: aioredis.Redis) -> dict[str, int]:
    stats: Any = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def idle_worker_cost(url: str, workers: int, seconds: float, result_keys: int) -> dict[str, float]:
    """Redis commands (and scripts) per second per idle worker, `workers` of them (see above)."""
    admin = aioredis.Redis.from_url(url)
    keys = Keys()
    pipe = admin.pipeline(transaction=False)
    for i in range(result_keys):
        pipe.hset(keys.result(f"done{i}"), mapping={"status": "completed", "result": b"x" * 64})
        pipe.pexpire(keys.result(f"done{i}"), 86_400_000)
    await pipe.execute()
    clients = [redis_client(url) for _ in range(workers)]
    async with SimHosts(parse_fleet(_FLEET, "idle.toml"), time_scale=0.0, seed=1) as hosts:
        backends = [OllamaBackend(hosts.url("host"), timeout_s=10.0) for _ in range(workers)]
        agents = [
            WorkerAgent(c, keys, b, WorkerConfig(name=f"w{i}", auto_bench=False), gate=RouterGate(c, keys))
            for i, (c, b) in enumerate(zip(clients, backends, strict=True))
        ]
        runs = [asyncio.create_task(a.run()) for a in agents]
        try:
            await asyncio.sleep(6.0)  # every worker online, past its first beats and looks
            before = await _commandstats(admin)
            t0 = time.perf_counter()
            await asyncio.sleep(seconds)
            after = await _commandstats(admin)
            elapsed = time.perf_counter() - t0
        finally:
            for a in agents:
                a.stopping.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 60)
            for b in backends:
                await b.aclose()
            for c in clients:
                await c.aclose()
    await admin.aclose()
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    delta["info"] = delta.get("info", 1) - 1  # the INFO that read `after`
    per = workers * elapsed
    return {
        "cmds": sum(delta.values()) / per,
        "scripts": (delta.get("evalsha", 0) + delta.get("eval", 0) + delta.get("fcall", 0)) / per,
    }


def measure_idle(sizes: list[int], seconds: float, result_keys: int) -> dict[str, float]:
    """`idle_worker_redis_cmds_per_s_{n}` and `idle_worker_scripts_per_s_{n}` for each n workers,
    each on a fresh embedded Redis."""
    out: dict[str, float] = {}
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="rl-scale-") as tmp:
            server = EmbeddedRedis(Path(tmp) / "redis")
            server.start()
            try:
                cost = asyncio.run(idle_worker_cost(server.url, n, seconds, result_keys))
            finally:
                server.stop()
        out[f"idle_worker_redis_cmds_per_s_{n}"] = round(cost["cmds"], 2)
        out[f"idle_worker_scripts_per_s_{n}"] = round(cost["scripts"], 2)
    return out


def _sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        workers, backlog = part.lower().split("x")
        out.append((int(workers), int(backlog)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=_sizes, default=_sizes("50x100,500x1000"), help="workers x backlog, ...")
    ap.add_argument("--models", type=int, default=20)
    ap.add_argument(
        "--decisions",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2000, 300],
        help="decisions timed at each size, in the order of --sizes",
    )
    ap.add_argument(
        "--idle",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[10, 200],
        help="idle workers, ...",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds of decisions timed; medians are quoted")
    ap.add_argument("--idle-seconds", type=float, default=20.0)
    ap.add_argument("--result-keys", type=int, default=27_000)
    ap.add_argument(
        "--chat",
        action="store_true",
        help="also time decisions with every slot holding a conversation, half the queue continuing one"
        " and every queued task paced",
    )
    ap.add_argument(
        "--gate",
        choices=("aware", "blind"),
        default="aware",
        help="the gate check timed: RouterGate's size-aware one (default) or the size-blind one",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    gate = GateParams(skip_ahead=args.gate == "aware")
    if len(args.decisions) != len(args.sizes):
        ap.error("--decisions needs one count per size")
    decisions = measure_decisions(args.sizes, args.models, args.decisions, args.rounds, gate=gate)
    decisions["gate"] = args.gate
    if args.chat:
        decisions.update(
            measure_decisions(args.sizes, args.models, args.decisions, args.rounds, chat=True, gate=gate)
        )
    if not args.json:
        for chat in (False, True) if args.chat else (False,):
            for (workers, backlog), count in zip(args.sizes, args.decisions, strict=True):
                size = f"{workers}x{backlog}" + ("_chat" if chat else "")
                p50 = decisions[f"decision_p50_us_{size}"]
                p99 = decisions[f"decision_p99_us_{size}"]
                each = ", ".join(f"{v:,.0f}" for v in decisions[f"decision_p99_us_{size}_rounds"])
                print(
                    f"{workers} workers x {args.models} models, backlog {backlog}"
                    f"{', slots holding conversations' if chat else ''}:"
                    f" decision p50 {p50:,.0f} us, p99 {p99:,.0f} us (medians of {args.rounds} rounds of"
                    f" {count} decisions; p99 of each round: {each})"
                )
    idle = measure_idle(args.idle, args.idle_seconds, args.result_keys)
    if not args.json:
        for n in args.idle:
            cmds, scripts = idle[f"idle_worker_redis_cmds_per_s_{n}"], idle[f"idle_worker_scripts_per_s_{n}"]
            print(
                f"{n} idle workers: {cmds:.2f} Redis commands/s per worker"
                f" ({scripts:.2f} of them script calls; every command a"
                f" script runs counted), {args.result_keys:,} result keys in Redis"
            )
    worst = max((v for k, v in idle.items() if k.startswith("idle_worker_redis_cmds")), default=None)
    figures: dict[str, object] = {
        "bench": "scale",
        "idle_worker_redis_cmds_per_s": worst,
        **decisions,
        **idle,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
