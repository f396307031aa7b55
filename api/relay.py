"""Streaming responses that notice a client leaving, so that its task is cancelled.

The body is produced by an async iterator (SSE or NDJSON lines built from Gateway.relay) while
a second task watches the connection. If the client disconnects first, the producer is
cancelled and `on_disconnect` runs in a task of its own, outside the cancelled request, so that
the cancel reaches Redis even though the request is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

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
        finished = False

        async def produce() -> None:
            nonlocal finished
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            finished = True

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(watch())
        disconnected = False
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            disconnected = watcher.done() and not producer.done()
        finally:
            for t in (producer, watcher):
                if not t.done():
                    t.cancel()
            for t in (producer, watcher):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await t
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if disconnected and not finished and self.on_disconnect is not None:
            cancel = asyncio.ensure_future(self.on_disconnect())
            _background.add(cancel)
            cancel.add_done_callback(_background.discard)
        if producer.done() and not producer.cancelled() and (exc := producer.exception()) is not None:
            # The producer failed after the headers went out: nothing left to tell the client.
            log.warning("stream ended by %s: %s", type(exc).__name__, exc)
