"""What a request says about its size: the estimate, the size-aware gate and its bound, and the
simulator's size-aware peers."""

from __future__ import annotations

import msgspec

from projections.snapshot import LengthRow
from router.choose import RouteQuery, rank_workers
from router.gate import GateParams, should_take
from router.plan import BacklogEntry, service
from sim.fleetspec import load_fleet
from sim.scheduling.experiment import sweep_sita
from sim.scheduling.policies import Routeledger, Sita, exact_size, make_policy
from sim.scheduling.schedule import Simulation, simulate
from sim.scheduling.workload import MixClass, WorkloadSpec, capped_mean, generate, load_mix
from tests.router_helpers import NOW, QWEN, busy, estimator, snapshot, speed_row, stat, view, worker

SIZED = GateParams(skip_ahead=True)


def _seed_estimator(lengths: dict[str, list[float]]):
    rows = [
        speed_row("macbookair", QWEN, 11.4, 30, prompt=120.0, load=8.0),
        speed_row("rtx3070ti", QWEN, 83.0, 30, prompt=2000.0, load=3.0),
    ]
    snap = snapshot(rows)
    for domain, values in lengths.items():
        snap.length[(QWEN, domain)] = LengthRow(digest=QWEN, domain=domain, output_tokens=stat(values))
    return estimator(snap)


def _spread(mean: float) -> list[float]:
    """Forty output lengths around `mean` (half at 0.5x, half at 1.5x: a coefficient of variation of 0.5)."""
    return [mean * 0.5] * 20 + [mean * 1.5] * 20


def _entry(task_id: str, domain: str, prompt: int, max_tokens: int | None, waited_s: float) -> BacklogEntry:
    return BacklogEntry(
        task_id=task_id,
        digest=QWEN,
        enqueued_at_ms=NOW - int(waited_s * 1000),
        domain=domain,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
    )


def test_a_short_task_with_a_small_max_tokens_gets_a_smaller_estimate() -> None:
    est = _seed_estimator({"chat": _spread(300.0)})
    whole = service(est, "rtx3070ti", QWEN, domain="chat", prompt_tokens=350)
    short = service(est, "rtx3070ti", QWEN, domain="chat", prompt_tokens=120, max_tokens=32)
    assert short.total_s < whole.total_s / 5
    assert short.output_tokens < 32


def test_a_cap_at_the_mean_cuts_the_long_answers_only_as_the_lengths_law_says() -> None:
    est = _seed_estimator({"chat": _spread(300.0)})
    capped = est.capped_output(QWEN, "chat", 300)
    # E[min(L, mean)] is below the mean (min(mean, cap) would say 300), and equals the lognormal's
    # own figure at the spread the estimator read from the lengths.
    sigma = est.length_sigma(QWEN, "chat")
    law = MixClass(
        domain="chat",
        share=1.0,
        prompt_tokens=1.0,
        output_tokens=est.output_tokens(QWEN, "chat").value,
        output_dist="lognormal",
        output_sigma=sigma,
        max_tokens=300,
    )
    assert capped.value < 290.0
    assert abs(capped.value - capped_mean(law)) < 1e-6
    assert "max_tokens 300" in capped.source
    assert est.capped_output(QWEN, "chat", None) == est.output_tokens(QWEN, "chat")


def _queue(head_waited_s: float) -> list[BacklogEntry]:
    return [
        _entry("code", "code", 900, 4096, head_waited_s),
        _entry("label", "classify", 120, 32, 1.0),
    ]


def _fleet(queue: list[BacklogEntry]):
    mac, rtx = worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})
    busy(rtx, QWEN, started_s_ago=1.0, expected_s=20.0)
    return view([mac, rtx], {QWEN: queue}, rate=0.0)


def test_the_slow_worker_takes_a_later_small_task_ahead_of_a_big_head() -> None:
    est = _seed_estimator({"code": _spread(800.0), "classify": _spread(12.0)})
    sized = should_take("macbookair", _fleet(_queue(5.0)), est, NOW, SIZED)
    assert sized.take and sized.task_id == "label"
    # Size-blind, the plan gives it the same small task but it takes the big head instead.
    blind = should_take("macbookair", _fleet(_queue(5.0)), est, NOW, GateParams())
    assert blind.take and blind.task_id == "code"


def test_a_task_that_waited_the_bound_is_laid_out_before_any_smaller_later_one() -> None:
    est = _seed_estimator({"code": _spread(800.0), "classify": _spread(12.0)})
    mac, rtx = worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})
    for waited, first in ((SIZED.max_skip_wait_s - 1.0, "label"), (SIZED.max_skip_wait_s, "code")):
        decision = should_take("rtx3070ti", view([mac, rtx], {QWEN: _queue(waited)}), est, NOW, SIZED)
        assert decision.take and decision.task_id == first, waited


def test_overdue_tasks_go_in_queue_order_whatever_their_sizes() -> None:
    est = _seed_estimator({"code": _spread(800.0), "classify": _spread(12.0)})
    bound = SIZED.max_skip_wait_s
    queue = [
        _entry("old-code", "code", 900, 4096, bound + 30.0),
        _entry("old-label", "classify", 120, 32, bound + 10.0),
        _entry("new-label", "classify", 100, 32, 1.0),
    ]
    decision = should_take("rtx3070ti", view([worker("rtx3070ti", {QWEN})], {QWEN: queue}), est, NOW, SIZED)
    assert decision.task_id == "old-code"


def test_on_a_mix_the_size_aware_gate_beats_the_size_blind_one() -> None:
    fleet = load_fleet("seed")
    spec = WorkloadSpec(load=0.6, tasks=600, seed=3, mix=load_mix("chat-code"))
    jobs = generate(fleet, "qwen3:8b", spec)
    sized = simulate(fleet, "qwen3:8b", spec, make_policy("routeledger"), jobs)
    blind = simulate(fleet, "qwen3:8b", spec, Routeledger(gate=GateParams()), jobs)
    assert sized.mean_s < 0.95 * blind.mean_s


def test_sita_sends_each_job_to_the_worker_whose_size_interval_holds_it() -> None:
    fleet = load_fleet("seed")
    spec = WorkloadSpec(load=0.5, tasks=300, seed=2, mix=load_mix("chat-code"))
    jobs = generate(fleet, "qwen3:8b", spec)
    sim = Simulation(fleet, "qwen3:8b", spec, Sita((2.0,)), jobs)
    result = sim.run()
    for j in jobs:
        expected = "macbookair" if exact_size(sim, j) < 2.0 else "rtx3070ti"
        assert result.worker_of[j.index] == expected


def test_sed_size_sends_a_small_job_to_an_idle_slow_worker_and_a_big_one_to_the_fast() -> None:
    fleet = load_fleet("seed")
    spec = WorkloadSpec(load=0.5, tasks=2, seed=2, mix=load_mix("chat-code"))
    jobs = generate(fleet, "qwen3:8b", spec)
    sim = Simulation(fleet, "qwen3:8b", spec, make_policy("sed-size"), jobs)
    sim.run()
    fast = sim.by_name["rtx3070ti"]
    # The fast worker has a long task queued: a short label is done sooner on the idle laptop.
    fast.own.append(msgspec.structs.replace(jobs[0], domain="code", prompt_tokens=900, max_tokens=4096))
    label = msgspec.structs.replace(jobs[0], domain="classify", prompt_tokens=120, max_tokens=32)
    code = msgspec.structs.replace(jobs[0], domain="code", prompt_tokens=900, max_tokens=4096)
    assert sim.policy.route(sim, label).name == "macbookair"
    assert sim.policy.route(sim, code).name == "rtx3070ti"


def test_on_alike_tasks_the_size_aware_gate_keeps_the_size_blind_figures_within_one_percent() -> None:
    # Only a benchmark running beside alike tasks (a smaller prompt) makes sizes differ at all.
    fleet = load_fleet("trio")
    for load in (0.5, 0.9):
        spec = WorkloadSpec(load=load, tasks=400, seed=5)
        jobs = generate(fleet, "qwen3:8b", spec)
        sized = simulate(fleet, "qwen3:8b", spec, make_policy("routeledger"), jobs)
        blind = simulate(fleet, "qwen3:8b", spec, make_policy("routeledger-sizeblind"), jobs)
        assert abs(sized.mean_s / blind.mean_s - 1.0) < 0.01, load


def test_the_breakdown_shows_the_size_estimate_and_its_source() -> None:
    est = _seed_estimator({"chat": _spread(300.0)})
    mac, rtx = worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})
    query = RouteQuery(model="qwen3:8b", domain="chat", prompt_tokens=350, max_tokens=256)
    best = rank_workers(view([mac, rtx]), est, QWEN, NOW, query).best
    assert best.terms["prompt_tokens"] == 350.0
    assert "4 characters a token" in best.fields["prompt_tokens"].source
    assert best.terms["output_tokens"] == est.capped_output(QWEN, "chat", 256).value
    assert "max_tokens 256" in best.fields["output_tokens"].source


def test_the_sita_sweep_finds_cutoffs_no_worse_than_sending_everything_to_the_fastest() -> None:
    fleet = load_fleet("seed")
    spec = WorkloadSpec(load=0.7, tasks=300, seed=6, mix=load_mix("chat-code"))
    jobs = generate(fleet, "qwen3:8b", spec)
    swept, cutoffs = sweep_sita(fleet, "qwen3:8b", spec, jobs)
    everything_fast = simulate(fleet, "qwen3:8b", spec, Sita((0.0,)), jobs)
    assert len(cutoffs) == 1
    assert swept.mean_s <= everything_fast.mean_s
