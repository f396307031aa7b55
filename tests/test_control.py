"""An operator's request to one worker and its progress (dispatch.control), on one Redis and on a
cluster: appended, read after the cursor of a new life, reported entry by entry (each with its
expiry, in one MULTI on the entry's own slot) and followed through its end."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from dispatch.control import (
    PROGRESS_TTL_MS,
    ControlRequest,
    Progress,
    cursor,
    follow,
    new_id,
    report,
    requests,
    send,
)
from events.keys import Keys

pytestmark = pytest.mark.cluster_tier


async def test_a_request_reaches_its_worker_and_its_progress_comes_back_in_order_until_its_end(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    earlier = ControlRequest(op="delete", id=new_id(), model="old")
    await send(redis_client, keys, "b", earlier)
    # A worker starting now reads only what comes after the last request (its earlier life's).
    after = await cursor(redis_client, keys, "b")
    asked = ControlRequest(op="pull", id=new_id(), model="extra")
    await send(redis_client, keys, "b", asked)
    taken = await requests(redis_client, keys, "b", after, block_ms=1000)
    for progress in (
        Progress(),
        Progress(line={"status": "pulling manifest"}),
        Progress(line={"status": "success"}),
        Progress(end=True),
    ):
        await report(redis_client, keys, "b", asked.id, progress)
    followed = [p async for p in follow(redis_client, keys, "b", asked.id, first_line_s=2)]
    ttl = await redis_client.pttl(keys.run_out("b", asked.id))
    assert [request for _, request in taken] == [asked]
    assert [p.line for p in followed] == [None, {"status": "pulling manifest"}, {"status": "success"}, None]
    assert followed[-1].end and followed[-1].error is None
    assert 0 < ttl <= PROGRESS_TTL_MS
