"""A cancel that the cancelled code drops (as asyncio.wait_for does on Python 3.11) is sent again."""

from __future__ import annotations

import asyncio
import contextlib

from events.cancellation import cancel_and_wait


async def _drops_one_cancel(started: asyncio.Event, dropped: list[int]) -> None:
    # What asyncio.wait_for does on Python 3.11 when its inner awaitable completes in the step
    # the cancel lands in: it returns the result, and the CancelledError is gone.
    started.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(60)
    dropped.append(1)
    await asyncio.sleep(60)


async def test_a_task_that_drops_a_cancel_is_cancelled_again_until_it_ends() -> None:
    started, dropped = asyncio.Event(), []
    task = asyncio.ensure_future(_drops_one_cancel(started, dropped))
    await started.wait()
    await asyncio.wait_for(cancel_and_wait((task,), every_s=0.01), timeout=5)
    assert dropped == [1] and task.cancelled()


async def test_what_tasks_ended_with_is_left_on_them() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    failing = asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    sleeping = asyncio.ensure_future(asyncio.sleep(60))
    await cancel_and_wait((failing, sleeping))
    assert isinstance(failing.exception(), ValueError) and sleeping.cancelled()


async def test_nothing_to_cancel_returns_at_once() -> None:
    await asyncio.wait_for(cancel_and_wait(()), timeout=1)
