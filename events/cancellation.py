"""Stopping a task for sure: cancel it, and cancel it again while it runs.

On Python 3.11, `asyncio.wait_for` returns the inner result and drops a cancel that lands in the
same loop step as the inner awaitable completes (CPython gh-86296, fixed in 3.12). redis-py sends
every command through `wait_for` when a socket timeout is set, so a task blocked on Redis loses
one cancel in a few hundred at random (measured: 3 of 300 cancels of a task looping on XREAD BLOCK)
and runs on as if nobody had asked. A caller that waits for the end of what it cancelled would wait
for as long as the task would have run: a streamed answer whose client hung up was relayed to the
end before its task was cancelled, and a worker's shutdown waited for its readers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

# How long a cancel is given to take before it is sent again; a cancel that was not lost ends a
# task within a step or two of the event loop, so this only bounds the wait after a lost one.
RECANCEL_S = 0.05


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], *, every_s: float = RECANCEL_S) -> None:
    """Cancel each task and return once all have ended, cancelling again those still running.

    What the tasks ended with (a result, an exception, the cancel) is left on them to read; a
    caller that is itself cancelled meanwhile gets its CancelledError as usual."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
