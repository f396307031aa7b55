"""One Redis against a 3-master Redis Cluster, side by side: ledger appends, projector catch-up, dispatch.

    python -m bench.cluster [--events N] [--batch B] [--singles S] [--fold N] [--tasks T] [--workers W]
        [--slots K] [--rounds R] [--json]

It starts one embedded redis-server and one embedded 3-master cluster (no replicas) in temporary
directories, and measures on each, in the same run:

- append: `Ledger.append_many` of N events of bench/ledger.py's mix in batches of B, and S single
  `Ledger.append` calls, events/s;
- projector: a fresh projector folding a ledger of N events (its catch-up), events/s;
- dispatch: bench/dispatch.py's fleet (sim hosts, workers as processes) running T tasks, tasks/s.

Each figure is the median of R rounds; the rounds alternate between the two. On a cluster the
ledger is one stream in one slot, so its appends and folds go to one node, as on one Redis; what
spreads (outputs, results, projections, quotas) costs extra round trips to other nodes. The last line is JSON:
{"bench": "cluster", "append_ratio_cluster_vs_single": ..., "projector_ratio_cluster_vs_single": ...,
"dispatch_ratio_cluster_vs_single": ..., ...}
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import dispatch as dispatch_bench
from bench import ledger as ledger_bench
from events.connection import redis_client
from events.event import Event
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from routeledger.embedded import EmbeddedCluster, EmbeddedRedis


async def append_rates(url: str, events: list[Event], batch: int, singles: int) -> tuple[float, float]:
    """Events/s appended in batches of `batch`, and by single appends of the first `singles`."""
    client = redis_client(url)
    try:
        ledger = Ledger(client, Keys.for_client(client))
        start = time.perf_counter()
        for i in range(0, len(events), batch):
            await ledger.append_many(events[i : i + batch])
        batched = len(events) / (time.perf_counter() - start)
        start = time.perf_counter()
        for event in events[:singles]:
            await ledger.append(event)
        single = singles / (time.perf_counter() - start)
        return batched, single
    finally:
        await client.aclose()


async def fold_rate(url: str, events: list[Event]) -> float:
    """Events/s a fresh projector folds, from start to the end of its catch-up over `events`."""
    client = redis_client(url)
    try:
        await Ledger(client, Keys.for_client(client)).append_many(events)
        projector = Projector(client)
        start = time.perf_counter()
        await projector.start()
        folded = await projector.catch_up()
        elapsed = time.perf_counter() - start
        await projector.release()
        assert projector.folded >= len(events), f"folded {folded} ({projector.folded}) of {len(events)}"
        return len(events) / elapsed
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000, help="events appended per round")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--singles", type=int, default=2000, help="single appends per round")
    parser.add_argument("--fold", type=int, default=20_000, help="events the projector folds per round")
    parser.add_argument("--tasks", type=int, default=300, help="dispatch tasks per round")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dispatch-limit-s", type=float, default=20, help="a dispatch round not done by then has no figure"
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()

    events = ledger_bench.realistic_mix(max(args.events, args.fold))
    gc.freeze()  # the generated input stands for what producers wrote (see bench/ledger.py)
    tmp = tempfile.TemporaryDirectory(prefix="rl-bench-cluster-")
    single = EmbeddedRedis(Path(tmp.name) / "single")
    cluster = EmbeddedCluster(Path(tmp.name) / "cluster", masters=3)
    figures: dict[str, dict[str, list[float]]] = {}
    try:
        single_url = single.start()
        cluster.start()

        def flush_single() -> None:
            async def go() -> None:
                client = redis_client(single_url)
                await client.flushall()
                await client.aclose()

            asyncio.run(go())

        targets = (("single", single_url, flush_single), ("cluster", cluster.url, cluster.flush))
        figures = {
            name: {"append_batched": [], "append_single": [], "projector": [], "dispatch": []}
            for name, _url, _flush in targets
        }
        dispatch_failed: set[str] = set()
        # Rounds alternate between the two, so that a slow spell of a shared machine falls on both.
        for _ in range(args.rounds):
            for name, url, flush in targets:
                mine = figures[name]
                flush()
                batched, one = asyncio.run(append_rates(url, events[: args.events], args.batch, args.singles))
                mine["append_batched"].append(batched)
                mine["append_single"].append(one)
                flush()
                mine["projector"].append(asyncio.run(fold_rate(url, events[: args.fold])))
                if name in dispatch_failed:
                    continue
                flush()
                try:
                    tps, _lat, _cpu, _rtt = dispatch_bench.measure(
                        url,
                        workers=args.workers,
                        slots=args.slots,
                        tasks=args.tasks,
                        latency_samples=5,
                        limit_s=args.dispatch_limit_s,
                    )
                except SystemExit as exc:
                    # Reported as no figure (null in the JSON line), not as a rate of zero.
                    print(f"dispatch on {name}: {exc}", file=sys.stderr)
                    dispatch_failed.add(name)
                    mine["dispatch"].clear()
                    continue
                mine["dispatch"].append(tps)
    finally:
        cluster.stop()
        single.stop()
        tmp.cleanup()

    med = {
        name: {k: statistics.median(v) if v else None for k, v in f.items()} for name, f in figures.items()
    }

    def ratio(label: str) -> float | None:
        s, c = med["single"][label], med["cluster"][label]
        return round(c / s, 3) if s and c is not None else None

    def rounded(value: float | None, digits: int | None = None) -> float | None:
        return None if value is None else round(value, digits)

    if not args.json:
        print(
            f"{args.rounds} rounds; appends: {args.events} events in batches of {args.batch} and"
            f" {args.singles} single; projector: {args.fold} events; dispatch: {args.tasks} tasks on"
            f" {args.workers} workers x {args.slots} slots"
        )
        for label, unit in (
            ("append_batched", "events/s"),
            ("append_single", "events/s"),
            ("projector", "events/s"),
            ("dispatch", "tasks/s"),
        ):
            s, c = med["single"][label], med["cluster"][label]
            shown = [f"{v:>10,.0f}" if v is not None else "   no figure" for v in (s, c)]
            print(
                f"  {label:15} single {shown[0]}  cluster {shown[1]} {unit}  (cluster/single {ratio(label)})"
            )
    line: dict[str, object] = {
        "bench": "cluster",
        "append_ratio_cluster_vs_single": ratio("append_batched"),
        "single_append_ratio_cluster_vs_single": ratio("append_single"),
        "projector_ratio_cluster_vs_single": ratio("projector"),
        "dispatch_ratio_cluster_vs_single": ratio("dispatch"),
    }
    for name, m in med.items():
        line[f"append_eps_{name}"] = rounded(m["append_batched"])
        line[f"single_append_eps_{name}"] = rounded(m["append_single"])
        line[f"projector_eps_{name}"] = rounded(m["projector"])
        line[f"dispatch_tasks_per_s_{name}"] = rounded(m["dispatch"], 1)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
