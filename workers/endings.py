"""How a run ends when it does not complete: failed, cancelled, expired, given up, handed back.

Each records what happened (TaskFailed, TaskExpired, the task's result) and finishes or re-queues
the run's entry (dead-lettered past its delivery limit). A backend that fails for reasons of its
own makes the worker step back from shared work for a while (`cooldown_until`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from redis.exceptions import RedisError

from events.clock import LedgerClock
from events.event import TaskExpired, TaskFailed, Timings
from events.ledger import Ledger
from projections.status import Outcome
from tasks.payload import Result
from tasks.store import Requeue, TaskStore, parse_entry
from workers.config import WorkerConfig
from workers.errors import BackendError, TaskCancelledError
from workers.heartbeat import Heartbeat
from workers.holdings import Holdings
from workers.pinned import PinnedStream
from workers.runs import Running

log = logging.getLogger("routeledger.worker")

# A background task given up for user work goes back to its stream: it may be given up this many
# times before it is dead-lettered (a machine that is never idle for long is never benchmarked).
_PREEMPT_LIMIT = 100


class Endings:
    """Closes one worker's runs that did not complete, and re-queues what a previous life left."""

    def __init__(
        self,
        config: WorkerConfig,
        clock: LedgerClock,
        ledger: Ledger,
        queues: TaskStore,
        holdings: Holdings,
        heartbeat: Heartbeat,
        pinned: PinnedStream,
        background: str,
    ) -> None:
        self.config = config
        self.name = config.name
        self.clock = clock
        self.ledger = ledger
        self.queues = queues
        self.holdings = holdings
        self.heartbeat = heartbeat
        self.pinned = pinned
        # This worker's stream of benchmark and grading tasks.
        self.background = background
        # A worker that writes to an inbox never acknowledges a queue entry (its ACL has no XACK or
        # XDEL): the ingest finishes the entry when it moves the event that closes the run.
        self.finishes = not config.inbox
        # Failures in a row that may be this machine's, and the cooldown they set (monotonic).
        self.failures = 0
        self.cooldown_until = 0.0

    async def fail(self, run: Running, exc: BackendError) -> None:
        entry = run.entry
        log.warning("task %s attempt %d failed on %s: %s", entry.task.task_id, entry.attempt, self.name, exc)
        # A run its client withdrew ends cancelled whatever stopped it: a retryable failure would
        # re-queue it, and it would run again for nobody (a timeout of a prompt the client gave
        # up on, the stream of a backend that died after the client was told to retry).
        withdrawn = exc.retryable and await self.withdrawn(run)
        if not withdrawn:
            await self.record_failure(run, exc.kind, exc.retryable, exc.message)
        if exc.kind not in ("model_missing", "bad_request", "unsupported"):
            # The backend misbehaves (it did not refuse the request itself): step back from shared
            # work for a while so others take it.
            self.failures += 1
            pause = min(self.config.max_cooldown_s, self.config.cooldown_s * 2 ** (self.failures - 1))
            self.cooldown_until = time.monotonic() + pause
        if exc.kind == "unsupported":
            # The server cannot do this for the model (a 501): say so in the lease before the
            # client hears, so that the next such request is refused at submission.
            self.holdings.refused(entry.task)
        if withdrawn:
            await self.cancelled(run, ended=f"{exc.kind}: {exc.message[:200]}")
            return
        if exc.retryable:
            run.closing = True
            if entry.task.stream and run.prompt_done:
                # Before the re-queue, so that a relay that passed on this run's text hears of it
                # first (Gateway.relay), and withdraws the task before another worker takes it.
                with contextlib.suppress(RedisError, OSError):
                    await self.queues.break_output(
                        entry.task.task_id, entry.attempt, run.run_id, f"{exc.kind}: {exc.message[:200]}"
                    )
            await self.requeue_run(run, f"{exc.kind}: {exc.message[:200]}")
            return
        await self.settle(run, "failed", str(exc), refused=exc.kind in ("bad_request", "unsupported"))

    async def hand_back_preempted(self, run: Running) -> None:
        """A run given up for user work: its claim settled, its reason recorded, its task back in
        the background stream."""
        with contextlib.suppress(RedisError, OSError, TaskCancelledError):
            await run.settle_claim()
        with contextlib.suppress(RedisError, OSError):
            await self.record_failure(run, "preempted", True, "gave its slot to user work; runs again later")
            run.closing = True
            await self.requeue_run(run, "preempted by user work")

    async def withdrawn(self, run: Running) -> bool:
        """Whether the run's client withdrew its task (seen while it ran, or asked now)."""
        return run.withdrawn() or await self.queues.cancel_asked(run.entry.task.task_id)

    async def cancelled(self, run: Running, *, ended: str = "") -> None:
        """A run whose client withdrew its task: recorded as cancelled (with how the run `ended`,
        when something else stopped it first), its entry finished, never re-queued."""
        log.info("task %s cancelled by its client", run.entry.task.task_id)
        task = run.entry.task
        # Charged to the task's key (Projector._charge): the prompt (as estimated at submission:
        # the backend reports its count only at the end) once the first token showed the backend
        # had evaluated it, and every piece of output generated.
        done = Timings(
            prompt_eval_count=task.prompt_tokens if run.prompt_done else None,
            eval_count=run.pieces or None,
            counted="stream" if run.pieces else None,
        )
        message = "cancelled by the client" + (f"; its run ended first: {ended}" if ended else "")
        await self.record_failure(run, "cancelled", False, message, done)
        await self.settle(run, "cancelled", "cancelled")

    async def record_failure(
        self, run: Running, kind: str, retryable: bool, message: str, timings: Timings | None = None
    ) -> None:
        entry = run.entry
        await self.ledger.append(
            TaskFailed(
                task_id=entry.task.task_id,
                worker=self.name,
                digest=entry.task.digest,
                attempt=entry.attempt,
                kind=kind,
                retryable=retryable,
                message=message[:500],
                timings=timings or Timings(),
            )
        )

    async def settle(self, run: Running, status: Outcome, error: str, *, refused: bool = False) -> None:
        """A final outcome without a completion: record it, close the output, finish the entry."""
        entry = run.entry
        task_id = entry.task.task_id
        if self.holdings.stale.is_set():
            # What the backend refused reaches the lease before the client's answer does.
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await self.holdings.refresh()
                await asyncio.wait_for(self.heartbeat.write(), self.config.heartbeat_ms / 1000)
        await self.queues.record_result(
            Result(
                task_id=task_id,
                status=status,
                worker=self.name,
                attempt=entry.attempt,
                error=error,
                refused=refused,
            )
        )
        await self.queues.end_output(task_id, entry.attempt, error)
        run.closing = True
        if self.finishes:
            await self.queues.finish(entry.queue, entry.entry_id, self.name)

    async def expire(self, run: Running, deadline: int) -> None:
        """A task taken after its `deadline`: nobody waits for it any more, so it never runs."""
        entry = run.entry
        task = entry.task
        now = await self.clock.now_ms()
        late = now - deadline
        log.info(
            "task %s expired %.1fs before %s took it; not running it", task.task_id, late / 1000, self.name
        )
        await self.ledger.append(
            TaskExpired(
                task_id=task.task_id,
                queue=entry.queue,
                worker=self.name,
                deadline=deadline,
                entry_id=entry.entry_id,
                waited_ms=max(0, now - task.submitted_at),
            )
        )
        await self.settle(
            run, "cancelled", f"expired: its deadline passed {late / 1000:.1f}s before a worker took it"
        )

    async def requeue_run(self, run: Running, reason: str, *, interrupted: bool = False) -> None:
        """Put the run's entry back in its queue as its next attempt (dead-lettered past its
        delivery limit, with `reason`); a task its client withdrew is finished as cancelled instead.
        An `interrupted` run (this worker shut down or died, nothing failed) has no failure in the
        ledger yet: it gets one, retryable, with `reason`, ahead of the next attempt's claim, so
        that every re-run's history says why it ran again."""
        entry = run.entry
        if await self.withdrawn(run):
            await self.cancelled(run, ended=reason)
            return
        if interrupted:
            await self.record_failure(run, "interrupted", True, reason)
        moved = await self.queues.requeue(
            entry.queue,
            entry.entry_id,
            delivery_limit=self.delivery_limit(entry.queue),
            owner=self.name,
            attempt=entry.attempt,
        )
        await self.after_requeue(entry.queue, entry.entry_id, moved, reason)

    def delivery_limit(self, queue: str) -> int:
        """How many deliveries an entry of `queue` may have: a background task's are spent by
        preemptions as well as failures, so it has more."""
        return _PREEMPT_LIMIT if queue == self.background else self.config.delivery_limit

    async def after_requeue(self, queue: str, entry_id: str, moved: Requeue, reason: str) -> None:
        """Dead-letter a task whose deliveries are spent; log anything odd."""
        if queue == self.pinned.key:
            self.pinned.handed_back()  # a re-queued entry wakes nobody: look at it next time
        if not await self.queues.settle_requeue(
            queue, entry_id, moved, reason, self.delivery_limit(queue), finish=self.finishes
        ):
            log.warning(
                "could not re-queue %s on %s (status %s): it was no longer ours",
                entry_id,
                queue,
                moved.status,
            )

    async def recover_own_pending(self) -> None:
        """Entries this name still owns are from a previous life that died: put them back now, but for
        runs it closed whose entry the ingest has yet to finish."""
        queues = [self.pinned.key, self.background]
        for digest in sorted({m.digest for m in self.holdings.serving()}):
            queues += await self.queues.band_queues(digest)
        for queue in queues:
            for pending in await self.ledger.pending(queue, consumer=self.name, count=1000):
                if not self.finishes and await self.queues.closed(
                    queue, pending.entry_id, self.name, pending.deliveries
                ):
                    continue
                fields = await self.queues.entry(queue, pending.entry_id)
                try:
                    left = parse_entry(queue, pending.entry_id, fields or {}, pending.deliveries)
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                    left = None
                if left is not None:
                    # A run cut off by this worker's death: re-queued with its reason in the
                    # ledger (or finished, when its client withdrew it meanwhile).
                    log.warning(
                        "re-queuing %s (task %s) left by a previous run of %s",
                        pending.entry_id,
                        left.task.task_id,
                        self.name,
                    )
                    await self.requeue_run(
                        Running(entry=left, started=time.monotonic()),
                        f"worker {self.name} restarted; its run of attempt {left.attempt} was cut off",
                        interrupted=True,
                    )
                    continue
                # Not a task (or gone): re-queued as it is, for the reaper or a take to settle.
                moved = await self.queues.requeue(
                    queue,
                    pending.entry_id,
                    delivery_limit=self.delivery_limit(queue),
                    owner=self.name,
                    attempt=pending.deliveries,
                )
                log.warning(
                    "re-queued %s (task %s) left by a previous run of %s",
                    pending.entry_id,
                    moved.task_id,
                    self.name,
                )
                await self.after_requeue(queue, pending.entry_id, moved, "worker restarted")
