"""A machine that slows down mid-run (a game on the GPU PC): the simulator's slowdown windows, the
router routing away from it within a minute (or five tasks) and back within five minutes of its
recovery, and a mean response near the oracle's that knows the true speeds at every moment.

"Routed away" is read from the tasks themselves: a task the slowed machine starts while a machine
faster at that moment has a free slot went to a slower machine than it had to (`misrouted`). The
router has routed away once no such task starts any more; while the fast machine is merely busy,
the slowed one taking work is the right call and does not count. "Back" is the same in reverse:
after the window, the last task a slower machine starts while the recovered one is free.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from sim.errors import FleetError
from sim.fleetspec import (
    Fleet,
    ModelSpec,
    OutputLength,
    Slowdown,
    WorkerModel,
    WorkerSpec,
    load_fleet,
    parse_fleet,
)
from sim.scheduling.experiment import RETURN_HORIZON_S, slowdown_figures
from sim.scheduling.policies import Routeledger, make_policy
from sim.scheduling.schedule import RunResult, simulate
from sim.scheduling.workload import WorkloadSpec, generate

SLOWDOWN_TOML = """
[[worker]]
name = "rtx3070ti"
[worker.models."qwen3:8b"]
decode_tps = 83.0

[[worker.slowdown]]          # repeatable
from_s = 3600
until_s = 7200
factor = 0.06                # decode and prompt speed multiplied by this

[[worker.slowdown]]
from_s = 9000
until_s = 9600
factor = 0.5
"""
MODEL = "qwen3:8b"


def _slowed(fleet: Fleet, worker: str, window: Slowdown) -> Fleet:
    workers = [msgspec.structs.replace(w, slowdown=[window]) if w.name == worker else w for w in fleet.worker]
    return msgspec.structs.replace(fleet, worker=workers)


def _run(fleet: Fleet, model: str, spec: WorkloadSpec, name: str) -> tuple[RunResult, Routeledger | None]:
    policy = make_policy(name)
    result = simulate(fleet, model, spec, policy, generate(fleet, model, spec))
    return result, policy if isinstance(policy, Routeledger) else None


def _late(result: RunResult, worker: str, after_s: float) -> list[float]:
    """Starts on a slower machine while `worker` was free and much faster, after `after_s`."""
    return [
        t
        for t, faster in zip(result.start_s, result.misrouted, strict=True)
        if faster == worker and after_s <= t < after_s + RETURN_HORIZON_S
    ]


def _check_follows(
    fleet: Fleet,
    model: str,
    spec: WorkloadSpec,
    worker: str,
    window: Slowdown,
    *,
    back: bool = True,
    unslowed: Fleet | None = None,
) -> RunResult:
    """With `unslowed` (the fleet without the window), "back" is judged against what the router
    does there: a young fleet's gate sends the odd task past a free, much faster machine at any
    time (an estimate still settling), and the return asks only that the slowdown adds none."""
    result, policy = _run(fleet, model, spec, "routeledger")
    assert policy is not None
    figures = slowdown_figures(fleet, result, policy.shifts)
    assert figures is not None
    # Away within 60 simulated seconds or five tasks, whichever allows more.
    assert figures.away_s <= 60.0 or figures.misrouted <= 5, figures
    if not back:
        return result
    # Back within five minutes: no task goes to a slower machine while it is free after that...
    if unslowed is None:
        assert figures.back_s <= 300.0, figures
    else:
        plain, _ = _run(unslowed, model, spec, "routeledger")
        late, usual = (
            _late(result, worker, window.until_s + 300.0),
            _late(plain, worker, window.until_s + 300.0),
        )
        assert len(late) <= len(usual), (figures, late, usual)
    # ... and the router's own notice says so: the shift is cleared within five minutes.
    cleared = [
        t for t, w, state in policy.shifts if w == worker and state == "cleared" and t >= window.until_s
    ]
    detected = [
        t for t, w, state in policy.shifts if w == worker and state == "slower" and t >= window.from_s
    ]
    if detected and detected[0] < window.until_s:
        assert cleared and cleared[0] - window.until_s <= 300.0, policy.shifts
    return result


def test_the_documented_slowdown_shape_parses_and_multiplies_speed_inside_its_windows() -> None:
    (w,) = parse_fleet(SLOWDOWN_TOML).worker
    assert w.slowdown == [
        Slowdown(from_s=3600, until_s=7200, factor=0.06),
        Slowdown(from_s=9000, until_s=9600, factor=0.5),
    ]
    assert [w.speed_factor(t) for t in (0.0, 3600.0, 7199.0, 7200.0, 9300.0)] == [1.0, 0.06, 0.06, 1.0, 0.5]


@pytest.mark.parametrize("bad", ["factor = 0.0", "until_s = 3000"])
def test_a_slowdown_with_no_positive_factor_or_an_empty_window_is_refused(bad: str) -> None:
    text = SLOWDOWN_TOML.replace("factor = 0.06" if "factor" in bad else "until_s = 7200", bad, 1)
    with pytest.raises(FleetError, match="slowdown"):
        parse_fleet(text)


def test_a_slowed_machine_finishes_later_in_the_simulator_and_the_oracle_knows_it() -> None:
    fleet = Fleet(
        worker=[
            WorkerSpec(name="m", models={"m1": WorkerModel(decode_tps=50.0, prompt_tps=500.0, load_s=0.0)})
        ],
        model={"m1": ModelSpec(output=OutputLength(dist="fixed", mean=100.0))},
    )
    spec = WorkloadSpec(load=0.1, tasks=200, seed=2)
    plain = simulate(fleet, "m1", spec, make_policy("routeledger-oracle"))
    slow = simulate(
        _slowed(fleet, "m", Slowdown(from_s=0, until_s=1e9, factor=0.5)), "m1", spec, make_policy("fast-only")
    )
    # Half the speed: every task takes twice its two seconds.
    assert plain.mean_s == pytest.approx(2.0 + 64 / 500, rel=0.2)
    assert slow.mean_s > 1.8 * plain.mean_s


@pytest.mark.parametrize("load", [0.3, 0.6])
def test_on_the_story_fleet_the_router_leaves_the_slowed_gpu_pc_and_returns_near_the_oracle(
    load: float,
) -> None:
    window = Slowdown(from_s=3600, until_s=7200, factor=0.06)
    fleet = _slowed(load_fleet("seed"), "rtx3070ti", window)
    spec = WorkloadSpec(load=load, tasks=1500, seed=1)
    ours = _check_follows(fleet, MODEL, spec, "rtx3070ti", window)
    oracle, _ = _run(fleet, MODEL, spec, "routeledger-oracle")
    assert ours.mean_s <= 1.15 * oracle.mean_s, (ours.mean_s, oracle.mean_s)


def _random_fleet(rng: random.Random) -> tuple[Fleet, str, float]:
    """Two to four machines of random speeds on one model; (fleet, the slowed worker, factor)."""
    workers = []
    for i in range(rng.randint(2, 4)):
        decode = rng.uniform(5.0, 120.0)
        workers.append(
            WorkerSpec(
                name=f"w{i}",
                slots=rng.choice((1, 1, 2)),
                models={
                    "m": WorkerModel(decode_tps=decode, prompt_tps=decode * rng.uniform(10, 30), load_s=3.0)
                },
            )
        )
    fleet = Fleet(
        name="random", worker=workers, model={"m": ModelSpec(output=OutputLength(mean=rng.uniform(150, 600)))}
    )
    return fleet, rng.choice(workers).name, rng.uniform(0.03, 0.3)


def _random_case(seed: int) -> tuple[Fleet, str, WorkloadSpec, Slowdown]:
    """A random fleet, its slowed worker, a workload and a slowdown window in its middle part."""
    rng = random.Random(seed)
    fleet, worker, factor = _random_fleet(rng)
    spec = WorkloadSpec(load=rng.uniform(0.2, 0.6), tasks=1200, seed=seed)
    end = generate(fleet, "m", spec)[-1].arrival
    start = rng.uniform(0.2, 0.4) * end
    window = Slowdown(from_s=start, until_s=start + rng.uniform(0.1, 0.3) * end, factor=factor)
    return fleet, worker, spec, window


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_on_random_fleets_a_random_slowdown_is_left_within_a_minute_and_returned_from_within_five(
    seed: int,
) -> None:
    fleet, worker, spec, window = _random_case(seed)
    _check_follows(_slowed(fleet, worker, window), "m", spec, worker, window, back=False)


@pytest.mark.parametrize("seed", [12, 13, 14, 33, 40])
def test_on_random_fleets_work_returns_within_five_minutes_of_the_recovery(seed: int) -> None:
    fleet, worker, spec, window = _random_case(seed)
    _check_follows(_slowed(fleet, worker, window), "m", spec, worker, window, unslowed=fleet)
