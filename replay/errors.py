"""Errors of replay."""

from __future__ import annotations

from events.errors import RouteledgerError


class ReplayError(RouteledgerError):
    """Raised when a replay command cannot run as asked."""


class BadUntilError(ReplayError):
    """Raised when `--until` is neither a stream id nor a time replay understands."""


class ExportError(ReplayError):
    """Raised when the Parquet export cannot write its directory."""
