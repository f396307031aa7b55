"""Rebuild from the archive against rebuild from the stream, side by side, on the same ledger.

    python -m bench.archive [--events N] [--redis-url URL] [--json]
    python -m bench.archive --history-tasks T --data-dir DIR [--hot-tasks H] [--baseline REV] [--json]

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
"stream_read_eps": ..., "archive_read_eps": ..., "archive_s": ..., "archive_mb": ...,
"stream_rss_mb": ..., "archive_rss_mb": ...};
`*_rss_mb` is the peak resident memory of the rebuild's child process (and its children), sampled.

With --history-tasks, a long history instead: T tasks of sim/synthetic.py's history (about 4.2
events each, so 2.4M tasks is 10^7 events) over the year that ends an hour ago, archived as Parquet
segments in DIR once (entry ids from each event's own clock, so task rows fall in the day shards of
their history; a later run with the same T reuses them), and the last H tasks appended to the stream
of a fresh Redis. One `routeledger replay rebuild --no-switch` in a child process then reads archive
+ stream; its events/s and peak RSS are printed, and with --baseline REV the same rebuild run from
the source of git revision REV first, on the same data. The JSON line: {"bench": "rebuild", "events":
N, "tasks": T, "rebuild_eps": ..., "rebuild_s": ..., "peak_rss_mb": ..., "baseline": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import polars as pl
import psutil
import redis.asyncio as aioredis

from bench.ledger import append_mix
from events.codec import encode_event
from events.event import Event
from events.keys import Keys
from events.ledger import Ledger, WireEntry
from projections.projector import Projector
from replay import segment
from replay.archive import segment_frame, write_segment
from replay.frames import Frames
from replay.history import History
from replay.rebuild import gc_paused
from routeledger.embedded import EmbeddedRedis
from sim.synthetic import YEAR_MS, HistoryMaker

# Samples of a child's resident memory per second: a peak lasts longer than this.
_RSS_EVERY_S = 0.02


class PeakRss:
    """The peak resident memory of a process and its children, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                tree = [self.process, *self.process.children(recursive=True)]
                total = sum(p.memory_info().rss for p in tree)
            except psutil.Error:
                # The process ended between two samples.
                return
            self.peak = max(self.peak, total)
            self._stop.wait(_RSS_EVERY_S)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_child(
    url: str, archive_dir: Path, *args: str, source: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """Run `routeledger ARGS` (from `source`, a checkout, when given); output, seconds, peak RSS bytes."""
    started = time.perf_counter()
    env = {**os.environ, "ROUTELEDGER_LOG_LEVEL": "warning", "ROUTELEDGER_ARCHIVE_DIR": str(archive_dir)}
    if source is not None:
        # `-m` puts the working directory first on sys.path: the checkout's packages win.
        env["PYTHONPATH"] = str(source)
    with subprocess.Popen(
        [sys.executable, "-m", "routeledger", *args, "--redis-url", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=source,
    ) as proc:
        rss = PeakRss(proc.pid)
        stdout, stderr = proc.communicate()
        peak = rss.stop()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if done.returncode != 0:
        raise SystemExit(
            f"`routeledger {' '.join(args)}` failed: {done.stdout[-2000:]} {done.stderr[-2000:]}"
        )
    return done, time.perf_counter() - started, peak


def _rebuild(url: str, archive_dir: Path, source: Path | None = None) -> tuple[int, float, float]:
    """One rebuild in a child process: events, seconds (as the command times itself), peak RSS in MB."""
    done, _, peak = run_child(url, archive_dir, "replay", "rebuild", "--no-switch", "--json", source=source)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["events"], result["seconds"], peak / 2**20


def _rebuild_eps(url: str, archive_dir: Path) -> tuple[int, float, float]:
    n, seconds, rss_mb = _rebuild(url, archive_dir)
    return n, n / seconds, rss_mb


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


# -- a long synthetic history, archived once -----------------------------------------------


def _history(tasks: int) -> HistoryMaker:
    """The year of history that ends an hour ago (the day shards of its last month are live)."""
    end = time.time_ns() // 1_000_000 - 3_600_000
    return HistoryMaker(tasks, start_ms=end - YEAR_MS, span_ms=YEAR_MS)


def _archived_rows(maker: HistoryMaker) -> Iterator[list[WireEntry]]:
    """Ledger rows of the maker's tasks, with ids from each event's clock (kept increasing)."""
    last_ms, seq = 0, 0
    for batch in maker.batches(20_000):
        rows: list[WireEntry] = []
        for event in batch:
            ms = max(last_ms, event.at)
            seq = seq + 1 if ms == last_ms else 0
            last_ms = ms
            kind, version, data = encode_event(event)
            rows.append([f"{ms}-{seq}".encode(), [b"type", kind, b"v", version, b"data", data]])
        yield rows


def _write_history(
    directory: Path, tasks: int, hot_tasks: int, say: Callable[[str], None]
) -> segment.Manifest:
    """The archive of the first `tasks - hot_tasks` tasks in `directory`, written unless there."""
    found = segment.load_manifest(directory)
    token = f"synthetic-{tasks}-{hot_tasks}"
    if found is not None and found.ledger == token:
        return found
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob(segment.SEGMENT_GLOB):
        old.unlink()
    say(f"writing the archive of {tasks - hot_tasks:,} synthetic tasks into {directory} (once) …")
    maker = _history(tasks)
    maker.tasks = tasks - hot_tasks
    manifest = segment.Manifest(ledger=token, stream=Keys().events)
    parts: list[pl.DataFrame] = []
    count = 0
    for rows in _archived_rows(maker):
        parts.append(segment_frame(rows))
        count += len(rows)
        if count >= 500_000:
            manifest.segments.append(write_segment(directory, pl.concat(parts)))
            parts, count = [], 0
    if parts:
        manifest.segments.append(write_segment(directory, pl.concat(parts)))
    segment.save_manifest(directory, manifest)
    return manifest


async def _adopt_history(
    url: str, directory: Path, manifest: segment.Manifest, tasks: int, hot_tasks: int
) -> int:
    """A fresh Redis that owns the archive in `directory`, with the last `hot_tasks` tasks in its
    stream; returns the events in the stream."""
    client = aioredis.Redis.from_url(url)
    try:
        await client.flushall()
        keys = Keys()
        await client.hset(
            keys.archive,
            mapping={
                "ledger": manifest.ledger,
                "last_id": manifest.last_id or "",
                "segments": len(manifest.segments),
                "events": manifest.events,
                "bytes": manifest.bytes,
                "dir": str(directory),
            },
        )
        ledger = Ledger(client, keys)
        hot = 0
        for batch in _history(tasks).batches(5_000, first=tasks - hot_tasks):
            events: list[Event] = batch
            await ledger.append_many(events)
            hot += len(events)
        return hot
    finally:
        await client.aclose()


def _baseline_source(rev: str, into: Path) -> Path:
    """The project's source at git revision `rev`, unpacked into `into`."""
    root = Path(__file__).resolve().parent.parent
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def _history_main(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    server: EmbeddedRedis | None = None
    tmp = tempfile.TemporaryDirectory(prefix="rl-bench-rebuild-")
    directory = Path(args.data_dir) / f"archive-{args.history_tasks}-{args.hot_tasks}"
    baseline: dict[str, Any] | None = None
    try:
        manifest = _write_history(directory, args.history_tasks, args.hot_tasks, say)
        if args.redis_url:
            url = args.redis_url
        else:
            server = EmbeddedRedis(Path(tmp.name) / "redis")
            url = server.start()
        hot = asyncio.run(_adopt_history(url, directory, manifest, args.history_tasks, args.hot_tasks))
        say(
            f"history: {manifest.events:,} archived events in {len(manifest.segments)} segments, "
            f"{hot:,} in the stream"
        )
        if args.baseline:
            source = _baseline_source(args.baseline, Path(tmp.name) / "baseline")
            n, seconds, rss_mb = _rebuild(url, directory, source)
            baseline = {
                "rev": args.baseline,
                "rebuild_eps": round(n / seconds),
                "rebuild_s": round(seconds, 2),
                "peak_rss_mb": round(rss_mb),
            }
            say(
                f"rebuild at {args.baseline}: {n:,} events in {seconds:.2f} s, "
                f"{n / seconds:,.0f} events/s, peak RSS {rss_mb:,.0f} MB"
            )
        n, seconds, rss_mb = _rebuild(url, directory)
        say(
            f"rebuild now: {n:,} events in {seconds:.2f} s, "
            f"{n / seconds:,.0f} events/s, peak RSS {rss_mb:,.0f} MB"
        )
    finally:
        if server is not None:
            server.stop()
        tmp.cleanup()
    print(
        json.dumps(
            {
                "bench": "rebuild",
                "events": n,
                "tasks": args.history_tasks,
                "rebuild_eps": round(n / seconds),
                "rebuild_s": round(seconds, 2),
                "peak_rss_mb": round(rss_mb),
                "baseline": baseline,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--redis-url")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--history-tasks", type=int, help="rebuild a synthetic history of this many tasks")
    parser.add_argument(
        "--hot-tasks", type=int, default=20_000, help="of them, the newest left in the stream"
    )
    parser.add_argument("--data-dir", help="where the synthetic history's archive is kept between runs")
    parser.add_argument("--baseline", help="also rebuild with the source of this git revision, first")
    args = parser.parse_args()

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    if args.history_tasks is not None:
        if not args.data_dir:
            parser.error("--history-tasks needs --data-dir (the archive is written there once)")
        _history_main(args, say)
        return

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
        asyncio.run(append_mix(url, args.events))
        asyncio.run(_fold(url))

        n, stream_eps, stream_rss_mb = _rebuild_eps(url, archive_dir)
        stream_read_eps = asyncio.run(_read_eps(url, None))
        say(
            f"rebuild from the stream:  {n:,} events at {stream_eps:,.0f} events/s, "
            f"peak RSS {stream_rss_mb:,.0f} MB"
        )
        say(f"  reading it into frames alone: {stream_read_eps:,.0f} events/s")

        done, archive_s, _ = run_child(url, archive_dir, "archive", "--hot-window", "0", "--json")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        archive_mb = report["bytes"] / 2**20
        say(
            f"archive: {report['archived']:,} events into {report['segments']} segment(s), "
            f"{archive_mb:,.1f} MB, in {archive_s:.2f} s (child process, start-up included); "
            f"{report['hot']:,} left in the stream"
        )

        n, archive_eps, archive_rss_mb = _rebuild_eps(url, archive_dir)
        archive_read_eps = asyncio.run(_read_eps(url, archive_dir))
        say(
            f"rebuild from the archive: {n:,} events at {archive_eps:,.0f} events/s, "
            f"peak RSS {archive_rss_mb:,.0f} MB"
        )
        say(f"  reading it into frames alone: {archive_read_eps:,.0f} events/s")
        run_child(url, archive_dir, "replay", "verify")
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
                "stream_rss_mb": round(stream_rss_mb),
                "archive_rss_mb": round(archive_rss_mb),
            }
        )
    )


if __name__ == "__main__":
    main()
