"""Ledger throughput: append a realistic mix in batches, then read it all back with decoding.

    python -m bench.ledger [--events N] [--batch B] [--repeat R] [--redis-url URL] [--json]

Without --redis-url it starts an embedded redis-server (AOF on, as `routeledger up` runs it) in a
temporary directory. The last line printed is JSON:
{"bench": "ledger", "events": N, "append_eps": ..., "read_eps": ...}; the rates are medians of
--repeat runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import time

import msgspec
import redis.asyncio as aioredis

from events.event import (
    BenchmarkResult,
    Event,
    ModelEntry,
    QualityScored,
    Resources,
    TaskClaimed,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskSubmitted,
    Timings,
    WorkerHeartbeat,
)
from events.keys import Keys
from events.ledger import Ledger
from routeledger.embedded import redis_or_embedded

WORKERS = ["macbookair", "rtx3070ti", "homeserver", "minipc"]
MODELS = {
    "qwen3:8b": "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41",
    "elyza-jp-8b": "3c1d4b0f6e7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c",
    "llama3.2:3b": "a80c4f17acd55265feec403c7aef86be0c25983ab279d83f3bcd3abbcb5b8b72",
}


def realistic_mix(n: int, seed: int = 7) -> list[Event]:
    """Tasks (submitted, routed, claimed, completed or failed), heartbeats, benchmarks and grades."""
    rnd = random.Random(seed)
    inventory = [ModelEntry(name=name, digest=digest) for name, digest in MODELS.items()]
    out: list[Event] = []
    t = 1_764_000_000_000
    i = 0
    while len(out) < n:
        t += rnd.randint(5, 500)
        roll = rnd.random()
        worker = rnd.choice(WORKERS)
        model, digest = rnd.choice(list(MODELS.items()))
        if roll < 0.25:
            out.append(
                WorkerHeartbeat(
                    at=t,
                    worker=worker,
                    slots=rnd.choice([1, 2, 4]),
                    in_flight=rnd.randint(0, 2),
                    inventory=inventory,
                    loaded=[digest],
                    resources=Resources(
                        cpu_percent=rnd.random() * 100, mem_used_bytes=rnd.randint(1, 32) << 30
                    ),
                )
            )
            continue
        if roll < 0.30:
            out.append(
                BenchmarkResult(
                    at=t,
                    bench_id=f"b{i}",
                    worker=worker,
                    digest=digest,
                    timings=Timings(eval_count=64, eval_duration=rnd.randint(700, 6000) * 1_000_000),
                )
            )
            out.append(
                QualityScored(at=t, digest=digest, domain="general", score=rnd.random(), bench_id=f"b{i}")
            )
            continue
        i += 1
        task = f"task-{i:08d}"
        queue = f"rl:q:{digest[:12]}"
        out.append(
            TaskSubmitted(
                at=t,
                task_id=task,
                model=model,
                digest=digest,
                queue=queue,
                prompt_tokens=rnd.randint(10, 900),
            )
        )
        out.append(
            TaskRouted(
                at=t,
                task_id=task,
                digest=digest,
                queue=queue,
                breakdown={w: {"expected_finish_s": rnd.random() * 20} for w in WORKERS[:2]},
            )
        )
        out.append(TaskClaimed(at=t + 3, task_id=task, worker=worker, digest=digest, attempt=1))
        if rnd.random() < 0.05:
            out.append(
                TaskFailed(
                    at=t + 9,
                    task_id=task,
                    worker=worker,
                    digest=digest,
                    attempt=1,
                    kind="timeout",
                    retryable=True,
                )
            )
        else:
            eval_count = rnd.randint(16, 800)
            out.append(
                TaskCompleted(
                    at=t + 2000,
                    task_id=task,
                    worker=worker,
                    digest=digest,
                    attempt=1,
                    timings=Timings(
                        prompt_eval_count=rnd.randint(10, 900),
                        prompt_eval_duration=rnd.randint(50, 900) * 1_000_000,
                        eval_count=eval_count,
                        eval_duration=int(eval_count / rnd.uniform(10, 90) * 1e9),
                        load_duration=rnd.choice([None, 0, 2_000_000_000]),
                        total_duration=rnd.randint(1, 60) * 1_000_000_000,
                    ),
                    ttft_ms=rnd.uniform(50, 3000),
                    wall_ms=rnd.uniform(500, 60000),
                    output_bytes=eval_count * 4,
                )
            )
    return out[:n]


async def append_mix(url: str, n: int) -> None:
    """Empty the Redis at `url` and append `n` events of `realistic_mix`, every task distinct."""
    client = aioredis.Redis.from_url(url)
    try:
        await client.flushall()
        ledger = Ledger(client, Keys())
        step = 100_000
        for start in range(0, n, step):
            events = realistic_mix(min(step, n - start), seed=start)
            # Each chunk numbers its tasks from 1: keep them distinct, or they would be duplicates.
            events = [
                msgspec.structs.replace(e, task_id=f"c{start}-{e.task_id}")  # type: ignore[type-var]
                if getattr(e, "task_id", "")
                else e
                for e in events
            ]
            await ledger.append_many(events)
    finally:
        await client.aclose()


async def run_once(url: str, events: list[Event], batch: int) -> tuple[float, float]:
    client = aioredis.Redis.from_url(url)
    try:
        await client.flushall()
        ledger = Ledger(client, Keys())
        start = time.perf_counter()
        for i in range(0, len(events), batch):
            await ledger.append_many(events[i : i + batch])
        append_s = time.perf_counter() - start

        start = time.perf_counter()
        n = 0
        async for batch in ledger.read_batches():
            n += len(batch)
        read_s = time.perf_counter() - start
        assert n == len(events), f"read {n} of {len(events)}"
        await client.flushall()
        return len(events) / append_s, n / read_s
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--redis-url")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()

    events = realistic_mix(args.events)
    # The generated input stands for what many producers wrote; a reader's heap does not hold it.
    # Freezing it keeps the cyclic GC from rescanning it on every collection during the timings.
    gc.freeze()
    with redis_or_embedded(args.redis_url, prefix="rl-bench-") as url:
        runs = [asyncio.run(run_once(url, events, args.batch)) for _ in range(args.repeat)]

    append = statistics.median(a for a, _ in runs)
    read = statistics.median(r for _, r in runs)
    if not args.json:
        kinds: dict[str, int] = {}
        for e in events:
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
        print(f"events: {args.events} in batches of {args.batch}, {args.repeat} runs; mix: {kinds}")
        for k, (a, r) in enumerate(runs, 1):
            print(f"  run {k}: append {a:,.0f} events/s, read+decode {r:,.0f} events/s")
        print(
            f"median: append {append:,.0f} events/s (goal 100,000), read {read:,.0f} events/s (goal 200,000)"
        )
    print(
        json.dumps(
            {"bench": "ledger", "events": args.events, "append_eps": round(append), "read_eps": round(read)}
        )
    )


if __name__ == "__main__":
    main()
