"""Lower bounds no policy can beat, to print beside the policies.

Every job j has a solo time t[j][w] on each worker w (model loaded, since loading is avoidable).
A worker's relative speed s_w = max_j t[j][ref] / t[j][w] (ref: the fastest worker) bounds how
much reference work it can do per second and slot, so the whole fleet is at most one machine of
speed S = sum_w s_w * slots_w**e: a schedule on the fleet is a schedule on that machine, and
nothing on it beats SRPT.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import msgspec


class Bounds(msgspec.Struct, kw_only=True, frozen=True):
    """The bounds of one run."""

    capacity_per_s: float
    makespan_s: float
    mean_response_s: float


def pooled_speed(times: Sequence[Sequence[float]], capacity: Sequence[float]) -> tuple[float, int]:
    """(S, ref): the pooled speed in units of the reference worker's time, and that worker."""
    n_workers = len(capacity)
    ref = min(range(n_workers), key=lambda w: sum(t[w] for t in times))
    total = 0.0
    for w in range(n_workers):
        rel = max(t[ref] / t[w] for t in times)
        total += rel * capacity[w]
    return total, ref


def srpt_mean(arrivals: Sequence[float], sizes: Sequence[float]) -> float:
    """Mean response of preemptive shortest-remaining-time-first on one unit-speed machine."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    heap: list[tuple[float, int]] = []
    t = 0.0
    total = 0.0
    k = 0
    n = len(order)
    while k < n or heap:
        if not heap:
            t = max(t, arrivals[order[k]])
        while k < n and arrivals[order[k]] <= t:
            i = order[k]
            heapq.heappush(heap, (sizes[i], i))
            k += 1
        rem, i = heapq.heappop(heap)
        next_arrival = arrivals[order[k]] if k < n else math.inf
        if t + rem <= next_arrival:
            t += rem
            total += t - arrivals[i]
        else:
            heapq.heappush(heap, (rem - (next_arrival - t), i))
            t = next_arrival
    return total / max(1, n)


def lower_bounds(
    arrivals: Sequence[float], times: Sequence[Sequence[float]], capacity: Sequence[float]
) -> Bounds:
    """Makespan (from the first arrival) and mean-response bounds of a run.

    `times[j][w]`: job j's solo time on worker w; `capacity[w]`: slots**exponent.
    """
    speed, ref = pooled_speed(times, capacity)
    fastest = [min(t) for t in times]
    t0 = min(arrivals)
    # Work arriving from each arrival on must still be done after it: max over suffixes.
    order = sorted(range(len(arrivals)), key=lambda j: arrivals[j])
    suffix = 0.0
    makespan = 0.0
    for j in reversed(order):
        suffix += times[j][ref]
        makespan = max(makespan, arrivals[j] - t0 + suffix / speed, arrivals[j] - t0 + fastest[j])
    srpt = srpt_mean(arrivals, [times[j][ref] / speed for j in range(len(times))])
    return Bounds(
        capacity_per_s=speed,
        makespan_s=makespan,
        mean_response_s=max(srpt, sum(fastest) / len(fastest)),
    )


def burst_optimum(times: Sequence[Sequence[float]], load_s: Sequence[float] | None = None) -> float:
    """Best makespan of jobs all present at time 0, by brute force over assignments (<= 8 jobs).

    Each worker runs its jobs one after another (one slot each: pass a multi-slot worker as
    several columns), paying `load_s[w]` once if it gets any job.
    """
    n = len(times)
    if n > 8:
        raise ValueError("brute force is for bursts of at most 8 jobs")
    n_workers = len(times[0]) if times else 0
    loads = list(load_s) if load_s is not None else [0.0] * n_workers
    best = math.inf
    for assignment in itertools.product(range(n_workers), repeat=n):
        busy = [0.0] * n_workers
        for j, w in enumerate(assignment):
            busy[w] += times[j][w]
        span = max(b + (loads[w] if b > 0 else 0.0) for w, b in enumerate(busy))
        best = min(best, span)
    return best
