"""The worker's side of operators' requests about its machine's models (dispatch.control).

A worker reads its own control stream beside its other loops and carries each request out in a
task of its own, so a pull that downloads for minutes holds no slot and blocks no run. Each line
its backend sends goes on to the API (a layer's byte counts at most twice a second: the last one
of a burst is kept), then one closing entry; after a pull or a delete the worker reads its
backend's list again, so its lease and the ledger (WorkerChanged) say what the machine now holds.
A server that cannot pull (an OpenAI-compatible one) answers that it cannot, in so many words.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Final

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, RedisError

from dispatch.control import (
    FIRST_LINE_S,
    ControlRequest,
    Failure,
    Progress,
    asked_ms,
    cursor,
    report,
    requests,
)
from events.cancellation import cancel_and_wait
from events.keys import Keys
from workers.backend import Backend, Pulling
from workers.errors import BackendError

log = logging.getLogger("routeledger.worker")

# Shortest time between two progress lines of one status sent on (Ollama sends many a second).
PROGRESS_EVERY_S: Final = 0.5
# BackendError kinds of a server that answered (workers.backend._raise_status).
_ANSWERED: Final = frozenset({"bad_request", "http_5xx", "unsupported"})
# Request ids remembered, so that one appended twice (a retried append) runs once.
SEEN_IDS: Final = 256
# How long to wait before reading the stream again after Redis failed.
_RETRY_S: Final = 1.0


class Control:
    """Reads `worker`'s control stream and carries out each request against `backend`;
    `on_change` is awaited after a change to the machine's models (the worker refreshes its
    inventory, its lease and the ledger); `ledger_ms` is the ledger's clock (events.clock), which
    a request's age is read on."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        worker: str,
        backend: Backend,
        on_change: Callable[[], Awaitable[None]],
        ledger_ms: Callable[[], Awaitable[int]],
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.worker = worker
        self.backend = backend
        self.on_change = on_change
        self.ledger_ms = ledger_ms
        self._after: str | None = None
        # False once its Redis user was found unable to read the stream.
        self.allowed = True
        self._doing: set[asyncio.Task[None]] = set()
        # Ids of the requests taken up lately, oldest first: one appended twice runs once.
        self._seen: deque[str] = deque(maxlen=SEEN_IDS)

    async def start(self) -> None:
        """Skip what was asked of an earlier life of this worker (its caller has given up)."""
        try:
            self._after = await cursor(self.redis, self.keys, self.worker)
        except NoPermissionError as exc:
            self._forbidden(exc)
        except (RedisError, OSError, TimeoutError) as exc:
            # Read again by `run`; the worker starts regardless.
            log.warning("worker %s could not read its control stream (%s)", self.worker, exc)

    def _forbidden(self, exc: RedisError) -> None:
        # An ACL made before this stream existed: the worker runs, and says once why pulls fail.
        self.allowed = False
        log.warning(
            "worker %s: its Redis user may not read %s (%s); pulls and deletes through the API will "
            "not reach it until `routeledger acl worker %s` is applied again",
            self.worker,
            self.keys.control(self.worker),
            exc,
            self.worker,
        )

    async def run(self, stopping: asyncio.Event) -> None:
        """Until `stopping`: take each new request and start carrying it out."""
        if self._after is None and self.allowed:
            await self.start()
        while not stopping.is_set() and self.allowed:
            try:
                if self._after is None:
                    await self.start()
                    if self._after is None:
                        await asyncio.sleep(_RETRY_S)
                    continue
                found = await requests(self.redis, self.keys, self.worker, self._after)
            except NoPermissionError as exc:
                self._forbidden(exc)
                return
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("worker %s could not read its control stream (%s); will retry", self.worker, exc)
                await asyncio.sleep(_RETRY_S)
                continue
            for entry_id, request in found:
                self._after = entry_id
                if request is None:
                    log.warning("worker %s: control entry %s is no request; skipped", self.worker, entry_id)
                    continue
                if request.id in self._seen:
                    continue
                self._seen.append(request.id)
                task = asyncio.create_task(self.carry_out(request, asked_ms(entry_id)), name=request.id)
                self._doing.add(task)
                task.add_done_callback(self._doing.discard)

    async def aclose(self) -> None:
        """Stop what is under way; each says so at its end (the worker is stopping)."""
        doing = list(self._doing)
        await cancel_and_wait(doing)
        await asyncio.gather(*doing, return_exceptions=True)

    async def carry_out(self, request: ControlRequest, asked: int) -> None:
        """One request, from its acknowledgement to its end, which is written whatever happens."""
        send = _Throttled(lambda p: report(self.redis, self.keys, self.worker, request.id, p))
        end = Progress(end=True, failure="backend", error="the worker stopped before it finished")
        changed = False
        try:
            age_s = (await self.ledger_ms() - asked) / 1000
            if age_s > FIRST_LINE_S:
                # Its caller was told it was not taken up: doing it now would surprise them.
                end = Progress(
                    end=True,
                    failure="expired",
                    error=f"taken up {age_s:.0f} s after it was asked, when its caller had given up",
                )
                return
            # Taken up: the API waits for the next entry as long as a pull may print nothing.
            await send(Progress())
            end = await self._do(request, send)
            changed = end.failure != "unsupported"
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError, TimeoutError) as exc:
            end = Progress(end=True, failure="backend", error=f"the worker could not report on it ({exc})")
        finally:
            await self._finish(request, send, end, changed)

    async def _do(self, request: ControlRequest, send: _Throttled) -> Progress:
        """Carry it out; its end (a failure of the machine's server is an end, not an exception)."""
        if not isinstance(self.backend, Pulling):
            return Progress(
                end=True,
                failure="unsupported",
                error=f"this machine's server ({self.backend.kind} at {self.backend.url}) cannot "
                f"{request.op} models: put the model where that server loads models from, and restart it",
            )
        try:
            if request.op == "pull":
                log.info("worker %s: pulling %s", self.worker, request.model)
                async with contextlib.aclosing(
                    self.backend.pull(request.model, insecure=request.insecure)
                ) as lines:
                    async for line in lines:
                        await send(Progress(line=line))
            else:
                log.info("worker %s: deleting %s", self.worker, request.model)
                await self.backend.delete(request.model)
        except BackendError as exc:
            # A server that answered refused (Ollama answers a name its registry lacks with a 500);
            # one that could not be reached or broke off is the machine's failure.
            failure: Failure = (
                "not_found"
                if exc.kind == "model_missing"
                else "refused"
                if exc.kind in _ANSWERED
                else "backend"
            )
            return Progress(end=True, failure=failure, error=exc.message)
        return Progress(end=True)

    async def _finish(self, request: ControlRequest, send: _Throttled, end: Progress, changed: bool) -> None:
        """What the machine now holds (even a failed pull may have left a part), then the end."""
        if changed:
            try:
                await self.on_change()
            except (RedisError, OSError, TimeoutError) as exc:
                # The next heartbeat says it; the caller still gets its answer.
                log.warning(
                    "worker %s: could not report its models after %s (%s)", self.worker, request.id, exc
                )
        try:
            await send.flush()
            await send(end)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("worker %s: could not report the end of %s (%s)", self.worker, request.id, exc)
        log.info(
            "worker %s: %s %s %s",
            self.worker,
            request.op,
            request.model,
            "done" if end.error is None else f"failed ({end.error})",
        )


class _Throttled:
    """Sends progress on, but a line whose status is the one sent last goes at most every
    PROGRESS_EVERY_S (the latest one is kept and sent before anything else)."""

    def __init__(self, send: Callable[[Progress], Awaitable[None]]) -> None:
        self._send = send
        self._last_status: Any = None
        self._last_at = -PROGRESS_EVERY_S
        self._held: Progress | None = None

    async def __call__(self, progress: Progress) -> None:
        status = progress.line.get("status") if progress.line is not None else None
        now = time.monotonic()
        soon = now - self._last_at < PROGRESS_EVERY_S
        if progress.line is not None and status == self._last_status and soon:
            self._held = progress
            return
        await self.flush()
        await self._send(progress)
        self._last_status, self._last_at = status, now

    async def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            await self._send(held)
