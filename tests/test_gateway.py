"""The gateway's exactness: a submission whose reply was lost is queued once, and a relay never mixes
the text of two runs."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from dispatch.errors import TaskFailedError, TaskLostError, TaskTimeoutError
from dispatch.gateway import Gateway
from events.connection import redis_client as make_client
from events.event import TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from events.scripts import load_library
from projections.projector import Projector
from tasks.payload import (
    Chunk,
    Message,
    Result,
    TaskMessage,
    Thought,
    ToolCall,
    encode_chunk,
    encode_result,
)
from tasks.store import _SUBMIT, _SUBMIT_DEF, OUTPUT_TTL_MS, TaskStore
from tests.helpers import MODEL_DIGEST, events_of
from tests.reliability.proxy import redis_proxy
from tests.test_api_support import ghost_worker

pytestmark = pytest.mark.cluster_tier


async def test_a_submission_whose_reply_was_lost_is_sent_again_and_queued_once(
    redis_client: aioredis.Redis, redis_url: str, keys: Keys, ledger: Ledger, redis_backend: str
) -> None:
    if redis_backend == "cluster":
        pytest.skip("the reply-muting proxy stands in front of one server, not a cluster's nodes")
    await ghost_worker(redis_client)
    # Loaded beforehand, so that the gateway's first sending is the FCALL (EVALSHA on a Redis without
    # functions) whose reply is lost.
    sha = await redis_client.script_load(_SUBMIT)
    call = _SUBMIT_DEF.function if await load_library(redis_client) else sha
    parts = urlsplit(redis_url)
    async with redis_proxy(parts.hostname or "127.0.0.1", parts.port or 6379) as proxy:
        client = make_client(proxy.url(parts.password), socket_timeout=1.0)
        gateway = Gateway(client, keys, retry_budget_s=6.0)
        try:
            proxy.mute_reply_after(call.encode() if isinstance(call, str) else call)
            sub = await gateway.submit(
                TaskMessage(model="m", messages=[Message(role="user", content="once")])
            )
        finally:
            await client.aclose()
    assert proxy.muted_replies == 1
    queue = keys.queue(MODEL_DIGEST)
    assert await redis_client.xlen(queue) == 1
    submitted = await events_of(ledger, TaskSubmitted)
    assert [e.task_id for e in submitted] == [sub.task_id]


async def _out(
    redis: aioredis.Redis, keys: Keys, task_id: str, chunk: Chunk, result: Result | None = None
) -> None:
    fields = {b"c": encode_chunk(chunk)}
    if result is not None:
        fields[b"r"] = encode_result(result)
    await redis.xadd(keys.out(task_id), fields)  # type: ignore[arg-type]
    await redis.pexpire(keys.out(task_id), OUTPUT_TTL_MS)


async def test_a_relay_follows_one_run_and_never_mixes_in_a_second_run_of_the_same_attempt(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    for text, run in (("The ", "a"), ("Das ", "b"), ("sky", "a"), ("Himmel", "b")):
        await _out(redis_client, keys, "t1", Chunk(attempt=1, text=text, run=run))
    done = Result(task_id="t1", status="completed", attempt=1, text="The sky", run="a")
    await _out(redis_client, keys, "t1", Chunk(attempt=1, done=True, run="b"))
    await _out(redis_client, keys, "t1", Chunk(attempt=1, done=True, run="a"), done)
    items = [item async for item in Gateway(redis_client, keys).relay("t1", timeout_s=5)]
    assert items == ["The ", "sky", done]


async def test_an_outcome_no_run_wrote_ends_the_relay_whichever_run_it_follows(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await _out(redis_client, keys, "t2", Chunk(attempt=1, text="partial", run="a"))
    cancelled = Result(task_id="t2", status="cancelled", attempt=1, error="cancelled")
    await redis_client.hset(
        keys.result("t2"), mapping={"result": encode_result(cancelled), "status": "cancelled"}
    )
    await _out(redis_client, keys, "t2", Chunk(attempt=1, done=True, error="cancelled"))
    relayed: list[object] = []

    async def relay() -> None:
        async for item in Gateway(redis_client, keys).relay("t2", timeout_s=5):
            relayed.append(item)

    with pytest.raises(TaskFailedError, match="cancelled"):
        await relay()
    assert relayed == ["partial"]


async def test_a_relay_yields_tool_calls_as_they_come_and_any_the_chunks_missed_before_the_result(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    weather = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
    clock = ToolCall(id="call_2", name="get_time")
    await _out(redis_client, keys, "t3", Chunk(attempt=1, text="Let me look. ", run="a"))
    await _out(redis_client, keys, "t3", Chunk(attempt=1, run="a", tool_calls=[weather]))
    # The second call's flush was refused (Redis out of memory): only the result carries it.
    done = Result(
        task_id="t3",
        status="completed",
        attempt=1,
        text="Let me look. ",
        run="a",
        tool_calls=[weather, clock],
    )
    await _out(redis_client, keys, "t3", Chunk(attempt=1, done=True, run="a"), done)
    items = [item async for item in Gateway(redis_client, keys).relay("t3", timeout_s=5)]
    assert items == ["Let me look. ", [weather], [clock], done]


async def test_a_relay_yields_thinking_before_the_text_and_any_thinking_the_chunks_missed(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await _out(redis_client, keys, "t4", Chunk(attempt=1, run="a", thinking="Hmm, "))
    await _out(redis_client, keys, "t4", Chunk(attempt=1, run="a", thinking="blue. ", text="Blue"))
    # The last flush of thinking was refused (Redis out of memory): only the result carries it.
    done = Result(
        task_id="t4", status="completed", attempt=1, text="Blue", run="a", thinking="Hmm, blue. Rayleigh."
    )
    await _out(redis_client, keys, "t4", Chunk(attempt=1, done=True, run="a"), done)
    items = [item async for item in Gateway(redis_client, keys).relay("t4", timeout_s=5)]
    assert items == [Thought("Hmm, "), Thought("blue. "), "Blue", Thought("Rayleigh."), done]


async def test_a_relay_reads_the_own_output_of_the_worker_holding_the_task_and_never_another_s(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    queue = keys.queue(MODEL_DIGEST)
    task = TaskMessage(task_id="t9", model="m", digest=MODEL_DIGEST, messages=[])
    entry = await queues.enqueue(queue, task)
    await redis_client.hset(keys.task("t9"), mapping={"queue": queue, "entry": entry})
    assert (await queues.take(queue, "a")).entry_id == entry
    done = Result(task_id="t9", status="completed", worker="a", attempt=1, text="The sky", run="r1")
    forged = Result(task_id="t9", status="completed", worker="b", attempt=1, text="forged", run="r2")
    # b, live too, holds nothing of t9: what it writes to its own keys is never read.
    await redis_client.sadd(keys.workers, "a", "b")
    await redis_client.xadd(
        keys.run_out("b", "t9"),
        {
            b"c": encode_chunk(Chunk(attempt=1, text="forged", done=True, run="r2")),
            b"r": encode_result(forged),
        },
    )
    await redis_client.hset(keys.run_result("b", "t9"), "result", encode_result(forged))
    held = TaskStore(redis_client, keys, ledger, writer="a")
    relay = Gateway(redis_client, keys).relay("t9", timeout_s=5)
    await held.close_run(done, "The sky")
    await held.log_run("t9", [], counts=True, done=Chunk(attempt=1, done=True, run="r1"), carried=done)
    assert [item async for item in relay] == ["The sky", done]
    assert await Gateway(redis_client, keys).result("t9") == done
    assert await redis_client.exists(keys.out("t9")) == 0


async def test_a_client_waiting_on_a_task_redis_lost_is_told_so_within_seconds_and_the_loss_counted(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await ghost_worker(redis_client)
    gateway = Gateway(redis_client, keys)
    seen: list[str] = []
    gateway.on_lost = seen.append
    kept = await gateway.submit(TaskMessage(model="m", messages=[Message(role="user", content="kept")]))
    lost = await gateway.submit(TaskMessage(model="m", messages=[Message(role="user", content="lost")]))
    waiting = asyncio.create_task(gateway.wait(lost.task_id, timeout_s=30))
    # A task that is only slow to start is waited for until its deadline, never called lost.
    with pytest.raises(TaskTimeoutError):
        await gateway.wait(kept.task_id, timeout_s=2.5)
    assert not waiting.done()
    # What a failover leaves of a task whose writes never reached the promoted replica: nothing.
    await redis_client.delete(keys.task(lost.task_id), lost.queue)
    with pytest.raises(TaskLostError, match="no longer has it"):
        await asyncio.wait_for(waiting, 5)
    assert seen == [lost.task_id] and gateway.lost == 1


async def test_looking_up_a_task_the_tables_saw_submitted_but_redis_lost_says_it_was_lost(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    await ghost_worker(redis_client)
    gateway = Gateway(redis_client, keys)
    sub = await gateway.submit(
        TaskMessage(model="m", messages=[Message(role="user", content="hi")]), waits=False
    )
    projector = Projector(redis_client, keys)
    await projector.start()
    await projector.catch_up()
    await projector.release()
    assert (await gateway.view(sub.task_id))["status"] in ("submitted", "queued")
    # A failover that lost the task takes its record, queue entry and TaskSubmitted; the tables, on
    # other nodes of a cluster (or folded before it), still hold its row.
    await redis_client.delete(keys.task(sub.task_id), sub.queue)
    with pytest.raises(TaskLostError, match="no longer has it"):
        await gateway.view(sub.task_id)
