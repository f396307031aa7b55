"""The experiment of `routeledger sim schedule`: every policy at every load on the same tasks,
the best fixed threshold found by a sweep, and the lower bounds beside them.

All policies at one load see the same jobs (common random numbers), so their ratios are not
blurred by sampling noise between runs. On chats (`WorkloadSpec.kind == "chat"`) a later turn
arrives when the policy finished the one before, so the lower bounds (which need every arrival in
advance) are left out, and so is `sita` (it needs every task's size at its arrival, and is
swept on the tasks in advance), the best threshold is swept only when asked for, and each row
also has the time to first token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import msgspec

from sim.fleetspec import Fleet
from sim.scheduling.bounds import Bounds, lower_bounds
from sim.scheduling.policies import POLICY_NAMES, Sita, Threshold, make_policy
from sim.scheduling.schedule import RunResult, simulate
from sim.scheduling.workload import Job, WorkloadSpec, generate, serving, speeds

BEST_THRESHOLD = "best-threshold"
SITA = "sita"
# The cutoffs SITA tries: these quantiles of the jobs' exact sizes (and none: 0 and inf).
SITA_QUANTILES = tuple(i / 40 for i in range(1, 40))
SWEPT = (BEST_THRESHOLD, SITA)


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
    # For sita: the size cutoffs it found (seconds on the fastest worker, slowest worker's first).
    cutoffs_s: list[float] | None = None
    # With slowdown windows in the fleet (see `slowdown_figures`): mean over the oracle's, seconds
    # until the router saw the slowdown (routeledger only), until new work went elsewhere, and
    # until work came back after it ended; and tasks sent to the slowed machine while a faster one
    # was free.
    vs_oracle: float | None = None
    detect_s: float | None = None
    away_s: float | None = None
    back_s: float | None = None
    misrouted: int | None = None
    # Chats: mean and 95th percentile of the time to first token (RunResult.ttft_s).
    mean_ttft_s: float | None = None
    p95_ttft_s: float | None = None
    # Mixes (`WorkloadSpec.mix`): each class's 99th percentile response, by its domain.
    class_p99_s: dict[str, float] | None = None


def class_p99(jobs: Sequence[Job], result: RunResult, domains: Sequence[str] = ()) -> dict[str, float]:
    """The 99th percentile response of each domain's jobs in `result` (the nearest rank), in the
    order of `domains` first (a domain without jobs is left out)."""
    by: dict[str, list[float]] = {d: [] for d in domains}
    for j, r in zip(jobs, result.response_s, strict=True):
        by.setdefault(j.domain, []).append(r)
    out = {}
    for domain, xs in by.items():
        if not xs:
            continue
        xs.sort()
        out[domain] = xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]
    return out


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


def sweep_sita(
    fleet: Fleet, model: str, spec: WorkloadSpec, jobs: Sequence[Job], passes: int = 2
) -> tuple[RunResult, list[float]]:
    """The best SITA cutoffs for these jobs: each cutoff swept over SITA_QUANTILES of the exact
    sizes (and 0: that worker gets nothing) with the others fixed, kept in increasing order
    (coordinate descent, `passes` passes)."""
    workers = serving(fleet, model)
    n = len(workers)
    if n <= 1:
        return simulate(fleet, model, spec, Sita(()), jobs), []
    fastest = max(workers, key=lambda w: speeds(w, model).decode_tps)
    true = speeds(fastest, model)
    sizes = sorted(true.seconds(j.prompt_tokens, j.output_tokens, True) for j in jobs)
    grid = sorted({0.0, *(sizes[min(len(sizes) - 1, int(q * len(sizes)))] for q in SITA_QUANTILES)})
    cache: dict[tuple[float, ...], RunResult] = {}

    def run(cs: tuple[float, ...]) -> float:
        if cs not in cache:
            cache[cs] = simulate(fleet, model, spec, Sita(cs), jobs)
        return cache[cs].mean_s

    # Start from cutoffs that split the jobs evenly by count among the slower workers' share.
    best = tuple(grid[min(len(grid) - 1, (i + 1) * len(grid) // (2 * n))] for i in range(n - 1))
    best_mean = run(best)
    for _ in range(passes):
        moved = False
        for i in range(n - 1):
            lo = best[i - 1] if i > 0 else 0.0
            hi = best[i + 1] if i + 1 < n - 1 else float("inf")
            for c in grid:
                if not lo <= c <= hi:
                    continue
                cs = (*best[:i], c, *best[i + 1 :])
                mean = run(cs)
                if mean < best_mean:
                    best, best_mean, moved = cs, mean, True
        if not moved:
            break
    return cache[best], list(best)


ORACLE = "routeledger-oracle"
# After a slowdown ends, how long the return of work is looked for.
RETURN_HORIZON_S = 1800.0


class SlowdownFigures(msgspec.Struct, kw_only=True, frozen=True):
    """How a run followed the fleet's slowdown windows (the worst window counts).

    `away_s`: from a window's start to the last task the slowed machine started while a machine
    faster at that moment (by more than MIN_RATIO, for that task: `RunResult.misrouted`) had a
    free slot (0: none); `misrouted`: how many such tasks. `back_s`: from a window's end to the
    last task a slower machine started while the recovered one was free and so much faster (within
    RETURN_HORIZON_S). `detect_s`: from a window's start to the router's notice that the
    machine's speed shifted (None for policies that keep no such statistic, or no notice).
    """

    away_s: float
    misrouted: int
    back_s: float
    detect_s: float | None


def slowdown_figures(
    fleet: Fleet, result: RunResult, shifts: Sequence[tuple[float, str, str]] = ()
) -> SlowdownFigures | None:
    """The figures of `result` for the fleet's slowdown windows, or None when it has none."""
    windows = [(w.name, s.from_s, s.until_s) for w in fleet.worker for s in w.slowdown]
    if not windows:
        return None
    away, back, count = 0.0, 0.0, 0
    detect: float | None = None
    starts = list(zip(result.start_s, result.start_order, result.misrouted, strict=True))
    for name, a, b in windows:
        late = [t - a for t, w, faster in starts if w == name and faster and a <= t < b]
        count += len(late)
        away = max([away, *late])
        back = max(
            [back, *[t - b for t, _, faster in starts if faster == name and b <= t < b + RETURN_HORIZON_S]]
        )
        seen = [t - a for t, w, state in shifts if w == name and state == "slower" and a <= t < b]
        if seen:
            detect = max(detect or 0.0, min(seen))
    return SlowdownFigures(away_s=away, misrouted=count, back_s=back, detect_s=detect)


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
    chat = base.kind == "chat"
    for load in loads:
        spec = msgspec.structs.replace(base, load=load)
        jobs = generate(fleet, model, spec)
        bound = None if chat else limits_of(fleet, model, jobs)
        best: tuple[RunResult, list[int]] | None = None
        if not chat or BEST_THRESHOLD in policies:
            best = sweep_thresholds(fleet, model, spec, jobs)
        best_mean = best[0].mean_s if best is not None else None
        sita = sweep_sita(fleet, model, spec, jobs) if SITA in policies and not chat else None
        slowed = any(w.slowdown for w in fleet.worker)
        oracle_mean = simulate(fleet, model, spec, make_policy(ORACLE), jobs).mean_s if slowed else None
        for name in policies:
            if progress is not None:
                progress(f"load {load}: {name}")
            shifts: list[tuple[float, str, str]] = []
            cutoffs: list[float] | None = None
            if name == BEST_THRESHOLD and best is not None:
                result, found = best
            elif name == SITA:
                if sita is None:
                    continue
                (result, cutoffs), found = sita, None
            else:
                policy = make_policy(name)
                result, found = simulate(fleet, model, spec, policy, jobs), None
                shifts = getattr(policy, "shifts", [])
            mean = result.mean_s
            figures = slowdown_figures(fleet, result, shifts)
            rows.append(
                ResultRow(
                    policy=name,
                    load=load,
                    mean_s=mean,
                    p95_s=result.p95_s(),
                    makespan_s=result.makespan_s,
                    vs_best_threshold=mean / best_mean if best_mean and math.isfinite(mean) else None,
                    vs_lower_bound=mean / bound.mean_response_s if bound and math.isfinite(mean) else None,
                    thresholds=found,
                    cutoffs_s=cutoffs,
                    vs_oracle=mean / oracle_mean if oracle_mean and math.isfinite(mean) else None,
                    detect_s=None if figures is None else figures.detect_s,
                    away_s=None if figures is None else figures.away_s,
                    back_s=None if figures is None else figures.back_s,
                    misrouted=None if figures is None else figures.misrouted,
                    mean_ttft_s=result.mean_ttft_s if chat else None,
                    p95_ttft_s=result.p95_ttft_s() if chat else None,
                    class_p99_s=(
                        class_p99(jobs, result, [c.domain for c in base.mix.classes])
                        if base.mix is not None
                        else None
                    ),
                )
            )
    return rows


def parse_policies(text: str) -> list[str]:
    """'all' or a comma-separated list of policy names, checked."""
    if text.strip() == "all":
        return list(POLICY_NAMES)
    names = [p.strip() for p in text.split(",") if p.strip()]
    for n in names:
        if n not in SWEPT:
            make_policy(n)
    return names
