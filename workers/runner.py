"""The run lifecycle: one task taken off a queue, claimed, generated on the backend, closed.

A run's claim (its lease, TaskClaimed, the cancel check) is on its way while the backend is asked,
and done before anything of the run is written. Its output streams to the task's output stream;
its result, closing events and done chunk are written in full (Redis out of memory is waited out)
before its entry is acknowledged. A run that does not complete ends in workers.endings. A
benchmark or grading run (the background stream) is given up for user work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from dispatch.prefix import held_after, task_chain
from events.clock import LedgerClock
from events.codec import encode_fields, encode_flat
from events.connection import is_oom, send_all
from events.event import TaskClaimed
from events.keys import Keys
from events.ledger import Ledger
from projections.benchset import prompt_by_id
from tasks.lease import Leases
from tasks.payload import EMBED, Chunk, Result, Thought, ToolCall, encode_chunk
from tasks.store import OUTPUT_TTL_MS, Taken, TaskStore, parse_entry
from workers.backend import Backend, Generated
from workers.closing import FinishedRun
from workers.config import WorkerConfig
from workers.crash import crash_here
from workers.endings import Endings
from workers.errors import BackendError, PreemptedError, TaskCancelledError
from workers.heartbeat import Heartbeat
from workers.holdings import Holdings
from workers.runs import Claim, Running, Runs

log = logging.getLogger("routeledger.worker")


# Longest pause between tries of a write Redis refused for lack of memory.
_ROOM_WAIT_MAX_S = 2.0


class Runner:
    """Runs the tasks one worker takes, each in an asyncio task of its own (`Running.task`)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        config: WorkerConfig,
        backend: Backend,
        clock: LedgerClock,
        ledger: Ledger,
        queues: TaskStore,
        leases: Leases,
        holdings: Holdings,
        heartbeat: Heartbeat,
        endings: Endings,
        runs: Runs,
        *,
        background: str,
        eager_lease: bool,
        stopping: asyncio.Event,
        chores: list[asyncio.Task[None]],
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.config = config
        self.name = config.name
        self.backend = backend
        self.clock = clock
        self.ledger = ledger
        self.queues = queues
        self.leases = leases
        self.holdings = holdings
        self.heartbeat = heartbeat
        self.endings = endings
        self.runs = runs
        # This worker's stream of benchmark and grading tasks: its runs are given up for user work.
        self.background = background
        # A speed-aware gate plans with what every worker runs, so the lease says so at once.
        self.eager_lease = eager_lease
        self.stopping = stopping
        # The agent's own background tasks (cancelled when it drains): a malformed entry's rejection.
        self.chores = chores
        # A worker that writes to an inbox never acknowledges a queue entry (its ACL has no XACK or
        # XDEL): the ingest finishes the entry when it moves the event that closes the run.
        self.finishes = not config.inbox
        self._ordinal = 0

    def start(self, queue: str, taken: Taken) -> None:
        entry_id, fields = taken.entry_id, taken.fields
        try:
            entry = parse_entry(queue, entry_id, fields, taken.attempt)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            task = asyncio.create_task(self._reject_malformed(queue, entry_id, fields, str(exc)))
            self.chores.append(task)
            return
        self._ordinal += 1
        run = Running(
            entry=entry, started=time.monotonic(), ordinal=self._ordinal, background=queue == self.background
        )
        if not run.background:
            # User work: no benchmark or grading answer runs beside it.
            self._preempt()
        self.runs.running[entry_id] = run
        run.task = asyncio.create_task(self._run(run), name=f"task-{entry.task.task_id}")

    def _preempt(self) -> None:
        """Give up every background run for user work: each stops at its next read of the backend
        (cancelled at once when it is awaiting one; its backend request is closed, which frees the
        server's slot) and goes back to the background stream. A run whose backend has answered
        finishes: its sample is taken."""
        for run in self.runs.running.values():
            if not run.background or run.preempted or run.answered or run.closing:
                continue
            log.info(
                "task %s (%s) gives its slot to user work; it runs again later",
                run.entry.task.task_id,
                "grading" if prompt_by_id(run.entry.task.bench_prompt or "") else "benchmark",
            )
            run.preempted = True
            if run.reading and run.task is not None:
                run.task.cancel()

    async def watch_cancels(self) -> None:
        """Stop every run whose client withdrew its task, within `cancel_check_ms`.

        A run looks at its cancel key itself only between the backend's pieces, and a backend still
        evaluating a long prompt sends none for minutes: it would run on for nobody until its
        timeout, and a timeout is retryable. So one loop asks about every run at once (one round
        trip), marks each withdrawn one `cancelled`, and cancels a run awaiting its backend, which
        closes the backend request and frees the server's slot."""
        pause = self.config.cancel_check_ms / 1000
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), pause)
            watched = [
                run
                for run in self.runs.running.values()
                if not (run.cancelled or run.closing or run.answered or run.background)
            ]
            if not watched:
                continue
            try:
                asked = await self.queues.cancels_asked([run.entry.task.task_id for run in watched])
            except (RedisError, OSError) as exc:
                log.debug("could not read cancel keys (%s); asking again next round", exc)
                continue
            for run, cancel in zip(watched, asked, strict=True):
                if not cancel or run.closing or run.answered:
                    continue
                log.info("task %s: its client withdrew it; stopping its run", run.entry.task.task_id)
                run.cancelled = True
                if run.reading and run.task is not None:
                    run.task.cancel()

    async def _reject_malformed(
        self, queue: str, entry_id: str, fields: dict[bytes, bytes], reason: str
    ) -> None:
        log.error("entry %s on %s is not a task (%s); dead-lettering it", entry_id, queue, reason)
        await self.queues.dead_letter(queue, entry_id, fields, f"malformed entry: {reason}")
        if self.finishes:
            await self.queues.finish(queue, entry_id, self.name)
        # Else it stays pending, unrun: the reaper takes it back after two leases, and past the
        # delivery limit dead-letters and finishes it.

    async def _run(self, run: Running) -> None:
        entry = run.entry
        task = entry.task
        try:
            # The deadline is the submitting API's time: compared on the ledger's clock, not this one.
            if task.deadline_ms is not None and await self.clock.now_ms() > task.deadline_ms:
                await self.endings.expire(run, task.deadline_ms)
                return
            local = self.holdings.local_name(task.digest)
            if local is None:
                await self.endings.fail(
                    run,
                    BackendError("model_missing", f"{self.name} does not serve {task.model}", retryable=True),
                )
                return
            crash_here("claim", run.ordinal)
            if task.kind != EMBED:
                # Before the lease below: it must not show the slot this run takes as holding
                # what it held before.
                run.slot = self.holdings.slots.start(task.digest, task.prefix or task_chain(task))
            # One round trip: the lease that now lists this task, the claim, and the cancel check.
            # The lease goes first: a worker woken by the TaskClaimed reads it up to date. It is on
            # its way while the backend is asked, and done before anything of the run is written.
            sent = time.monotonic()
            claimed = TaskClaimed(
                task_id=task.task_id,
                worker=self.name,
                digest=task.digest,
                attempt=entry.attempt,
                queue=entry.queue,
                entry_id=entry.entry_id,
                in_flight=len(self.runs.running),
            )
            cancel_key = self.keys.cancel(task.task_id)
            commands: list[tuple[Any, ...]] = []
            lease = (
                self.leases.put_command(self.heartbeat.info(), self.config.lease_ms)
                if self.eager_lease
                else None
            )
            if not self.eager_lease or lease is not None:
                if lease is not None:
                    commands.append(lease)
                commands.append(("XADD", self.ledger.appends_to, "*", *encode_flat(claimed)))
                commands.append(("EXISTS", cancel_key))
                replies = send_all(self.redis, commands, raise_on_error=True)
            else:
                # The lease script cannot be sent as a plain command yet (events.scripts.Script.command).
                pipe = self.redis.pipeline(transaction=False)
                await self.leases.put_in(pipe, self.heartbeat.info(), self.config.lease_ms)
                pipe.xadd(self.ledger.appends_to, encode_fields(claimed))  # type: ignore[arg-type]
                pipe.exists(cancel_key)
                replies = pipe.execute()
            claim = Claim(
                asyncio.ensure_future(replies),
                sent,
                task.task_id,
                self.heartbeat.claimed if self.eager_lease else None,
            )
            run.claim = claim
            await self._generate(run, local)
            self.endings.failures = 0
        except TaskCancelledError:
            # Stopped by `watch_cancels` while the backend evaluated the prompt, its claim may not
            # be settled yet: its TaskClaimed goes in before the TaskFailed that ends the run.
            with contextlib.suppress(RedisError, OSError, TaskCancelledError):
                await run.settle_claim()
            await self.endings.cancelled(run)
        except PreemptedError:
            await self.endings.hand_back_preempted(run)
        except BackendError as exc:
            try:
                await run.settle_claim()
            except TaskCancelledError:
                await self.endings.cancelled(run)
            else:
                await self.endings.fail(run, exc)
        except asyncio.CancelledError:
            # Shut down mid-run: hand the task back for another worker.
            with contextlib.suppress(RedisError, OSError, TaskCancelledError):
                await run.settle_claim()
            with contextlib.suppress(RedisError, OSError):
                why = "lost its lease" if run.lost else "shut down"
                await self.endings.requeue_run(run, f"worker {self.name} {why} mid-run", interrupted=True)
            raise
        except (RedisError, OSError) as exc:
            # The entry stays pending for us; if we die, the reaper reclaims it.
            log.error("task %s: Redis failed mid-run (%s); leaving the entry pending", task.task_id, exc)
        finally:
            if run.claim is not None:
                run.claim.discard()
            if run.slot is not None:
                # Ended without an answer: what the slot holds now is not known.
                self.holdings.slots.finish(task.digest, run.slot, None)
            if run.background:
                self.runs.background_ended = time.monotonic()
            self.runs.running.pop(entry.entry_id, None)
            self.runs.freed.set()
            if self.eager_lease and not self.stopping.is_set():
                with contextlib.suppress(RedisError, OSError):
                    await asyncio.wait_for(self.heartbeat.write(), self.config.heartbeat_ms / 1000)

    async def _generate(self, run: Running, local: str) -> None:
        entry = run.entry
        task = entry.task
        out_key = self.queues.out_key(task.task_id)
        cancel_key = self.keys.cancel(task.task_id)
        pieces: list[str] = []
        buffer: list[str] = []
        # Tool calls the model made, and those not written to the output yet.
        calls: list[ToolCall] = []
        unsent_calls: list[ToolCall] = []
        # The model's thinking, and what of it is not written to the output yet.
        thoughts: list[str] = []
        unsent_thoughts: list[str] = []
        t0 = time.perf_counter()
        # Decided before the run, from what the backend last listed as loaded (workers.warmth).
        cold = self.holdings.warmth.before(task.digest, self.holdings.inventory)
        alone = len(self.runs.running) <= 1
        ttft_ms: float | None = None
        last_flush = 0.0
        last_cancel_check = t0
        generated: Generated | None = None
        held: list[bool] = []  # output flushes Redis refused for lack of memory (logged once)

        async def flush(final: Chunk | None = None) -> None:
            await run.settle_claim()
            commands: list[tuple[Any, ...]] = []
            if buffer or unsent_calls or unsent_thoughts:
                piece = Chunk(
                    attempt=entry.attempt,
                    text="".join(buffer),
                    run=run.run_id,
                    tool_calls=list(unsent_calls) or None,
                    thinking="".join(unsent_thoughts),
                )
                commands.append(("XADD", out_key, "*", "c", encode_chunk(piece)))
            if final is not None:
                commands.append(("XADD", out_key, "*", "c", encode_chunk(final)))
            commands.append(("PEXPIRE", out_key, OUTPUT_TTL_MS))
            try:
                await send_all(self.redis, commands, raise_on_error=True)
            except ResponseError as exc:
                if final is not None or not is_oom(exc):
                    raise
                # Redis is at its memory limit: keep the text; a later flush or the close writes it.
                if not held:
                    log.warning("task %s: Redis is out of memory for its output; holding it", task.task_id)
                held.append(True)
                return
            buffer.clear()
            unsent_calls.clear()
            unsent_thoughts.clear()

        stream = self.backend.generate(task, local)
        try:
            while True:
                item = await self._read(run, stream)
                if item is None:
                    break
                if isinstance(item, Generated):
                    generated = item
                    # The backend has answered: the run finishes, whatever work comes now.
                    run.answered = True
                    break
                now = time.perf_counter()
                if ttft_ms is None:
                    ttft_ms = (now - t0) * 1000
                    run.prompt_done = True
                    # A task cancelled before its claim stops at its first token, streamed or not.
                    await run.settle_claim()
                if isinstance(item, list):
                    # Whole calls, which the client acts on: written at once. Calls a refused
                    # write held back still reach the client, from the result (Gateway.relay).
                    calls += item
                    unsent_calls += item
                    if task.stream:
                        await flush()
                        last_flush = now
                    continue
                run.pieces += 0 if isinstance(item, list) else 1
                if isinstance(item, Thought):
                    thoughts.append(item.text)
                    unsent_thoughts.append(item.text)
                    opening = len(thoughts) == 1
                else:
                    pieces.append(item)
                    buffer.append(item)
                    opening = len(pieces) == 1
                if task.stream and (opening or (now - last_flush) * 1000 >= self.config.flush_ms):
                    await flush()
                    last_flush = now
                    crash_here("stream", run.ordinal)
                if (now - last_cancel_check) * 1000 >= self.config.cancel_check_ms:
                    last_cancel_check = now
                    if await self.redis.exists(cancel_key):
                        raise TaskCancelledError(task.task_id)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        if generated is None:
            raise BackendError("disconnect", "the backend stream ended early", retryable=True)
        if unsent_thoughts and task.stream:
            # Thinking goes out before the closing text (a refused write reaches the client from
            # the result: Gateway.relay).
            await flush()
        wall_ms = (time.perf_counter() - t0) * 1000
        reported = generated.timings
        if (
            run.slot is not None
            and self.holdings.slots.hit(task.digest, run.slot) > 0
            and reported.prompt_eval_cached_count is None
            and reported.prompt_eval_count is not None
        ):
            # This run should have found its prefix cached, and the backend does not say how
            # much it did (Ollama's count includes cached tokens, with or without saying so): its
            # prompt time is no prompt speed sample. Recorded as all cached, which leaves it out.
            reported = msgspec.structs.replace(reported, prompt_eval_cached_count=reported.prompt_eval_count)
        cold, timings = self.holdings.warmth.after(
            task.digest,
            cold,
            reported,
            alone=alone and len(self.runs.running) <= 1,
            prompt_tokens=task.prompt_tokens,
        )
        if timings is not generated.timings:
            generated = msgspec.structs.replace(generated, timings=timings)
        text = "".join(pieces)
        if run.slot is not None:
            holds = held_after(task, text, calls)
            self.holdings.slots.finish(task.digest, run.slot, holds)
            run.slot, run.answered = None, True
            if holds is not None and self.eager_lease:
                # The lease says what the slot holds before the answer reaches the client: a
                # chat's next turn, sent at once, is planned with it.
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await asyncio.wait_for(self.heartbeat.write(), self.config.heartbeat_ms / 1000)
        result = Result(
            task_id=task.task_id,
            status="completed",
            worker=self.name,
            attempt=entry.attempt,
            text=text,
            timings=generated.timings,
            ttft_ms=ttft_ms,
            wall_ms=wall_ms,
            done_reason=generated.done_reason,
            run=run.run_id,
            tool_calls=calls or None,
            thinking="".join(thoughts),
            embeddings=generated.embeddings,
        )
        done = Chunk(attempt=entry.attempt, done=True, run=run.run_id)
        # The last text piece and the result in one round trip. A run that lost its entry (the
        # reaper took it back) stores its result only over a dead letter: then it is the task's
        # completion; otherwise the task's new run answers.
        await run.settle_claim()
        rest = "".join(buffer)
        buffer.clear()
        if not task.stream:
            # Nobody streams it: its whole text goes out with the done chunk, so that a reader (a
            # waiting client, or a pipeline relaying it) wakes once, not for a text chunk and again
            # for the done chunk. The outcome is stored first all the same (close_run).
            done = Chunk(attempt=entry.attempt, done=True, run=run.run_id, text=rest)
            rest = ""
        finished = FinishedRun(
            worker=self.name,
            task=task,
            attempt=entry.attempt,
            generated=generated,
            text=text,
            ttft_ms=ttft_ms,
            wall_ms=wall_ms,
            in_flight=len(self.runs.running),
            cold=cold,
        )

        def at(step: str) -> None:
            crash_here(step, run.ordinal)
            if step == "ack":
                run.closing = True

        # Outcome, closing events and done chunk written in full (Redis out of memory is waited out:
        # the result stays here, the entry pending and kept alive); only then the acknowledgement.
        closed = await self.queues.complete(
            result,
            rest=rest,
            done=done,
            closing=lambda counts: finished.closing_events(counts=counts),
            entry=entry,
            owner=self.name,
            acknowledge=self.finishes,
            lost=run.lost,
            wait_for_room=lambda what, rounds: self._wait_for_room(task.task_id, what, rounds),
            at=at,
        )
        if closed.acked == 0 and closed.counts:
            log.warning(
                "task %s completed on %s after it was dead-lettered: the completion counts",
                task.task_id,
                self.name,
            )
        elif closed.acked == 0:
            log.warning(
                "entry %s on %s was reclaimed while we ran it; this completion is a duplicate",
                entry.entry_id,
                entry.queue,
            )

    async def _read(
        self, run: Running, stream: AsyncIterator[str | Thought | list[ToolCall] | Generated]
    ) -> str | Thought | list[ToolCall] | Generated | None:
        """The backend's next piece (None at its end). A background run given up for user work
        stops here, before or during the read (PreemptedError), and nowhere else."""
        if run.preempted:
            raise PreemptedError(run.entry.task.task_id)
        if run.cancelled:
            raise TaskCancelledError(run.entry.task.task_id)
        run.reading = True
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            # Read again: `_preempt` sets it from another task while this one awaits.
            if run.given_up() and not self.stopping.is_set() and current is not None:
                # Cancelled by `_preempt`, not by a shutdown: the run hands its task back.
                current.uncancel()
                raise PreemptedError(run.entry.task.task_id) from None
            if run.withdrawn() and not self.stopping.is_set() and current is not None:
                # Cancelled by `watch_cancels`: its client withdrew the task.
                current.uncancel()
                raise TaskCancelledError(run.entry.task.task_id) from None
            raise
        finally:
            run.reading = False

    async def _wait_for_room(self, task_id: str, what: str, rounds: int) -> None:
        """Pause before writing again what Redis refused for lack of memory: the run keeps its result,
        and its entry stays pending and kept alive (XCLAIM needs no memory), so nothing is lost."""
        if rounds == 1:
            log.warning(
                "task %s: Redis is at its memory limit (OOM) and refused its %s; keeping it and retrying "
                "until there is room (run `routeledger archive` or raise redis_maxmemory)",
                task_id,
                what,
            )
        await asyncio.sleep(min(_ROOM_WAIT_MAX_S, 0.05 * 2**rounds))
