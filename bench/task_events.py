"""A task's events: the entry index against the whole-ledger scan it replaced, side by side.

    python -m bench.task_events [--tasks 20000,100000] [--lookups L] [--scans S] [--repeat R]
                                [--redis-url URL] [--json]

For each size it appends a synthetic history of that many tasks (sim/synthetic.py: submitted,
routed, claimed, completed, now and then failed, reclaimed, cancelled, benchmarks), folds it with
the projector without the index work and with it (alternating, `--repeat` times each; CPU of
this process per ledger entry, medians), then times `Gateway.events_of` for a known and an
unknown task id (median of `--lookups` calls) against the old scan (median of `--scans` calls; the
scan lives only here, for the comparison). It also prints the bytes of a stored task row without
and with its entry list. Without --redis-url it starts an embedded redis-server in a temporary
directory. The last line printed is JSON: {"bench": "task_events", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import redis.asyncio as aioredis

import projections.folder as folder_module
import projections.projector as projector_module
from dispatch.gateway import Gateway
from events.codec import decode_rows
from events.compression import unpack
from events.event import Event
from events.keys import Keys
from events.ledger import Ledger
from projections import store
from projections.projector import Projector
from routeledger.embedded import redis_or_embedded
from sim.synthetic import HistoryMaker

# A week of history: every task row stays within retention (a year would drop most shards).
SPAN_MS = 7 * 86_400_000


@contextlib.contextmanager
def index_off() -> Iterator[None]:
    """The projector as it was before the index: no mention decoded, no entry listed."""
    read_mention, add_entry = projector_module.read_mention, folder_module.add_entry
    projector_module.read_mention = lambda flat: None  # type: ignore[assignment]
    folder_module.add_entry = lambda entries, ms, seq: None  # type: ignore[assignment]
    try:
        yield
    finally:
        projector_module.read_mention, folder_module.add_entry = read_mention, add_entry


async def old_scan(ledger: Ledger, task_id: str) -> list[tuple[str, Event]]:
    """The replaced `Gateway.events_of`: the whole ledger in chunks, filtered on the bytes."""
    found: list[tuple[str, Event]] = []
    needle = task_id.encode()

    def plain(value: bytes) -> bytes:
        try:
            return unpack(value)
        except ValueError:
            return value

    async for batch in ledger.read_raw(chunk=5000):
        hits = [(i, flat) for i, flat in batch if any(needle in plain(part) for part in flat[1::2])]
        for entry_id, event in decode_rows(hits, lambda exc: None):
            if getattr(event, "task_id", None) == task_id:
                found.append((entry_id, event))
    return found


async def fold(client: aioredis.Redis, keys: Keys) -> tuple[float, int, list[bytes]]:
    """Fold the whole ledger into a fresh namespace: CPU seconds, entries, the stored task rows."""
    for key in await client.keys(f"{keys.prefix}p:*"):
        await client.delete(key)
    projector = Projector(client, keys, batch=2000)
    await projector.start()
    cpu = time.process_time()
    await projector.catch_up()
    cpu = time.process_time() - cpu
    ns = await store.current(client, keys)
    assert ns is not None
    rows: list[bytes] = []
    for key in await client.keys(keys.table(ns, f"{store.TASKS}:*")):
        rows += (await client.hgetall(key)).values()
    return cpu, projector.folded, rows


async def timed(make: Any, n: int) -> float:
    """Median ms of `n` awaited calls of `make()`."""
    out: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        await make()
        out.append((time.perf_counter() - t) * 1000)
    return statistics.median(out)


async def measure(url: str, tasks: int, lookups: int, scans: int, repeat: int) -> dict[str, float]:
    client = aioredis.Redis.from_url(url)
    keys = Keys()
    ledger = Ledger(client, keys)
    try:
        await client.flushall()
        maker = HistoryMaker(tasks, span_ms=SPAN_MS)
        known = ""
        for batch in maker.batches(5000):
            for start in range(0, len(batch), 1000):
                await ledger.append_many(batch[start : start + 1000])
            if not known:
                known = next(e.task_id for e in batch[len(batch) // 2 :] if hasattr(e, "task_id"))
        entries = await ledger.length()
        before_cpu, after_cpu = [], []
        after_rows: list[bytes] = []
        for _ in range(repeat):
            with index_off():
                cpu, folded, _ = await fold(client, keys)
            before_cpu.append(cpu / folded * 1e6)
            cpu, folded, after_rows = await fold(client, keys)
            after_cpu.append(cpu / folded * 1e6)
        # A row as it was before the field existed: the same row, `entries` left out.
        decode = msgspec.msgpack.Decoder(dict[str, Any]).decode
        rows = [decode(r) for r in after_rows]
        bare = [len(msgspec.msgpack.encode({k: v for k, v in row.items() if k != "entries"})) for row in rows]
        gw = Gateway(client, keys)
        events = await gw.events_of(known)
        assert events == await old_scan(ledger, known), "the index and the scan disagree"
        history = await gw.history(known)
        return {
            "tasks": tasks,
            "entries": entries,
            "events_of_task": len(events),
            "index_entries_read": history.indexed + history.tail_read,
            "new_known_ms": await timed(lambda: gw.events_of(known), lookups),
            "new_unknown_ms": await timed(lambda: gw.events_of("no-such-task"), lookups),
            "old_known_ms": await timed(lambda: old_scan(ledger, known), scans),
            "old_unknown_ms": await timed(lambda: old_scan(ledger, "no-such-task"), scans),
            "row_bytes_before": statistics.fmean(bare),
            "row_bytes_after": statistics.fmean(len(r) for r in after_rows),
            "events_per_row": statistics.fmean(len(row["entries"]) / 2 for row in rows),
            "projector_cpu_us_per_entry_before": statistics.median(before_cpu),
            "projector_cpu_us_per_entry_after": statistics.median(after_cpu),
        }
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="20000,100000", help="comma-separated history sizes")
    parser.add_argument("--lookups", type=int, default=50, help="index lookups timed per id")
    parser.add_argument("--scans", type=int, default=3, help="whole-ledger scans timed per id")
    parser.add_argument("--repeat", type=int, default=3, help="folds per variant (before/after)")
    parser.add_argument("--redis-url")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    sizes = [int(s) for s in args.tasks.split(",")]

    with redis_or_embedded(args.redis_url, prefix="rl-bench-") as url:
        results = [asyncio.run(measure(url, n, args.lookups, args.scans, args.repeat)) for n in sizes]

    figures: dict[str, Any] = {"bench": "task_events"}
    for r in results:
        n = int(r["tasks"])
        if not args.json:
            print(
                f"{n:,} tasks ({int(r['entries']):,} ledger entries); the task has "
                f"{int(r['events_of_task'])} events, the index read {int(r['index_entries_read'])} entries"
            )
            print(
                f"  events_of known id:   index {r['new_known_ms']:.2f} ms, scan {r['old_known_ms']:,.0f} ms "
                f"(median of {args.lookups} / {args.scans})"
            )
            print(
                f"  events_of unknown id: index {r['new_unknown_ms']:.2f} ms, "
                f"scan {r['old_unknown_ms']:,.0f} ms"
            )
            growth = r["row_bytes_after"] - r["row_bytes_before"]
            print(
                f"  task row (mean of stored rows): {r['row_bytes_before']:.1f} bytes without the entry "
                f"list, {r['row_bytes_after']:.1f} with it: +{growth:.1f} bytes for "
                f"{r['events_per_row']:.2f} events, "
                f"{growth / r['events_per_row']:.2f} bytes per event (key and list header included)"
            )
            print(
                f"  projector CPU per ledger entry: {r['projector_cpu_us_per_entry_before']:.1f} us before, "
                f"{r['projector_cpu_us_per_entry_after']:.1f} us after (median of {args.repeat} folds each)"
            )
        for k, v in r.items():
            if k != "tasks":
                figures[f"{k}_{n}"] = round(v, 3) if isinstance(v, float) else v
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
