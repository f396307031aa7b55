"""Random fleets for the router: workers of unequal speed serving some of many models, the snapshot
of what they measured, and a backlog that favours a popular model.

The router's benchmarks (bench/router.py, bench/scale.py) time decisions on these, and the router's
tests check on them that the pruned plan walk decides exactly as the full one. `FleetShape`'s
defaults are the benchmark's fleet; the tests turn its knobs (slots, loaded models, running tasks,
speeds that tie, slots that slow each other down, unknown prompt sizes, output caps). Everything
is drawn from one seeded generator, so one shape and seed give one fleet.
"""

from __future__ import annotations

import random
from typing import Final

import msgspec

from projections.snapshot import LengthRow, QualityRow, Snapshot, SpeedRow, Stat, fold
from router.plan import BacklogEntry, FleetView, RunningTask, WorkerView

NOW_MS: Final = 1_764_000_000_000
HALF_LIFE_S: Final = 7 * 86_400.0
DOMAINS: Final = ("general", "code", "japanese")


class FleetShape(msgspec.Struct, kw_only=True, frozen=True):
    """What a random fleet is made of."""

    workers: int = 50
    models: int = 20
    backlog: int = 100
    # Models each worker serves (at most `models`), and how many of those it has loaded.
    held: int = 6
    loaded: int = 2
    # Each worker's slot count is one of these, drawn evenly (repeat a value to weigh it).
    slots: tuple[int, ...] = (1, 1, 2)
    # Share of workers running something, and at most how many tasks each of those runs (more
    # than its slots: it serves several queues).
    running: float = 0.5
    max_running: int = 1
    # Share of (worker, model) pairs with measured speeds; the rest are estimated from priors.
    measured: float = 0.8
    # Share of measured pairs whose speed samples show slowdown with tasks in flight (the plan
    # then shares those machines among their slots).
    sharing: float = 0.0
    # 0: every worker its own speed; k: one of k speeds, so that finishes tie.
    speed_levels: int = 0
    # Share of queued tasks whose prompt was not counted, and the output caps tasks carry.
    unknown_prompts: float = 0.0
    max_tokens: tuple[int | None, ...] = (None, 256, 1024)


def _stat(rng: random.Random, mean: float, n: int) -> Stat:
    s = Stat()
    for i in range(n):
        s = fold(s, mean * rng.uniform(0.9, 1.1), NOW_MS - i * 600_000, HALF_LIFE_S)
    return s


def _shared_speeds(rng: random.Random, speed: float, n: int) -> tuple[Stat, Stat]:
    """Decode speed and in-flight count samples of a machine whose tasks slow each other down."""
    decode, in_flight = Stat(), Stat()
    for i in range(max(2, n)):
        k = rng.randint(1, 3)
        at = NOW_MS - i * 600_000
        decode = fold(decode, speed * k**-0.5 * rng.uniform(0.95, 1.05), at, HALF_LIFE_S)
        in_flight = fold(in_flight, float(k), at, HALF_LIFE_S)
    return decode, in_flight


def random_fleet(
    shape: FleetShape | None = None, seed: int = 1
) -> tuple[Snapshot, FleetView, dict[str, str]]:
    """(snapshot, fleet, model name -> digest) of one random fleet."""
    sh = shape or FleetShape()
    rng = random.Random(seed)
    digests = {f"model-{m}": f"{m:064x}" for m in range(sh.models)}
    names = list(digests)
    snap = Snapshot(half_life_s=HALF_LIFE_S, taken_at=NOW_MS)
    cost = {d: rng.uniform(0.3, 2.0) for d in digests.values()}
    levels = [rng.uniform(5.0, 150.0) for _ in range(sh.speed_levels)]
    fleet = FleetView()
    for w in range(sh.workers):
        name = f"worker-{w:02d}"
        speed = rng.choice(levels) if levels else rng.uniform(5.0, 150.0)
        # Sorted: a set's order changes with the interpreter's string hashing, the fleet must not.
        held = sorted(digests[m] for m in rng.sample(names, min(sh.held, sh.models)))
        view = WorkerView(
            name=name, slots=rng.choice(sh.slots), holds=set(held), loaded=set(held[: sh.loaded])
        )
        for d in held:
            if rng.random() >= sh.measured:
                continue  # never measured: its prior does the work
            row = SpeedRow(
                worker=name,
                digest=d,
                decode_tps=_stat(rng, speed / cost[d], rng.randint(1, 30)),
                prompt_tps=_stat(rng, 20 * speed / cost[d], rng.randint(1, 30)),
                load_s=_stat(rng, 3.0 * cost[d], rng.randint(1, 5)),
            )
            if rng.random() < sh.sharing:
                row.decode_tps, row.in_flight = _shared_speeds(rng, speed / cost[d], rng.randint(2, 30))
            snap.speed[(name, d)] = row
        if rng.random() < sh.running:
            for k in range(rng.randint(1, sh.max_running)):
                view.running.append(
                    RunningTask(
                        task_id=f"r{w}-{k}",
                        digest=rng.choice(held),
                        started_at_ms=NOW_MS - rng.randint(0, 20_000),
                        domain=rng.choice(DOMAINS),
                    )
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
    weights = [1.0 / (i + 1) for i in range(sh.models)]
    for i in range(sh.backlog):
        d = digests[rng.choices(names, weights)[0]]
        fleet.backlog.setdefault(d, []).append(
            BacklogEntry(
                task_id=f"q{i}",
                digest=d,
                enqueued_at_ms=NOW_MS - (sh.backlog - i) * 1000,
                domain=rng.choice(DOMAINS),
                prompt_tokens=None if rng.random() < sh.unknown_prompts else rng.randint(20, 2000),
                max_tokens=rng.choice(sh.max_tokens),
            )
        )
    return snap, fleet, digests
