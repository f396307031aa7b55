"""Router decision time: estimate + plan + choose for 50 workers x 20 models with a backlog of 100.

    python -m bench.router [--workers 50] [--models 20] [--backlog 100] [--decisions 2000] [--json]

One decision is what the API does for a request with model=auto (rank every model's holders on
the plan of its queue, score each model's utility) plus one worker's gate check. The fits of the
snapshot (the two-way speed fit, the pooled tables) are built once per snapshot, as the API and
the workers do, and the estimates a decision reads are cached with them (per snapshot). The
first decision on a new snapshot also computes those estimates: reported as `cold_*`.

A request that names its model costs the API less than that, and more than the decision: the
decision for that model alone, the ledger's record of it (TaskRouted, its compact breakdown
encoded as the submission sends it) and the whole breakdown the task's lookup hash keeps (JSON).
Each is timed apart, for the model the most workers hold: `named_*`, `record_*`, `breakdown_*`.
`--workers 1 --models 1 --backlog 0` is `bench/api.py`'s fleet. The last line is JSON:
{"bench": "router", "decision_p50_us": ..., "decision_p99_us": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import msgspec

from bench.scale import decision_times, times_us
from dispatch.submit import routed_event
from events.codec import encode_batch
from router.choose import STORED_CANDIDATES, RouteQuery, decide
from router.estimate import Estimator, build_estimator
from router.plan import FleetView
from sim.random_fleet import DOMAINS, NOW_MS, FleetShape, random_fleet


def named_request_costs(
    fleet: FleetView, models: dict[str, str], est: Estimator, count: int, rng: random.Random
) -> dict[str, float]:
    """Median microseconds of what the API does per request naming its model (the one the most
    workers hold): the decision, its TaskRouted encoded for the ledger, its stored breakdown."""
    model = max(models, key=lambda name: (len(fleet.holders(models[name])), name))
    queries = [
        RouteQuery(model=model, domain=DOMAINS[i % 3], prompt_tokens=rng.randint(20, 2000))
        for i in range(count)
    ]
    decisions = [decide(q, models, fleet, est, NOW_MS) for q in queries]
    steps: dict[str, Callable[[int], object]] = {
        "named": lambda i: decide(queries[i], models, fleet, est, NOW_MS),
        "record": lambda i: encode_batch([routed_event("t", "q", decisions[i])]),
        "breakdown": lambda i: msgspec.json.encode(decisions[i].to_dict(top=STORED_CANDIDATES)),
    }
    return {name: statistics.median(times_us(step, count)) for name, step in steps.items()}


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
    named = named_request_costs(fleet, digests, est, args.decisions, rng)
    if not args.json:
        print(f"snapshot fits (once per snapshot): {fit_us:,.0f} us")
        print(f"{args.workers} workers x {args.models} models, backlog {args.backlog}:")
        print(f"  decision p50 {p50:,.0f} us, p99 {p99:,.0f} us (estimates cached per snapshot)")
        print(f"  first decision on a snapshot p50 {cold50:,.0f} us, p99 {cold99:,.0f} us")
        print(
            f"  a request naming its model, p50: decision {named['named']:,.0f} us, its ledger record "
            f"{named['record']:,.0f} us, its stored breakdown {named['breakdown']:,.0f} us"
        )
    figures = {
        "bench": "router",
        "decision_p50_us": round(p50, 1),
        "decision_p99_us": round(p99, 1),
        "cold_decision_p50_us": round(cold50, 1),
        "cold_decision_p99_us": round(cold99, 1),
        "snapshot_fit_us": round(fit_us, 1),
        **{f"{name}_p50_us": round(us, 1) for name, us in named.items()},
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
