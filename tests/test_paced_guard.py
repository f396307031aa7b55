"""A free faster machine is never passed over (design rule 13): pacing a streamed task by its
reader's finish may order only the holders at least as good as the fastest free one."""

from __future__ import annotations

import msgspec

from router.choose import RouteQuery, rank_workers
from router.plan import BacklogEntry, guard_paced, plan_state
from tests.router_helpers import NOW, QWEN, busy, estimator, snapshot, speed_row, view, worker

# `slow` reads prompts ten times faster (its first token comes first) and decodes at 10 tok/s,
# still faster than anyone reads: by the reader's finish alone it would win while `fast` is free.
ROWS = [
    speed_row("fast", QWEN, 40.0, 30, prompt=500.0, load=0.0),
    speed_row("slow", QWEN, 10.0, 30, prompt=5000.0, load=0.0),
]
QUERY = RouteQuery(model="m", prompt_tokens=2000, max_tokens=256, paced=True)


def test_a_paced_task_never_goes_to_a_slower_machine_while_a_faster_one_is_free() -> None:
    est = estimator(snapshot(ROWS))
    fleet = view([worker("fast", [QWEN]), worker("slow", [QWEN])])
    ranking = rank_workers(fleet, est, QWEN, NOW, QUERY)
    assert ranking.best.worker == "fast"
    # The breakdown says who pacing would have preferred and why it did not.
    passed = {c.worker: c.terms["paced_passed_over"] for c in ranking.candidates}
    assert passed == {"fast": 0.0, "slow": 1.0}
    # Not paced, the same.
    assert (
        rank_workers(fleet, est, QWEN, NOW, msgspec.structs.replace(QUERY, paced=False)).best.worker == "fast"
    )
    # The plan of a queue (every gate's) places it alike.
    entry = BacklogEntry(
        task_id="t", digest=QWEN, enqueued_at_ms=NOW, prompt_tokens=2000, max_tokens=256, paced=True
    )
    _, state = plan_state(fleet, est, QWEN, NOW, backlog=[])
    assert state is not None
    i, _, _ = state.best(entry)
    assert state.names[i] == "fast"


def test_while_the_faster_machine_is_busy_a_paced_task_may_start_on_a_free_one() -> None:
    est = estimator(snapshot(ROWS))
    fast = worker("fast", [QWEN])
    busy(fast, QWEN, started_s_ago=0.0, expected_s=6.0)
    fleet = view([fast, worker("slow", [QWEN])])
    paced = rank_workers(fleet, est, QWEN, NOW, QUERY)
    plain = rank_workers(fleet, est, QWEN, NOW, msgspec.structs.replace(QUERY, paced=False))
    # Placed by its finish it waits for `fast`; its reader starts sooner on `slow` and finishes
    # reading sooner there.
    assert plain.best.worker == "fast"
    assert paced.best.worker == "slow"


def test_the_guard_keeps_the_reader_order_only_among_holders_no_worse_than_the_fastest_free_one() -> None:
    # Holder 0 free and fastest; holder 1 free, first token sooner but finishing later; holder 2
    # busy, no better on either.
    costs, finishes, firsts = [50.0, 48.0, 60.0], [10.0, 26.0, 30.0], [4.0, 0.4, 20.0]
    guarded = guard_paced(costs, finishes, firsts, [True, True, False])
    assert guarded.index(min(guarded)) == 0
    assert guarded[0] == 50.0 and guarded[1] > 50.0 and guarded[2] > 50.0
    # A holder that starts and finishes no later than the fastest free one keeps its reader's cost.
    assert guard_paced([50.0, 45.0], [10.0, 9.0], [4.0, 3.0], [True, False]) == [50.0, 45.0]
    # Nobody free: the reader's finish decides.
    assert guard_paced(costs, finishes, firsts, [False, False, False]) == costs
