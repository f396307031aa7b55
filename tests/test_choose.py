"""Choosing the model for `auto` and ranking holders, with every term as plain data."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from router.choose import (
    STORED_CANDIDATES,
    ChooseParams,
    RouteQuery,
    _short,
    choose_model,
    classify_domain,
    decide,
    rank_workers,
)
from router.errors import NoHolderError, NoModelError
from router.estimate import Estimator
from router.plan import FleetView, PlanParams, plan_queue
from sim.random_fleet import DOMAINS, NOW_MS, FleetShape, random_fleet
from tests.router_helpers import (
    ELYZA,
    NOW,
    QWEN,
    estimator,
    fleet_shapes,
    graded,
    snapshot,
    speed_row,
    view,
    worker,
)

MODELS = {"qwen3:8b": QWEN, "elyza-jp-8b": ELYZA}


def fleet_est(*extra: object):
    rows = [
        *extra,
        speed_row("rtx3070ti", QWEN, 83.0, 10, prompt=2000.0, load=3.0),
        speed_row("rtx3070ti", ELYZA, 88.0, 10, prompt=2100.0, load=3.0),
    ]
    lengths = {(QWEN, "japanese"): 600.0, (ELYZA, "japanese"): 180.0, (QWEN, "general"): 600.0}
    quality = {(QWEN, "japanese"): 0.62, (ELYZA, "japanese"): 0.82, (QWEN, "general"): 0.74}
    return estimator(snapshot(rows, lengths, quality))


@pytest.mark.parametrize(
    ("text", "domain"),
    [
        ("日本の首都はどこですか", "japanese"),
        ("def add(a, b):\n    return a + b\nwhy does this fail?", "code"),
        ("```\nSELECT name FROM users\n```", "code"),
        ("What is the capital of France?", "general"),
    ],
)
def test_the_default_classifier_tells_code_japanese_and_general_apart(text: str, domain: str) -> None:
    assert classify_domain(text) == domain


def test_auto_picks_the_model_with_the_better_quality_and_latency_for_the_domain() -> None:
    fv = view([worker("rtx3070ti", {QWEN, ELYZA})])
    choice = choose_model(RouteQuery(domain="japanese"), MODELS, fv, fleet_est(), NOW)
    assert choice.model == "elyza-jp-8b"
    assert [c.rank for c in choice.candidates] == [1, 2]
    assert choice.candidates[0].utility > choice.candidates[1].utility


def test_the_latency_weight_can_outweigh_quality() -> None:
    fv = view([worker("rtx3070ti", {QWEN, ELYZA})])
    quality_only = choose_model(
        RouteQuery(domain="japanese"), MODELS, fv, fleet_est(), NOW, params=ChooseParams(latency_weight=0.0)
    )
    assert quality_only.model == "elyza-jp-8b"
    # ELYZA only on a slow machine: qwen on the fast one finishes far sooner.
    slow = view([worker("rtx3070ti", {QWEN}), worker("macbookair", {ELYZA})])
    est = fleet_est(speed_row("macbookair", ELYZA, 2.0, 10, prompt=50.0, load=8.0))
    latency_heavy = choose_model(
        RouteQuery(domain="japanese"), MODELS, slow, est, NOW, params=ChooseParams(latency_weight=10.0)
    )
    assert latency_heavy.model == "qwen3:8b"


def test_the_whole_decision_is_plain_json_with_weights_terms_and_sources() -> None:
    fv = view([worker("rtx3070ti", {QWEN, ELYZA}), worker("macbookair", {QWEN, ELYZA})])
    decision = decide(RouteQuery(model="auto", domain="japanese"), MODELS, fv, fleet_est(), NOW)
    data = json.loads(json.dumps(decision.to_dict()))
    assert data["auto"]["weights"]["latency_scale_s"] == ChooseParams().latency_scale_s
    first = data["candidates"][0]
    assert first["worker"] == "rtx3070ti"
    assert set(first["terms"]) >= {"wait_s", "load_s", "prompt_s", "decode_s", "quality"}
    assert first["fields"]["decode_tps"]["source"].startswith("worker n=10")
    assert data["candidates"][1]["fields"]["decode_tps"]["source"].startswith("two-way") is False


def test_equal_evidence_gives_equal_rank_whatever_the_names() -> None:
    fv = view([worker("b", {QWEN}), worker("a", {QWEN})])
    ranking = rank_workers(fv, fleet_est(), QWEN, NOW)
    assert [c.rank for c in ranking.candidates] == [1, 1]


def test_a_model_nobody_live_holds_is_a_clear_error() -> None:
    with pytest.raises(NoHolderError, match="no live worker holds"):
        rank_workers(view([]), fleet_est(), QWEN, NOW)
    with pytest.raises(NoModelError):
        choose_model(RouteQuery(), MODELS, view([]), fleet_est(), NOW)
    with pytest.raises(NoModelError):
        decide(RouteQuery(model="llama-unknown"), MODELS, view([worker("a", {QWEN})]), fleet_est(), NOW)


@settings(max_examples=60, deadline=None)
@given(shape=fleet_shapes(), seed=st.integers(0, 2**16), domain=st.sampled_from(DOMAINS))
def test_a_decision_for_a_named_model_is_the_same_from_the_pruned_walk_as_from_the_full_one(
    shape: FleetShape, seed: int, domain: str
) -> None:
    snap, fleet, models = random_fleet(shape, seed)
    est = estimator(snap, NOW_MS)
    full = PlanParams(full_walk=True)
    for name, digest in models.items():
        if not fleet.holders(digest):
            continue
        query = RouteQuery(
            model=name, domain=domain, prompt_tokens=seed % 3000, max_tokens=[None, 0, 300][seed % 3]
        )
        pruned = decide(query, models, fleet, est, NOW_MS)
        assert pruned == decide(query, models, fleet, est, NOW_MS, plan_params=full)
        assert (
            pruned.ranking.plan.assignments == plan_queue(fleet, est, digest, NOW_MS, params=full).assignments
        )


@settings(max_examples=100, deadline=None)
@given(
    shape=fleet_shapes(),
    seed=st.integers(0, 2**16),
    domain=st.sampled_from(DOMAINS),
    weights=st.sampled_from(
        [ChooseParams(), ChooseParams(quality_weight=0.0), ChooseParams(latency_weight=0.0)]
    ),
)
def test_auto_chooses_as_the_full_walk_does_and_leaves_out_only_queues_of_models_that_cannot_win(
    shape: FleetShape, seed: int, domain: str, weights: ChooseParams
) -> None:
    snap, fleet, models = random_fleet(shape, seed)
    est = estimator(snap, NOW_MS)
    assume(any(fleet.holders(d) for d in models.values()))
    query = RouteQuery(model="auto", domain=domain, prompt_tokens=seed % 3000)
    pruned = decide(query, models, fleet, est, NOW_MS, params=weights)
    full = decide(query, models, fleet, est, NOW_MS, params=weights, plan_params=PlanParams(full_walk=True))
    assert pruned.choice is not None and full.choice is not None
    # The answer: the model, every holder's breakdown, the plan of its queue.
    assert (pruned.model, pruned.digest, pruned.ranking) == (full.model, full.digest, full.ranking)
    assert [c.model for c in pruned.choice.candidates if c.rank == 1] == [
        c.model for c in full.choice.candidates if c.rank == 1
    ]
    assert not any(c.bound for c in full.choice.candidates)
    truth = {c.model: c for c in full.choice.candidates}
    best = pruned.choice.candidates[0].utility
    for c in pruned.choice.candidates:
        t = truth[c.model]
        # The baseline is found exactly, so every model counts the quality the full walk counts.
        assert (c.baseline, c.quality_counted) == (t.baseline, t.quality_counted)
        if c.bound:
            # What a model that cannot win shows is a bound on its true figures.
            assert c.utility >= t.utility
            assert c.expected_finish_s <= t.expected_finish_s
            assert c.utility < best
            assert c.rank > 1 and t.rank > 1
        else:
            assert (c.utility, c.expected_finish_s, c.best_worker) == (
                t.utility,
                t.expected_finish_s,
                t.best_worker,
            )


def test_on_a_fleet_of_hundreds_auto_lays_out_only_the_queues_that_could_win_and_marks_the_rest() -> None:
    snap, fleet, models = random_fleet(FleetShape(workers=200, backlog=400), seed=3)
    est = estimator(snap, NOW_MS)
    bounds = 0
    for domain in DOMAINS:
        query = RouteQuery(model="auto", domain=domain, prompt_tokens=500)
        pruned = decide(query, models, fleet, est, NOW_MS)
        full = decide(query, models, fleet, est, NOW_MS, plan_params=PlanParams(full_walk=True))
        assert (pruned.model, pruned.ranking) == (full.model, full.ranking)
        assert pruned.choice is not None
        marked = [m for m in pruned.to_dict()["auto"]["models"] if m.get("bound")]  # type: ignore[index, union-attr]
        assert len(marked) == sum(c.bound for c in pruned.choice.candidates)
        bounds += len(marked)
        # A negative latency weight makes a later finish better: no floor bounds the utility then.
        upside = decide(query, models, fleet, est, NOW_MS, params=ChooseParams(latency_weight=-1.0))
        assert upside.choice is not None and not any(c.bound for c in upside.choice.candidates)
    assert bounds > 0


def test_the_stored_breakdown_of_a_large_fleet_keeps_the_best_candidates_and_counts_the_rest() -> None:
    snap, fleet, models = random_fleet(FleetShape(workers=200, backlog=400), seed=3)
    est = estimator(snap, NOW_MS)
    decision = decide(RouteQuery(model="auto", domain="code", prompt_tokens=500), models, fleet, est, NOW_MS)
    whole = decision.ranking.candidates
    assert len(whole) > STORED_CANDIDATES
    stored = decision.to_dict(top=STORED_CANDIDATES)
    kept = stored["candidates"]
    assert isinstance(kept, list) and len(kept) == STORED_CANDIDATES
    assert kept == [c.to_dict() for c in whole[:STORED_CANDIDATES]]
    assert stored["others"] == {
        "count": len(whole) - STORED_CANDIDATES,
        "best_finish_s": min(c.expected_finish_s for c in whole[STORED_CANDIDATES:]),
    }
    # Within the bound every candidate is kept, with nothing left over.
    within = decision.to_dict(top=len(whole))
    assert "others" not in within and within["candidates"] == decision.to_dict()["candidates"]


# -- `auto` under uncertainty ------------------------------------------------------------------

# The story's demo: a `general` task, qwen3:8b on the GPU PC, elyza on the laptop six times slower.
FAST_TPS, SLOW_TPS = 84.0, 14.0
GENERAL_TOKENS = 200.0


def two_model_fleet(fast_grades: list[float], slow_grades: list[float]) -> tuple[FleetView, Estimator]:
    """QWEN only on the fast machine, ELYZA only on the slow one, each graded on the given answers
    (folded as the projector folds QualityScored)."""
    rows = [
        speed_row("rtx3070ti", QWEN, FAST_TPS, 200, prompt=2000.0, load=3.0),
        speed_row("macbookair", ELYZA, SLOW_TPS, 200, prompt=330.0, load=8.0),
    ]
    lengths = {(QWEN, "general"): GENERAL_TOKENS, (ELYZA, "general"): GENERAL_TOKENS}
    snap = snapshot(rows, lengths)
    graded(snap, QWEN, "general", fast_grades)
    graded(snap, ELYZA, "general", slow_grades)
    fv = view([worker("rtx3070ti", {QWEN}), worker("macbookair", {ELYZA})])
    return fv, estimator(snap)


def draw(rng: random.Random, quality: float, n: int) -> list[float]:
    return [1.0 if rng.random() < quality else 0.0 for _ in range(n)]


def picks_of_the_faster(fast_q: float, slow_q: float, n: int, params: ChooseParams) -> int:
    picked = 0
    for seed in range(100):
        rng = random.Random(seed)
        fv, est = two_model_fleet(draw(rng, fast_q, n), draw(rng, slow_q, n))
        picked += (
            choose_model(RouteQuery(domain="general"), MODELS, fv, est, NOW, params=params).model
            == "qwen3:8b"
        )
    return picked


def test_one_side_of_the_uncertainty_fleet_is_six_times_faster_and_the_gap_is_worth_over_0_04() -> None:
    fv, est = two_model_fleet([], [])
    choice = choose_model(RouteQuery(domain="general"), MODELS, fv, est, NOW)
    finish = {c.model: c.expected_finish_s for c in choice.candidates}
    assert finish["elyza-jp-8b"] / finish["qwen3:8b"] > 5.0
    # With the true qualities known, the faster model is the better choice either way round: the
    # latency gap costs more utility than 0.04 of quality.
    p = ChooseParams()
    gap = p.latency_weight * (finish["elyza-jp-8b"] - finish["qwen3:8b"]) / p.latency_scale_s
    assert gap > 0.04 * p.quality_weight


@pytest.mark.parametrize(
    ("fast_q", "slow_q"),
    [(0.74, 0.70), (0.70, 0.74)],
    ids=["the-faster-is-better-as-in-the-demo", "the-faster-is-worse-by-0.04"],
)
def test_a_thin_quality_lead_on_three_grades_never_buys_a_large_well_measured_latency_gap(
    fast_q: float, slow_q: float
) -> None:
    assert picks_of_the_faster(fast_q, slow_q, 3, ChooseParams()) >= 95
    # The test can fail: comparing posterior means alone, the noise of three grades often wins.
    assert picks_of_the_faster(fast_q, slow_q, 3, ChooseParams(quality_z=0.0)) < 95


def test_a_large_well_measured_quality_gap_does_win_over_latency() -> None:
    assert picks_of_the_faster(0.5, 0.9, 100, ChooseParams()) <= 5
    # The same on fixed grades: 60 answers each, 54 right against 30.
    fv, est = two_model_fleet([1.0] * 30 + [0.0] * 30, [1.0] * 54 + [0.0] * 6)
    choice = choose_model(RouteQuery(domain="general"), MODELS, fv, est, NOW)
    assert choice.model == "elyza-jp-8b"
    assert choice.candidates[1].baseline and choice.candidates[1].model == "qwen3:8b"


def _four_digits(x: float) -> float | int:
    """What the ledger record keeps of a number, by its definition: the "4g" format read back."""
    r = float(f"{x:.4g}")
    return int(r) if r.is_integer() and abs(r) < 2**31 else r


@settings(max_examples=3000)
@given(
    x=st.floats(allow_nan=False)
    | st.builds(
        lambda digits, half, exp: (digits + half) * 10.0**exp,
        st.integers(1000, 9999),
        st.sampled_from([0.0, 0.5, 0.4999999999, 0.5000000001, 0.9999999999999]),
        st.integers(-30, 30),
    )
    | st.builds(
        lambda exp, near: 10.0**exp * near,
        st.integers(-300, 300),
        st.sampled_from([1.0, 1 - 1e-16, 1 + 1e-15]),
    )
)
def test_a_recorded_number_keeps_four_significant_digits_exactly_as_the_4g_format_rounds_them(
    x: float,
) -> None:
    kept = _short(x)
    assert kept == _four_digits(x) and type(kept) is type(_four_digits(x))


def test_the_auto_breakdown_shows_each_models_quality_with_its_n_and_interval() -> None:
    fv, est = two_model_fleet([1.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    decision = decide(RouteQuery(model="auto", domain="general"), MODELS, fv, est, NOW)
    data = json.loads(json.dumps(decision.to_record()))
    auto = data["auto"]
    assert "lower bound" in auto["rule"] and auto["weights"]["quality_z"] == ChooseParams().quality_z
    by_model = {m["model"]: m for m in auto["models"]}
    for model, successes in (("qwen3:8b", 2), ("elyza-jp-8b", 3)):
        q = by_model[model]["quality"]
        assert q["n"] == 3 and q["source"].startswith("model n=3 graded")
        low, high = q["interval"]
        assert 0.0 <= low < q["value"] < high <= 1.0
        # Beta(1 + successes, 1 + 3 - successes): the mean the breakdown shows.
        assert q["value"] == pytest.approx((1 + successes) / 5)
    assert by_model["qwen3:8b"].get("baseline") is True
    assert by_model["elyza-jp-8b"]["quality_counted"] < by_model["elyza-jp-8b"]["quality"]["value"]
    # elyza looked better, and the breakdown says why it did not win.
    assert decision.model == "qwen3:8b" and "elyza-jp-8b looks better" in auto["note"]


def test_a_never_graded_model_does_not_beat_a_measured_mediocre_one_on_its_prior() -> None:
    mediocre = [1.0] * 6 + [0.0] * 14  # 0.3 on 20 answers
    fv = view([worker("rtx3070ti", {QWEN, ELYZA})])
    rows = [speed_row("rtx3070ti", d, 83.0, 50, prompt=2000.0, load=3.0) for d in (QWEN, ELYZA)]
    snap = graded(
        snapshot(rows, {(QWEN, "general"): 200.0, (ELYZA, "general"): 200.0}), QWEN, "general", mediocre
    )
    choice = choose_model(RouteQuery(domain="general"), MODELS, fv, estimator(snap), NOW)
    assert choice.model == "qwen3:8b"
    unknown = next(c for c in choice.candidates if c.model == "elyza-jp-8b")
    assert unknown.quality.n == 0 and "never graded" in unknown.quality.source
    assert unknown.quality.value == 0.5 and "elyza-jp-8b looks better" in choice.note


def test_a_never_graded_model_that_wins_on_speed_is_named_as_such_in_the_breakdown() -> None:
    # The graded model is on the laptop only, the never-graded one on the GPU PC: far faster.
    fv = view([worker("macbookair", {QWEN}), worker("rtx3070ti", {ELYZA})])
    rows = [
        speed_row("macbookair", QWEN, 2.0, 50, prompt=100.0, load=8.0),
        speed_row("rtx3070ti", ELYZA, 90.0, 50, prompt=2000.0, load=3.0),
    ]
    snap = snapshot(rows, {(QWEN, "general"): 600.0, (ELYZA, "general"): 600.0})
    graded(snap, QWEN, "general", [1.0] * 8 + [0.0] * 2)
    choice = choose_model(RouteQuery(domain="general"), MODELS, fv, estimator(snap), NOW)
    assert choice.model == "elyza-jp-8b"
    assert "never graded" in choice.note and "qwen3:8b (n=10)" in choice.note
    assert "note" in choice.to_dict()
