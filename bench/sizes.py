"""Size-aware dispatch on random fleets: routeledger against best-threshold, sita and the
size-aware peers, on fleets that no constant was chosen for.

    python -m bench.sizes [--fleets N] [--tasks N] [--loads 0.6,0.9] [--mix chat-code] [--seed S]

Each fleet has 2 to 4 machines serving one model: the fastest decodes at 40-120 tok/s, each
other one 2x to 15x slower (log-uniform), with its own prompt speed (10-40x its decode speed),
one or two slots and a load time of 2-12 s. Every policy runs the same tasks at each load
(`sim.scheduling.experiment.run_matrix`, the code of `routeledger sim schedule`).

Prints one row per fleet and load (mean response of each policy over best-threshold's), then
a JSON line last: {"bench": "sizes", "rows": [...], "worst_vs_best_threshold": ...,
"worst_vs_sita": ..., "worst_class_p99_vs_best_threshold": ...}.
"""

from __future__ import annotations

import argparse
import json
import math
import random

from sim.fleetspec import Fleet, OutputLength, WorkerModel, WorkerSpec
from sim.fleetspec import ModelSpec as SimModel
from sim.scheduling.experiment import run_matrix
from sim.scheduling.workload import WorkloadSpec, load_mix

MODEL = "m"
POLICIES = ("routeledger", "routeledger-sizeblind", "best-threshold", "sita", "sed-size", "least-busy-size")


def random_fleet(rng: random.Random, index: int) -> Fleet:
    """One random fleet (module docstring)."""
    n = rng.randint(2, 4)
    fastest = rng.uniform(40.0, 120.0)
    workers = []
    for i in range(n):
        decode = fastest if i == 0 else fastest / math.exp(rng.uniform(math.log(2.0), math.log(15.0)))
        model = WorkerModel(
            decode_tps=decode, prompt_tps=decode * rng.uniform(10.0, 40.0), load_s=rng.uniform(2.0, 12.0)
        )
        workers.append(WorkerSpec(name=f"w{i}", slots=rng.choice((1, 1, 2)), models={MODEL: model}))
    # Registration order is not speed order.
    rng.shuffle(workers)
    spec = SimModel(output=OutputLength(dist="lognormal", mean=300.0, sigma=0.6))
    return Fleet(name=f"random-{index}", worker=workers, model={MODEL: spec})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fleets", type=int, default=6)
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--loads", default="0.6,0.9")
    ap.add_argument("--mix", default="chat-code")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    loads = [float(x) for x in args.loads.split(",")]
    mix = load_mix(args.mix)
    rows: list[dict[str, object]] = []
    worst_bt, worst_sita, worst_p99 = 0.0, 0.0, 0.0
    for k in range(args.fleets):
        fleet = random_fleet(rng, k)
        speeds = ", ".join(f"{w.models[MODEL].decode_tps:.0f}x{w.slots}" for w in fleet.worker)
        base = WorkloadSpec(tasks=args.tasks, seed=k + 1, mix=mix)
        results = run_matrix(fleet, MODEL, loads, POLICIES, base)
        for load in loads:
            by = {r.policy: r for r in results if r.load == load}
            bt, rl = by["best-threshold"], by["routeledger"]
            vs_bt = rl.mean_s / bt.mean_s
            vs_sita = rl.mean_s / by["sita"].mean_s
            p99 = max(rl.class_p99_s[c] / bt.class_p99_s[c] for c in (rl.class_p99_s or {}) if bt.class_p99_s)
            worst_bt, worst_sita = max(worst_bt, vs_bt), max(worst_sita, vs_sita)
            worst_p99 = max(worst_p99, p99)
            figures = {p: round(r.mean_s / bt.mean_s, 3) for p, r in by.items()}
            print(
                f"fleet {k} [{speeds} tok/s x slots] load {load}: best-threshold {bt.mean_s:.1f} s;"
                f" over it: {figures}; worst class p99 over best-threshold's {p99:.2f}"
            )
            rows.append(
                {
                    "fleet": k,
                    "decode_tps_x_slots": speeds,
                    "load": load,
                    "best_threshold_mean_s": bt.mean_s,
                    "vs_best_threshold": figures,
                    "routeledger_vs_sita": vs_sita,
                    "class_p99_vs_best_threshold": p99,
                }
            )
    out = {
        "bench": "sizes",
        "rows": rows,
        "worst_vs_best_threshold": worst_bt,
        "worst_vs_sita": worst_sita,
        "worst_class_p99_vs_best_threshold": worst_p99,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
