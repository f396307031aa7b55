"""Where clients of the fleet meet Redis: submit, wait, relay, cancel, look up a task.

The HTTP surfaces (native, OpenAI, Ollama) and pipelines turn their requests into a TaskMessage
and their responses out of a Result or a relayed stream; nothing here knows any wire format, and
every error is a dispatch error that each surface renders in its own shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ClusterDownError, RedisError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from dispatch.errors import (
    DispatchError,
    ModelNotServedError,
    RedisUnavailableError,
    TaskFailedError,
    TaskFinishedError,
    TaskLostError,
    TaskNotFoundError,
    TaskRefusedError,
    TaskTimeoutError,
)
from dispatch.memory import MemoryWatch, full_error
from dispatch.serving import find_holders, require_model
from dispatch.submit import Submitted, route_and_submit
from dispatch.view import LiveView
from events.codec import as_str
from events.connection import is_oom
from events.event import Event, TaskCancelled, TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from projections.errors import ProjectionError
from projections.index import Found, task_events
from projections.reader import get_task
from projections.snapshot import TaskRow
from projections.status import TaskStatus, is_terminal, settle
from tasks.lease import LeaseInfo
from tasks.outputs import Outputs, RegisteredWorkers
from tasks.payload import Chunk, Relayed, Result, TaskMessage, Thought
from tasks.quota import ApiKey, Quotas
from tasks.store import (
    CANCEL_ABSENT,
    CANCEL_REMOVED,
    CANCEL_RUNNING,
    TaskStore,
)

log = logging.getLogger("routeledger.gateway")

T = TypeVar("T")

# Errors that mean "Redis is not there right now", as opposed to a command Redis refused. A cluster
# answers CLUSTERDOWN (no master serves the slot: a failover is under way) and TRYAGAIN (a slot is
# moving) without running the command.
TRANSIENT: Final = (
    RedisConnectionError,
    RedisTimeoutError,
    ConnectionError,
    OSError,
    ClusterDownError,
    TryAgainError,
)
# The pause after a try that found Redis away, doubled after each further one (up to 0.5 s).
_FIRST_PAUSE_S: Final = 0.05
# The longest one blocking read waits: under the client's socket timeout, so a read never times out.
_BLOCK_MS: Final = 2000
# A waiting reader that has seen no output for this long checks that its task is still in Redis (see
# Gateway._still_there); right away after a read failed (a failover may have lost the task).
_LOST_CHECK_S: Final = 2.0
# Pause before reading a task's output again after a read failed: Redis is away (restarting, or a
# cluster promoting a replica), and the client waits until its own deadline anyway.
_READ_PAUSE_S: Final = 0.25


class _Watch:
    """A waiting client's reads of its task's output: read failures are waited out until the
    client's deadline (a read is safe to repeat, and Redis may be promoting a replica), and a task
    that shows nothing for a while, or after a failure, is checked to be still there
    (Gateway.still_there), so that a lost one ends the wait with TaskLostError."""

    def __init__(self, gateway: Gateway, outputs: Outputs) -> None:
        self.gateway = gateway
        self.outputs = outputs
        self._checked = time.monotonic()

    async def read(self, block_ms: int) -> list[tuple[Chunk, Result | None]]:
        try:
            got = await self.outputs.read(block_ms)
        except TRANSIENT as exc:
            log.info("reading the output of task %s failed (%s); reading it again", self.outputs.task_id, exc)
            await asyncio.sleep(_READ_PAUSE_S)
            self._checked = -float("inf")
            return []
        if got:
            self._checked = time.monotonic()
            return got
        if time.monotonic() - self._checked >= _LOST_CHECK_S:
            try:
                there = await self.gateway.still_there(self.outputs.task_id)
            except TRANSIENT:
                await asyncio.sleep(_READ_PAUSE_S)
                return []
            self._checked = time.monotonic()
            if not there:
                raise TaskLostError(
                    f"task {self.outputs.task_id} was accepted but Redis no longer has it: a failover"
                    " lost the writes that queued it before they reached a replica",
                    hint="submit the request again",
                )
        return []


class Gateway:
    """Submission, waiting, relaying and cancelling, over one Redis connection pool."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        retry_budget_s: float = 1.5,
        wait_timeout_s: float = 600.0,
        cancel_ttl_s: float = 3600.0,
        max_queue_s: float = 3600.0,
        max_queue_depth: int | None = None,
        keyed: bool = False,
        prefix_pricing: bool = True,
        paced_streams: bool = False,
    ) -> None:
        self.redis = redis
        # Tasks carry their prompt's chain (router.prefix), which the plan prices.
        self.prefix_pricing = prefix_pricing
        # A streamed request is paced (TaskMessage.paced); False: none is.
        self.paced_streams = paced_streams
        self.keys = keys
        self.ledger = Ledger(redis, keys)
        self.queues = TaskStore(redis, keys, self.ledger)
        self.fleet = LiveView(redis, keys, snapshot_every_s=2.0, leases_every_s=0.5)
        self.workers = RegisteredWorkers(redis, keys)
        self.memory = MemoryWatch(redis)
        self.retry_budget_s = retry_budget_s
        self.wait_timeout_s = wait_timeout_s
        self.cancel_ttl_s = cancel_ttl_s
        self.max_queue_s = max_queue_s
        self.max_queue_depth = max_queue_depth
        # API keys are configured: tasks are charged to them as their outcomes are handed out.
        self.keyed = keyed
        # A key's task stays open (counted against max_queued) until settled, or this long at most.
        self.quotas = Quotas(redis, keys, open_ttl_s=max_queue_s + wait_timeout_s)
        # Tasks found lost while their clients waited (_still_there), and who else is told (metrics).
        self.lost = 0
        self.on_lost: Callable[[str], None] | None = None

    # -- resilience -----------------------------------------------------------------------------
    async def retrying(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run `op`, retrying while Redis is unreachable within the budget; then RedisUnavailableError."""
        started = time.monotonic()
        try:
            # The first try outside the retry machinery: it succeeds nearly always, and tenacity's
            # bookkeeping costs more than many a command it wraps. The rest keep the same budget
            # and the same first pause.
            return await op()
        except TRANSIENT as exc:
            left = self.retry_budget_s - (time.monotonic() - started)
            if left <= 0:
                raise unavailable(exc) from None
        await asyncio.sleep(_FIRST_PAUSE_S)
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_delay(max(0.0, left - _FIRST_PAUSE_S)),
                wait=wait_exponential(multiplier=2 * _FIRST_PAUSE_S, max=0.5),
                retry=retry_if_exception_type(TRANSIENT),
                reraise=True,
            ):
                with attempt:
                    return await op()
        except TRANSIENT as exc:
            raise unavailable(exc) from None
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    # -- models ---------------------------------------------------------------------------------
    async def resolve(self, model: str) -> tuple[str, dict[str, LeaseInfo]]:
        """The digest `model` names among live workers, and the leases it was resolved against.

        A miss in the cached leases is checked once more against fresh ones, so that a worker
        that just came online is found at once. ModelNotServedError when no live worker serves it.
        """
        leases = await self.fleet.leases()
        digest, holders = find_holders(model, leases)
        if digest is None or not holders:
            leases = await self.fleet.leases(fresh=True)
        return require_model(model, leases), leases

    # -- submission -----------------------------------------------------------------------------
    async def submit(
        self,
        req: TaskMessage,
        *,
        waits: bool = True,
        timeout_s: float | None = None,
        key: ApiKey | None = None,
        child: bool = False,
    ) -> Submitted:
        """Route and queue through the one submission path (dispatch.submit), retrying while Redis
        is away: the task's id is drawn once, before the first try, so that a try whose reply was
        lost and the next one queue it once. Its deadline is when its client stops waiting (`waits`:
        after `timeout_s`, or the wait timeout), and never later than the longest a task may queue.
        ModelNotServedError (with the leases it was looked for in) when nobody serves it;
        RedisMemoryFullError past the memory high-water mark, or when Redis refuses the writes (OOM).

        With `key`, the request is first held to the key's limits (QuotaExceededError names the one
        it is over): its priority is capped at the key's ceiling, its name recorded, and its
        fair-share round drawn from how many of the key's tasks are open (a pipeline's `child` after
        its first task: held to the key's tokens and open tasks, not its rpm). QueueFullError when
        the model's queue is at max_queue_depth.

        Every task enters here: a client's request, and each task of a pipeline (its decomposer,
        children and integration), which carry the pipeline's deadline."""
        patience = min(timeout_s or self.wait_timeout_s, self.max_queue_s) if waits else self.max_queue_s
        # On the ledger's clock: the worker that takes the task judges it there, not by this API's.
        deadline = req.deadline_ms or await self.fleet.clock.now_ms() + int(patience * 1000)
        req = msgspec.structs.replace(req, task_id=req.task_id or uuid.uuid4().hex, deadline_ms=deadline)
        await self.retrying(self.memory.admit)
        if key is not None:
            task_id = req.task_id or ""
            admitted = await self.retrying(lambda: self.quotas.admit(key, task_id, req.priority, child=child))
            req = msgspec.structs.replace(
                req, key=key.name, priority=admitted.priority, share_round=admitted.round
            )
        try:
            return await self._submit_routed(req)
        except DispatchError:
            if key is not None:
                # Nothing was queued (or nobody will learn of it): the key's place is given back.
                with contextlib.suppress(RedisError, *TRANSIENT):
                    await self.quotas.settle(key.name, req.task_id or "", 0)
            raise

    async def _charge(self, task_id: str, result: Result | None, name: bytes | str | None = None) -> None:
        """Charge a finished task's tokens (prompt and output, as the backend reported them) to the
        API key it came with, once, and give back its place among the key's open tasks. Called
        wherever the API hands an outcome to a client, and on a cancel (which gives back the place
        only: what a cancelled run had done is charged by the projector, from its worker's report);
        the live projector charges every completion too, collected or not (Projector._charge), and
        whichever comes first charges it. The key's name is read from the task's lookup hash unless
        given."""
        if not self.keyed:
            return
        if name is None:
            raw: Any = await self.redis.hget(self.keys.task(task_id), "key")
            name = raw
        if not name:
            return
        tokens = 0
        if result is not None and result.status == "completed":
            tokens = (result.timings.prompt_eval_count or 0) + (result.timings.eval_count or 0)
        await self.quotas.settle(as_str(name), task_id, tokens)

    async def _submit_routed(self, req: TaskMessage) -> Submitted:
        try:
            return await self.retrying(
                lambda: route_and_submit(
                    self.queues,
                    self.fleet,
                    req if self.paced_streams or not req.paced else msgspec.structs.replace(req, paced=False),
                    max_depth=self.max_queue_depth,
                    prefixes=self.prefix_pricing,
                )
            )
        except ResponseError as exc:
            if not is_oom(exc):
                raise
            # Redis filled up since the last reading and denied the writes (the queue entry, last of
            # them, among them). Read memory afresh for the next request.
            self.memory.forget()
            raise full_error(None) from None
        except ModelNotServedError as exc:
            if isinstance(exc.fleet, dict):
                raise
            leases = await self.fleet.leases(fresh=True)
            raise ModelNotServedError(str(exc), model=req.model, fleet=leases) from None

    # -- results ----------------------------------------------------------------------------------
    async def result(self, task_id: str) -> Result | None:
        """The task's outcome, from its shared key or the own key of a worker that ran it
        (TaskStore.result)."""
        return await self.queues.result(task_id)

    async def wait(self, task_id: str, timeout_s: float | None = None) -> Result:
        """Block on the task's output stream until it ends, then return its result."""
        deadline = time.monotonic() + (timeout_s or self.wait_timeout_s)
        watch = _Watch(self, self.queues.relay(task_id, self.workers))
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TaskTimeoutError(
                    f"task {task_id} did not finish within {timeout_s or self.wait_timeout_s:.0f}s",
                    hint=f"it is still queued or running: GET /v1/tasks/{task_id}",
                )
            for chunk, carried in await watch.read(min(_BLOCK_MS, left_ms)):
                if chunk.done:
                    result = carried or await self.result(task_id)
                    if result is not None:
                        await self._charge(task_id, result)
                        return result

    async def relay(self, task_id: str, timeout_s: float | None = None) -> AsyncIterator[Relayed]:
        """The task's output as it arrives (thinking, text pieces and tool calls), then its Result.
        Thinking and tool calls the result has and the chunks did not carry (a flush Redis refused)
        come just before it.

        One run is relayed: the first one seen, told apart from others by its attempt and its run
        nonce. A later attempt (the task re-ran after a reclaim or a retryable failure) replaces it
        only while no text was relayed yet; after that, the stream ends with a TaskFailedError rather
        than mixing two runs' text. Another run of the same attempt (which the dispatch never
        makes, but a network can) is never mixed in. An outcome no run wrote (a cancel, a dead
        letter, an expiry: its chunk has no run nonce) ends the stream whichever run it follows.
        """
        deadline = time.monotonic() + (timeout_s or self.wait_timeout_s)
        watch = _Watch(self, self.queues.relay(task_id, self.workers))
        followed: tuple[int, str] | None = None
        relayed = False
        calls = 0
        thought = 0  # characters of thinking relayed
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TaskTimeoutError(f"task {task_id} did not finish in time")
            for chunk, carried in await watch.read(min(_BLOCK_MS, left_ms)):
                run = (chunk.attempt, chunk.run)
                settled = chunk.done and not chunk.run
                if not settled:
                    if followed is None or (run != followed and chunk.attempt > followed[0] and not relayed):
                        followed = run
                    elif run != followed:
                        if chunk.attempt > followed[0]:
                            # The client is told to retry: the new run's output would reach nobody
                            # (two runs' text is never mixed), so it is stopped, not left to run on.
                            await self.cancel_quietly(task_id, why="its client was told to retry")
                            raise TaskFailedError(
                                f"task {task_id} was re-run (attempt {chunk.attempt}) after its output"
                                " had started",
                                hint="retry the request; streamed text from two runs is never mixed",
                            )
                        continue  # a superseded run finishing late, or a second run of one attempt
                if chunk.error and not chunk.done and chunk.run:
                    if not relayed:
                        continue  # a broken run nothing was passed on of: the next attempt replaces it
                    # The run this relay passed on broke off mid-stream, and its task goes back to the
                    # queue: its next run's text can never follow, so the client is told to retry,
                    # and the task is withdrawn before it runs again for nobody.
                    await self.cancel_quietly(task_id, why="its client was told to retry")
                    raise TaskFailedError(
                        f"task {task_id} broke off mid-stream (attempt {chunk.attempt}: {chunk.error})",
                        hint="retry the request; streamed text from two runs is never mixed",
                    )
                if chunk.thinking:
                    relayed = True
                    thought += len(chunk.thinking)
                    yield Thought(chunk.thinking)
                if chunk.text:
                    relayed = True
                    yield chunk.text
                if chunk.tool_calls:
                    relayed = True
                    calls += len(chunk.tool_calls)
                    yield chunk.tool_calls
                if chunk.done:
                    result = carried or await self.result(task_id)
                    if result is None:
                        continue  # the done chunk of a run whose result is not written yet
                    await self._charge(task_id, result)
                    if result.refused:
                        raise TaskRefusedError(f"the backend refused task {task_id}: {result.error}")
                    if result.status != "completed":
                        raise TaskFailedError(
                            f"task {task_id} {result.status}: {result.error or chunk.error}"
                        )
                    if relayed and (result.attempt, result.run) != followed:
                        raise TaskFailedError(
                            f"task {task_id} completed on another run (attempt {result.attempt})",
                            hint="retry the request; streamed text from two runs is never mixed",
                        )
                    if len(result.thinking) > thought:
                        yield Thought(result.thinking[thought:])
                    if result.tool_calls and len(result.tool_calls) > calls:
                        yield result.tool_calls[calls:]
                    yield result
                    return

    async def still_there(self, task_id: str) -> bool:
        """Whether the task is still in Redis: its lookup hash (written with its queue entry and its
        TaskSubmitted, in one script, and kept for as long as its result) or its outcome. Both gone
        while a client waits means the writes that acknowledged it were lost: a replica promoted
        before they reached it (replication is asynchronous), or Redis restarted without them.
        Nothing will ever run or answer it, so the waiting client is told (TaskLostError) rather
        than left waiting until its deadline; `lost` counts it, and the log names it."""
        exists: Any = await self.redis.exists(self.keys.task(task_id))
        if exists or await self.result(task_id) is not None:
            return True
        self.lost += 1
        log.warning("task %s was acknowledged but is gone from Redis with no outcome: lost", task_id)
        if self.on_lost is not None:
            self.on_lost(task_id)
        return False

    # -- cancelling -------------------------------------------------------------------------------
    async def cancel(self, task_id: str) -> dict[str, Any]:
        """Withdraw a task: removed if queued, told to stop if running. TaskNotFoundError for an
        unknown task, TaskFinishedError for one that has its outcome."""
        done = await self.result(task_id)
        if done is not None:
            raise TaskFinishedError(
                f"task {task_id} already {done.status}", hint="only a queued or running task can be cancelled"
            )
        info = await self._info(task_id)
        queue = info[b"queue"].decode() if b"queue" in info else await self._queue_of(task_id)
        if queue is None:
            raise TaskNotFoundError(f"no task {task_id}")
        # Asked first, before the entry is looked at: a run that ends meanwhile, and would re-queue
        # its task, finds the key and finishes the entry instead (workers.endings); set after the
        # look, a run ending in between would re-queue it and it would run again for nobody.
        await self.redis.set(self.keys.cancel(task_id), b"1", px=int(self.cancel_ttl_s * 1000))
        # The lookup hash records the task's entry (its place never changes: a re-queue keeps it).
        entry = info.get(b"entry", b"").decode()
        status, entry_id, attempt = (
            await self.queues.cancel_queued(queue, entry) if entry else (CANCEL_ABSENT, "", 0)
        )
        if status == CANCEL_REMOVED:
            await self.queues.record_result(
                Result(task_id=task_id, status="cancelled", attempt=attempt, error="cancelled before it ran")
            )
            await self.queues.end_output(task_id, attempt, "cancelled")
            await self.ledger.append(TaskCancelled(task_id=task_id, queue=queue, was_running=False))
            await self._charge(task_id, None, info.get(b"key", b""))
            return {"task_id": task_id, "status": "cancelled", "was_running": False}
        if status != CANCEL_RUNNING:
            done = await self.result(task_id)
            if done is not None:
                raise TaskFinishedError(f"task {task_id} already {done.status}")
        # Running (or between a reclaim and its next claim): the worker watches the key set above
        # while it runs and reads it when it claims, and stops.
        await self.ledger.append(TaskCancelled(task_id=task_id, queue=queue, was_running=True))
        # Nobody will wait for what it had done: its place among its key's open tasks is given back.
        await self._charge(task_id, None, info.get(b"key", b""))
        return {"task_id": task_id, "status": "cancelling", "was_running": True, "entry": entry_id or None}

    async def cancel_quietly(self, task_id: str, *, why: str = "its client disconnected") -> None:
        """Cancel after a client went away (or was told to retry: `why`); a task that finished
        meanwhile is left as it is."""
        try:
            await self.cancel(task_id)
            log.info("task %s cancelled: %s", task_id, why)
        except (TaskFinishedError, TaskNotFoundError):
            pass
        except (RedisError, *TRANSIENT) as exc:
            log.warning("could not cancel task %s (%s): %s", task_id, why, exc)

    # -- looking up -------------------------------------------------------------------------------
    async def _info(self, task_id: str) -> dict[bytes, bytes]:
        raw: Any = await self.redis.hgetall(self.keys.task(task_id))
        return dict(raw)

    async def _queue_of(self, task_id: str) -> str | None:
        info = await self._info(task_id)
        if b"queue" in info:
            return info[b"queue"].decode()
        row = await self._row(task_id)
        if row is not None and row.queue:
            return row.queue
        for _, event in await self.events_of(task_id):
            if isinstance(event, TaskSubmitted):
                return event.queue
        return None

    async def _row(self, task_id: str) -> TaskRow | None:
        try:
            return await get_task(self.redis, self.keys, task_id)
        except ProjectionError as exc:
            log.warning("tasks row of %s unreadable: %s", task_id, exc)
            return None

    async def view(self, task_id: str) -> dict[str, Any]:
        """Everything known of a task: status, result, who ran it, timings, attempts, the routing."""
        info, row, result = await asyncio.gather(
            self._info(task_id), self._row(task_id), self.result(task_id)
        )
        if not info and row is None and result is None:
            raise TaskNotFoundError(f"no task {task_id}", hint="task records expire 24 h after they finish")
        if not info and result is None and row is not None and not is_terminal(row.status):
            # The tables saw it submitted, but Redis has neither its record (kept for as long as
            # its outcome) nor an outcome: a failover lost the writes that queued it.
            raise TaskLostError(
                f"task {task_id} was accepted but Redis no longer has it: a failover lost the writes"
                " that queued it before they reached a replica",
                hint="submit the request again",
            )
        status = task_status(row, result)
        if result is not None:
            await self._charge(task_id, result, info.get(b"key", b""))
        routed = info.get(b"routed")
        out: dict[str, Any] = {
            "task_id": task_id,
            "status": status,
            "model": row.model if row is not None else _d(info.get(b"model")),
            "digest": row.digest if row is not None else _d(info.get(b"digest")),
            "domain": row.domain if row is not None else _d(info.get(b"domain")),
            "queue": row.queue if row is not None else _d(info.get(b"queue")),
            "worker": (result.worker if result is not None else None)
            or (row.worker if row is not None else None),
            "attempts": max(
                row.attempts if row is not None else 0, result.attempt if result is not None else 0
            ),
            "submitted_at": row.submitted_at if row is not None else _int(info.get(b"submitted_at")),
            "claimed_at": row.claimed_at if row is not None else None,
            "finished_at": result.finished_at
            if result is not None
            else row.finished_at
            if row is not None
            else None,
            "result": None,
            "timings": None,
            "routing": msgspec.json.decode(routed) if routed else None,
            "projected": row is not None,
        }
        if result is not None:
            out["result"] = {
                "text": result.text,
                "done_reason": result.done_reason,
                "error": result.error,
                "attempt": result.attempt,
            }
            if result.tool_calls:
                out["result"]["tool_calls"] = msgspec.to_builtins(result.tool_calls)
            if result.thinking:
                out["result"]["thinking"] = result.thinking
            out["timings"] = {
                **msgspec.to_builtins(result.timings),
                "ttft_ms": result.ttft_ms,
                "wall_ms": result.wall_ms,
            }
        elif row is not None:
            out["timings"] = {"ttft_ms": row.ttft_ms, "wall_ms": row.wall_ms, "eval_count": row.eval_count}
        return out

    async def events_of(self, task_id: str) -> list[tuple[str, Event]]:
        """The task's events, in order, from the entry index (projections/index.py): the entries
        its row lists and the unfolded tail, never the whole ledger."""
        return (await self.history(task_id)).events

    async def history(self, task_id: str) -> Found:
        """As `events_of`, with what the lookup read (and whether the unfolded tail was cut)."""
        return await task_events(self.redis, self.keys, task_id)


def _d(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode()


def _int(raw: bytes | None) -> int | None:
    return None if raw is None else int(raw)


def task_status(row: TaskRow | None, result: Result | None) -> TaskStatus:
    """A task's status from its projected row (None: not folded yet) and its stored outcome."""
    status: TaskStatus = row.status if row is not None else "submitted"
    return status if result is None else settle(status, result.status)


def unavailable(exc: BaseException) -> RedisUnavailableError:
    return RedisUnavailableError(
        f"Redis is unreachable ({type(exc).__name__})",
        hint="the API retries by itself; try again in a few seconds",
    )
