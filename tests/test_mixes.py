"""Workload mixes for the scheduling simulator: the `[[class]]` TOML shape, its errors, and runs."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from routeledger.cli import app
from router.plan import BacklogEntry, RunningTask
from sim.errors import MixError
from sim.fleetspec import load_fleet
from sim.scheduling.policies import FastOnly, make_policy
from sim.scheduling.schedule import Simulation, SimWorker, simulate
from sim.scheduling.workload import Job, WorkloadSpec, capped_mean, generate, load_mix, parse_mix

ISSUE_EXAMPLE = """
[[class]]
domain = "classify"
share = 0.5                 # fraction of arrivals
prompt_tokens = 120         # mean; lognormal with sigma below
prompt_sigma = 0.3
output_tokens = 12          # mean of the output length distribution
output_dist = "lognormal"   # exp | lognormal | fixed
output_sigma = 0.4
max_tokens = 32             # optional cap the request carries
"""

SECOND = """
[[class]]
domain = "code"
share = 0.5
prompt_tokens = 900
prompt_sigma = 0.5
output_tokens = 800
output_dist = "exp"
"""

# The seed fleet's default model (qwen3:8b) has lognormal outputs, mean 600, sigma 0.5.
ONE_CLASS = """
[[class]]
domain = "general"
share = 1.0
prompt_tokens = 64
output_tokens = 600
output_dist = "lognormal"
output_sigma = 0.5
"""


def test_the_issue_example_parses_into_its_fields() -> None:
    mix = parse_mix(ISSUE_EXAMPLE + SECOND)
    classify, code = mix.classes
    assert (classify.domain, classify.share, classify.prompt_tokens, classify.prompt_sigma) == (
        "classify",
        0.5,
        120.0,
        0.3,
    )
    assert (classify.output_tokens, classify.output_dist, classify.output_sigma) == (12.0, "lognormal", 0.4)
    assert classify.max_tokens == 32
    assert (code.output_dist, code.max_tokens, code.output_sigma) == ("exp", None, 0.0)


def test_the_shipped_mixes_load_by_name() -> None:
    assert [c.domain for c in load_mix("chat-code").classes] == ["classify", "chat", "code"]
    assert [c.domain for c in load_mix("rag").classes] == ["rewrite", "answer", "summarize"]
    with pytest.raises(MixError, match="shipped mixes: chat-code, rag"):
        load_mix("nope")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (ISSUE_EXAMPLE.replace('"lognormal"', '"pareto"') + SECOND, "output_dist 'pareto'"),
        (ISSUE_EXAMPLE + SECOND.replace("share = 0.5", "share = 0.3"), "share values sum to 0.8"),
        (ISSUE_EXAMPLE.replace("share = 0.5", "share = -0.5") + SECOND, "share must be positive"),
        (ISSUE_EXAMPLE.replace("output_tokens = 12", "") + SECOND, "output_tokens"),
        (ISSUE_EXAMPLE + SECOND + "colour = 1\n", "colour"),
    ],
)
def test_a_bad_mix_file_is_one_line_naming_the_field_and_exit_code_2(
    tmp_path: Path, text: str, needle: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    out = CliRunner().invoke(app, ["sim", "schedule", "--fleet", "seed", "--mix", str(path), "--tasks", "10"])
    assert out.exit_code == 2, out.output
    assert needle in out.output
    assert "Traceback" not in out.output


def test_a_one_class_mix_gives_exactly_the_single_domain_workload() -> None:
    fleet = load_fleet("seed")
    mix = parse_mix(ONE_CLASS)
    plain = WorkloadSpec(load=0.7, tasks=400, seed=5, dist="lognormal", mean_tokens=600.0, sigma=0.5)
    mixed = msgspec.structs.replace(plain, dist=None, mean_tokens=None, sigma=None, mix=mix)
    assert generate(fleet, "qwen3:8b", mixed) == generate(fleet, "qwen3:8b", plain)
    for name in ("routeledger", "least-busy"):
        a = simulate(fleet, "qwen3:8b", plain, make_policy(name))
        b = simulate(fleet, "qwen3:8b", mixed, make_policy(name))
        assert a.response_s == b.response_s


def test_the_command_with_a_one_class_mix_prints_the_flags_figures(tmp_path: Path) -> None:
    path = tmp_path / "one.toml"
    path.write_text(ONE_CLASS)
    common = ["sim", "schedule", "--fleet", "seed", "--tasks", "150", "--load", "0.5", "--json"]
    common += ["--policies", "routeledger,best-threshold"]
    flags = CliRunner().invoke(app, [*common, "--dist", "lognormal", "--mean-tokens", "600"])
    mixed = CliRunner().invoke(app, [*common, "--mix", str(path)])
    assert flags.exit_code == 0 and mixed.exit_code == 0, flags.output + mixed.output
    a = json.loads(flags.output.strip().splitlines()[-1])["results"]
    b = json.loads(mixed.output.strip().splitlines()[-1])["results"]
    assert "class_p99_s" not in a[0]
    classes = [r.pop("class_p99_s") for r in b]
    assert all(c.keys() == {"general"} for c in classes)
    assert a == b


def test_a_generated_workload_keeps_the_files_shares() -> None:
    mix = load_mix("chat-code")
    jobs = generate(load_fleet("seed"), "qwen3:8b", WorkloadSpec(tasks=4000, seed=2, mix=mix))
    for c in mix.classes:
        mine = [j for j in jobs if j.domain == c.domain]
        assert abs(len(mine) / len(jobs) - c.share) < 0.03, c.domain
        assert all(j.max_tokens == c.max_tokens for j in mine)
        mean_prompt = sum(j.prompt_tokens for j in mine) / len(mine)
        assert abs(mean_prompt / c.prompt_tokens - 1.0) < 0.1, c.domain


def test_max_tokens_caps_every_output_as_a_backend_stops_there() -> None:
    mix = parse_mix(SECOND.replace("share = 0.5", "share = 1.0") + "max_tokens = 400\n")
    jobs = generate(load_fleet("seed"), "qwen3:8b", WorkloadSpec(tasks=2000, seed=3, mix=mix))
    outs = [j.output_tokens for j in jobs]
    assert max(outs) == 400
    # Exponential, mean 800, capped at 400: about e^-0.5 = 61% hit the cap.
    assert 0.55 < outs.count(400) / len(outs) < 0.67
    assert abs(sum(outs) / len(outs) / capped_mean(mix.classes[0]) - 1.0) < 0.05


class _Recording(FastOnly):
    """Fast-only, keeping what the queue and the running list said about each task."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[BacklogEntry] = []
        self.running: list[RunningTask] = []

    def take(self, sim: Simulation, worker: SimWorker) -> bool:
        self.entries.append(sim.queue[0])
        return super().take(sim, worker)

    def arrived(self, sim: Simulation, job: Job) -> None:
        for w in sim.workers:
            self.running.extend(w.view.running)


def test_the_queue_and_running_tasks_say_what_a_real_request_would() -> None:
    fleet = load_fleet("seed")
    spec = WorkloadSpec(load=0.8, tasks=200, seed=4, mix=parse_mix(ISSUE_EXAMPLE + SECOND))
    jobs = {str(j.index): j for j in generate(fleet, "qwen3:8b", spec)}
    policy = _Recording()
    Simulation(fleet, "qwen3:8b", spec, policy).run()
    assert policy.entries and policy.running
    for e in policy.entries + policy.running:
        j = jobs[e.task_id]
        assert (e.domain, e.prompt_tokens, e.max_tokens) == (j.domain, j.prompt_tokens, j.max_tokens)
    assert {e.max_tokens for e in policy.entries} == {32, None}


def test_the_json_of_a_mixed_run_has_each_classes_p99() -> None:
    args = ["sim", "schedule", "--fleet", "seed", "--mix", "chat-code", "--tasks", "300", "--load", "0.6"]
    out = CliRunner().invoke(app, [*args, "--policies", "least-busy", "--json"])
    assert out.exit_code == 0, out.output
    (row,) = json.loads(out.output.strip().splitlines()[-1])["results"]
    p99 = row["class_p99_s"]
    assert list(p99) == ["classify", "chat", "code"]
    assert all(v > 0 for v in p99.values())
    # The longest answers wait longest at the tail, and the worst class's p99 is at least the
    # whole run's p95.
    assert p99["code"] > p99["classify"]
    assert max(p99.values()) >= row["p95_s"]


def test_a_mix_with_the_chat_workload_is_refused_in_one_line() -> None:
    args = ["sim", "schedule", "--fleet", "seed", "--mix", "rag", "--workload", "chat", "--tasks", "10"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2, out.output
    assert "a mix runs with the poisson workload" in out.output
