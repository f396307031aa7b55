"""Replay and projector figures: rebuild and verify over a large ledger, the live projector's rate and lag.

    python -m bench.replay [--events N] [--seconds S] [--redis-url URL] [--json]

Without --redis-url it starts an embedded redis-server (AOF on, as `routeledger up` runs it) in a
temporary directory; with one, that Redis is FLUSHED first. Steps:

1. append N events of a realistic mix (bench/ledger.py's) to the ledger;
2. `routeledger replay rebuild` in a child process: its rate, and the child's peak RSS;
3. `routeledger replay verify` in a child process: its time (and that it passes);
4. a fresh projector folds the whole ledger in this process: its rate;
5. a projector child follows while this process appends 1,000 events/s for S seconds, sampling
   the lag (age of the oldest unfolded entry) every 20 ms: its p99.

The last line printed is JSON: {"bench": "replay", "events": N, "rebuild_eps": ...,
"rebuild_peak_mb": ..., "projector_eps": ..., "lag_p99_ms": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import redis.asyncio as aioredis

from bench.ledger import append_mix, realistic_mix
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from projections.reader import lag
from routeledger.embedded import redis_or_embedded


def _child(url: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "routeledger", *args, "--redis-url", url],
        capture_output=True,
        text=True,
        env={**os.environ, "ROUTELEDGER_LOG_LEVEL": "warning"},
        check=False,
    )
    return done, time.perf_counter() - started


async def _projector_rate(url: str) -> tuple[int, float]:
    client = aioredis.Redis.from_url(url)
    keys = Keys()
    try:
        await client.delete(keys.current)
        projector = Projector(client, keys)
        started = time.perf_counter()
        await projector.start()
        folded = await projector.catch_up()
        return folded, time.perf_counter() - started
    finally:
        await client.aclose()


async def _lag_under_load(url: str, seconds: float, rate: int) -> list[int]:
    client = aioredis.Redis.from_url(url)
    keys = Keys()
    ledger = Ledger(client, keys)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "routeledger",
        "projector",
        "--redis-url",
        url,
        env={**os.environ, "ROUTELEDGER_LOG_LEVEL": "warning"},
    )
    samples: list[int] = []
    try:
        # The child takes over the lease and adopts the namespace: wait until it keeps up.
        deadline = time.monotonic() + 60
        await ledger.append_many(realistic_mix(10, seed=1))
        while time.monotonic() < deadline:
            if await lag(client, keys) == (0, 0):
                break
            await asyncio.sleep(0.05)
        events = realistic_mix(int(seconds * rate) + rate, seed=99)
        tick = 0.01
        per_tick = max(1, int(rate * tick))
        stop = asyncio.Event()

        async def produce() -> None:
            start = time.perf_counter()
            for k, i in enumerate(range(0, len(events), per_tick)):
                await ledger.append_many(events[i : i + per_tick])
                delay = start + (k + 1) * tick - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() - start > seconds:
                    break
            stop.set()

        async def sample() -> None:
            while not stop.is_set():
                samples.append((await lag(client, keys))[1])
                await asyncio.sleep(0.02)

        await asyncio.gather(produce(), sample())
    finally:
        proc.terminate()
        await proc.wait()
        await client.aclose()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of the lag measurement")
    parser.add_argument("--rate", type=int, default=1000, help="events/s offered during the lag measurement")
    parser.add_argument("--redis-url")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    with redis_or_embedded(args.redis_url, prefix="rl-bench-replay-") as url:
        say(f"appending {args.events:,} events …")
        asyncio.run(append_mix(url, args.events))
        gc.collect()

        done, _ = _child(url, "replay", "rebuild", "--json")
        if done.returncode != 0:
            raise SystemExit(f"rebuild failed: {done.stderr}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rebuild_eps = result["events"] / result["seconds"]
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        say(
            f"rebuild: {result['events']:,} events in {result['seconds']:.2f} s "
            f"= {rebuild_eps:,.0f} events/s, peak RSS {peak_mb:,.0f} MB"
        )

        done, verify_s = _child(url, "replay", "verify")
        say(f"verify: exit {done.returncode} in {verify_s:.2f} s (child process, start-up included)")
        if done.returncode != 0:
            raise SystemExit(f"verify failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")

        folded, projector_s = asyncio.run(_projector_rate(url))
        projector_eps = folded / projector_s
        say(
            f"projector: {folded:,} events from scratch in {projector_s:.2f} s "
            f"= {projector_eps:,.0f} events/s"
        )

        samples = asyncio.run(_lag_under_load(url, args.seconds, args.rate))
        samples.sort()
        p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))] if samples else 0
        say(
            f"lag at {args.rate:,} events/s over {args.seconds:.0f} s: {len(samples)} samples, "
            f"median {statistics.median(samples) if samples else 0:.0f} ms, p99 {p99} ms, "
            f"max {max(samples, default=0)} ms"
        )

    print(
        json.dumps(
            {
                "bench": "replay",
                "events": args.events,
                "rebuild_eps": round(rebuild_eps),
                "rebuild_peak_mb": round(peak_mb),
                "verify_s": round(verify_s, 2),
                "projector_eps": round(projector_eps),
                "lag_p99_ms": p99,
            }
        )
    )


if __name__ == "__main__":
    main()
