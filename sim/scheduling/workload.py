"""Workloads of the scheduling simulator: Poisson arrivals at a target load, output lengths per
domain, bursts (pipelines of k children), and workers joining or leaving mid-run.

Load = arrival rate x mean work / total fleet speed, for the requested model: the fleet's
capacity is the sum over the workers that serve the model of slots**parallel_exponent / (mean
service time there), so load 1.0 is what the whole fleet can just keep up with.
"""

from __future__ import annotations

import math
import random

import msgspec

from sim.errors import FleetError
from sim.fleetspec import Fleet, WorkerSpec


class WorkloadSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What to submit: how many tasks, how fast, how long."""

    load: float = 0.6
    tasks: int = 10_000
    seed: int = 1
    # None: the model's own output distribution from the fleet file.
    dist: str | None = None
    mean_tokens: float | None = None
    sigma: float | None = None
    prompt_tokens: int = 64
    domain: str = "general"
    # Each arrival is a pipeline of `burst` children submitted at once.
    burst: int = 1
    # (worker, simulated second): offline until then / offline from then.
    joins: tuple[tuple[str, float], ...] = ()
    leaves: tuple[tuple[str, float], ...] = ()


class Job(msgspec.Struct, kw_only=True, gc=False):
    """One simulated task: what it asks for (the truth the router does not see)."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    domain: str = "general"
    burst_id: int = 0
    bench: bool = False


class ModelSpeeds(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """The true speeds of the requested model on one worker."""

    decode_tps: float
    prompt_tps: float
    load_s: float

    def seconds(self, prompt_tokens: int, output_tokens: float, loaded: bool) -> float:
        """Solo service time of a task on this worker."""
        return (
            (0.0 if loaded else self.load_s)
            + prompt_tokens / self.prompt_tps
            + output_tokens / self.decode_tps
        )


def serving(fleet: Fleet, model: str) -> list[WorkerSpec]:
    """Workers that hold and serve `model`, in registration order."""
    out = []
    for w in fleet.worker:
        held = w.models.get(model)
        if held is None or not held.held:
            continue
        if w.serves is not None and model not in w.serves:
            continue
        out.append(w)
    return out


def default_model(fleet: Fleet) -> str:
    """The model served by the most workers (first declared on a tie)."""
    counts: dict[str, int] = {}
    for w in fleet.worker:
        for m in w.models:
            counts.setdefault(m, 0)
    for m in counts:
        counts[m] = len(serving(fleet, m))
    if not counts or max(counts.values()) == 0:
        raise FleetError(f"fleet {fleet.name!r} has no model that any worker serves")
    return max(counts, key=lambda m: counts[m])


def speeds(worker: WorkerSpec, model: str) -> ModelSpeeds:
    m = worker.models[model]
    return ModelSpeeds(decode_tps=m.decode_tps, prompt_tps=m.prompt_tps, load_s=m.load_s)


def output_law(fleet: Fleet, model: str, spec: WorkloadSpec) -> tuple[str, float, float]:
    """(dist, mean, sigma) of output tokens: the flags, else the model's own law."""
    own = fleet.model_spec(model).output
    dist = spec.dist or own.dist
    if dist not in ("exp", "lognormal", "fixed"):
        raise FleetError(f"unknown output distribution {dist!r}; use exp, lognormal or fixed")
    return dist, spec.mean_tokens or own.mean, own.sigma if spec.sigma is None else spec.sigma


def capacity(fleet: Fleet, model: str, spec: WorkloadSpec) -> float:
    """Tasks per second the fleet can serve for `model` (all serving workers, models loaded)."""
    _, mean, _ = output_law(fleet, model, spec)
    total = 0.0
    for w in serving(fleet, model):
        s = speeds(w, model).seconds(spec.prompt_tokens, mean, True)
        total += w.slots**w.parallel_exponent / s
    if total <= 0:
        raise FleetError(f"no worker of fleet {fleet.name!r} serves {model!r}")
    return total


def draw_tokens(rng: random.Random, dist: str, mean: float, sigma: float) -> int:
    """One output length; at least one token."""
    if dist == "fixed":
        x = mean
    elif dist == "exp":
        x = rng.expovariate(1.0 / mean)
    else:
        # A lognormal with the given mean: mu = ln(mean) - sigma^2 / 2.
        x = rng.lognormvariate(math.log(mean) - sigma * sigma / 2.0, sigma)
    return max(1, round(x))


def generate(fleet: Fleet, model: str, spec: WorkloadSpec) -> list[Job]:
    """The jobs of one run, in arrival order; the same for the same seed."""
    if spec.load <= 0 or spec.tasks < 1 or spec.burst < 1:
        raise FleetError("load must be positive, tasks and burst at least 1")
    rng = random.Random(spec.seed)
    dist, mean, sigma = output_law(fleet, model, spec)
    rate = spec.load * capacity(fleet, model, spec) / spec.burst
    jobs: list[Job] = []
    t = 0.0
    burst_id = 0
    while len(jobs) < spec.tasks:
        t += rng.expovariate(rate)
        burst_id += 1
        for _ in range(min(spec.burst, spec.tasks - len(jobs))):
            jobs.append(
                Job(
                    index=len(jobs),
                    arrival=t,
                    prompt_tokens=spec.prompt_tokens,
                    output_tokens=draw_tokens(rng, dist, mean, sigma),
                    domain=spec.domain,
                    burst_id=burst_id,
                )
            )
    return jobs
