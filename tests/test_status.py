"""The one task-status rule: every reader folds it the same way, whatever order the events come in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.gateway import task_status
from dispatch.recent import Recent
from events.event import (
    Event,
    TaskCancelled,
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskFailed,
    TaskReclaimed,
    TaskStalled,
    TaskSubmitted,
)
from events.keys import Keys
from projections.folder import Folder
from projections.status import TERMINAL_RANK, TaskStatus, fold_status, settle
from projections.tables import Tables
from tasks.payload import Result

DIGEST = "d" * 64
TASK = "t1"

NON_TERMINAL: list[Event] = [
    TaskClaimed(task_id=TASK, worker="a", digest=DIGEST, attempt=1),
    TaskFailed(task_id=TASK, worker="a", digest=DIGEST, attempt=1, kind="timeout", retryable=True),
    TaskReclaimed(task_id=TASK, queue="q", old_entry="1-0", new_entry="2-0", owner="a", attempt=2),
    TaskStalled(task_id=TASK, queue="q", entry_id="2-0", waited_ms=1),
    TaskCompleted(task_id=TASK, worker="b", digest=DIGEST, attempt=1, duplicate=True),
]
TERMINAL: dict[TaskStatus, Event] = {
    "completed": TaskCompleted(task_id=TASK, worker="a", digest=DIGEST, attempt=2),
    "failed": TaskFailed(
        task_id=TASK, worker="a", digest=DIGEST, attempt=1, kind="bad_request", retryable=False
    ),
    "dead": TaskDeadLettered(task_id=TASK, queue="q", reason="spent", attempts=3),
    "cancelled": TaskCancelled(task_id=TASK, queue="q"),
}
SUBMITTED = TaskSubmitted(task_id=TASK, model="m", digest=DIGEST, queue="q")


def fold_all(events: list[Event]) -> TaskStatus:
    status: TaskStatus = "submitted"
    for event in events:
        status = fold_status(status, event)
    return status


@settings(max_examples=300, deadline=None)
@given(
    extra=st.lists(st.sampled_from(NON_TERMINAL), max_size=6),
    terminals=st.lists(st.sampled_from(sorted(TERMINAL)), max_size=4),
    order=st.randoms(use_true_random=False),
)
def test_the_final_status_is_the_highest_terminal_one_in_any_order(
    extra: list[Event], terminals: list[TaskStatus], order: object
) -> None:
    events = [SUBMITTED, *extra, *(TERMINAL[t] for t in terminals)]
    order.shuffle(events)  # type: ignore[attr-defined]
    status = fold_all(events)
    if terminals:
        assert status == max(terminals, key=TERMINAL_RANK.__getitem__)
    else:
        assert status not in TERMINAL_RANK


@settings(max_examples=100, deadline=None)
@given(
    events=st.lists(st.sampled_from([SUBMITTED, *NON_TERMINAL, *TERMINAL.values()]), min_size=1, max_size=8)
)
def test_the_projector_and_the_dashboard_fold_the_status_the_same_way(events: list[Event]) -> None:
    folder = Folder(Tables())
    recent = Recent(Keys())
    for i, event in enumerate([SUBMITTED, *events]):
        folder.apply(event)
        recent.add(f"1-{i}", event)
    expected = fold_all([SUBMITTED, *events])
    assert folder.tables.tasks[TASK].status == expected
    assert recent.tasks[TASK].status == expected


def test_a_late_reclaim_never_turns_a_completed_task_back_into_a_queued_one() -> None:
    status = fold_all([SUBMITTED, NON_TERMINAL[0], TERMINAL["completed"], NON_TERMINAL[2]])
    assert status == "completed"


def test_a_task_view_merges_its_stored_outcome_by_the_same_rule() -> None:
    outcome = Result(task_id=TASK, status="cancelled")
    assert task_status(None, None) == "submitted"
    assert task_status(None, outcome) == "cancelled"
    assert settle("running", "queued") == "queued"
    assert settle("completed", "dead") == "completed"
