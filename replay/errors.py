"""Errors of replay."""

from __future__ import annotations

from events.errors import RouteledgerError


class ReplayError(RouteledgerError):
    """Raised when a replay command cannot run as asked."""


class BadUntilError(ReplayError):
    """Raised when `--until` is neither a stream id nor a time replay understands."""


class ExportError(ReplayError):
    """Raised when the Parquet export cannot write its directory."""


class ArchiveError(ReplayError):
    """Raised when the archive cannot be written or read as asked (its directory, a lease, a mismatch)."""


class SegmentError(ArchiveError):
    """Raised when a segment file the manifest lists is missing, has the wrong size or does not read back."""


class ArchiverBusyError(ArchiveError):
    """Raised when another archiver holds the lease and a one-off run cannot wait for it."""
