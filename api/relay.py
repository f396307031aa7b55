"""Streaming responses that notice a client leaving, so that its task is cancelled.

The body is produced by an async iterator (SSE or NDJSON lines built from Gateway.relay) while
a second task watches the connection. If the client disconnects first, `on_disconnect` starts in
a task of its own, outside the request, so that the cancel reaches Redis even though the request
is gone; then the producer is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from events.cancellation import cancel_and_wait

log = logging.getLogger("routeledger.api")

# Cancels in flight after their request ended; kept referenced so they are not collected early.
_background: set[asyncio.Task[None]] = set()


class RelayResponse(Response):
    """A streamed body that cancels its task when the client goes away mid-stream."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        media_type: str,
        headers: Mapping[str, str] | None = None,
        on_disconnect: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.on_disconnect = on_disconnect
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher.done() and not producer.done() and self.on_disconnect is not None:
                # Cancelled first, before the producer is stopped: its end may wait on a Redis read
                # (and on a lost cancel, events.cancellation), and every moment the task runs on
                # for nobody holds a slot of the fleet.
                cancel = asyncio.ensure_future(self.on_disconnect())
                _background.add(cancel)
                cancel.add_done_callback(_background.discard)
        finally:
            await cancel_and_wait((producer, watcher))
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if not watcher.cancelled():
            watcher.exception()  # a receive that failed: the connection is gone, as a disconnect says
        if not producer.cancelled() and (exc := producer.exception()) is not None:
            # The producer failed after the headers went out: nothing left to tell the client.
            log.warning("stream ended by %s: %s", type(exc).__name__, exc)
