"""This worker's pinned stream (tasks handed to it by name) and where it was last found empty.

Consumption looks at the stream when something may be there; a run handed back to it (re-queued)
wakes no read, so the run lifecycle says so here and the next take looks again.
"""

from __future__ import annotations


class PinnedStream:
    """The pinned stream's key, and the cursor of the last look that found it empty."""

    def __init__(self, key: str) -> None:
        self.key = key
        # The stream's cursor after the last look that found it empty (None: look next time).
        self.cursor: str | None = None
        # When that look was (monotonic).
        self.looked = 0.0

    def handed_back(self) -> None:
        """An entry was re-queued to the stream: it wakes nobody, so the next take looks at it."""
        self.cursor = None
