"""Routing decision time as the fleet and its backlog grow: 50 workers x backlog 100, 500 x 1,000.

    python bench/scale.py [--sizes 50x100,500x1000] [--models 20] [--decisions 2000,300] [--json]

A decision is what bench/router.py times: a request with model=auto (every model's holders ranked
on the plan of its queue, each model's utility scored) plus one worker's gate check, on a random
fleet of sim/random_fleet.py (`--models` models, each worker serving 6; the backlog favours a
popular model) with the snapshot's estimates already cached. `--decisions` gives how many are
timed at each size, after a few untimed ones. Each measurement is one function that returns its
figures; `main` puts them together. The last line is JSON:

    {"bench": "scale", "decision_p99_us_50x100": ..., "decision_p99_us_500x1000": ...,
     "decision_p50_us_50x100": ..., "decision_p50_us_500x1000": ...}
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

# The project this script sits in, ahead of any installed copy: a copy of the script in an older
# checkout times that checkout's router.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from router.choose import RouteQuery, decide
from router.estimate import Estimator, build_estimator
from router.gate import should_take
from router.plan import FleetView
from sim.random_fleet import DOMAINS, NOW_MS, FleetShape, random_fleet

WARMUP = 5


def decision_times(
    fleet: FleetView,
    models: dict[str, str],
    est: Estimator,
    decisions: int,
    *,
    rng: random.Random,
    cold: bool = False,
) -> tuple[float, float]:
    """(p50, p99) in microseconds of `decisions` decisions, each an `auto` request of a random
    domain and prompt size and the gate check of one of the workers with a free slot (in turn).
    `cold`: the estimator forgets its looked-up estimates before each (the first decision on a
    new snapshot)."""
    # Workers with a free slot get past the gate's first checks; a fleet without one asks them all.
    free = [w.name for w in fleet.workers if len(w.running) < w.slots] or [w.name for w in fleet.workers]
    times: list[float] = []
    gc.disable()
    try:
        for i in range(decisions):
            if cold:
                est.clear_cache()
            query = RouteQuery(model="auto", domain=DOMAINS[i % 3], prompt_tokens=rng.randint(20, 2000))
            t = time.perf_counter()
            decide(query, models, fleet, est, NOW_MS)
            should_take(free[i % len(free)], fleet, est, NOW_MS)
            times.append((time.perf_counter() - t) * 1e6)
    finally:
        gc.enable()
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def measure_decisions(sizes: list[tuple[int, int]], models: int, decisions: list[int]) -> dict[str, float]:
    """Decision p50 and p99 (us) at each (workers, backlog) size, as `decision_p50_us_{w}x{b}` and
    `decision_p99_us_{w}x{b}`."""
    p50s: dict[str, float] = {}
    p99s: dict[str, float] = {}
    for (workers, backlog), count in zip(sizes, decisions, strict=True):
        snap, fleet, digests = random_fleet(FleetShape(workers=workers, models=models, backlog=backlog))
        est = build_estimator(snap, NOW_MS)
        rng = random.Random(2)
        decision_times(fleet, digests, est, WARMUP, rng=rng)
        p50, p99 = decision_times(fleet, digests, est, count, rng=rng)
        p50s[f"decision_p50_us_{workers}x{backlog}"] = round(p50, 1)
        p99s[f"decision_p99_us_{workers}x{backlog}"] = round(p99, 1)
    return {**p99s, **p50s}


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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if len(args.decisions) != len(args.sizes):
        ap.error("--decisions needs one count per size")
    decisions = measure_decisions(args.sizes, args.models, args.decisions)
    if not args.json:
        for (workers, backlog), count in zip(args.sizes, args.decisions, strict=True):
            p50 = decisions[f"decision_p50_us_{workers}x{backlog}"]
            p99 = decisions[f"decision_p99_us_{workers}x{backlog}"]
            print(
                f"{workers} workers x {args.models} models, backlog {backlog}:"
                f" decision p50 {p50:,.0f} us, p99 {p99:,.0f} us ({count} decisions)"
            )
    figures: dict[str, object] = {"bench": "scale", **decisions}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
