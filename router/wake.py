"""Whether waking a sleeping machine pays: the plan of a model's queued work with it and without it.

A sleeping machine (its worker's lease is absent, its record says how to wake it) is planned as one
more holder of the models it serves whose slots are all free no sooner than `wake_s` from now, with
every model unloaded (a machine that just booted has loaded nothing, so its first task pays the
load). The estimator remembers its speeds from the times it was online, by its worker name, as it
does any worker's.

The measure is the makespan: when the last task of the queued work finishes. That is what "finishes
the queued work sooner" means for a burst, and it counts only what waking changes. A sum of finishes
would count a task that the sleeper takes off the end of a long queue as a gain for every task
behind it, and it would wake a machine to save seconds of waiting spread over many tasks; the
makespan wakes it only when the work as a whole ends sooner, by `margin_s` and by `margin_ratio` of
the makespan without it (a plan is an estimate; a machine woken on a tie costs power and a boot).

An idle awake holder is never bypassed: the plan gives each task to whichever slot finishes it
first, so the sleeper gets a task only where it finishes that task before every awake holder could,
and when the sleeper gets nothing the makespan is the same with it and nothing is woken.

Pure: it reads a FleetView and an Estimator, and sends nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from router.choose import RouteQuery, prompt_estimate
from router.estimate import Estimator, Field
from router.plan import BacklogEntry, FleetView, PlanParams, PlanState, WorkerView


class Sleeper(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A machine whose worker is not online, that can be woken: what it serves and how soon."""

    name: str
    slots: int
    # Digests of the models its worker serves (from its record).
    holds: frozenset[str]
    # Seconds from the magic packet to a worker taking work, and where that figure comes from
    # ("configured", or "measured" from the ledger).
    wake_s: float
    wake_source: str = "configured"
    # Age of the measured wake time (None: configured).
    wake_age_s: float | None = None


class WakeParams(msgspec.Struct, kw_only=True, frozen=True):
    """How much sooner the work must end with the machine awake before it is woken."""

    margin_s: float = 5.0
    margin_ratio: float = 0.1


class WakeDecision(msgspec.Struct, kw_only=True, frozen=True):
    """What the plan of one model's queued work says of waking one machine, term by term."""

    worker: str
    digest: str
    wake: bool
    # Tasks laid out (the queued backlog), and how many of them the plan gives the sleeper.
    tasks: int
    given: int
    makespan_without_s: float
    makespan_with_s: float
    gain_s: float
    needed_s: float
    wake_s: float
    wake_source: str
    reason: str

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = msgspec.to_builtins(self)
        for k in ("makespan_without_s", "makespan_with_s", "gain_s", "needed_s", "wake_s"):
            v = out[k]
            out[k] = round(v, 3) if isinstance(v, float) and v != float("inf") else None
        return out


def _not_before(state: PlanState, i: int, wake_s: float) -> None:
    """Holder `i`'s slots in `state` free no sooner than `wake_s` from now: it is asleep until then."""
    # A fresh list: the state's slot lists may be shared with its holders' template.
    state.free[i] = [max(wake_s, f) for f in state.free[i]]
    state.head[i] = state.free[i][0]


def _makespan(
    holders: Sequence[WorkerView],
    est: Estimator,
    digest: str,
    now_ms: int,
    entries: Sequence[BacklogEntry],
    view: FleetView,
    params: PlanParams,
    asleep: tuple[int, float] | None = None,
) -> tuple[float, int]:
    """(makespan of `entries` laid out on `holders`, tasks the plan gives holder `asleep[0]`);
    `asleep`: that holder's slots are free no sooner than `asleep[1]` seconds from now."""
    if not holders:
        return float("inf"), 0
    state = PlanState(holders, est, digest, now_ms, params, backlog=view.backlog)
    if asleep is not None:
        _not_before(state, *asleep)
    steps = state.walk(entries)
    given = 0 if asleep is None else sum(1 for i, _, _ in steps if i == asleep[0])
    return max((finish for _, _, finish in steps), default=0.0), given


def decide_wake(
    view: FleetView,
    est: Estimator,
    digest: str,
    sleeper: Sleeper,
    now_ms: int,
    *,
    backlog: Sequence[BacklogEntry] | None = None,
    params: WakeParams | None = None,
    plan_params: PlanParams | None = None,
) -> WakeDecision:
    """Whether waking `sleeper` finishes `digest`'s queued work (`backlog`, else the view's) sooner
    than the live holders alone, by the margin; with each plan's makespan."""
    wp = params or WakeParams()
    pp = plan_params or PlanParams()
    entries = list(view.backlog.get(digest, []) if backlog is None else backlog)

    def decision(
        wake: bool, reason: str, without: float = 0.0, with_: float = 0.0, given: int = 0
    ) -> WakeDecision:
        gain = without - with_ if given else 0.0
        return WakeDecision(
            worker=sleeper.name,
            digest=digest,
            wake=wake,
            tasks=len(entries),
            given=given,
            makespan_without_s=without,
            makespan_with_s=with_,
            gain_s=gain,
            needed_s=needed,
            wake_s=sleeper.wake_s,
            wake_source=sleeper.wake_source,
            reason=reason,
        )

    needed = 0.0
    if digest not in sleeper.holds:
        return decision(False, "it does not serve this model")
    if not entries:
        return decision(False, "nothing is queued")
    awake = [w for w in view.holders(digest) if w.name != sleeper.name]
    without, _ = _makespan(awake, est, digest, now_ms, entries, view, pp)
    # Booted: slots free, nothing loaded (PlanState charges the load on its first task).
    ghost = WorkerView(name=sleeper.name, slots=max(1, sleeper.slots), holds=set(sleeper.holds))
    with_, given = _makespan(
        [*awake, ghost], est, digest, now_ms, entries, view, pp, asleep=(len(awake), sleeper.wake_s)
    )
    if not awake:
        return decision(True, "no awake machine serves this model", without, with_, given)
    needed = max(wp.margin_s, wp.margin_ratio * without)
    if given == 0:
        return decision(False, "the awake holders finish every queued task sooner", without, with_)
    gain = without - with_
    if gain <= needed:
        return decision(
            False,
            f"waking saves {gain:.1f}s of the queued work's makespan, under the {needed:.1f}s margin",
            without,
            with_,
            given,
        )
    return decision(True, f"waking finishes the queued work {gain:.1f}s sooner", without, with_, given)


def sleeping_candidate(
    view: FleetView,
    est: Estimator,
    digest: str,
    sleeper: Sleeper,
    now_ms: int,
    query: RouteQuery | None = None,
    *,
    params: WakeParams | None = None,
    plan_params: PlanParams | None = None,
) -> dict[str, object] | None:
    """A sleeping machine as a candidate for a new task of `digest` (as `query` describes it): when
    it would finish the task behind the queued work if it were woken now, with every term (its
    `wake_s` among them, with its source) and the wake decision for the queued work. None when it
    does not serve `digest`. The shape of a preview's candidate, plus `asleep` and `wake`."""
    if digest not in sleeper.holds:
        return None
    pp = plan_params or PlanParams()
    q = query or RouteQuery()
    entries = view.backlog.get(digest, [])
    awake = [w for w in view.holders(digest) if w.name != sleeper.name]
    ghost = WorkerView(name=sleeper.name, slots=max(1, sleeper.slots), holds=set(sleeper.holds))
    holders = [*awake, ghost]
    i = len(awake)
    state = PlanState(holders, est, digest, now_ms, pp, backlog=view.backlog)
    _not_before(state, i, sleeper.wake_s)
    state.walk(entries)
    prompt = prompt_estimate(q, pp.default_prompt_tokens, est)
    out_field = est.output_tokens(digest, q.domain)
    out = out_field.value if q.max_tokens is None else min(out_field.value, float(q.max_tokens))
    wait, load, prompt_s, decode_s, finish = state.new_task(i, prompt, out)
    sp = state.sp.estimates[i]
    measured = sleeper.wake_age_s is not None
    wake_field = Field(
        value=sleeper.wake_s, n=1 if measured else 0, source=sleeper.wake_source, age_s=sleeper.wake_age_s
    )
    decision = decide_wake(view, est, digest, sleeper, now_ms, params=params, plan_params=pp)
    return {
        "worker": sleeper.name,
        "asleep": True,
        "expected_finish_s": finish,
        "terms": {
            "wake_s": sleeper.wake_s,
            # The wait counts the wake: its slots are free no sooner than wake_s from now.
            "wait_s": wait,
            "load_s": load,
            "prompt_s": prompt_s,
            "decode_s": decode_s,
            "output_tokens": out,
        },
        "fields": {
            "wake_s": wake_field.to_dict(),
            "decode_tps": sp.decode_tps.to_dict(),
            "prompt_tps": sp.prompt_tps.to_dict(),
            "load_s": sp.load_s.to_dict(),
            "output_tokens": out_field.to_dict(),
        },
        "wake": decision.to_dict(),
    }
