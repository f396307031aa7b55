"""The preview: what the router would do with a request now, as plain JSON.

`routeledger route preview --json` and the HTTP endpoint both print `preview(...)` as it is:

    {"model": ..., "digest": ..., "candidates": [{"worker": ..., "expected_finish_s": ...,
     "terms": {...}, "fields": {"decode_tps": {"value", "n", "source", "age_s"}, ...}}, ...],
     "plan": {...}}

candidates best first. `plan` says who would take the task now, its expected wait and finish,
the queued tasks' assignments, and for `auto` the models weighed with their utilities.
"""

from __future__ import annotations

from collections.abc import Mapping

from router.choose import ChooseParams, Decision, RouteQuery, decide
from router.estimate import Estimator
from router.plan import FleetView, PlanParams


def preview_of(decision: Decision) -> dict[str, object]:
    """The preview JSON of a decision already made (the same function the API uses)."""
    ranking = decision.ranking
    best = ranking.best
    plan: dict[str, object] = {
        "taker": best.worker,
        "expected_wait_s": best.terms["wait_s"],
        "expected_finish_s": best.expected_finish_s,
        "domain": decision.domain,
        "queue": ranking.plan.to_dict(),
    }
    if decision.choice is not None:
        plan["auto"] = decision.choice.to_dict()
    return {
        "model": decision.model,
        "digest": decision.digest,
        "candidates": [
            {
                "worker": c.worker,
                "expected_finish_s": c.expected_finish_s,
                "terms": dict(c.terms),
                "fields": {k: f.to_dict() for k, f in c.fields.items()},
            }
            for c in ranking.candidates
        ],
        "plan": plan,
    }


def preview(
    query: RouteQuery,
    models: Mapping[str, str],
    view: FleetView,
    est: Estimator,
    now_ms: int,
    *,
    params: ChooseParams | None = None,
    plan_params: PlanParams | None = None,
) -> dict[str, object]:
    """The preview JSON for a request (`query.model` a name in `models`, name -> digest, or 'auto')."""
    return preview_of(decide(query, models, view, est, now_ms, params=params, plan_params=plan_params))
