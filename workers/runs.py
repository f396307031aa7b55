"""The tasks a worker is running: each run as the agent keeps it, its claim, and the set of them.

Every part of the agent reads the set (the lease lists it, the heartbeat keeps its entries alive,
consumption counts its free slots, benchmarking waits for quiet); only the run lifecycle
(workers.runner) adds and removes runs.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from collections.abc import Callable
from typing import Any

import msgspec

from events.event import now_ms
from tasks.store import QueueEntry
from workers.errors import TaskCancelledError


class Claim:
    """A run's claim round trip (its lease, TaskClaimed, the cancel check), sent while the backend
    is asked: it must be done before anything of the run is written, and says whether the task
    was cancelled before it started."""

    def __init__(
        self,
        sent: asyncio.Future[list[Any]],
        at: float,
        task_id: str,
        lease_renewed: Callable[[Any, float], None] | None,
    ) -> None:
        self._sent = sent
        self._at = at
        self._task_id = task_id
        # Where the round trip carried the lease (an eager lease), its reply and when it was sent.
        self._lease_renewed = lease_renewed
        self._done = False

    async def settle(self) -> None:
        """Wait for the claim (once); raise TaskCancelledError when the task was cancelled first."""
        if self._done:
            return
        self._done = True
        replies = await self._sent
        if self._lease_renewed is not None:
            self._lease_renewed(replies[0], self._at)
        if replies[-1]:
            raise TaskCancelledError(self._task_id)

    def discard(self) -> None:
        """The run ended without waiting for its claim (it failed first): its failure, if any, is
        taken here and not reported as never retrieved."""
        if not self._done:
            self._done = True
            self._sent.add_done_callback(lambda f: f.cancelled() or f.exception())


class Running(msgspec.Struct, kw_only=True):
    """A task this worker is running."""

    entry: QueueEntry
    started: float
    started_at_ms: int = msgspec.field(default_factory=now_ms)
    task: asyncio.Task[None] | None = None
    lost: bool = False
    # The run is closing (acknowledging or settling its entry): the heartbeat leaves its entry alone.
    closing: bool = False
    # 1 for the first task this process runs, and so on (for the test crash hook).
    ordinal: int = 0
    # This run's nonce: its output chunks and result carry it, so no relay mixes two runs.
    run_id: str = msgspec.field(default_factory=lambda: secrets.token_hex(4))
    # Its claim, on its way while the backend is asked (None: not sent yet).
    claim: Claim | None = None
    # What the backend has produced so far: whether the first token came (the prompt was
    # evaluated), and the text and thinking pieces it streamed (one a token, as backends stream).
    # A cancelled run reports them, and its API key is charged for them (Projector._charge).
    prompt_done: bool = False
    pieces: int = 0
    # The backend slot it runs in, as this worker models them (workers.slots; None: none, or done).
    slot: int | None = None
    # The backend has answered: its slot is free, though the run still writes what it made.
    answered: bool = False
    # A benchmark or grading answer (from the worker's background stream): given up for user work.
    background: bool = False
    # Given up for user work: it stops at its next read of the backend (PreemptedError) and goes
    # back to the background stream for later.
    preempted: bool = False
    # It is awaiting its backend's next piece: the only place a preemption cancels it, so that no
    # write of the run (its claim, its result, its events) is ever cut in two.
    reading: bool = False
    # Its client withdrew the task (the cancel key was seen while it ran): it stops at its next
    # read of the backend, or at once when awaiting one, and its entry is finished, never re-queued.
    cancelled: bool = False

    def given_up(self) -> bool:
        """Whether the run was given up for user work (`preempted`)."""
        return self.preempted

    def withdrawn(self) -> bool:
        """Whether its client withdrew the task while it ran (`cancelled`)."""
        return self.cancelled

    async def settle_claim(self) -> None:
        """`Claim.settle` of this run's claim, where one was sent."""
        if self.claim is not None:
            await self.claim.settle()


class Runs:
    """The runs of one worker, by entry id, and what the other parts wait on or read of them."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.running: dict[str, Running] = {}
        # Set when a run ends: a worker whose slots were all busy may take again.
        self.freed = asyncio.Event()
        # When the last benchmark or grading run ended (monotonic).
        self.background_ended = -math.inf

    def free_slots(self) -> int:
        """Slots free for user work: a benchmark or grading run holds none (it is given up)."""
        return max(0, self.slots - sum(1 for r in self.running.values() if not r.background))

    def background_free(self) -> bool:
        """Whether a background task may start: the worker runs nothing (one answer at a time, and
        never beside user work, which it would slow down on a machine with several slots)."""
        return not self.running
