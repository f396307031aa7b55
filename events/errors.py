"""Errors of the events layer, and the base class every routeledger error derives from."""

from __future__ import annotations


class RouteledgerError(Exception):
    """Raised when anything in routeledger fails in a way the caller should handle; the base of all errors."""


class LedgerError(RouteledgerError):
    """Raised when a ledger operation is malformed or meets an entry it cannot use (Redis's own errors,
    an unreachable or full Redis among them, pass through as they are)."""


class UndecodableEntryError(LedgerError):
    """Raised when a stream entry is not a valid event: garbage bytes, a missing field or an unknown type."""

    def __init__(self, entry_id: str, reason: str, fields: dict[bytes, bytes] | None = None) -> None:
        super().__init__(f"entry {entry_id} is not a valid event: {reason}")
        self.entry_id = entry_id
        self.reason = reason
        # Kept so that the projector can dead-letter the raw entry as it was.
        self.fields = fields or {}


class RedisUrlError(RouteledgerError):
    """Raised when a Redis URL's TLS settings cannot work: TLS files on a plain redis:// URL, or a
    CA, certificate or key file that cannot be read."""


class ScriptLibraryError(RouteledgerError):
    """Raised when Redis lacks the routeledger functions of this version and the caller may not load them."""
