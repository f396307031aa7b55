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

import heapq
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
    guard_paced,
    holders_by_digest,
    plan_state,
    service_floor,
)
from router.prefix import BLOCK_CHARS, PromptChain, tokens_of_blocks

DomainClassifier = Callable[[str], str]

# Candidates a decision's ledger record keeps in full; the rest are a count and their best finish
# (a decision over 28 holders cost 17 KB of ledger otherwise, most of it about losers).
RECORDED_CANDIDATES: Final = 3
# Candidates the task's own record (readable while the task is recent) keeps in full: every one
# cost 150 KB of Redis and about 1 ms of the API's CPU per task at 500 workers (bench/scale.py's
# fleet); 16 keep it near 20 KB there, and every candidate of a fleet of a few machines.
STORED_CANDIDATES: Final = 16
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


# The model name that asks the router to pick the model too.
AUTO_MODEL: Final = "auto"


class RouteQuery(msgspec.Struct, kw_only=True, frozen=True):
    """What routing reads of a request: the model it names (or `auto`), its domain and its size."""

    model: str = AUTO_MODEL
    domain: str = "general"
    # Counted (or estimated) before the backend counts them; None: the plan's default.
    prompt_tokens: int | None = None
    # The UTF-8 bytes of its prompt's text, where known: a model whose bytes per token were
    # learned (Estimator.bytes_per_token) counts the prompt from them instead of `prompt_tokens`.
    prompt_bytes: int | None = None
    max_tokens: int | None = None
    # Images it carries: each adds Estimator.image_tokens() to the prompt (the backend counts
    # them in its prompt_eval_count), shown as the `image_tokens` term and field.
    images: int = 0
    # Its prompt's chain (router.prefix): a holder whose idle slot holds a prefix of it evaluates
    # only the rest, shown as the `cached_prompt_tokens` term and field. None: not known.
    prefix: PromptChain | None = None
    # A person reads its answer as it streams (router.plan.BacklogEntry.paced): holders no worse
    # than the fastest free one are ranked by when that reader would finish reading it (the
    # `reading_s` term); the others after them by finish (`paced_passed_over`, router.plan.guard_paced).
    paced: bool = False


def most_cached(query: RouteQuery, prompt_tokens: int) -> int:
    """The most prompt tokens of `query` any slot could hold (its whole chain): what a floor on
    its finish takes off before the holders' slots are looked at."""
    chain = query.prefix
    if chain is None or not chain.hashes:
        return 0
    return tokens_of_blocks(len(chain.hashes), chain.chars, prompt_tokens)


def prompt_estimate(query: RouteQuery, default_prompt: int, est: Estimator, digest: str | None = None) -> int:
    """The prompt tokens a decision counts for `query` on model `digest`: its text (at the model's
    learned bytes per token, where its text's bytes are known and the model has one), and its
    images."""
    prompt = default_prompt if query.prompt_tokens is None else query.prompt_tokens
    learned = _learned_ratio(query, est, digest)
    if learned is not None and query.prompt_bytes is not None:
        prompt = learned_tokens(query.prompt_bytes, learned.value)
    if query.images > 0:
        prompt += round(query.images * est.image_tokens().value)
    return prompt


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


class Ranking:
    """The holders of one model ranked for a new task, best first, with the plan they were ranked on.

    A holder's candidate, with every term and source, is built when it is first read: a decision
    over hundreds of holders keeps three of them (`Decision.to_record`), and building them all
    cost more than laying out a queue.
    """

    __slots__ = ("_build", "_built", "_costs", "_finishes", "_order", "_ranks", "digest", "domain", "plan")

    def __init__(
        self,
        *,
        digest: str,
        domain: str,
        plan: Plan,
        finishes: list[float],
        build: Callable[[int, int], WorkerCandidate],
        costs: list[float] | None = None,
    ) -> None:
        """`finishes[i]`: holder i's finish for the new task; `build(i, rank)` its candidate;
        `costs[i]`: what the ranking orders by where that is not the finish (a paced task's
        reader's finish)."""
        self.digest = digest
        self.domain = domain
        self.plan = plan
        self._finishes = finishes
        self._costs = finishes if costs is None else costs
        self._ranks = _ranks(self._costs)
        # Best first; equal ranks in holder (registration) order.
        self._order = sorted(range(len(finishes)), key=self._ranks.__getitem__)
        self._build = build
        self._built: list[WorkerCandidate] = []

    def __len__(self) -> int:
        return len(self._order)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ranking):
            return NotImplemented
        return (self.digest, self.domain, self.plan, self.candidates) == (
            other.digest,
            other.domain,
            other.plan,
            other.candidates,
        )

    def top(self, n: int) -> list[WorkerCandidate]:
        """The first `n` candidates, best first."""
        built, order = self._built, self._order
        while len(built) < min(n, len(order)):
            i = order[len(built)]
            built.append(self._build(i, self._ranks[i]))
        return built[:n]

    @property
    def candidates(self) -> list[WorkerCandidate]:
        """Every holder's candidate, best first."""
        return self.top(len(self._order))

    @property
    def best(self) -> WorkerCandidate:
        return self.top(1)[0]

    def best_finish_after(self, n: int) -> float | None:
        """The best expected finish among the candidates after the first `n` (None: there are none)."""
        rest = self._order[n:]
        return min(self._finishes[i] for i in rest) if rest else None

    def best_cost_after(self, n: int) -> float | None:
        """The lowest of what the ranking orders by (the finish, or a paced task's reader's finish)
        among the candidates after the first `n` (None: there are none)."""
        rest = self._order[n:]
        return min(self._costs[i] for i in rest) if rest else None

    def cost(self, n: int) -> float:
        """What the ranking orders the `n`th candidate (0: the best) by."""
        return self._costs[self._order[n]]


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
    free: dict[str, list[float]] | None = None,
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
    prompt = prompt_estimate(query, params.default_prompt_tokens, est, digest)
    # The size estimate: its own prompt tokens, and its output as the lengths' law capped by its
    # max_tokens (the field's source says which).
    out_field = est.capped_output(digest, domain, query.max_tokens)
    quality = est.quality(digest, domain)
    out = out_field.value
    cached = state.cached(query.prefix, prompt)
    finishes = state.finishes(prompt, out, cached)
    pace = state.pace if query.paced else None
    costs = None
    demoted: list[bool] = []
    if pace is not None:
        # The reader's finish, never at the cost of a free faster machine (design rule 13).
        reading = [f + out * x for f, x in zip(finishes, pace, strict=True)]
        costs = guard_paced(reading, finishes, state.firsts(prompt, cached), state.free_now())
        demoted = [c != r for c, r in zip(costs, reading, strict=True)]
    prompt_field = _prompt_field(
        query, prompt, params.default_prompt_tokens, _learned_ratio(query, est, digest)
    )

    def build(i: int, rank: int) -> WorkerCandidate:
        w, sp = holders[i], state.sp.estimates[i]
        wait, load, prompt_s, decode_s, finish = state.new_task(i, prompt, out, cached.get(i, 0))
        terms = {
            "wait_s": wait,
            "load_s": load,
            "prompt_s": prompt_s,
            "decode_s": decode_s,
            "prompt_tokens": float(prompt),
            "output_tokens": out,
            "quality": quality.value,
        }
        fields = {
            "prompt_tokens": prompt_field,
            "decode_tps": sp.decode_tps,
            "prompt_tps": sp.prompt_tps,
            # A backend that cannot say what is loaded is charged the load its runs have shown.
            "load_s": sp.load_s if w.loaded_known else est.unknown_load(w.name, digest),
            "output_tokens": out_field,
            "quality": quality,
        }
        if est.embeds(digest):
            # An embedding: its prompt tokens at the embedding rate, and nothing decoded.
            fields["embed_tps"] = sp.embed_tps
            del fields["decode_tps"], fields["prompt_tps"]
        if query.images > 0:
            image = est.image_tokens()
            terms["image_tokens"] = query.images * image.value
            fields["image_tokens"] = image
        if query.prefix is not None and query.prefix.hashes:
            tokens = cached.get(i, 0)
            terms["cached_prompt_tokens"] = float(tokens)
            fields["cached_prompt_tokens"] = _cached_field(tokens, prompt, query.prefix, w)
        if state.fac[i] is not None:
            # Its other slots' tasks share the machine with this one: the time that costs, and why.
            terms["sharing_s"] = finish - (wait + load + prompt_s + decode_s)
            fields["parallel_exponent"] = est.concurrency(w.name, digest).exponent
        if pace is not None:
            # Reading its answer outlasts decoding it by this much (0: it decodes slower than
            # its reader reads); the holders are ranked by finish + this, but for those a free
            # faster holder beats (1: ranked after every other, by finish).
            terms["reading_s"] = out * pace[i]
            terms["paced_passed_over"] = 1.0 if demoted[i] else 0.0
        return WorkerCandidate(worker=w.name, rank=rank, expected_finish_s=finish, terms=terms, fields=fields)

    return Ranking(digest=digest, domain=domain, plan=plan, finishes=finishes, build=build, costs=costs)


def _learned_ratio(query: RouteQuery, est: Estimator, digest: str | None) -> Field | None:
    """The model's learned bytes per token, where the query's text bytes are known and it has one."""
    if digest is None or query.prompt_bytes is None:
        return None
    return est.bytes_per_token(digest)


def learned_tokens(prompt_bytes: int, bytes_per_token: float) -> int:
    """A text of `prompt_bytes` bytes in tokens at a model's learned bytes per token. The ratio is
    a quotient of decayed sums, so a whole number of tokens can come out a rounding error above
    itself: that error is not a token more."""
    return max(1, math.ceil(prompt_bytes / bytes_per_token - 1e-9))


def _prompt_field(query: RouteQuery, prompt: int, default_prompt: int, learned: Field | None = None) -> Field:
    """The size estimate's prompt part and where it comes from: the request's own text, at the
    model's learned bytes per token (Estimator.bytes_per_token) or else at about 4 characters a
    token before the backend counts it (tasks.payload.estimate_tokens), or the plan's default
    when the request said nothing."""
    n = 0
    if learned is not None:
        source = f"the request's text, {learned.source} (estimated before the backend counts)"
        n = learned.n
    elif query.prompt_tokens is None:
        source = f"default: {default_prompt} tokens (the request's prompt was not counted)"
    else:
        source = "the request's text at about 4 characters a token (estimated before the backend counts)"
    if query.images > 0:
        source += f", + {query.images} image(s)"
    return Field(value=float(prompt), n=n, source=source, age_s=None)


def _cached_field(tokens: int, prompt: int, chain: PromptChain, worker: WorkerView) -> Field:
    """Why `tokens` of a prompt of `prompt` tokens count as held on `worker`."""
    if tokens:
        source = (
            f"prefix: an idle slot of {worker.name} holds {tokens} of {prompt} prompt tokens"
            f" ({len(chain.hashes)} blocks of {BLOCK_CHARS} characters; worker's lease)"
        )
    elif any(not s.busy for s in worker.cache):
        source = "prefix: no idle slot holds its start, or work planned before it takes that slot"
    elif worker.cache:
        source = "prefix: every slot is busy"
    else:
        source = "prefix: the worker reports no slot contents"
    return Field(value=float(tokens), n=0, source=source, age_s=None)


class ModelCandidate(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One model for `auto`: its utility and the terms it came from.

    `bound`: the model could not win, and its queue was not laid out to find out by how much: its
    `expected_finish_s` is a floor under the new task's finish (`best_worker` the holder that
    floor was taken at), its `utility` the most it could reach, and its rank is by that utility.
    `quality_counted`: the quality the utility used (the posterior mean for the baseline, the
    baseline's mean plus the lower bound of the lead for the others, bound or not).
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
    better = [c for c in candidates[1:] if c.quality.value > best.quality.value]
    if better:
        c = max(better, key=lambda c: c.quality.value)
        lead = c.quality.value - best.quality.value
        # A bound model's finish is a floor: its queue was never laid out.
        later = (
            f"a finish of at least {c.expected_finish_s:.1f} s against {best.expected_finish_s:.1f} s"
            if c.bound
            else f"{c.expected_finish_s - best.expected_finish_s:.1f} s more"
        )
        return (
            f"{c.model} looks better by {lead:.2f} (n={c.quality.n} vs {best.quality.n}), within the "
            f"noise of its grades or not worth {later}"
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

    A queue is laid out only when its model might be the baseline or might win, in that order.

    The baseline comes first, because until it is known no model's quality is known: it is the
    best on latency among graded models (all models when none is graded). Each pool model has a
    floor under the new task's finish: its holders' fastest speeds with no wait and no load
    (`service_floor`, cached per snapshot). Its holders' slot state gives a higher floor that
    counts their waits and loads (`PlanState.finish_floor`). The model with the lowest floor is
    taken first, again and again: a first floor is raised, a raised one laid out; once the lowest
    floor is slower than the best finish laid out, no other model can be faster. A floor is never
    above the finish it bounds and the best finish only gets better, so every model that could be
    the baseline is laid out and the baseline is exact.

    Then every model's counted quality is exact (the baseline's mean, or a mean less the noise of
    its lead over that baseline), and its utility has a ceiling: that quality with its finish
    floor, since utility falls as the finish grows (a non-negative latency weight). Taken by
    ceiling, best first, a model whose ceiling is below the best utility found by more than the
    margin within which `_ranks` lets utilities share a rank (so no tie can reach it) cannot win;
    otherwise its finish floor is checked the same way, and only then is its queue laid out.

    A model that cannot win is a `bound` candidate: its ceiling, the floor under its finish and
    that floor's holder. The chosen model, its ranking, the baseline and every laid-out model's
    figures are what laying out every queue gives; a bound model's rank is by its ceiling, and so
    may differ from its rank on its true utility.
    """
    domain = query.domain
    default_prompt = plan_params.default_prompt_tokens
    # Each model's own estimate of the prompt (its learned bytes per token, where it has one).
    prompts: list[int] = []
    prune = not plan_params.full_walk and params.latency_weight >= 0.0 and params.latency_scale_s > 0.0
    # Per model: quality, output tokens, queue, and the floor under the new task's finish as
    # (seconds, holder) (None where no floor holds, or when nothing is pruned).
    rows: list[tuple[Field, float, list[BacklogEntry], tuple[float, str] | None]] = []
    for _, digest, holders in weighed:
        quality = est.quality(digest, domain)
        out = est.capped_output(digest, domain, query.max_tokens).value
        queue = view.backlog.get(digest, [])
        prompt = prompt_estimate(query, default_prompt, est, digest)
        prompts.append(prompt)
        # A slot may hold every full block of the prompt: a floor counts only the rest.
        floor_prompt = prompt - most_cached(query, prompt)
        floor = None
        if prune:
            found = service_floor(est, holders, digest, floor_prompt, out, queue, default_prompt, view)
            floor = None if found is None else (found[1], holders[found[0]].name)
        rows.append((quality, out, queue, floor))
    pool = [k for k in range(len(rows)) if rows[k][0].n > 0] or list(range(len(rows)))
    margin = _TIE * (len(rows) + 1)
    # Per model: (finish, worker) when laid out; (ceiling, finish floor, floor's worker) when bound.
    finished: dict[int, tuple[float, str]] = {}
    bounds: dict[int, tuple[float, float, str]] = {}
    laid: dict[str, tuple[PlanState, list[Step]]] = {}
    states: dict[int, PlanState] = {}
    slowdowns: dict[str, float] = {}

    def state_of(k: int) -> PlanState:
        state = states.get(k)
        if state is not None:
            return state
        _, digest, holders = weighed[k]
        state = states[k] = PlanState(
            holders, est, digest, now_ms, plan_params, free=free, slowdowns=slowdowns, backlog=view.backlog
        )
        return state

    def raise_floor(k: int) -> bool:
        """Put the slot state's finish floor in place of model k's floor: False where none holds
        (then only laying its queue out tells)."""
        state = state_of(k)
        _, out, queue, _ = rows[k]
        prompt = prompts[k]
        found = state.finish_floor(prompt, out, queue, state.cached(query.prefix, prompt))
        if found is None:
            return False
        quality, out, queue, _ = rows[k]
        rows[k] = (quality, out, queue, (found[1], state.names[found[0]]))
        return True

    def lay_out(k: int) -> float:
        """Lay the model's queue out; its finish for the new task."""
        state = state_of(k)
        _, digest, _ = weighed[k]
        _, out, queue, _ = rows[k]
        steps = state.walk(queue)
        laid[digest] = (state, steps)
        prompt = prompts[k]
        finishes = state.finishes(prompt, out, state.cached(query.prefix, prompt))
        i = _first_best(finishes)
        finished[k] = (finishes[i], state.names[i])
        return finishes[i]

    def slower(finish_s: float, top: float) -> bool:
        return _latency_part(params, finish_s) < top - margin

    # The baseline: every pool model whose finish could reach the best finish laid out. The
    # lowest floor is looked at first, and raised (or laid out, once raised) before any other:
    # of several fast-looking models, the one whose waits and loads are shortest is most often
    # the fastest, and its finish tells the others they are not.
    top = -math.inf
    raised: set[int] = set()
    heap = [(-math.inf if (f := rows[k][3]) is None else f[0], k) for k in pool]
    heapq.heapify(heap)
    while heap:
        floor_s, k = heapq.heappop(heap)
        if slower(floor_s, top):
            break  # the rest are no faster
        if rows[k][3] is not None and k not in raised:
            raised.add(k)
            if raise_floor(k):
                heapq.heappush(heap, (rows[k][3][0], k))  # type: ignore[index]
                continue
        top = max(top, _latency_part(params, lay_out(k)))
    top = max(_latency_part(params, finished[j][0]) for j in pool if j in finished)
    tied = [j for j in pool if j in finished and _latency_part(params, finished[j][0]) >= top - _TIE]
    base = max(tied, key=lambda j: (rows[j][0].value, -j))
    base_sd = rows[base][0].sd

    # The quality each model counts: the baseline's mean, or the baseline's mean plus the lower
    # bound of the lead, which is the mean less the lead's noise.
    counted = [
        q.value if k == base else q.value - _lead_penalty(params, q.sd, base_sd)
        for k, (q, _, _, _) in enumerate(rows)
    ]

    def ceiling_of(k: int) -> float:
        floor = rows[k][3]
        return math.inf if floor is None else _utility(params, counted[k], floor[0])

    # Every other model that might win, by its ceiling, best first.
    best = max(_utility(params, counted[k], finished[k][0]) for k in finished)
    rest = sorted((-ceiling_of(k), k) for k in range(len(rows)) if k not in finished)
    for negated, k in rest:
        ceiling = -negated
        floor = rows[k][3]
        if floor is not None and k not in raised and ceiling >= best - margin and raise_floor(k):
            ceiling, floor = ceiling_of(k), rows[k][3]
        if floor is not None and ceiling < best - margin:
            bounds[k] = (ceiling, floor[0], floor[1])
            continue
        best = max(best, _utility(params, counted[k], lay_out(k)))

    scored: list[tuple[float, float, str, bool, float]] = []
    for k in range(len(rows)):
        if k in bounds:
            ceiling, floor_s, worker = bounds[k]
            scored.append((ceiling, floor_s, worker, True, counted[k]))
            continue
        finish, worker = finished[k]
        scored.append((_utility(params, counted[k], finish), finish, worker, False, counted[k]))
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
            quality_counted=counted_k,
            baseline=k == base,
        )
        for k, (
            (name, digest, _),
            (quality, _, _, _),
            (utility, finish, worker, bound, counted_k),
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

    def to_dict(self, top: int | None = None) -> dict[str, object]:
        """Plain data: candidates, every term, every source. `top`: only the first `top`
        candidates, and the rest as `others` ({"count", "best_finish_s"}) when there are more."""
        ranking = self.ranking
        out: dict[str, object] = {
            "model": self.model,
            "digest": self.digest,
            "domain": self.domain,
            "candidates": [c.to_dict() for c in (ranking.candidates if top is None else ranking.top(top))],
            "backlog": len(ranking.plan.assignments),
        }
        if top is not None and len(ranking) > top:
            out["others"] = {"count": len(ranking) - top, "best_finish_s": ranking.best_finish_after(top)}
        if self.choice is not None:
            out["auto"] = self.choice.to_dict()
        return out

    def to_record(self, top: int = RECORDED_CANDIDATES) -> dict[str, object]:
        """The compact breakdown TaskRouted keeps in the ledger (`to_dict()` stays the whole one):

            {"model", "domain", "backlog",
             "shared": {"terms": {"output_tokens", "quality", "image_tokens" (with images)},
                        "fields": {name: [value, n, source, age_s]}},
             "candidates": [{"worker", "rank", "expected_finish_s", "terms": {...},
                             "fields": {name: [value, n, source, age_s]}}, ...],
             "others": {"count", "best_finish_s"}, "auto": {...}}

        The `top` candidates keep every term and source; the rest are `others`: how many, and the
        best expected finish among them. What is the model's, not the worker's (output length,
        quality) is written once under `shared`. Numbers are rounded to 4 significant digits (ages to
        whole seconds). The digest is TaskRouted's own field. Old entries (the whole `to_dict()`) and
        new ones both list `candidates` with `worker` and `expected_finish_s`.
        """
        ranking = self.ranking
        candidates = ranking.top(top)
        rest_best = ranking.best_finish_after(top)
        shared_terms = ("prompt_tokens", "output_tokens", "quality", "image_tokens")
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
                for c in candidates
            ],
            "others": {
                "count": max(0, len(ranking) - top),
                "best_finish_s": None if rest_best is None else _short(rest_best),
            },
        }
        if self.choice is not None:
            out["auto"] = self.choice.to_dict()
        return out


def _short(x: float) -> float | int:
    """`x` to 4 significant digits, as an int when that is whole (msgpack writes small ints in
    1-3 bytes, every float in 9)."""
    if x != x or x in (math.inf, -math.inf):
        return x
    if x == 0:
        return 0
    # round() and the "4g" format both round the exact binary value at one decimal place, so they
    # agree wherever that place is the same; log10 can misplace it by one only within a few ulps
    # of a power of ten, where both give the power itself. At the top of the float range round()
    # would overflow where the format gives inf. Half the format's cost: a routed request's
    # ledger record (`to_record`) calls this for every number it keeps.
    r = round(x, 3 - math.floor(math.log10(abs(x)))) if abs(x) < 1e300 else float(f"{x:.4g}")
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
    if query.model == AUTO_MODEL:
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
