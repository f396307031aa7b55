"""The experiment of `routeledger sim schedule`: every policy at every load on the same tasks,
the best fixed threshold found by a sweep, and the lower bounds beside them.

All policies at one load see the same jobs (common random numbers), so their ratios are not
blurred by sampling noise between runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import msgspec

from sim.fleetspec import Fleet
from sim.scheduling.bounds import Bounds, lower_bounds
from sim.scheduling.policies import POLICY_NAMES, Threshold, make_policy
from sim.scheduling.schedule import RunResult, simulate
from sim.scheduling.workload import Job, WorkloadSpec, generate, serving, speeds

BEST_THRESHOLD = "best-threshold"


class ResultRow(msgspec.Struct, kw_only=True):
    """One policy at one load."""

    policy: str
    load: float
    mean_s: float
    p95_s: float
    makespan_s: float
    vs_best_threshold: float | None = None
    vs_lower_bound: float | None = None
    # For best-threshold: the thresholds it found (per slower worker, fastest first).
    thresholds: list[int] | None = None


def limits_of(fleet: Fleet, model: str, jobs: Sequence[Job]) -> Bounds:
    """The lower bounds of a run of `jobs` on the serving workers (all assumed online)."""
    workers = serving(fleet, model)
    true = [speeds(w, model) for w in workers]
    times = [[s.seconds(j.prompt_tokens, j.output_tokens, True) for s in true] for j in jobs]
    cap = [float(w.slots**w.parallel_exponent) for w in workers]
    return lower_bounds([j.arrival for j in jobs], times, cap)


def sweep_thresholds(
    fleet: Fleet, model: str, spec: WorkloadSpec, jobs: Sequence[Job], max_k: int = 40, patience: int = 4
) -> tuple[RunResult, list[int]]:
    """The best fixed thresholds for these jobs: one K swept for all slower workers, then each
    slower worker's own K swept with the others fixed (coordinate descent, one pass)."""
    slower = len(serving(fleet, model)) - 1
    if slower <= 0:
        return simulate(fleet, model, spec, Threshold((1,)), jobs), [1]
    cache: dict[tuple[int, ...], RunResult] = {}

    def run(ks: tuple[int, ...]) -> float:
        if ks not in cache:
            cache[ks] = simulate(fleet, model, spec, Threshold(ks), jobs)
        return cache[ks].mean_s

    def line(make: Callable[[int], tuple[int, ...]], start: tuple[int, ...]) -> tuple[int, ...]:
        best, best_mean, worse = start, run(start), 0
        for k in range(1, max_k + 1):
            ks = make(k)
            mean = run(ks)
            if mean < best_mean:
                best, best_mean, worse = ks, mean, 0
            else:
                worse += 1
                if worse >= patience and k > best[0]:
                    break
        return best

    best = line(lambda k: (k,) * slower, (1,) * slower)
    for i in range(slower if slower > 1 else 0):
        best = line(lambda k, i=i, b=best: (*b[:i], k, *b[i + 1 :]), best)  # type: ignore[misc]
    return cache[best], list(best)


def run_matrix(
    fleet: Fleet,
    model: str,
    loads: Sequence[float],
    policies: Sequence[str],
    base: WorkloadSpec,
    progress: Callable[[str], None] | None = None,
) -> list[ResultRow]:
    """Every policy at every load; `best-threshold` is always computed (the others are compared to it)."""
    rows: list[ResultRow] = []
    for load in loads:
        spec = msgspec.structs.replace(base, load=load)
        jobs = generate(fleet, model, spec)
        bound = limits_of(fleet, model, jobs)
        best_run, ks = sweep_thresholds(fleet, model, spec, jobs)
        best_mean = best_run.mean_s
        for name in policies:
            if progress is not None:
                progress(f"load {load}: {name}")
            if name == BEST_THRESHOLD:
                result, found = best_run, ks
            else:
                result, found = simulate(fleet, model, spec, make_policy(name), jobs), None
            mean = result.mean_s
            rows.append(
                ResultRow(
                    policy=name,
                    load=load,
                    mean_s=mean,
                    p95_s=result.p95_s(),
                    makespan_s=result.makespan_s,
                    vs_best_threshold=mean / best_mean if math.isfinite(mean) else None,
                    vs_lower_bound=mean / bound.mean_response_s if math.isfinite(mean) else None,
                    thresholds=found,
                )
            )
    return rows


def parse_policies(text: str) -> list[str]:
    """'all' or a comma-separated list of policy names, checked."""
    if text.strip() == "all":
        return list(POLICY_NAMES)
    names = [p.strip() for p in text.split(",") if p.strip()]
    for n in names:
        if n != BEST_THRESHOLD:
            make_policy(n)
    return names
