"""Rebuild from the archive against rebuild from the stream, side by side, on the same ledger.

    python bench/archive.py [--events N] [--redis-url URL] [--json]

Without --redis-url it starts an embedded redis-server (AOF on, as `routeledger up` runs it) in a
temporary directory; with one, that Redis is FLUSHED first. Steps:

1. append N events of a realistic mix (bench/ledger.py's) and fold them with a projector;
2. `routeledger replay rebuild --no-switch` in a child process: the rate from the stream; and, in
   this process, the rate of reading the history into frames alone (the part the archive speeds up;
   the fold and the namespace write after it are the same either way);
3. `routeledger archive --hot-window 0` in a child process: everything folded goes to Parquet;
4. the same two rates from the archive;
5. `routeledger replay verify`: that the archive's history still matches the live tables.

The last line printed is JSON: {"bench": "archive", "events": N, "stream_eps": ..., "archive_eps": ...,
"stream_read_eps": ..., "archive_read_eps": ..., "archive_s": ..., "archive_mb": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger import realistic_mix

from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from replay.frames import Frames
from replay.history import History
from replay.rebuild import gc_paused
from routeledger.embedded import EmbeddedRedis


def _child(url: str, archive_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "routeledger", *args, "--redis-url", url],
        capture_output=True,
        text=True,
        env={**os.environ, "ROUTELEDGER_LOG_LEVEL": "warning", "ROUTELEDGER_ARCHIVE_DIR": str(archive_dir)},
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(
            f"`routeledger {' '.join(args)}` failed: {done.stdout[-2000:]} {done.stderr[-2000:]}"
        )
    return done, time.perf_counter() - started


def _rebuild_eps(url: str, archive_dir: Path) -> tuple[int, float]:
    done, _ = _child(url, archive_dir, "replay", "rebuild", "--no-switch", "--json")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["events"], result["events"] / result["seconds"]


async def _append(url: str, n: int) -> None:
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


async def _fold(url: str) -> int:
    client = aioredis.Redis.from_url(url)
    try:
        projector = Projector(client, Keys())
        await projector.start()
        return await projector.catch_up()
    finally:
        await client.aclose()


async def _read_eps(url: str, archive_dir: Path | None) -> float:
    """Events per second of reading the whole history into frames (no fold), in this process."""
    client = aioredis.Redis.from_url(url)
    try:
        with gc_paused():
            started = time.perf_counter()
            n, _ = await History(client, Keys(), archive_dir).fold_into(Frames(), on_poison=lambda _: None)
            return n / (time.perf_counter() - started)
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--redis-url")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    server: EmbeddedRedis | None = None
    tmp = tempfile.TemporaryDirectory(prefix="rl-bench-archive-")
    archive_dir = Path(tmp.name) / "archive"
    try:
        if args.redis_url:
            url = args.redis_url
        else:
            server = EmbeddedRedis(Path(tmp.name) / "redis")
            url = server.start()
        say(f"appending {args.events:,} events and folding them …")
        asyncio.run(_append(url, args.events))
        asyncio.run(_fold(url))

        n, stream_eps = _rebuild_eps(url, archive_dir)
        stream_read_eps = asyncio.run(_read_eps(url, None))
        say(f"rebuild from the stream:  {n:,} events at {stream_eps:,.0f} events/s")
        say(f"  reading it into frames alone: {stream_read_eps:,.0f} events/s")

        done, archive_s = _child(url, archive_dir, "archive", "--hot-window", "0", "--json")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        archive_mb = report["bytes"] / 2**20
        say(
            f"archive: {report['archived']:,} events into {report['segments']} segment(s), "
            f"{archive_mb:,.1f} MB, in {archive_s:.2f} s (child process, start-up included); "
            f"{report['hot']:,} left in the stream"
        )

        n, archive_eps = _rebuild_eps(url, archive_dir)
        archive_read_eps = asyncio.run(_read_eps(url, archive_dir))
        say(f"rebuild from the archive: {n:,} events at {archive_eps:,.0f} events/s")
        say(f"  reading it into frames alone: {archive_read_eps:,.0f} events/s")
        _child(url, archive_dir, "replay", "verify")
        say("verify: the live tables match the archived history")
    finally:
        if server is not None:
            server.stop()
        tmp.cleanup()

    print(
        json.dumps(
            {
                "bench": "archive",
                "events": args.events,
                "stream_eps": round(stream_eps),
                "archive_eps": round(archive_eps),
                "stream_read_eps": round(stream_read_eps),
                "archive_read_eps": round(archive_read_eps),
                "archive_s": round(archive_s, 2),
                "archive_mb": round(archive_mb, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
