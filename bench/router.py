"""Router decision time: estimate + plan + choose for 50 workers x 20 models with a backlog of 100.

    python bench/router.py [--workers 50] [--models 20] [--backlog 100] [--decisions 2000] [--json]

One decision is what the API does for a request with model=auto (rank every model's holders on
the plan of its queue, score each model's utility) plus one worker's gate check. The fits of the
snapshot (the two-way speed fit, the pooled tables) are built once per snapshot, as the API and
the workers do, and the estimates a decision reads are cached with them (per snapshot). The
first decision on a new snapshot also computes those estimates: reported as `cold_*`. The last
line is JSON: {"bench": "router", "decision_p50_us": ..., "decision_p99_us": ..., ...}.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

# This script is named like the package it measures: without its own folder on the path, `import
# router` finds the package and not this file.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from projections.snapshot import DEFAULT_HALF_LIFE_S, LengthRow, QualityRow, Snapshot, SpeedRow, Stat, fold  # noqa: E402
from router.choose import RouteQuery, decide  # noqa: E402
from router.estimate import build_estimator  # noqa: E402
from router.gate import should_take  # noqa: E402
from router.plan import BacklogEntry, FleetView, RunningTask, WorkerView  # noqa: E402

NOW = 1_764_000_000_000
DOMAINS = ("general", "code", "japanese")


def _stat(rng: random.Random, mean: float, n: int) -> Stat:
    s = Stat()
    for i in range(n):
        s = fold(s, mean * rng.uniform(0.9, 1.1), NOW - i * 600_000, DEFAULT_HALF_LIFE_S)
    return s


def build(
    workers: int, models: int, backlog: int, seed: int = 1
) -> tuple[Snapshot, FleetView, dict[str, str]]:
    rng = random.Random(seed)
    digests = {f"model-{m}": f"{m:064x}" for m in range(models)}
    names = list(digests)
    snap = Snapshot(half_life_s=DEFAULT_HALF_LIFE_S, taken_at=NOW)
    cost = {d: rng.uniform(0.3, 2.0) for d in digests.values()}
    fleet = FleetView()
    for w in range(workers):
        name = f"worker-{w:02d}"
        speed = rng.uniform(5.0, 150.0)
        held = {digests[m] for m in rng.sample(names, 6)}
        view = WorkerView(name=name, slots=rng.choice((1, 1, 2)), holds=held, loaded=set(list(held)[:2]))
        for d in held:
            if rng.random() < 0.8:  # some pairs never measured: their prior does the work
                snap.speed[(name, d)] = SpeedRow(
                    worker=name,
                    digest=d,
                    decode_tps=_stat(rng, speed / cost[d], rng.randint(1, 30)),
                    prompt_tps=_stat(rng, 20 * speed / cost[d], rng.randint(1, 30)),
                    load_s=_stat(rng, 3.0 * cost[d], rng.randint(1, 5)),
                )
        if rng.random() < 0.5:
            d = next(iter(held))
            view.running.append(
                RunningTask(task_id=f"r{w}", digest=d, started_at_ms=NOW - rng.randint(0, 20_000))
            )
        fleet.workers.append(view)
    for d in digests.values():
        for dom in DOMAINS:
            snap.length[(d, dom)] = LengthRow(
                digest=d, domain=dom, output_tokens=_stat(rng, rng.uniform(100, 800), 20)
            )
            snap.quality[(d, dom)] = QualityRow(
                digest=d, domain=dom, score=_stat(rng, rng.uniform(0.4, 0.9), 10)
            )
        fleet.arrival_rate[d] = rng.uniform(0.0, 0.5)
    # A popular model gets most of the backlog.
    weights = [1.0 / (i + 1) for i in range(models)]
    for i in range(backlog):
        d = digests[rng.choices(names, weights)[0]]
        fleet.backlog.setdefault(d, []).append(
            BacklogEntry(
                task_id=f"q{i}",
                digest=d,
                enqueued_at_ms=NOW - (backlog - i) * 1000,
                domain=rng.choice(DOMAINS),
                prompt_tokens=rng.randint(20, 2000),
                max_tokens=rng.choice((None, 256, 1024)),
            )
        )
    return snap, fleet, digests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=50)
    ap.add_argument("--models", type=int, default=20)
    ap.add_argument("--backlog", type=int, default=100)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    snap, fleet, digests = build(args.workers, args.models, args.backlog)
    t0 = time.perf_counter()
    est = build_estimator(snap, NOW)
    fit_us = (time.perf_counter() - t0) * 1e6
    free = [w.name for w in fleet.workers if len(w.running) < w.slots]
    rng = random.Random(2)

    def run(cold: bool) -> tuple[float, float]:
        times: list[float] = []
        gc.disable()
        for i in range(args.decisions):
            if cold:
                est.clear_cache()
            query = RouteQuery(model="auto", domain=DOMAINS[i % 3], prompt_tokens=rng.randint(20, 2000))
            t = time.perf_counter()
            decide(query, digests, fleet, est, NOW)
            should_take(free[i % len(free)], fleet, est, NOW)
            times.append((time.perf_counter() - t) * 1e6)
        gc.enable()
        times.sort()
        return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]

    cold50, cold99 = run(cold=True)
    p50, p99 = run(cold=False)
    if not args.json:
        print(f"snapshot fits (once per snapshot): {fit_us:,.0f} us")
        print(f"{args.workers} workers x {args.models} models, backlog {args.backlog}:")
        print(f"  decision p50 {p50:,.0f} us, p99 {p99:,.0f} us (estimates cached per snapshot)")
        print(f"  first decision on a snapshot p50 {cold50:,.0f} us, p99 {cold99:,.0f} us")
    figures = {
        "bench": "router",
        "decision_p50_us": round(p50, 1),
        "decision_p99_us": round(p99, 1),
        "cold_decision_p50_us": round(cold50, 1),
        "cold_decision_p99_us": round(cold99, 1),
        "snapshot_fit_us": round(fit_us, 1),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
