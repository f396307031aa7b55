"""The one rule of a task's status: folded from its ledger events, whatever order they arrive in.

The projector's task table, the dashboard's recent tasks, a pipeline's children and
`GET /v1/tasks/{id}` all fold with these functions, so that they never disagree about a task.

A terminal status outranks every other one, and among terminal ones the higher rank wins: a
completion that arrives after its task was reported failed or dead still counts, and a late
TaskReclaimed never turns a completed task back into a queued one. Between non-terminal statuses
the later event wins (a reclaimed or retried task is queued again until someone claims it).
"""

from __future__ import annotations

from typing import Final, Literal, TypeGuard, get_args

from events.event import (
    Event,
    TaskCancelled,
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskExpired,
    TaskFailed,
    TaskReclaimed,
    TaskStalled,
    TaskSubmitted,
)
from tasks.payload import Outcome as Outcome

# `submitted`: accepted, and not yet seen by whoever folds (the projector may lag).
TaskStatus = Literal["submitted", "queued", "running", "stalled", "completed", "failed", "dead", "cancelled"]

STATUSES: Final[frozenset[str]] = frozenset(get_args(TaskStatus))
TERMINAL_RANK: Final[dict[str, int]] = {"failed": 1, "dead": 2, "cancelled": 3, "completed": 4}


def is_status(value: str) -> TypeGuard[TaskStatus]:
    """Whether `value` is one of the statuses."""
    return value in STATUSES


def is_terminal(status: str) -> bool:
    """Whether a task in `status` will never run again."""
    return status in TERMINAL_RANK


def settle(current: TaskStatus, new: TaskStatus) -> TaskStatus:
    """The status after `new` is reported for a task in `current` (see the module docstring)."""
    rank = TERMINAL_RANK.get(new)
    if rank is None:
        return current if current in TERMINAL_RANK else new
    return new if TERMINAL_RANK.get(current, 0) < rank else current


def reported(event: Event) -> TaskStatus | None:
    """The status one event reports for its task; None for an event that reports none (a
    duplicate completion, an event about no task)."""
    match event:
        case TaskSubmitted() | TaskReclaimed():
            return "queued"
        case TaskClaimed():
            return "running"
        case TaskCompleted(duplicate=False):
            return "completed"
        case TaskFailed(retryable=True):
            return "queued"
        case TaskFailed():
            return "failed"
        case TaskStalled():
            return "stalled"
        case TaskDeadLettered():
            return "dead"
        case TaskCancelled() | TaskExpired():
            return "cancelled"
    return None


def fold_status(current: TaskStatus, event: Event) -> TaskStatus:
    """`current` after `event`."""
    new = reported(event)
    return current if new is None else settle(current, new)
