"""Projector start time and Redis time over a namespace holding N task rows.

    python -m bench.projector_start [--rows N ...] [--redis-url URL]

Writes N task rows (created today, or spread over 30 day shards) and N/100 benchmark marks into
a namespace directly through the store, makes it live, then measures `Projector.start()` and one
`step()` of a batch that completes 1,000 of those tasks: wall time, and the Redis time (INFO
commandstats usec) each spent.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import redis.asyncio as aioredis

from events.event import TaskCompleted, Timings
from events.keys import Keys
from events.ledger import Ledger
from projections import store
from projections.projector import Projector
from projections.snapshot import TaskRow
from projections.tables import Tables
from routeledger.embedded import redis_or_embedded

D1 = "a" * 64
DAY_MS = store.DAY_MS
BATCH = 1000


async def _redis_usec(client: aioredis.Redis) -> tuple[int, dict[str, int]]:
    stats: Any = await client.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    usec = sum(
        int(v["usec"]) for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config|resetstat")
    )
    return usec, calls


async def measure(url: str, rows: int, spread_days: int) -> dict[str, float]:
    client = aioredis.Redis.from_url(url)
    keys = Keys()
    try:
        await client.flushall()
        now = int(time.time() * 1000)
        # Spread over `spread_days` shards: beyond two, a completion looks in the older ones too.
        tables = Tables(
            tasks={
                f"t{i}": TaskRow(
                    task_id=f"t{i}",
                    model="m",
                    digest=D1,
                    submitted_at=now,
                    first_ms=now - (i % spread_days) * DAY_MS,
                )
                for i in range(rows)
            },
            benched={(f"b{i}", f"x{i}"): now for i in range(rows // 100)},
        )
        ns = await store.create(client, keys, tables, built_by="bench")
        await store.switch(client, keys, ns)
        await Ledger(client, keys).append_many(
            [
                TaskCompleted(
                    at=now,
                    task_id=f"t{i * (rows // BATCH)}",
                    worker="w1",
                    digest=D1,
                    attempt=1,
                    timings=Timings(eval_count=100, eval_duration=10**9),
                )
                for i in range(BATCH)
            ]
        )
        await client.config_resetstat()
        projector = Projector(client, keys)
        started = time.perf_counter()
        await projector.start()
        start_s = time.perf_counter() - started
        start_usec, start_calls = await _redis_usec(client)
        await client.config_resetstat()
        started = time.perf_counter()
        folded = await projector.step(count=BATCH)
        step_s = time.perf_counter() - started
        step_usec, _ = await _redis_usec(client)
        assert folded == BATCH
        return {
            "rows": rows,
            "start_s": start_s,
            "start_redis_ms": start_usec / 1000,
            "start_hgetall": start_calls.get("hgetall", 0),
            "step_s": step_s,
            "step_redis_ms": step_usec / 1000,
        }
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    with redis_or_embedded(args.redis_url, prefix="rl-bench-start-") as url:
        for n, spread in ((n, spread) for n in args.rows for spread in (1, 30)):
            r = asyncio.run(measure(url, n, spread))
            print(
                f"{n:>9,} task rows over {spread:2} days: start {r['start_s'] * 1000:8.1f} ms "
                f"(Redis {r['start_redis_ms']:7.1f} ms, "
                f"{r['start_hgetall']:.0f} HGETALL); step of {BATCH} completions "
                f"{r['step_s'] * 1000:7.1f} ms (Redis {r['step_redis_ms']:6.1f} ms)",
                flush=True,
            )


if __name__ == "__main__":
    main()
