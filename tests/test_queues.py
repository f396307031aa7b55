"""tasks.store.resend: what may be sent again is, after a failed sending, and nothing else is."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from tasks.store import resend


class _Flaky:
    """Fails its first `failures` sendings with `error`, then answers 1."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.sent = failures, error, 0

    async def __call__(self) -> int:
        self.sent += 1
        if self.sent <= self.failures:
            raise self.error
        return 1


async def test_an_operation_that_answers_at_once_is_sent_once() -> None:
    op = _Flaky(0, RedisConnectionError("x"))
    assert await resend(op) == 1
    assert op.sent == 1


async def test_an_operation_whose_connection_failed_is_sent_again_up_to_three_times() -> None:
    op = _Flaky(2, RedisConnectionError("gone"))
    assert await resend(op) == 1
    assert op.sent == 3
    always = _Flaky(9, TimeoutError())
    with pytest.raises(TimeoutError):
        await resend(always)
    assert always.sent == 3


async def test_an_operation_redis_refused_is_not_sent_again() -> None:
    op = _Flaky(1, ResponseError("OOM command not allowed"))
    with pytest.raises(ResponseError):
        await resend(op)
    assert op.sent == 1
