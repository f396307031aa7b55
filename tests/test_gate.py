"""The pull gate: a slow worker takes work only when the system is better off for it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.gate import GateParams, should_take
from router.plan import PlanParams
from sim.random_fleet import NOW_MS, FleetShape, random_fleet
from tests.router_helpers import (
    NOW,
    QWEN,
    backlog,
    busy,
    estimator,
    fleet_shapes,
    snapshot,
    speed_row,
    view,
    worker,
)

PLAN_ONLY = GateParams(rule="plan")


def seed():
    rows = [
        speed_row("macbookair", QWEN, 11.4, 30, prompt=120.0, load=8.0),
        speed_row("rtx3070ti", QWEN, 83.0, 30, prompt=2000.0, load=3.0),
    ]
    return estimator(snapshot(rows, {(QWEN, "general"): 600.0}))


def fleet(queued: int, rate: float = 0.0, fast_left_s: float = 4.0):
    mac, rtx = worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})
    # The fast worker is busy with a task expected to take 7.3 s; `fast_left_s` of it remain.
    busy(rtx, QWEN, started_s_ago=7.3 - fast_left_s, expected_s=7.3)
    return view([mac, rtx], {QWEN: backlog(QWEN, queued)}, rate=rate)


def test_with_one_task_and_the_fast_worker_finishing_in_two_seconds_the_slow_worker_leaves_it() -> None:
    est = seed()
    for params in (PLAN_ONLY, GateParams()):
        decision = should_take("macbookair", fleet(1, rate=0.05, fast_left_s=2.0), est, NOW, params)
        assert not decision.take
        assert decision.task_id == "q0"


def test_the_slow_worker_takes_a_task_only_when_the_backlog_is_long_enough() -> None:
    est = seed()
    takes = [should_take("macbookair", fleet(n), est, NOW, PLAN_ONLY).take for n in range(1, 15)]
    first = takes.index(True)
    assert first >= 4
    assert all(takes[first:])


def test_a_higher_arrival_rate_makes_the_slow_worker_take_at_a_shorter_backlog() -> None:
    est = seed()

    def threshold(rate: float) -> int:
        return next(n for n in range(1, 30) if should_take("macbookair", fleet(n, rate), est, NOW).take)

    assert threshold(0.14) < threshold(0.05) <= threshold(0.0)


def test_the_fast_worker_takes_the_head_when_it_is_free() -> None:
    est = seed()
    mac, rtx = worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})
    decision = should_take("rtx3070ti", view([mac, rtx], {QWEN: backlog(QWEN, 1)}), est, NOW)
    assert decision.take
    assert decision.numbers["position"] == 1.0


def test_a_worker_without_a_free_slot_or_without_queued_work_takes_nothing() -> None:
    est = seed()
    assert should_take("rtx3070ti", fleet(3), est, NOW).reason == "no free slot"
    empty = view([worker("macbookair", {QWEN})], {})
    assert not should_take("macbookair", empty, est, NOW).take
    assert not should_take("nobody", empty, est, NOW).take


def test_a_decision_is_plain_data_with_its_numbers() -> None:
    d = should_take("macbookair", fleet(20, rate=0.1), seed(), NOW).to_dict()
    assert d["take"] is True
    assert set(d["numbers"]) >= {"backlog", "expected_arrivals", "arrival_rate_per_s", "my_finish_s"}


def test_a_worker_with_more_slots_counts_the_arrivals_until_its_next_free_slot() -> None:
    est = seed()

    def share(slots: int, running: int) -> float:
        mac, rtx = worker("macbookair", {QWEN}, slots=slots), worker("rtx3070ti", {QWEN})
        busy(rtx, QWEN, started_s_ago=5.3, expected_s=7.3)
        for _ in range(running):
            busy(mac, QWEN, started_s_ago=1.0)
        d = should_take("macbookair", view([mac, rtx], {QWEN: backlog(QWEN, 1)}, rate=0.05), est, NOW)
        assert not d.take
        n = d.numbers
        return n["expected_arrivals"] / (n["arrival_rate_per_s"] * n["my_finish_s"])

    weight = GateParams().arrival_weight
    # One slot: every arrival until I finish the head; two: until one of mine frees up.
    assert abs(share(1, 0) - weight) < 1e-9
    assert abs(share(2, 0) - weight / 1.5) < 1e-9
    assert abs(share(2, 1) - weight / 2.0) < 1e-9


@settings(max_examples=60, deadline=None)
@given(shape=fleet_shapes(), seed=st.integers(0, 2**16), rule=st.sampled_from(["plan", "arrivals"]))
def test_every_worker_gets_the_same_answer_from_the_pruned_walk_as_from_the_full_one(
    shape: FleetShape, seed: int, rule: str
) -> None:
    snap, fleet, _ = random_fleet(shape, seed)
    est = estimator(snap, NOW_MS)
    pruned = GateParams(rule=rule)
    full = GateParams(rule=rule, plan=PlanParams(full_walk=True))
    for w in fleet.workers:
        assert should_take(w.name, fleet, est, NOW_MS, pruned) == should_take(
            w.name, fleet, est, NOW_MS, full
        )


def test_on_a_fleet_of_hundreds_each_worker_with_a_free_slot_decides_as_the_full_walk_would() -> None:
    snap, fleet, _ = random_fleet(FleetShape(workers=200, backlog=400), seed=5)
    est = estimator(snap, NOW_MS)
    full = GateParams(plan=PlanParams(full_walk=True))
    answers = [should_take(w.name, fleet, est, NOW_MS) for w in fleet.workers]
    assert answers == [should_take(w.name, fleet, est, NOW_MS, full) for w in fleet.workers]
    # Both answers occur, and some take only after a walk down the queue.
    assert {a.take for a in answers} == {True, False}
    assert any(a.numbers.get("position", 1.0) > 1.0 for a in answers)
