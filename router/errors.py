"""Errors of the router."""

from __future__ import annotations

from events.errors import RouteledgerError


class RouterError(RouteledgerError):
    """Raised when the router cannot make a decision from what it was given."""


class NoHolderError(RouterError):
    """Raised when no live worker holds the model a task needs, so nothing could run it."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"no live worker holds model {digest[:12]}")
        self.digest = digest


class NoModelError(RouterError):
    """Raised when `auto` has no model to choose from for the request's domain."""
