"""The dispatch plan: service terms, slot free times, and a burst assigned near the optimum."""

from __future__ import annotations

import pytest

from router.plan import plan_queue, service, slot_free_times
from sim.fleetspec import load_fleet
from sim.scheduling.bounds import burst_optimum
from tests.router_helpers import NOW, QWEN, backlog, busy, estimator, snapshot, speed_row, view, worker

SEED_QWEN = {"macbookair": (11.4, 120.0, 8.0), "rtx3070ti": (83.0, 2000.0, 3.0)}


def seed_snapshot():
    rows = [speed_row(w, QWEN, d, 30, prompt=p, load=ld) for w, (d, p, ld) in SEED_QWEN.items()]
    return snapshot(rows, {(QWEN, "general"): 600.0})


def test_service_pays_the_load_only_when_the_model_is_not_loaded_and_caps_output_at_max_tokens() -> None:
    est = estimator(seed_snapshot())
    warm = service(est, "rtx3070ti", QWEN, prompt_tokens=200, loaded=True)
    cold = service(est, "rtx3070ti", QWEN, prompt_tokens=200, loaded=False)
    capped = service(est, "rtx3070ti", QWEN, prompt_tokens=200, max_tokens=83)
    assert warm.load_s == 0.0
    assert cold.total_s - warm.total_s == pytest.approx(est.speed("rtx3070ti", QWEN).load_s.value)
    out = est.output_tokens(QWEN, "general").value
    assert warm.decode_s == pytest.approx(out / est.speed("rtx3070ti", QWEN).decode_tps.value)
    assert capped.output_tokens == 83.0


def test_a_slot_is_free_when_its_task_is_expected_to_end_and_an_overdue_one_is_not_free_now() -> None:
    est = estimator(seed_snapshot())
    w = worker("rtx3070ti", {QWEN}, slots=2)
    busy(w, QWEN, started_s_ago=3.0, expected_s=10.0)
    busy(w, QWEN, started_s_ago=30.0, expected_s=10.0)
    free = slot_free_times(w, est, NOW)
    assert free == pytest.approx([1.0, 7.0])


def test_a_burst_of_three_equal_tasks_on_the_seed_speeds_finishes_within_a_tenth_of_the_best_makespan() -> (
    None
):
    fleet = load_fleet("seed")
    est = estimator(seed_snapshot())
    mac, rtx = worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})
    plan = plan_queue(view([mac, rtx], {QWEN: backlog(QWEN, 3)}), est, QWEN, NOW)
    truth = {w.name: w.models["qwen3:8b"] for w in fleet.worker if w.name in SEED_QWEN}
    times = [[64 / truth[n].prompt_tps + 600 / truth[n].decode_tps for n in ("macbookair", "rtx3070ti")]] * 3
    best = burst_optimum(times)
    # The plan's assignment, timed on the true speeds.
    column = {"macbookair": 0, "rtx3070ti": 1}
    busy_s = {"macbookair": 0.0, "rtx3070ti": 0.0}
    for a in plan.assignments:
        busy_s[a.worker] += times[0][column[a.worker]]
    assert max(busy_s.values()) <= 1.1 * best
    assert [a.worker for a in plan.assignments] == ["rtx3070ti"] * 3


def test_the_plan_gives_the_slow_worker_a_task_only_when_the_fast_one_would_finish_it_later() -> None:
    est = estimator(seed_snapshot())
    mac, rtx = worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})
    plan = plan_queue(view([mac, rtx], {QWEN: backlog(QWEN, 12)}), est, QWEN, NOW)
    first_mac = next((a for a in plan.assignments if a.worker == "macbookair"), None)
    assert first_mac is not None
    before = plan.assignments[: plan.assignments.index(first_mac)]
    assert all(a.worker == "rtx3070ti" for a in before)
    assert len(before) >= 5
