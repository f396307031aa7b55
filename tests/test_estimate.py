"""Estimates shrink toward the prior chain, field by field, and say where each number came from."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.view import fleet_view
from events.event import ModelEntry
from projections.snapshot import FleetRow, Stamped
from router.choose import RouteQuery, choose_model, rank_workers
from router.estimate import EstimateParams, build_estimator
from tasks.lease import LeaseInfo
from tests.router_helpers import (
    ELYZA,
    NOW,
    QWEN,
    estimator,
    graded,
    snapshot,
    speed_row,
    stat,
    view,
    worker,
)

LENGTHS = {(QWEN, "general"): 600.0, (ELYZA, "general"): 180.0, (ELYZA, "japanese"): 180.0}
QUALITY = {(QWEN, "general"): 0.74, (ELYZA, "general"): 0.70, (ELYZA, "japanese"): 0.82}


def story_snapshot(rtx_qwen_samples: int = 0):
    rows = [
        speed_row("macbookair", QWEN, 11.4, 58, prompt=120.0, load=8.0, at_ms=NOW - 20 * 3_600_000),
        speed_row("macbookair", ELYZA, 12.0, 58, prompt=130.0, load=7.5, at_ms=NOW - 20 * 3_600_000),
    ]
    if rtx_qwen_samples:
        rows.append(speed_row("rtx3070ti", QWEN, 83.0, rtx_qwen_samples, prompt=2000.0, load=3.0))
    return snapshot(rows, LENGTHS, QUALITY)


def test_an_empty_ledger_gives_the_defaults_and_says_so() -> None:
    est = estimator(snapshot())
    sp = est.speed("w", QWEN)
    assert sp.decode_tps.value == EstimateParams().default_decode_tps
    assert sp.decode_tps.source == "default"
    assert sp.decode_tps.n == 0
    q = est.quality(QWEN, "general")
    assert q.source.startswith("prior default") and "never graded" in q.source
    assert (q.n, q.value) == (0, EstimateParams().default_quality)
    # The prior is explicit about how little it knows: Beta(1, 1) spans most of [0, 1].
    assert q.interval is not None and q.interval[1] - q.interval[0] > 0.7


def test_a_few_samples_are_shrunk_toward_the_models_pooled_speed() -> None:
    est = estimator(story_snapshot(rtx_qwen_samples=3))
    field = est.speed("rtx3070ti", QWEN).decode_tps
    pooled = (est.speed("macbookair", QWEN).decode_tps.weight * 11.4 + field.weight * 83.0) / (
        est.speed("macbookair", QWEN).decode_tps.weight + field.weight
    )
    k = EstimateParams().k_speed
    assert field.value == pytest.approx((3 * 83.0 + k * pooled) / (3 + k), rel=1e-6)
    # Three measured answers outweigh the pool of another machine's thirty times over.
    assert field.value > 0.95 * 83.0
    assert field.source.startswith("worker n=3 + prior model-pooled")
    assert field.age_s == 0.0


def test_the_prior_of_an_unmeasured_model_is_the_workers_speed_times_the_models_relative_cost() -> None:
    est = estimator(story_snapshot(rtx_qwen_samples=3))
    field = est.speed("rtx3070ti", ELYZA).decode_tps
    own_qwen = est.speed("rtx3070ti", QWEN).decode_tps
    assert field.n == 0
    assert field.source.startswith("two-way")
    # rtx's measured qwen speed (its mean, not the shrunk estimate) x elyza/qwen on the laptop
    assert field.value == pytest.approx(83.0 * 12.0 / 11.4, rel=1e-3)
    assert field.value > own_qwen.value


def test_old_samples_weigh_less_than_new_ones() -> None:
    fresh = estimator(story_snapshot(rtx_qwen_samples=3)).speed("rtx3070ti", QWEN).decode_tps
    later = build_estimator(story_snapshot(rtx_qwen_samples=3), NOW + 14 * 86_400_000)
    stale = later.speed("rtx3070ti", QWEN).decode_tps
    assert stale.weight < fresh.weight
    assert 11.4 < stale.value < fresh.value


def test_quality_belongs_to_the_digest_whoever_runs_it() -> None:
    est = estimator(story_snapshot())
    q = est.quality(ELYZA, "japanese")
    assert q.value == pytest.approx((20 * 0.82 + 2 * ((20 * 0.70) / 20)) / 22, rel=1e-6)
    assert q.source.startswith("model n=20")


def test_a_fresh_speed_row_that_agrees_with_its_prior_changes_no_total_and_quality_comes_from_the_model() -> (
    None
):
    rtx = worker("rtx3070ti", {QWEN, ELYZA})
    mac = worker("macbookair", {QWEN, ELYZA})
    before_snap = story_snapshot(rtx_qwen_samples=3)
    before = rank_workers(view([mac, rtx]), estimator(before_snap), ELYZA, NOW, RouteQuery(domain="japanese"))
    prior = {
        f: getattr(estimator(before_snap).speed("rtx3070ti", ELYZA), f).value
        for f in ("decode_tps", "prompt_tps", "load_s")
    }
    after_snap = story_snapshot(rtx_qwen_samples=3)
    after_snap.speed[("rtx3070ti", ELYZA)] = speed_row(
        "rtx3070ti", ELYZA, prior["decode_tps"], 2, prompt=prior["prompt_tps"], load=prior["load_s"]
    )
    after = rank_workers(view([mac, rtx]), estimator(after_snap), ELYZA, NOW, RouteQuery(domain="japanese"))
    cand = next(c for c in after.candidates if c.worker == "rtx3070ti")
    assert cand.fields["decode_tps"].source.startswith("worker n=2")
    assert cand.fields["quality"].source.startswith("model n=20")
    for b, a in zip(before.candidates, after.candidates, strict=True):
        assert a.worker == b.worker
        assert a.expected_finish_s == pytest.approx(b.expected_finish_s, rel=1e-6)


def test_the_story_replayed_the_fast_machine_wins_by_its_own_measured_speed() -> None:
    mac = worker("macbookair", {QWEN, ELYZA})
    # Before it joins, only the laptop serves.
    before = rank_workers(view([mac]), estimator(story_snapshot()), QWEN, NOW)
    assert before.best.worker == "macbookair"
    # It joins, holding qwen3:8b only, and is benchmarked three times.
    rtx = worker("rtx3070ti", {QWEN})
    est = estimator(story_snapshot(rtx_qwen_samples=3))
    ranking = rank_workers(view([mac, rtx]), est, QWEN, NOW)
    assert ranking.best.worker == "rtx3070ti"
    assert ranking.best.fields["decode_tps"].source.startswith("worker n=3")
    # The laptop's quality did not fall: the same digest has the same quality for both.
    qualities = {c.worker: c.fields["quality"].value for c in ranking.candidates}
    assert qualities["rtx3070ti"] == qualities["macbookair"]
    # It is given ELYZA (same digest): top at once, from its measured qwen speed via the two-way prior.
    rtx.holds.add(ELYZA)
    jp = rank_workers(view([mac, rtx]), est, ELYZA, NOW, RouteQuery(domain="japanese"))
    assert jp.best.worker == "rtx3070ti"
    assert jp.best.fields["decode_tps"].source.startswith("two-way")
    assert (
        jp.best.fields["quality"].value
        == next(c for c in jp.candidates if c.worker == "macbookair").fields["quality"].value
    )


def _fleet_row(name: str, resources: dict[str, float | None] | None) -> FleetRow:
    return FleetRow(
        worker=name,
        status="online",
        slots=Stamped(value=1, at=NOW),
        inventory=Stamped(value={"qwen3:8b": QWEN}, at=NOW),
        loaded=Stamped(value=[QWEN], at=NOW),
        resources=Stamped(value=resources, at=NOW if resources is not None else None),
    )


def _lease(name: str) -> LeaseInfo:
    return LeaseInfo(
        worker=name,
        token="t",
        slots=1,
        inventory=[ModelEntry(name="qwen3:8b", digest=QWEN)],
        loaded=[QWEN],
        since=NOW,
    )


@settings(max_examples=60, deadline=None)
@given(
    cpu=st.one_of(st.none(), st.floats(0, 100)),
    gpu=st.one_of(st.none(), st.floats(0, 100)),
    decode=st.floats(1, 200),
    n=st.integers(0, 30),
)
def test_a_worker_reporting_no_resources_never_ranks_above_an_identical_one_that_does(
    cpu: float | None, gpu: float | None, decode: float, n: int
) -> None:
    rows = [speed_row("a", QWEN, decode, n), speed_row("b", QWEN, decode, n)] if n else []
    snap = snapshot(rows, LENGTHS, QUALITY)
    # The resources reach the ledger's fleet table; the view is built from the leases, as in production.
    snap.fleet["a"] = _fleet_row("a", None)
    snap.fleet["b"] = _fleet_row("b", {"cpu_percent": cpu, "gpu_percent": gpu})
    fv = fleet_view({"a": _lease("a"), "b": _lease("b")}, {}, snap, NOW)
    ranking = rank_workers(fv, estimator(snap), QWEN, NOW)
    ranks = {c.worker: c.rank for c in ranking.candidates}
    assert ranks["a"] == ranks["b"]


def test_a_model_graded_at_0_9_stays_above_an_ungraded_one_after_30_days_without_traffic() -> None:
    day_ms = 86_400_000
    rows = [speed_row("rtx3070ti", d, 83.0, 20, prompt=2000.0, load=3.0) for d in (QWEN, ELYZA)]
    snap = snapshot(rows, {(QWEN, "general"): 200.0, (ELYZA, "general"): 200.0})
    graded(snap, QWEN, "general", [1.0] * 9 + [0.0])  # 0.9 on ten answers, graded on day 0
    fresh = estimator(snap, NOW).quality(QWEN, "general")
    later = estimator(snap, NOW + 30 * day_ms)
    kept, unknown = later.quality(QWEN, "general"), later.quality(ELYZA, "general")
    # The digest did not change, so neither did its grades: same value, same n, same interval.
    assert (kept.value, kept.n, kept.interval) == (fresh.value, fresh.n, fresh.interval)
    assert kept.value == pytest.approx((9 + 1) / (10 + 2))
    assert kept.age_s == pytest.approx(30 * 86_400)
    assert unknown.n == 0 and kept.value > unknown.value + 0.3
    assert kept.interval is not None and unknown.interval is not None
    assert kept.interval[1] - kept.interval[0] < unknown.interval[1] - unknown.interval[0]
    # And `auto`, between the two on one machine, takes the graded one.
    fv = view([worker("rtx3070ti", {QWEN, ELYZA})])
    models = {"qwen3:8b": QWEN, "elyza-jp-8b": ELYZA}
    choice = choose_model(RouteQuery(domain="general"), models, fv, later, NOW + 30 * day_ms)
    assert choice.model == "qwen3:8b"


def test_quality_is_a_beta_posterior_around_the_models_other_domains_when_a_domain_is_ungraded() -> None:
    snap = graded(snapshot(), ELYZA, "japanese", [1.0] * 8 + [0.0] * 2)
    est = estimator(snap)
    other = est.quality(ELYZA, "general")
    # The prior is the model's pooled quality (0.8) counted as k_quality grades.
    k = EstimateParams().k_quality
    assert other.n == 0 and other.value == pytest.approx(0.8)
    assert other.source.startswith("prior model-pooled n=10 other domains")
    a, b = k * 0.8, k * 0.2
    assert other.sd == pytest.approx(math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1))))


EMBEDDER = "e" * 64


def test_an_unmeasured_embedding_rate_falls_back_to_the_workers_prompt_speed_and_says_so() -> None:
    rows = [speed_row("gpu", EMBEDDER, 50.0, 4, prompt=3000.0)]
    est = build_estimator(snapshot(rows), NOW, embedding=frozenset({EMBEDDER}))
    embed = est.speed("gpu", EMBEDDER).embed_tps
    assert embed.n == 0
    assert embed.source.startswith("prompt-speed (worker n=4")
    assert embed.value == pytest.approx(est.speed("gpu", EMBEDDER).embed_tps.prior or 0.0)
    assert 1000.0 < embed.value <= 3000.0 * (1 + 1e-9)


def test_an_embedding_model_is_costed_by_its_measured_embedding_rate_and_writes_nothing() -> None:
    row = speed_row("gpu", EMBEDDER, 50.0, 0)
    row.embed_tps = stat([4000.0] * 10)
    other = speed_row("laptop", EMBEDDER, 50.0, 0)
    other.embed_tps = stat([400.0] * 10)
    est = build_estimator(snapshot([row, other]), NOW, embedding=frozenset({EMBEDDER}))
    fast = est.speed("gpu", EMBEDDER)
    assert fast.embed_tps.n == 10 and fast.embed_tps.source.startswith("worker n=10")
    # The plan's prompt rate of an embedding model is its embedding rate, and it has no output.
    assert fast.prompt_tps.value == fast.embed_tps.value
    assert fast.prompt_tps.source.startswith("embedding rate: worker n=10")
    assert est.output_tokens(EMBEDDER, "general").value == 0.0
    fleet = view([worker("gpu", [EMBEDDER]), worker("laptop", [EMBEDDER])])
    ranking = rank_workers(fleet, est, EMBEDDER, NOW, RouteQuery(model="e", prompt_tokens=8000))
    best = ranking.best
    assert best.worker == "gpu"
    assert best.terms["decode_s"] == 0.0 and best.terms["output_tokens"] == 0.0
    assert best.terms["prompt_s"] == pytest.approx(8000 / fast.embed_tps.value)
    assert set(best.fields) >= {"embed_tps"} and "decode_tps" not in best.fields


def test_a_model_that_generates_keeps_its_prompt_and_decode_costs_whatever_its_embedding_rate() -> None:
    row = speed_row("gpu", QWEN, 50.0, 5, prompt=3000.0)
    row.embed_tps = stat([9000.0] * 5)
    est = build_estimator(snapshot([row]), NOW)
    sp = est.speed("gpu", QWEN)
    assert sp.prompt_tps.value == pytest.approx(3000.0, rel=0.2)
    assert sp.embed_tps.value == pytest.approx(9000.0, rel=0.2)
    assert est.output_tokens(QWEN, "general").value > 0
