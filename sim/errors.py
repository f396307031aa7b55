"""Errors of the simulators."""

from __future__ import annotations

from events.errors import RouteledgerError


class FleetError(RouteledgerError):
    """Raised when a fleet preset or file is missing or malformed."""


class SimHostError(RouteledgerError):
    """Raised when a simulated host is asked for something it does not have."""


class UnknownModelError(SimHostError):
    """Raised when a request names a model the machine does not hold."""


class BadRequestError(SimHostError):
    """Raised when a request body is not what a simulated endpoint takes."""


class CapabilityError(BadRequestError):
    """Raised when a request asks a model for something its capabilities lack (tools, images, …)."""


class MixError(RouteledgerError):
    """Raised when a workload mix (a `[[class]]` TOML file or a shipped name) is missing or malformed."""
