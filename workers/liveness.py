"""What a worker last told the ledger about itself, and whether a beat has news.

Design rule 8: the ledger is history, not telemetry. Every beat refreshes the lease; the ledger
gets a WorkerChanged only when the worker's slots, inventory, loaded models or served models differ
from what it last appended (WorkerOnline carries the starting state, without loaded models).
"""

from __future__ import annotations

from collections.abc import Sequence

from events.event import ModelEntry, WorkerChanged, WorkerOnline


def _models(inventory: Sequence[ModelEntry]) -> list[ModelEntry]:
    # A backend may list the same models in another order: that is no change.
    return sorted(inventory, key=lambda m: (m.name, m.digest))


class Liveness:
    """One agent's last word to the ledger about its own state."""

    def __init__(self, worker: str, slots: int, serves: list[str] | None) -> None:
        self.worker = worker
        self.slots = slots
        self.serves = serves
        self._said: tuple[int, list[ModelEntry], list[str], list[str] | None] | None = None

    @property
    def announced(self) -> bool:
        """Whether this life's WorkerOnline is in the ledger (its end must be too)."""
        return self._said is not None

    def online(self, event: WorkerOnline) -> None:
        """The agent appended `event`: that is what the ledger knows now (nothing loaded yet)."""
        self._said = (event.slots, _models(event.inventory), [], event.serves)

    def beat(self, at: int, inventory: Sequence[ModelEntry], loaded: Sequence[str]) -> WorkerChanged | None:
        """The event to append after an inventory refresh, or None when nothing changed.

        The caller appends it and, once it is in the ledger, the agent has said it: the next beat
        compares with it (an append that failed is tried again on the next beat, by `said`)."""
        now = (self.slots, _models(inventory), sorted(set(loaded)), self.serves)
        if now == self._said:
            return None
        return WorkerChanged(
            at=at,
            worker=self.worker,
            slots=self.slots,
            inventory=list(now[1]),
            loaded=list(now[2]),
            serves=self.serves,
        )

    def said(self, event: WorkerChanged) -> None:
        """`event` is in the ledger now."""
        self._said = (event.slots, _models(event.inventory), sorted(set(event.loaded)), event.serves)
