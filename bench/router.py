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
import json
import random
import sys
import time
from pathlib import Path

# This script is named like the package it measures: its own folder goes last on the path, behind
# the project's root, so that `import router` finds the package and `import scale` the script
# beside this one (which times the decisions).
HERE = Path(__file__).resolve().parent
sys.path = [str(HERE.parent), *(p for p in sys.path if Path(p or ".").resolve() != HERE), str(HERE)]

from scale import decision_times  # noqa: E402

from router.estimate import build_estimator  # noqa: E402
from sim.random_fleet import NOW_MS, FleetShape, random_fleet  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=50)
    ap.add_argument("--models", type=int, default=20)
    ap.add_argument("--backlog", type=int, default=100)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    snap, fleet, digests = random_fleet(
        FleetShape(workers=args.workers, models=args.models, backlog=args.backlog)
    )
    t0 = time.perf_counter()
    est = build_estimator(snap, NOW_MS)
    fit_us = (time.perf_counter() - t0) * 1e6
    rng = random.Random(2)
    cold50, cold99 = decision_times(fleet, digests, est, args.decisions, rng=rng, cold=True)
    p50, p99 = decision_times(fleet, digests, est, args.decisions, rng=rng)
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
