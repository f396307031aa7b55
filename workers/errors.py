"""Errors of the worker agent."""

from __future__ import annotations

from events.errors import RouteledgerError


class BackendError(RouteledgerError):
    """Raised when a backend call fails; `kind` names the failure, `retryable` whether a rerun may work."""

    def __init__(self, kind: str, message: str, *, retryable: bool) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.retryable = retryable
        self.message = message


class WorkerNameTakenError(RouteledgerError):
    """Raised when a live worker with the same name already holds the lease."""


class TaskCancelledError(RouteledgerError):
    """Raised inside a run when the client withdrew the task."""


class PreemptedError(RouteledgerError):
    """Raised inside a benchmark or grading run when user work takes its slot: the run stops at its
    next read of the backend and its task goes back to the worker's background stream."""
