"""A test hook, off by default: kill -9 the worker process at an exact step of an exact task.

`ROUTELEDGER_TEST_CRASH=POINT@N` makes the worker kill itself at POINT of the N-th task it runs,
so that the reliability suite can crash it at a chosen step rather than at whatever moment an
outside kill happens to land. POINT is one of:

    claim   the entry is delivered, TaskClaimed not yet appended
    stream  the first output chunk is written, the generation goes on
    result  the result is stored, TaskCompleted not yet appended
    ack     TaskCompleted is appended, the entry not yet acknowledged

Never set it outside tests.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Final

TEST_CRASH_ENV: Final = "ROUTELEDGER_TEST_CRASH"
CRASH_POINTS: Final = ("claim", "stream", "result", "ack")


def _crash_plan(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    point, _, nth = spec.partition("@")
    if point not in CRASH_POINTS or not nth.isdigit():
        raise ValueError(f"{TEST_CRASH_ENV}={spec!r}: expected POINT@N with POINT in {CRASH_POINTS}")
    return point, int(nth)


_CRASH_PLAN: Final = _crash_plan(os.environ.get(TEST_CRASH_ENV))


def crash_armed(point: str, ordinal: int) -> bool:
    """True if the hook will kill this process at `point` of task #`ordinal`."""
    return _CRASH_PLAN is not None and (point, ordinal) == _CRASH_PLAN


def crash_here(point: str, ordinal: int) -> None:
    """Kill -9 this process if the hook's plan says so (a no-op when the variable is unset)."""
    if crash_armed(point, ordinal):
        sys.stderr.write(f"routeledger test hook: kill -9 at {point} of task #{ordinal}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
