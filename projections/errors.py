"""Errors of the projections layer."""

from __future__ import annotations

from events.errors import RouteledgerError


class ProjectionError(RouteledgerError):
    """Raised when the projection tables cannot be read or written as the layout expects."""


class LeaseLostError(ProjectionError):
    """Raised when the projector finds that another instance holds the lease or owns the namespace."""


class NoProjectionError(ProjectionError):
    """Raised when a reader needs the projection tables and none is live yet (no `rl:p:current`)."""


class BenchSetError(RouteledgerError):
    """Raised when the benchmark prompt set is malformed."""
