"""Errors of the simulators."""

from __future__ import annotations

from events.errors import RouteledgerError


class FleetError(RouteledgerError):
    """Raised when a fleet preset or file is missing or malformed."""
