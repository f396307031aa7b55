"""The dispatch plan: service terms, slot free times, a burst assigned near the optimum, and the
pruned walk that places every task exactly where the full walk does."""

from __future__ import annotations

import math
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import router.plan as plan_module
from projections.snapshot import LengthRow
from router.choose import RouteQuery, decide, rank_workers
from router.estimate import Estimator
from router.gate import should_take
from router.plan import (
    PRUNE_MIN_HOLDERS,
    PRUNE_MIN_TASKS,
    BacklogEntry,
    FleetView,
    PlanParams,
    PlanState,
    WorkerView,
    holders_by_digest,
    plan_queue,
    service,
    service_floor,
    slot_free_times,
)
from sim.fleetspec import load_fleet
from sim.random_fleet import NOW_MS, FleetShape, random_fleet
from sim.scheduling.bounds import burst_optimum
from tests.router_helpers import (
    NOW,
    QWEN,
    backlog,
    busy,
    estimator,
    fleet_shapes,
    snapshot,
    speed_row,
    stat,
    view,
    worker,
)

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


def spread_snapshot(sigma: float):
    """The seed speeds with 40 measured output lengths of mean about 600, lognormal with `sigma`."""
    import statistics

    rows = [speed_row(w, QWEN, d, 30, prompt=p, load=ld) for w, (d, p, ld) in SEED_QWEN.items()]
    snap = snapshot(rows, {(QWEN, "general"): 600.0})
    normal = statistics.NormalDist()
    quantiles = [normal.inv_cdf((i + 0.5) / 40) for i in range(40)]
    lengths = [600.0 * math.exp(sigma * z - sigma * sigma / 2) for z in quantiles]
    snap.length[(QWEN, "general")] = LengthRow(digest=QWEN, domain="general", output_tokens=stat(lengths))
    return snap


def test_a_slot_is_free_when_its_task_ends_and_an_overdue_one_needs_what_its_length_still_needs() -> None:
    est = estimator(spread_snapshot(0.8))
    w = worker("rtx3070ti", {QWEN}, slots=2)
    busy(w, QWEN, started_s_ago=3.0, expected_s=10.0)
    busy(w, QWEN, started_s_ago=30.0, expected_s=10.0)
    free = slot_free_times(w, est, NOW)
    assert free[0] == pytest.approx(7.0)
    # Three times over: a lognormal length past 3x its mean still has, on average, more than its
    # mean to go (E[L - 3 | L > 3] is about 1.4 at sigma 0.8), never "free in a second".
    sigma = est.length_sigma(QWEN, "general")
    assert sigma == pytest.approx(0.8, abs=0.1)
    assert free[1] == pytest.approx(10.0 * est.output_left(QWEN, "general", 3.0))
    assert 10.0 < free[1] < 20.0
    # The further over, the more it still needs (the tail of a lognormal grows).
    later = worker("rtx3070ti", {QWEN})
    busy(later, QWEN, started_s_ago=60.0, expected_s=10.0)
    assert slot_free_times(later, est, NOW)[0] > free[1]
    # Just past its estimate it is still not free now.
    busy_just_over = worker("rtx3070ti", {QWEN})
    busy(busy_just_over, QWEN, started_s_ago=10.5, expected_s=10.0)
    assert slot_free_times(busy_just_over, est, NOW)[0] > 5.0


def test_the_expected_remaining_output_matches_a_sampled_lognormal_tail() -> None:
    import random

    est = estimator(spread_snapshot(0.6))
    sigma = est.length_sigma(QWEN, "general")
    rng = random.Random(7)
    draws = [rng.lognormvariate(-sigma * sigma / 2, sigma) for _ in range(200_000)]
    for done in (0.5, 1.0, 2.0, 3.0):
        tail = [x - done for x in draws if x > done]
        assert est.output_left(QWEN, "general", done) == pytest.approx(sum(tail) / len(tail), rel=0.05)


def test_a_worker_running_a_task_far_past_its_estimate_gets_no_new_work_in_the_plan() -> None:
    est = estimator(spread_snapshot(0.5))
    mac, rtx = worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})
    expected = service(est, "rtx3070ti", QWEN).total_s
    fine = plan_queue(view([mac, rtx], {QWEN: backlog(QWEN, 2)}), est, QWEN, NOW)
    # Overdue within the spread of output lengths (the 99th percentile is about 2.8x the mean at
    # sigma 0.5): a long answer says nothing about the machine, which keeps the queue.
    busy(rtx, QWEN, started_s_ago=2.5 * expected, expected_s=expected)
    within = plan_queue(view([mac, rtx], {QWEN: backlog(QWEN, 2)}), est, QWEN, NOW)
    assert [a.worker for a in fine.assignments] == [a.worker for a in within.assignments] == ["rtx3070ti"] * 2
    # Thirty times over: even at the longest plausible length the machine is over 7.3x slower than
    # measured (the laptop's margin), and the laptop takes the head of the queue.
    rtx.running.clear()
    busy(rtx, QWEN, started_s_ago=30 * expected, expected_s=expected)
    slowed = plan_queue(view([mac, rtx], {QWEN: backlog(QWEN, 2)}), est, QWEN, NOW)
    assert slowed.assignments[0].worker == "macbookair"


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


def _walks(shape: FleetShape, seed: int) -> Iterator[tuple[list[BacklogEntry], PlanState, PlanState]]:
    """Every model's queue of a random fleet, with a pruned and a full plan state of its holders."""
    snap, fleet, _ = random_fleet(shape, seed)
    est = estimator(snap, NOW_MS)
    for digest, holders in holders_by_digest(fleet).items():
        queue = fleet.backlog.get(digest, [])
        pruned = PlanState(holders, est, digest, NOW_MS, PlanParams())
        full = PlanState(holders, est, digest, NOW_MS, PlanParams(full_walk=True))
        yield queue, pruned, full


def _same_walk(queue: list[BacklogEntry], pruned: PlanState, full: PlanState) -> None:
    assert pruned.walk(queue) == full.walk(queue)
    # Not only the assignments: the slots' state a new task is ranked on afterwards.
    assert pruned.free == full.free
    assert pruned.head == full.head
    assert pruned.load_left == full.load_left


@settings(max_examples=80, deadline=None)
@given(shape=fleet_shapes(), seed=st.integers(0, 2**16))
def test_the_pruned_walk_places_every_task_on_the_holder_and_at_the_times_the_full_walk_does(
    shape: FleetShape, seed: int
) -> None:
    for queue, pruned, full in _walks(shape, seed):
        _same_walk(queue, pruned, full)


@settings(max_examples=40, deadline=None)
@given(shape=fleet_shapes(max_workers=8), seed=st.integers(0, 2**16))
def test_the_pruned_walk_is_the_full_walk_on_the_smallest_fleets_and_queues_too(
    shape: FleetShape, seed: int
) -> None:
    # Below these sizes the plan walks in full because that is cheaper; pruning must hold there too.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_module, "PRUNE_MIN_TASKS", 1)
        mp.setattr(plan_module, "PRUNE_MIN_HOLDERS", 1)
        for queue, pruned, full in _walks(shape, seed):
            _same_walk(queue, pruned, full)


def test_on_a_fleet_of_hundreds_the_pruned_walk_equals_the_full_walk_for_every_queue() -> None:
    for seed in (1, 2, 3):
        walked = 0
        for queue, pruned, full in _walks(FleetShape(workers=200, backlog=400), seed):
            _same_walk(queue, pruned, full)
            if len(queue) >= PRUNE_MIN_TASKS and len(full.head) >= PRUNE_MIN_HOLDERS:
                walked += len(queue)
        # Most of the backlog sits in queues long enough, with holders enough, to take the pruned walk.
        assert walked >= 300


@settings(max_examples=60, deadline=None)
@given(shape=fleet_shapes(), seed=st.integers(0, 2**16))
def test_the_walk_for_a_holder_stops_at_the_first_task_the_full_walk_gives_it(
    shape: FleetShape, seed: int
) -> None:
    snap, fleet, _ = random_fleet(shape, seed)
    est = estimator(snap, NOW_MS)
    for digest, holders in holders_by_digest(fleet).items():
        queue = fleet.backlog.get(digest, [])
        steps = PlanState(holders, est, digest, NOW_MS, PlanParams(full_walk=True)).walk(queue)
        for i in range(len(holders)):
            first = next(((pos, f) for pos, (j, _, f) in enumerate(steps) if j == i), None)
            state = PlanState(holders, est, digest, NOW_MS, PlanParams())
            assert state.first_given(i, queue) == first


@settings(max_examples=80, deadline=None)
@given(
    shape=fleet_shapes(),
    seed=st.integers(0, 2**16),
    prompt=st.integers(0, 4000),
    out=st.sampled_from([0.0, 1.0, 256.0, 900.0]),
)
def test_no_holder_finishes_a_new_task_before_the_floors_however_the_backlog_is_laid_out(
    shape: FleetShape, seed: int, prompt: int, out: float
) -> None:
    snap, fleet, _ = random_fleet(shape, seed)
    est = estimator(snap, NOW_MS)
    default = PlanParams().default_prompt_tokens
    for digest, holders in holders_by_digest(fleet).items():
        queue = fleet.backlog.get(digest, [])
        state = PlanState(holders, est, digest, NOW_MS, PlanParams(full_walk=True))
        floor = state.finish_floor(prompt, out, queue)
        least = service_floor(est, holders, digest, prompt, out, queue, default)
        now = min(state.finishes(prompt, out))
        state.walk(queue)
        finish = min(state.finishes(prompt, out))
        if state.shared:
            assert floor is None and least is None
            continue
        assert floor is not None
        assert floor[1] <= finish
        # The cheaper floor holds no matter how many slots, so any sign of sharing rules it out.
        assert least is not None or shape.sharing > 0.0
        if least is not None:
            assert least[1] <= floor[1]
        if all(len(slots) == 1 for slots in state.free):
            # One slot each: the floor is the finish were the new task queued now.
            assert floor[1] == now


def test_a_malformed_task_gives_no_floor_and_no_slot_free_before_now() -> None:
    est = estimator(seed_snapshot())
    w = worker("rtx3070ti", {QWEN}, slots=2)
    busy(w, QWEN, started_s_ago=3.0, expected_s=-10.0)
    assert slot_free_times(w, est, NOW) == [0.0, 0.0]
    queue = backlog(QWEN, 3, max_tokens=-5)
    state = PlanState([w], est, QWEN, NOW, PlanParams())
    assert state.finish_floor(64, 600.0, queue) is None
    assert service_floor(est, [w], QWEN, 64, 600.0, queue, 64) is None
    assert state.finish_floor(64, 600.0, backlog(QWEN, 3)) is not None
    assert service_floor(est, [w], QWEN, 64, 600.0, backlog(QWEN, 3), 64) is not None


OTHER = "c" * 64


def _load_paid(w: WorkerView, digest: str = QWEN) -> float:
    rows = [
        speed_row("rtx3070ti", QWEN, 83.0, 30, prompt=2000.0, load=3.0),
        speed_row("rtx3070ti", OTHER, 40.0, 30, prompt=1000.0, load=6.0),
    ]
    est = estimator(snapshot(rows, {(QWEN, "general"): 600.0}))
    state = PlanState([w], est, digest, NOW, PlanParams())
    return state.load_left[0]


def test_on_a_machine_with_room_for_one_model_running_another_evicts_the_loaded_one() -> None:
    one = WorkerView(name="rtx3070ti", slots=1, holds={QWEN, OTHER}, loaded={QWEN}, max_loaded=1)
    assert _load_paid(one) == 0.0
    busy(one, OTHER, started_s_ago=1.0)
    # It runs the other model now: qwen is no longer in memory when the next task starts.
    assert _load_paid(one) == pytest.approx(3.0, rel=0.01)
    roomy = WorkerView(name="rtx3070ti", slots=1, holds={QWEN, OTHER}, loaded={QWEN}, max_loaded=2)
    busy(roomy, OTHER, started_s_ago=1.0)
    unknown = WorkerView(name="rtx3070ti", slots=1, holds={QWEN, OTHER}, loaded={QWEN})
    busy(unknown, OTHER, started_s_ago=1.0)
    assert _load_paid(roomy) == 0.0 and _load_paid(unknown) == 0.0


def _evicting_fleet(other_queued: int, qwen_queued: int = 0) -> tuple[FleetView, Estimator]:
    """The GPU PC with room for one model (qwen loaded, holding another) beside the laptop with
    qwen loaded; `other_queued` tasks of the other model waiting, then `qwen_queued` of qwen."""
    rows = [
        speed_row("rtx3070ti", QWEN, 83.0, 30, prompt=2000.0, load=30.0),
        speed_row("rtx3070ti", OTHER, 40.0, 30, prompt=1000.0, load=6.0),
        speed_row("macbookair", QWEN, 11.4, 30, prompt=120.0, load=8.0),
    ]
    est = estimator(snapshot(rows, {(QWEN, "general"): 100.0, (OTHER, "general"): 100.0}))
    pc = WorkerView(name="rtx3070ti", slots=1, holds={QWEN, OTHER}, loaded={QWEN}, max_loaded=1)
    laptop = WorkerView(name="macbookair", slots=1, holds={QWEN}, loaded={QWEN})
    queues: dict[str, list[BacklogEntry]] = {}
    if other_queued:
        queues[OTHER] = backlog(OTHER, other_queued)
    if qwen_queued:  # enqueued after the other model's tasks
        queues[QWEN] = [
            msgspec.structs.replace(e, task_id=f"qwen{i}", enqueued_at_ms=NOW - 100 + i)
            for i, e in enumerate(backlog(QWEN, qwen_queued))
        ]
    return view([pc, laptop], queues), est


def _qwen_loads(fv: FleetView, est: Estimator) -> list[float]:
    """Load seconds qwen's plan charges each of its holders."""
    return PlanState(fv.holders(QWEN), est, QWEN, NOW, PlanParams(), backlog=fv.backlog).load_left


def test_an_idle_one_model_machine_with_another_model_queued_first_is_priced_with_the_load() -> None:
    """The plans are per model: qwen's plan sees the other model's older queue on the GPU PC (its
    gate turns to that queue first, and loading that model evicts qwen)."""
    alone, est = _evicting_fleet(0)
    crowded, _ = _evicting_fleet(2)
    assert _qwen_loads(crowded, est) == [pytest.approx(30.0, rel=0.01), 0.0]
    assert _qwen_loads(alone, est) == [0.0, 0.0]
    # The router prices qwen's next task with the load there, and sends it to the laptop instead.
    assert rank_workers(alone, est, QWEN, NOW).best.worker == "rtx3070ti"
    ranked = rank_workers(crowded, est, QWEN, NOW)
    pc = next(c for c in ranked.candidates if c.worker == "rtx3070ti")
    assert pc.terms["load_s"] == pytest.approx(30.0, rel=0.01)
    assert ranked.best.worker == "macbookair"
    # Its own gate looks at the other model's queue first, the one the qwen plan charged for.
    gate = should_take("rtx3070ti", crowded, est, NOW)
    assert gate.digest == OTHER


def test_a_one_model_machine_keeps_its_loaded_model_when_that_queue_waited_longest() -> None:
    # Qwen's queue head waited longer than the other's: qwen goes first there, still loaded.
    fv, est = _evicting_fleet(0, qwen_queued=1)
    fv.backlog[OTHER] = [msgspec.structs.replace(e, enqueued_at_ms=NOW - 10) for e in backlog(OTHER, 1)]
    assert _qwen_loads(fv, est) == [0.0, 0.0]
    assert plan_queue(fv, est, QWEN, NOW).assignments[0].worker == "rtx3070ti"
    gate = should_take("rtx3070ti", fv, est, NOW)
    assert gate.digest == QWEN and gate.take
    # A machine with room for two keeps both whatever is queued.
    crowded, _ = _evicting_fleet(2)
    crowded.workers[0].max_loaded = 2
    assert _qwen_loads(crowded, est) == [0.0, 0.0]


def test_a_worker_that_cannot_say_what_is_loaded_pays_no_default_load() -> None:
    fresh = WorkerView(name="llamacpp", slots=1, holds={QWEN}, loaded_known=False)
    assert _load_paid(fresh) == 0.0
    told = WorkerView(name="llamacpp", slots=1, holds={QWEN})
    assert _load_paid(told) > 0.0  # "nothing loaded" from a backend that can say it is a fact


def _moved(fleet: FleetView) -> FleetView:
    """`fleet` a moment later, as a new read of the leases gives it: a new list of new worker
    views, with each worker now running what the one before it ran (and loaded what it had)."""
    ws = fleet.workers
    moved = [
        msgspec.structs.replace(w, running=list(ws[i - 1].running), loaded=set(ws[i - 1].loaded) & w.holds)
        for i, w in enumerate(ws)
    ]
    return FleetView(workers=moved, backlog=fleet.backlog, arrival_rate=fleet.arrival_rate)


@settings(max_examples=30, deadline=None)
@given(shape=fleet_shapes(), seed=st.integers(0, 2**16))
def test_what_the_plan_keeps_per_list_of_workers_never_outlives_that_list(
    shape: FleetShape, seed: int
) -> None:
    # Holders, fastest speeds and each model's starting slot state are kept per list of workers
    # and estimator; a decision on the next list (what runs where has changed) must be the one a
    # process that never saw the first list makes.
    snap, fleet, digests = random_fleet(shape, seed)
    est = estimator(snap, NOW_MS)
    query = RouteQuery(model="auto", prompt_tokens=300)
    decide(query, digests, fleet, est, NOW_MS)
    later = _moved(fleet)
    decide(query, digests, later, est, NOW_MS)
    # The second decision on the new list reads what the first one kept.
    warm = decide(query, digests, later, est, NOW_MS).to_dict()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_module, "_INDEX", [])
        cold = decide(query, digests, _moved(fleet), estimator(snap, NOW_MS), NOW_MS).to_dict()
    assert warm == cold
    # The same holds for a worker's gate on the new list.
    for w in later.workers[:5]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plan_module, "_INDEX", [])
            fresh = should_take(w.name, _moved(fleet), estimator(snap, NOW_MS), NOW_MS)
        assert should_take(w.name, later, est, NOW_MS) == fresh


def test_a_cold_estimator_forgets_what_the_plan_kept_for_it() -> None:
    snap, fleet, digests = random_fleet(FleetShape(workers=30, models=4, backlog=20))
    est = estimator(snap, NOW_MS)
    decide(RouteQuery(model="auto"), digests, fleet, est, NOW_MS)
    assert "#index" in est.memo
    est.clear_cache()
    assert "#index" not in est.memo


def _paced_view(paced: bool) -> tuple[FleetView, Estimator]:
    """The seed pair with the fast machine 20 s into a 27 s task and one 64-token task queued."""
    est = estimator(seed_snapshot())
    mac, rtx = worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})
    busy(rtx, QWEN, started_s_ago=7.0, expected_s=27.0)
    queue = [msgspec.structs.replace(e, paced=paced) for e in backlog(QWEN, 1)]
    return view([mac, rtx], {QWEN: queue}), est


def test_a_streamed_answer_starts_on_the_idle_machine_that_decodes_faster_than_its_reader_reads() -> None:
    # 600 output tokens: 53 s on the idle laptop (11.4 tok/s), 7 s on the GPU PC after its 20 s
    # wait. Read at 5.3 tok/s, both streams outpace the reader, who starts 20 s sooner on the laptop.
    fleet, est = _paced_view(paced=True)
    (step,) = PlanState(fleet.workers, est, QWEN, NOW, PlanParams()).walk(fleet.backlog[QWEN])
    assert step[0] == 0  # the laptop
    # Planned busy until its own finish, not its reader's.
    fresh = PlanState(fleet.workers, est, QWEN, NOW, PlanParams())
    assert step[2] == pytest.approx(fresh.best_on(0, fleet.backlog[QWEN][0]), rel=1e-9)


def test_an_answer_nobody_reads_as_it_streams_waits_for_the_machine_that_finishes_it_first() -> None:
    fleet, est = _paced_view(paced=False)
    (step,) = PlanState(fleet.workers, est, QWEN, NOW, PlanParams()).walk(fleet.backlog[QWEN])
    assert step[0] == 1  # the GPU PC
    paced, _ = _paced_view(paced=True)
    (off,) = PlanState(paced.workers, est, QWEN, NOW, PlanParams(reading_tps=0.0)).walk(paced.backlog[QWEN])
    assert off[0] == 1  # pacing off: a streamed one too


def test_a_reader_faster_than_the_slow_machine_streams_waits_for_the_fast_one() -> None:
    # A reader skimming at 40 tok/s waits on the laptop's 11.4 tok/s stream: 45 s against the GPU
    # PC's 20 s wait and 13 s of reading.
    fleet, est = _paced_view(paced=True)
    state = PlanState(fleet.workers, est, QWEN, NOW, PlanParams(reading_tps=40.0))
    (step,) = state.walk(fleet.backlog[QWEN])
    assert step[0] == 1


@settings(max_examples=40, deadline=None)
@given(shape=fleet_shapes(), seed=st.integers(0, 2**16), every=st.integers(1, 3))
def test_the_pruned_walk_places_paced_tasks_where_the_full_walk_does(
    shape: FleetShape, seed: int, every: int
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        # Prune however small the fleet: paced classes must hold their bound everywhere.
        mp.setattr(plan_module, "PRUNE_MIN_TASKS", 1)
        mp.setattr(plan_module, "PRUNE_MIN_HOLDERS", 1)
        for queue, pruned, full in _walks(shape, seed):
            mixed = [msgspec.structs.replace(e, paced=k % every == 0) for k, e in enumerate(queue)]
            _same_walk(mixed, pruned, full)


def test_a_streamed_request_ranks_holders_by_when_its_reader_finishes_and_shows_the_reading_time() -> None:
    fleet, est = _paced_view(paced=False)
    fleet.backlog[QWEN] = []
    read = rank_workers(fleet, est, QWEN, NOW, RouteQuery(model=QWEN, paced=True))
    assert [c.worker for c in read.candidates] == ["macbookair", "rtx3070ti"]
    laptop, gpu = read.candidates
    # Both machines outpace the reader, so reading outlasts decoding on each, more on the faster.
    assert laptop.terms["reading_s"] > 0.0 and gpu.terms["reading_s"] > laptop.terms["reading_s"]
    assert laptop.expected_finish_s > gpu.expected_finish_s  # ranked by the reader, not the finish
    plain = rank_workers(fleet, est, QWEN, NOW, RouteQuery(model=QWEN))
    assert plain.best.worker == "rtx3070ti" and "reading_s" not in plain.best.terms


@settings(max_examples=200, deadline=None)
@given(
    speeds=st.lists(st.tuples(st.floats(1e-5, 1.0), st.floats(1e-4, 2.0)), min_size=1, max_size=40),
    prompt=st.integers(0, 8000),
    out=st.floats(0.0, 4000.0),
)
def test_a_tasks_size_over_the_speed_front_is_its_least_time_over_every_holder(
    speeds: list[tuple[float, float]], prompt: int, out: float
) -> None:
    front = plan_module._pareto([a for a, _ in speeds], [b for _, b in speeds])
    every = min(prompt * a + out * b for a, b in speeds)
    # (Negative, malformed counts: `size_s` takes every holder.)
    assert min(prompt * a + out * b for a, b in front) == every
