"""The scheduling simulator: deterministic, never beating the limits, and right on M/G/1."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from routeledger.cli import app
from sim.fleetspec import Fleet, ModelSpec, OutputLength, WorkerModel, WorkerSpec, parse_fleet
from sim.scheduling.experiment import limits_of, sweep_thresholds
from sim.scheduling.policies import POLICIES, make_policy
from sim.scheduling.schedule import Simulation, simulate
from sim.scheduling.workload import Job, WorkloadSpec, default_model, generate

DOC_TOML = """
[[worker]]
name = "macbookair"
slots = 1
online = [[0, 1e9]]          # optional windows in simulated seconds; default: always on
[worker.models."qwen3:8b"]
decode_tps = 11.4
prompt_tps = 90.0
load_s = 8.0
"""


def one_machine(dist: str = "exp") -> Fleet:
    return Fleet(
        name="one",
        worker=[
            WorkerSpec(name="m", models={"m1": WorkerModel(decode_tps=50.0, prompt_tps=500.0, load_s=0.0)})
        ],
        model={"m1": ModelSpec(output=OutputLength(dist=dist, mean=200.0))},
    )


def test_the_documented_fleet_toml_parses() -> None:
    fleet = parse_fleet(DOC_TOML)
    (w,) = fleet.worker
    assert (w.name, w.slots, w.online) == ("macbookair", 1, [(0.0, 1e9)])
    assert w.models["qwen3:8b"].decode_tps == 11.4
    assert default_model(fleet) == "qwen3:8b"


def test_the_same_seed_gives_the_same_figures() -> None:
    fleet = parse_fleet(
        DOC_TOML.replace("macbookair", "a") + DOC_TOML.replace("macbookair", "b").replace("11.4", "80")
    )
    spec = WorkloadSpec(load=0.7, tasks=300, seed=3)
    for name in ("routeledger", "random", "litellm-latency"):
        a = simulate(fleet, "qwen3:8b", spec, make_policy(name))
        b = simulate(fleet, "qwen3:8b", spec, make_policy(name))
        assert a.response_s == b.response_s
    other = simulate(fleet, "qwen3:8b", WorkloadSpec(load=0.7, tasks=300, seed=4), make_policy("routeledger"))
    assert other.response_s != a.response_s


def test_fast_only_on_one_machine_matches_the_m_g_1_mean() -> None:
    fleet = one_machine()
    spec = WorkloadSpec(load=0.5, tasks=20_000, seed=11)
    jobs = generate(fleet, "m1", spec)
    service = [j.prompt_tokens / 500.0 + j.output_tokens / 50.0 for j in jobs]
    mean_s = sum(service) / len(service)
    second = sum(s * s for s in service) / len(service)
    rate = (len(jobs) - 1) / (jobs[-1].arrival - jobs[0].arrival)
    rho = rate * mean_s
    pollaczek_khinchine = mean_s + rate * second / (2 * (1 - rho))
    result = simulate(fleet, "m1", spec, make_policy("fast-only"), jobs)
    assert result.mean_s == pytest.approx(pollaczek_khinchine, rel=0.06)


def _fleet(draw: st.DrawFn) -> Fleet:
    n = draw(st.integers(1, 3))
    workers = [
        WorkerSpec(
            name=f"w{i}",
            slots=draw(st.integers(1, 2)),
            parallel_exponent=draw(st.sampled_from([0.7, 1.0])),
            models={
                "m": WorkerModel(
                    decode_tps=draw(st.floats(2.0, 150.0)),
                    prompt_tps=draw(st.floats(20.0, 3000.0)),
                    load_s=draw(st.floats(0.0, 10.0)),
                )
            },
        )
        for i in range(n)
    ]
    return Fleet(
        name="random", worker=workers, model={"m": ModelSpec(output=OutputLength(dist="exp", mean=150.0))}
    )


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), load=st.floats(0.2, 1.1), seed=st.integers(0, 1000))
def test_no_policy_beats_the_lower_bounds_on_random_fleets(
    data: st.DataObject, load: float, seed: int
) -> None:
    fleet = _fleet(data.draw)
    spec = WorkloadSpec(load=load, tasks=40, seed=seed, burst=data.draw(st.sampled_from([1, 4])))
    jobs = generate(fleet, "m", spec)
    bound = limits_of(fleet, "m", jobs)
    results = [simulate(fleet, "m", spec, make_policy(name), jobs) for name in POLICIES]
    results.append(sweep_thresholds(fleet, "m", spec, jobs, max_k=6, patience=2)[0])
    for r in results:
        assert r.mean_s >= bound.mean_response_s * (1 - 1e-9), r.policy
        assert r.makespan_s >= bound.makespan_s * (1 - 1e-9), r.policy


def test_a_worker_joining_mid_run_is_benchmarked_and_then_given_work() -> None:
    fleet = parse_fleet(
        DOC_TOML.replace("macbookair", "slow") + DOC_TOML.replace("macbookair", "fast").replace("11.4", "80")
    )
    spec = WorkloadSpec(load=0.5, tasks=400, seed=2, joins=(("fast", 2000.0),))
    result = simulate(fleet, "qwen3:8b", spec, make_policy("routeledger"))
    assert result.benchmarks == 6  # three on each machine, when each came online
    late = [w for w, t in zip(result.worker_of, result.finish_s, strict=True) if t > 2100.0]
    assert late.count("fast") > late.count("slow")


def test_a_joining_workers_benchmark_gives_its_slot_to_a_task_that_arrives_meanwhile() -> None:
    # One machine, 10 tok/s: each of its three join benchmarks (128 tokens) takes 12.8 s. A task
    # arriving a second in starts at once; the benchmarks run before and after it.
    fleet = parse_fleet(DOC_TOML.replace("11.4", "10.0"))
    job = Job(index=0, arrival=1.0, prompt_tokens=64, output_tokens=20)
    sim = Simulation(fleet, "qwen3:8b", WorkloadSpec(tasks=1), make_policy("routeledger"), [job])
    result = sim.run()
    assert sim.preempted == 1 and result.benchmarks == 3
    # Its prompt and its 20 tokens from its arrival (the model was loaded by the benchmark).
    assert result.ttft_s[0] == pytest.approx(64 / 90.0)
    assert result.finish_s[0] == pytest.approx(1.0 + 64 / 90.0 + 20 / 10.0)


def test_a_worker_going_offline_gives_back_what_it_ran() -> None:
    fleet = parse_fleet(DOC_TOML.replace("macbookair", "a") + DOC_TOML.replace("macbookair", "b"))
    spec = WorkloadSpec(load=0.6, tasks=200, seed=5, leaves=(("a", 500.0),))
    for name in ("routeledger", "least-busy"):
        result = simulate(fleet, "qwen3:8b", spec, make_policy(name))
        assert all(t < float("inf") for t in result.finish_s)
        assert "b" in result.worker_of


def test_the_schedule_command_prints_the_documented_json_last() -> None:
    out = CliRunner().invoke(
        app,
        [
            "sim",
            "schedule",
            "--fleet",
            "seed",
            "--tasks",
            "150",
            "--load",
            "0.5",
            "--policies",
            "routeledger,least-busy,best-threshold",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.output.strip().splitlines()[-1])
    assert data["fleet"] == "seed"
    assert data["tasks"] == 150
    assert [r["policy"] for r in data["results"]] == ["routeledger", "least-busy", "best-threshold"]
    for r in data["results"]:
        assert set(r) >= {
            "policy",
            "load",
            "mean_s",
            "p95_s",
            "makespan_s",
            "vs_best_threshold",
            "vs_lower_bound",
        }
        assert r["vs_lower_bound"] >= 1.0


def test_an_unknown_policy_or_fleet_is_one_clear_line() -> None:
    out = CliRunner().invoke(app, ["sim", "schedule", "--fleet", "seed", "--policies", "nope"])
    assert out.exit_code == 2
    assert "unknown policy" in out.output
    out = CliRunner().invoke(app, ["sim", "schedule", "--fleet", "nope"])
    assert out.exit_code == 2
    assert "no fleet preset" in out.output
