"""Errors of the dispatch layer: submission, waiting on a task, cancelling it, looking it up."""

from __future__ import annotations

from events.errors import RouteledgerError


class ModelNotServedError(RouteledgerError):
    """Raised when no live worker serves the model a request names."""

    def __init__(self, message: str, *, model: str, fleet: object = None) -> None:
        super().__init__(message)
        self.model = model
        self.fleet = fleet


class BenchSetError(RouteledgerError):
    """Raised when the benchmark prompt set is malformed."""
