"""Choosing: the candidates for one task with every term and source, and the model for `auto`.

For a named model the candidates are its live holders, ranked by when each would finish a new
task appended to the model's queue (the plan of the backlog first, then the task's service on
that worker). For `auto` every model with a live holder is a candidate, scored by an explicit
utility `quality_weight * quality - latency_weight * expected_finish_s / latency_scale_s`; the
weights are parameters and are part of the breakdown. A model that cannot win is shown with bounds
on its figures instead of a plan of its queue (`ModelCandidate.bound`). Ties share a rank: equal
evidence gives equal rank, whatever the names.

Quality is uncertain and latency is not (speed has hundreds of samples, quality a handful of
graded answers), so `auto` does not trade latency for a quality lead that may be noise. The
*baseline* is the model best on latency among those graded in the domain (among all, when none
is): its quality counts at its posterior mean. Every other model's quality counts as the
baseline's mean plus the lower end of a one-sided `quality_z` interval of its lead over the
baseline (`mean - z * sqrt(sd² + sd_baseline²)`). Two models graded on three answers each never
differ confidently, so the faster wins; 40 graded answers each at 0.9 and 0.5 do, and then quality
buys latency as the weights say. A never-graded model is never the baseline while a graded one
exists: its wide prior keeps it from winning on quality, only its speed can carry it, and the
breakdown says so (`Choice.note`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import msgspec

from router.errors import NoHolderError, NoModelError
from router.estimate import Estimator, Field
from router.plan import (
    BacklogEntry,
    FleetView,
    Plan,
    PlanParams,
    PlanState,
    Step,
    WorkerView,
    holders_by_digest,
    plan_state,
    service_floor,
    slot_free_times,
)

DomainClassifier = Callable[[str], str]

# Candidates a decision's ledger record keeps in full; the rest are a count and their best finish
# (a decision over 28 holders cost 17 KB of ledger otherwise, most of it about losers).
RECORDED_CANDIDATES: Final = 3
# Values this close share a rank (`_ranks`), each to the next: equal evidence, equal rank.
_TIE: Final = 1e-9

_JAPANESE = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9f]")
_CODE = re.compile(
    r"```|\bdef \w+\(|\bclass \w+[:(]|\bfunction\b|\bimport \w|#include|\bSELECT\b.+\bFROM\b|=>|"
    r"\bTraceback\b|\bstack trace\b|\bcompile error\b|\bregex\b|[{};]\s*$",
    re.IGNORECASE | re.MULTILINE,
)


def classify_domain(text: str) -> str:
    """Default rules: 'japanese' when the text has kana, 'code' when it looks like code, else 'general'."""
    if _JAPANESE.search(text):
        return "japanese"
    if _CODE.search(text):
        return "code"
    return "general"


class RouteQuery(msgspec.Struct, kw_only=True, frozen=True):
    """What routing reads of a request: the model it names (or `auto`), its domain and its size."""

    model: str = "auto"
    domain: str = "general"
    # Counted (or estimated) before the backend counts them; None: the plan's default.
    prompt_tokens: int | None = None
    max_tokens: int | None = None


class ChooseParams(msgspec.Struct, kw_only=True, frozen=True):
    """Weights of the `auto` utility (configurable; shown in every breakdown)."""

    quality_weight: float = 1.0
    latency_weight: float = 1.0
    # Seconds of expected finish that cost as much utility as one whole unit of quality.
    latency_scale_s: float = 120.0
    # A quality lead over the baseline counts at the lower end of its one-sided interval with this
    # many standard deviations (1.645: 95 %); 0 compares posterior means alone.
    quality_z: float = 1.645


class WorkerCandidate(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One live holder for a task: when it would finish it, each term, and every field's source."""

    worker: str
    rank: int
    expected_finish_s: float
    terms: dict[str, float]
    fields: dict[str, Field]

    def to_dict(self) -> dict[str, object]:
        return {
            "worker": self.worker,
            "rank": self.rank,
            "expected_finish_s": self.expected_finish_s,
            "terms": dict(self.terms),
            "fields": {k: f.to_dict() for k, f in self.fields.items()},
        }


class Ranking(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """The holders of one model ranked for a new task, best first, with the plan they were ranked on."""

    digest: str
    domain: str
    candidates: list[WorkerCandidate]
    plan: Plan

    @property
    def best(self) -> WorkerCandidate:
        return self.candidates[0]


def _ranks(values: list[float]) -> list[int]:
    """Competition ranks (1, 1, 3, …): equal values share a rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0] * len(values)
    for pos, i in enumerate(order):
        prev = order[pos - 1] if pos else None
        same = prev is not None and values[i] - values[prev] <= _TIE
        ranks[i] = ranks[prev] if same and prev is not None else pos + 1
    return ranks


def _first_best(values: list[float]) -> int:
    """The index `_ranks` would put first: the earliest-registered of those ranked 1."""
    if len(values) == 1:
        return 0
    ordered = sorted(values)
    top = ordered[0]
    for v in ordered[1:]:
        if v - top > _TIE:
            break
        top = v
    for i, v in enumerate(values):
        if v <= top:
            return i
    return 0


def rank_workers(
    view: FleetView,
    est: Estimator,
    digest: str,
    now_ms: int,
    query: RouteQuery | None = None,
    *,
    params: PlanParams | None = None,
    free: Mapping[str, list[float]] | None = None,
    holders: Sequence[WorkerView] | None = None,
) -> Ranking:
    """Every live holder of `digest`, ranked by when it would finish a new task queued behind the
    backlog (the task as `query` describes it; its model is `digest` whatever `query.model` says).

    `free`: every worker's slot free times, when the caller ranks several models on one view;
    `holders`: the digest's live holders, when the caller already has them.
    """
    p = params or PlanParams()
    hs = view.holders(digest) if holders is None else holders
    if not hs:
        raise NoHolderError(digest)
    plan, state = plan_state(view, est, digest, now_ms, params=p, free=free, holders=hs)
    assert state is not None
    return _ranking(est, digest, hs, state, plan, query or RouteQuery(), p)


def _ranking(
    est: Estimator,
    digest: str,
    holders: Sequence[WorkerView],
    state: PlanState,
    plan: Plan,
    query: RouteQuery,
    params: PlanParams,
) -> Ranking:
    """The holders ranked for a new task behind the backlog `state` has laid out as `plan`."""
    domain = query.domain
    prompt = params.default_prompt_tokens if query.prompt_tokens is None else query.prompt_tokens
    out_field = est.output_tokens(digest, domain)
    quality = est.quality(digest, domain)
    max_tokens = query.max_tokens
    out = out_field.value if max_tokens is None else min(out_field.value, float(max_tokens))
    rows: list[tuple[str, float, dict[str, float], dict[str, Field]]] = []
    for i, (w, sp) in enumerate(zip(holders, state.sp.estimates, strict=True)):
        wait, load, prompt_s, decode_s, finish = state.new_task(i, prompt, out)
        terms = {
            "wait_s": wait,
            "load_s": load,
            "prompt_s": prompt_s,
            "decode_s": decode_s,
            "output_tokens": out,
            "quality": quality.value,
        }
        fields = {
            "decode_tps": sp.decode_tps,
            "prompt_tps": sp.prompt_tps,
            # A backend that cannot say what is loaded is charged the load its runs have shown.
            "load_s": sp.load_s if w.loaded_known else est.unknown_load(w.name, digest),
            "output_tokens": out_field,
            "quality": quality,
        }
        if state.fac[i] is not None:
            # Its other slots' tasks share the machine with this one: the time that costs, and why.
            terms["sharing_s"] = finish - (wait + load + prompt_s + decode_s)
            fields["parallel_exponent"] = est.concurrency(w.name, digest).exponent
        rows.append((w.name, finish, terms, fields))
    ranks = _ranks([r[1] for r in rows])
    candidates = [
        WorkerCandidate(worker=name, rank=rank, expected_finish_s=finish, terms=terms, fields=fields)
        for (name, finish, terms, fields), rank in zip(rows, ranks, strict=True)
    ]
    candidates.sort(key=lambda c: c.rank)
    return Ranking(digest=digest, domain=domain, candidates=candidates, plan=plan)


class ModelCandidate(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One model for `auto`: its utility and the terms it came from.

    `bound`: the model could not win, and its queue was not laid out to find out by how much: its
    `expected_finish_s` is a floor under the new task's finish (`best_worker` the holder that
    floor was taken at), its `utility` the most it could reach, and its rank is by that utility.
    `quality_counted`: the quality the utility used (the posterior mean for the baseline, the
    baseline's mean plus the lower bound of the lead for the others; the mean on a bound).
    """

    model: str
    digest: str
    rank: int
    utility: float
    quality: Field
    expected_finish_s: float
    best_worker: str
    bound: bool = False
    quality_counted: float = 0.0
    baseline: bool = False

    def to_dict(self) -> dict[str, object]:
        """Plain data; "bound" and "baseline" only where true (a key on every model would grow
        every record)."""
        out: dict[str, object] = {
            "model": self.model,
            "digest": self.digest,
            "rank": self.rank,
            "utility": self.utility,
            "expected_finish_s": self.expected_finish_s,
            "best_worker": self.best_worker,
            "quality": self.quality.to_dict(),
            "quality_counted": self.quality_counted,
        }
        if self.bound:
            out["bound"] = True
        if self.baseline:
            out["baseline"] = True
        return out


class Choice(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """The model `auto` picked for a domain, beside every other model it weighed."""

    model: str
    digest: str
    domain: str
    params: ChooseParams
    candidates: list[ModelCandidate]
    ranking: Ranking
    # Why the choice is what it is, where quality and latency pulled apart or a prior decided it.
    note: str = ""

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "model": self.model,
            "digest": self.digest,
            "domain": self.domain,
            "weights": msgspec.to_builtins(self.params),
            "rule": RULE,
            "models": [c.to_dict() for c in self.candidates],
        }
        if self.note:
            out["note"] = self.note
        return out


RULE: Final = (
    "utility = quality_weight * quality - latency_weight * finish_s / latency_scale_s; quality is the "
    "posterior mean for the baseline (the graded model best on latency) and, for every other model, the "
    "baseline's mean plus the lower bound (quality_z) of its lead over the baseline"
)


def choose_model(
    query: RouteQuery,
    models: Mapping[str, str],
    view: FleetView,
    est: Estimator,
    now_ms: int,
    *,
    params: ChooseParams | None = None,
    plan_params: PlanParams | None = None,
) -> Choice:
    """`auto`: the model (name -> digest in `models`) with the best utility for the query's domain."""
    p = params or ChooseParams()
    domain = query.domain
    pp = plan_params or PlanParams()
    by_digest = holders_by_digest(view)
    # A worker's slot free times are the same whichever model it is planned for: worked out once,
    # and only for the holders of models whose slot state is looked at (`_score_models`).
    free: dict[str, list[float]] = {}
    weighed: list[tuple[str, str, list[WorkerView]]] = []
    seen: set[str] = set()
    for name, digest in sorted(models.items()):
        # Aliases of one digest are one model: the same weights, the same answers.
        holders = by_digest.get(digest)
        if digest in seen or not holders:
            continue
        seen.add(digest)
        weighed.append((name, digest, holders))
    if not weighed:
        raise NoModelError(f"no model has a live holder for domain {domain!r}")
    candidates, laid = _score_models(weighed, view, est, now_ms, query, p, pp, free)
    order = sorted(range(len(candidates)), key=lambda i: candidates[i].rank)
    best = candidates[order[0]]
    # Only the chosen model's ranking is kept: its plan and every holder's breakdown, from the
    # state its queue was laid out on.
    state, steps = laid[best.digest]
    plan = state.plan(view.backlog.get(best.digest, []), steps)
    ranking = _ranking(est, best.digest, by_digest[best.digest], state, plan, query, pp)
    ordered = [candidates[i] for i in order]
    return Choice(
        model=best.model,
        digest=best.digest,
        domain=domain,
        params=p,
        candidates=ordered,
        ranking=ranking,
        note=_note(ordered, domain),
    )


def _note(candidates: Sequence[ModelCandidate], domain: str) -> str:
    """What a reader of the breakdown should know about the choice, or '' when nothing stands out:
    a never-graded winner beside graded models, or a better-looking model passed over."""
    best = candidates[0]
    graded = [c for c in candidates[1:] if c.quality.n > 0]
    if best.quality.n == 0 and graded:
        names = ", ".join(f"{c.model} (n={c.quality.n})" for c in graded)
        return (
            f"{best.model} was never graded for {domain}: it won on its prior and its speed "
            f"over graded {names}"
        )
    better = [c for c in candidates[1:] if c.quality.value > best.quality.value and not c.bound]
    if better:
        c = max(better, key=lambda c: c.quality.value)
        lead = c.quality.value - best.quality.value
        gain = c.expected_finish_s - best.expected_finish_s
        return (
            f"{c.model} looks better by {lead:.2f} (n={c.quality.n} vs {best.quality.n}), within the "
            f"noise of its grades or not worth {gain:.1f} s more"
        )
    return ""


def _utility(params: ChooseParams, quality: float, finish_s: float) -> float:
    return params.quality_weight * quality + _latency_part(params, finish_s)


def _latency_part(params: ChooseParams, finish_s: float) -> float:
    return -params.latency_weight * finish_s / params.latency_scale_s


def _lead_penalty(params: ChooseParams, sd: float | None, baseline_sd: float | None) -> float:
    """How much of a model's quality lead over the baseline is noise: z standard deviations of the
    difference. Nothing when quality has no weight (or a negative one: then less quality is better
    and a pessimistic bound would run the other way) or z is 0."""
    if params.quality_weight <= 0.0 or params.quality_z <= 0.0:
        return 0.0
    var = (sd or 0.0) ** 2 + (baseline_sd or 0.0) ** 2
    return params.quality_z * math.sqrt(var)


def _score_models(
    weighed: Sequence[tuple[str, str, list[WorkerView]]],
    view: FleetView,
    est: Estimator,
    now_ms: int,
    query: RouteQuery,
    params: ChooseParams,
    plan_params: PlanParams,
    free: dict[str, list[float]],
) -> tuple[list[ModelCandidate], dict[str, tuple[PlanState, list[Step]]]]:
    """Every model's candidate (in the order of `weighed`), and the state and walk of each queue
    that was laid out.

    A queue is laid out only when its model might win or might be the baseline. A model's utility
    has a ceiling: its quality counted at the posterior mean (never more than the rule counts) and
    the new task's service at its holders' fastest speeds (`service_floor`, cached per snapshot),
    since utility falls as the finish grows (a non-negative latency weight). Models are taken by
    that ceiling, best first (the pool model with the fastest finish floor, the likeliest
    baseline, ahead of them all), and each laid-out model gives a floor under its final utility:
    its lead's penalty taken against the most uncertain pool model that may still turn out the
    baseline, none when no other can. A model that can no longer be the baseline has its
    smallest lead penalty taken off its ceiling. Once the best floor passes a model's ceiling by
    more than the margin within which
    `_ranks` lets utilities share a rank (so no tie can reach it), the model cannot win. Otherwise
    its holders' slot state gives a higher finish floor that counts their waits and loads
    (`PlanState.finish_floor`), checked the same way, and only then is its queue laid out. The
    baseline is the best on latency among graded models (all models when none is graded): every
    model of that pool whose finish floor could reach the best finish found is laid out too. A
    model that cannot win is a `bound` candidate: its ceiling, the floor under its finish and
    that floor's holder. The chosen model, its ranking and every laid-out model's figures are what
    laying out every queue gives; a bound model's rank is by its ceiling, and so may differ from
    its rank on its true utility.
    """
    domain = query.domain
    default_prompt = plan_params.default_prompt_tokens
    prompt = default_prompt if query.prompt_tokens is None else query.prompt_tokens
    prune = not plan_params.full_walk and params.latency_weight >= 0.0 and params.latency_scale_s > 0.0
    rows: list[tuple[Field, float, list[BacklogEntry], tuple[int, float] | None, float]] = []
    for _, digest, holders in weighed:
        quality = est.quality(digest, domain)
        out_value = est.output_tokens(digest, domain).value
        out = out_value if query.max_tokens is None else min(out_value, float(query.max_tokens))
        queue = view.backlog.get(digest, [])
        # With nothing queued there is no walk to save.
        floor = None
        if prune and queue:
            floor = service_floor(est, holders, digest, prompt, out, queue, default_prompt)
        ceiling = math.inf if floor is None else _utility(params, quality.value, floor[1])
        rows.append((quality, out, queue, floor, ceiling))
    # The baseline comes from this pool (graded models, or every model when none is), so a floor's
    # lead penalty need only allow for the most uncertain model in it.
    pool = [k for k in range(len(rows)) if rows[k][0].n > 0] or list(range(len(rows)))
    widest = max((rows[k][0].sd or 0.0) for k in pool)
    margin = _TIE * (len(rows) + 1)
    best = -math.inf
    # Per model: (finish, worker) when laid out, else (ceiling, finish floor, floor's worker).
    finished: dict[int, tuple[float, str]] = {}
    bounds: dict[int, tuple[float, float, str]] = {}
    laid: dict[str, tuple[PlanState, list[Step]]] = {}
    slowdowns: dict[str, float] = {}

    def state_of(k: int) -> PlanState:
        _, digest, holders = weighed[k]
        for w in holders:
            if w.name not in free:
                # An idle worker's slots are all free now (`slot_free_times` without the call).
                free[w.name] = (
                    slot_free_times(w, est, now_ms, plan_params) if w.running else [0.0] * max(1, w.slots)
                )
        return PlanState(
            holders, est, digest, now_ms, plan_params, free=free, slowdowns=slowdowns, backlog=view.backlog
        )

    def lay_out(k: int, state: PlanState) -> float:
        """Lay the model's queue out; its finish for the new task."""
        _, digest, _ = weighed[k]
        _, out, queue, _, _ = rows[k]
        steps = state.walk(queue)
        laid[digest] = (state, steps)
        finishes = state.finishes(prompt, out)
        i = _first_best(finishes)
        finished[k] = (finishes[i], state.names[i])
        bounds.pop(k, None)
        if k in in_pool:
            best_latency[0] = max(best_latency[0], _latency_part(params, finishes[i]))
        return finishes[i]

    in_pool = set(pool)
    # The best latency part among the laid-out pool models (kept by lay_out: read on every check).
    best_latency = [-math.inf]
    calmest = min((rows[k][0].sd or 0.0) for k in pool)
    # Each pool model's finish floor (None where no floor holds), to tell when a laid-out model is
    # sure to be the baseline: then its floor is its utility with no lead penalty at all.
    pool_floor: dict[int, float | None] = {}
    if prune:
        for k in pool:
            _, digest, holders = weighed[k]
            _, out, queue, floor, _ = rows[k]
            if floor is None and not queue:
                floor = service_floor(est, holders, digest, prompt, out, queue, default_prompt)
            pool_floor[k] = None if floor is None else floor[1]

    def floor_penalty(k: int) -> float:
        """The most lead penalty laid-out model k can pay: against the most uncertain pool model
        other than k that may still turn out the baseline, and nothing when there is none (then
        k is the baseline). A model is out of that running once its finish, or its finish floor,
        is slower than the best finish laid out by more than the margin; the best only gets
        better as queues are laid out, so the bound holds to the end."""
        if not prune:
            return _lead_penalty(params, rows[k][0].sd, widest)
        top = best_latency[0]
        rivals = [
            rows[i][0].sd or 0.0
            for i in pool
            if i != k
            and (
                (other := finished[i][0] if i in finished else pool_floor.get(i)) is None
                or _latency_part(params, other) >= top - margin
            )
        ]
        return _lead_penalty(params, rows[k][0].sd, max(rivals)) if rivals else 0.0

    def ceiling_of(k: int, quality: Field, floor_s: float) -> float:
        """Model k's ceiling for a finish floor: its mean, less the smallest lead penalty it can
        pay once it cannot be the baseline (outside the pool, or a floor slower than a pool
        model's finish: the baseline's latency only gets better as queues are laid out)."""
        counted = quality.value
        top = best_latency[0]
        if k not in in_pool or _latency_part(params, floor_s) < top - margin:
            counted -= _lead_penalty(params, quality.sd, calmest)

        return _utility(params, counted, floor_s)

    order = sorted(range(len(rows)), key=lambda k: -rows[k][4])
    # The pool model with the fastest finish floor first: the likeliest baseline, whose finish
    # tells most models early that they cannot be it (their lead penalty then counts in their
    # ceilings), and which floors the best with no penalty when it is sure to be it.
    known = [k for k in pool if pool_floor.get(k) is not None]
    if known:
        first = min(known, key=lambda k: (pool_floor[k], k))
        order.remove(first)
        order.insert(0, first)
    for k in order:
        _, _, holders = weighed[k]
        quality, out, queue, floor, ceiling = rows[k]
        if floor is not None:
            ceiling = ceiling_of(k, quality, floor[1])
        if floor is not None and ceiling < best - margin:
            bounds[k] = (ceiling, floor[1], holders[floor[0]].name)
            continue
        state = state_of(k)
        if floor is not None:
            floor = state.finish_floor(prompt, out, queue)
            if floor is not None:
                ceiling = ceiling_of(k, quality, floor[1])
                if ceiling < best - margin:
                    bounds[k] = (ceiling, floor[1], state.names[floor[0]])
                    continue
        finish = lay_out(k, state)
        penalty = floor_penalty(k)
        best = max(best, _utility(params, quality.value - penalty, finish))

    # The baseline's pool: a bound model whose finish floor reaches the best latency found may be
    # the baseline, so its queue is laid out (its figures then are its true ones).
    for k in sorted((k for k in pool if k in bounds), key=lambda k: bounds[k][1]):
        top = best_latency[0]
        if _latency_part(params, bounds[k][1]) < top - margin:
            break
        lay_out(k, state_of(k))
    top = max(_latency_part(params, finished[j][0]) for j in pool if j in finished)
    tied = [j for j in pool if j in finished and _latency_part(params, finished[j][0]) >= top - _TIE]
    base = max(tied, key=lambda j: (rows[j][0].value, -j))
    base_quality = rows[base][0]

    scored: list[tuple[float, float, str, bool, float]] = []
    for k, (quality, _, _, _, _) in enumerate(rows):
        if k in bounds:
            ceiling, floor_s, worker = bounds[k]
            scored.append((ceiling, floor_s, worker, True, quality.value))
            continue
        finish, worker = finished[k]
        counted = quality.value
        if k != base:
            # The baseline's mean plus the lower bound of the lead: the mean less the lead's noise.
            counted = quality.value - _lead_penalty(params, quality.sd, base_quality.sd)
        scored.append((_utility(params, counted, finish), finish, worker, False, counted))
    ranks = _ranks([-s[0] for s in scored])
    candidates = [
        ModelCandidate(
            model=name,
            digest=digest,
            rank=rank,
            utility=utility,
            quality=quality,
            expected_finish_s=finish,
            best_worker=worker,
            bound=bound,
            quality_counted=counted,
            baseline=k == base,
        )
        for k, (
            (name, digest, _),
            (quality, _, _, _, _),
            (utility, finish, worker, bound, counted),
            rank,
        ) in enumerate(zip(weighed, rows, scored, ranks, strict=True))
    ]
    return candidates, laid


class Decision(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A whole routing decision: the model (and how `auto` chose it) and the ranked holders."""

    model: str
    digest: str
    domain: str
    ranking: Ranking
    choice: Choice | None = None

    def to_dict(self) -> dict[str, object]:
        """Plain data for TaskRouted.breakdown: candidates, every term, every source."""
        out: dict[str, object] = {
            "model": self.model,
            "digest": self.digest,
            "domain": self.domain,
            "candidates": [c.to_dict() for c in self.ranking.candidates],
            "backlog": len(self.ranking.plan.assignments),
        }
        if self.choice is not None:
            out["auto"] = self.choice.to_dict()
        return out

    def to_record(self, top: int = RECORDED_CANDIDATES) -> dict[str, object]:
        """The compact breakdown TaskRouted keeps in the ledger (`to_dict()` stays the whole one):

            {"model", "domain", "backlog",
             "shared": {"terms": {"output_tokens", "quality"}, "fields": {name: [value, n, source, age_s]}},
             "candidates": [{"worker", "rank", "expected_finish_s", "terms": {...},
                             "fields": {name: [value, n, source, age_s]}}, ...],
             "others": {"count", "best_finish_s"}, "auto": {...}}

        The `top` candidates keep every term and source; the rest are `others`: how many, and the
        best expected finish among them. What is the model's, not the worker's (output length,
        quality) is written once under `shared`. Numbers are rounded to 4 significant digits (ages to
        whole seconds). The digest is TaskRouted's own field. Old entries (the whole `to_dict()`) and
        new ones both list `candidates` with `worker` and `expected_finish_s`.
        """
        candidates = self.ranking.candidates
        rest = candidates[top:]
        shared_terms = ("output_tokens", "quality")
        first = candidates[0]
        out: dict[str, object] = {
            "model": self.model,
            "domain": self.domain,
            "backlog": len(self.ranking.plan.assignments),
            "shared": {
                "terms": {k: _short(first.terms[k]) for k in shared_terms if k in first.terms},
                "fields": {k: _field_record(first.fields[k]) for k in shared_terms if k in first.fields},
            },
            "candidates": [
                {
                    "worker": c.worker,
                    "rank": c.rank,
                    "expected_finish_s": _short(c.expected_finish_s),
                    "terms": {k: _short(v) for k, v in c.terms.items() if k not in shared_terms},
                    "fields": {k: _field_record(f) for k, f in c.fields.items() if k not in shared_terms},
                }
                for c in candidates[:top]
            ],
            "others": {
                "count": len(rest),
                "best_finish_s": _short(min(c.expected_finish_s for c in rest)) if rest else None,
            },
        }
        if self.choice is not None:
            out["auto"] = self.choice.to_dict()
        return out


def _short(x: float) -> float | int:
    """`x` to 4 significant digits, as an int when that is whole (msgpack writes small ints in
    1-3 bytes, every float in 9)."""
    if x != x or x in (float("inf"), float("-inf")):
        return x
    r = float(f"{x:.4g}")
    return int(r) if r.is_integer() and abs(r) < 2**31 else r


def _field_record(f: Field) -> list[object]:
    """A field as [value, n, source, age_s] (age in whole seconds, None when unknown)."""
    return [_short(f.value), f.n, f.source, None if f.age_s is None else round(f.age_s)]


def decide(
    query: RouteQuery,
    models: Mapping[str, str],
    view: FleetView,
    est: Estimator,
    now_ms: int,
    *,
    params: ChooseParams | None = None,
    plan_params: PlanParams | None = None,
) -> Decision:
    """Route one request: `query.model` is a name in `models` (name -> digest) or 'auto'."""
    if query.model == "auto":
        choice = choose_model(query, models, view, est, now_ms, params=params, plan_params=plan_params)
        return Decision(
            model=choice.model,
            digest=choice.digest,
            domain=query.domain,
            ranking=choice.ranking,
            choice=choice,
        )
    digest = models.get(query.model)
    if digest is None:
        raise NoModelError(f"unknown model {query.model!r}")
    ranking = rank_workers(view, est, digest, now_ms, query, params=plan_params)
    return Decision(model=query.model, digest=digest, domain=query.domain, ranking=ranking)
