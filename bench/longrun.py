"""A ledger that lives for years: what history costs as it grows.

    python -m bench.longrun [--tasks N] [--hot-window S] [--json]

Steps, each on an embedded redis-server (AOF on, as `routeledger up` runs it) in a temporary
directory:

1. `bench/ledger_bytes.py` (a child process): ledger bytes per task with 3 holders, and the
   ledger bytes one worker's liveness costs per day.
2. A synthetic history of N tasks (default 2,400,000: about 10^7 events) with stream ids spread
   over a year ending now, appended in batches; a projector folds each batch and the archiver runs
   every 250,000 tasks with a one-day hot window (replay/longrun.py), as `up` would over the year.
   At 10^5, 10^6, 2x10^6 tasks and at the end: a fresh projector's start time (median of 5),
   Redis `used_memory`, and `routeledger replay rebuild --no-switch` from archive + stream in a
   child process: its time, events/s and peak RSS (sampled every 20 ms with psutil).
3. `routeledger replay verify` at the end: the live tables equal the rebuilt ones.

Prints the growth table, then a JSON line last:
{"bench": "longrun", "ledger_bytes_per_task", "heartbeat_bytes_per_worker_day",
 "redis_used_memory_mb_after_archive", "rebuild_events_per_s", "rebuild_peak_rss_mb",
 "projector_start_s_max", "marks": [...]}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench.archive import run_child
from events.keys import Keys
from projections import store
from replay.longrun import LongRun, Mark
from routeledger.embedded import EmbeddedRedis


def say(text: str, quiet: bool) -> None:
    if not quiet:
        print(text, flush=True)


def ledger_bytes() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.ledger_bytes", "--json", "--tasks", "3000"],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def rebuild(url: str, archive_dir: Path) -> tuple[int, float, float, str]:
    """A rebuild from archive + stream in a child process: events, seconds, peak RSS in MB, and the
    namespace it wrote (not switched to: the caller drops it)."""
    done, _, peak = run_child(url, archive_dir, "replay", "rebuild", "--no-switch", "--json")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return int(result["events"]), float(result["seconds"]), peak / 2**20, str(result["namespace"])


async def history(
    url: str, archive_dir: Path, tasks: int, hot_window_s: float, quiet: bool
) -> list[dict[str, Any]]:
    client = aioredis.Redis.from_url(url)
    rows: list[dict[str, Any]] = []
    try:
        run = LongRun(
            client, Keys(), archive_dir, tasks=tasks, hot_window_s=hot_window_s, batch_tasks=100_000
        )
        marks = sorted({m for m in (100_000, 1_000_000, 2_000_000, tasks) if m <= tasks})
        started = time.perf_counter()
        done = 0
        for target in marks:
            while done < target:
                step = min(run.batch_tasks, target - done)
                await run.append_tasks(done, step)
                done += step
                await run.fold()
                if done % run.archive_every_tasks == 0:
                    await run.archive()
            await run.archive()
            mark: Mark = await run.mark(done)
            events, seconds, rss, ns = await asyncio.to_thread(rebuild, url, archive_dir)
            # The rebuilt namespace was not switched to: drop it, or the next mark would count it.
            await store.retire(client, run.keys, ns, after_ms=1)
            row = {
                "tasks": done,
                "events": mark.events,
                "projector_start_ms": round(mark.projector_start_s * 1000, 2),
                "redis_used_memory_mb": round(mark.used_memory / 2**20, 1),
                "stream_entries": mark.stream_length,
                "archived_events": mark.archived_events,
                "rebuild_s": round(seconds, 2),
                "rebuild_events_per_s": round(events / seconds) if seconds > 0 else 0,
                "rebuild_peak_rss_mb": round(rss),
            }
            rows.append(row)
            say(f"{time.perf_counter() - started:7.0f} s  {row}", quiet)
        await asyncio.to_thread(run_child, url, archive_dir, "replay", "verify")
        say("verify: the live tables equal a rebuild from archive + stream", quiet)
    finally:
        await client.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=2_400_000, help="tasks of history (default 2,400,000)")
    parser.add_argument(
        "--hot-window", type=float, default=86_400.0, help="seconds kept in Redis (default 1 day)"
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    quiet = args.json

    sizes = ledger_bytes()
    say(
        f"ledger bytes per task (3 holders): {sizes['ledger_bytes_per_task']:,}; "
        f"liveness per worker-day: {sizes['heartbeat_bytes_per_worker_day']:,} bytes",
        quiet,
    )
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis")
        url = server.start()
        try:
            rows = asyncio.run(history(url, Path(tmp) / "archive", args.tasks, args.hot_window, quiet))
        finally:
            server.stop()
    say(
        "\n| tasks | events | projector start | Redis used_memory | rebuild | rebuild events/s | peak RSS |",
        quiet,
    )
    say("|---|---|---|---|---|---|---|", quiet)
    for r in rows:
        say(
            f"| {r['tasks']:,} | {r['events']:,} | {r['projector_start_ms']} ms "
            f"| {r['redis_used_memory_mb']} MB | {r['rebuild_s']} s "
            f"| {r['rebuild_events_per_s']:,} | {r['rebuild_peak_rss_mb']} MB |",
            quiet,
        )
    last = rows[-1]
    at_2m = next((r for r in rows if r["tasks"] == 2_000_000), last)
    print(
        json.dumps(
            {
                "bench": "longrun",
                "ledger_bytes_per_task": sizes["ledger_bytes_per_task"],
                "heartbeat_bytes_per_worker_day": sizes["heartbeat_bytes_per_worker_day"],
                "redis_used_memory_mb_after_archive": at_2m["redis_used_memory_mb"],
                "rebuild_events_per_s": last["rebuild_events_per_s"],
                "rebuild_peak_rss_mb": last["rebuild_peak_rss_mb"],
                "projector_start_s_max": max(r["projector_start_ms"] for r in rows) / 1000,
                "marks": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
