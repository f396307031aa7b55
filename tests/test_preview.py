"""The preview JSON: the model, its digest, the candidates best first with every term and source, the plan."""

from __future__ import annotations

import json

from router.choose import RouteQuery
from router.preview import preview
from tests.router_helpers import ELYZA, NOW, QWEN, backlog, estimator, snapshot, speed_row, view, worker

MODELS = {"qwen3:8b": QWEN, "elyza-jp-8b": ELYZA}


def setup():
    rows = [
        speed_row("macbookair", QWEN, 11.4, 58, prompt=120.0, load=8.0),
        speed_row("rtx3070ti", QWEN, 83.0, 3, prompt=2000.0, load=3.0),
    ]
    est = estimator(snapshot(rows, {(QWEN, "general"): 600.0}, {(QWEN, "general"): 0.74}))
    fv = view([worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})], {QWEN: backlog(QWEN, 2)})
    return fv, est


def test_the_preview_has_the_model_digest_candidates_best_first_and_the_plan() -> None:
    fv, est = setup()
    data = json.loads(json.dumps(preview(RouteQuery(model="qwen3:8b"), MODELS, fv, est, NOW)))
    assert set(data) == {"model", "digest", "candidates", "plan"}
    assert data["model"] == "qwen3:8b"
    assert data["digest"] == QWEN
    finishes = [c["expected_finish_s"] for c in data["candidates"]]
    assert finishes == sorted(finishes)
    first = data["candidates"][0]
    assert set(first) == {"worker", "expected_finish_s", "terms", "fields"}
    assert first["worker"] == "rtx3070ti"
    for field in ("decode_tps", "prompt_tps", "load_s", "output_tokens", "quality"):
        # Quality also shows how uncertain it is (its posterior's sd and interval).
        extra = {"sd", "interval"} if field == "quality" else set()
        assert set(first["fields"][field]) == {"value", "n", "source", "age_s"} | extra
    assert first["fields"]["decode_tps"]["n"] == 3
    plan = data["plan"]
    assert plan["taker"] == "rtx3070ti"
    assert plan["expected_finish_s"] == first["expected_finish_s"]
    assert plan["expected_wait_s"] > 0.0  # two tasks are queued ahead
    assert len(plan["queue"]["assignments"]) == 2


def test_an_auto_preview_shows_the_models_weighed() -> None:
    fv, est = setup()
    data = preview(RouteQuery(model="auto"), MODELS, fv, est, NOW)
    assert data["model"] == "qwen3:8b"
    auto = data["plan"]["auto"]  # type: ignore[index]
    assert auto["models"][0]["model"] == "qwen3:8b"
