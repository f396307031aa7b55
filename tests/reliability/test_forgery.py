"""A compromised worker, holding a real worker's Redis credentials, tries to forge the fleet's history;
Redis refuses what the ACL forbids, the ingest dead-letters the rest with the reason, replay still
agrees with the live tables, and the real worker on the same credentials goes on serving."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from dispatch.errors import TaskTimeoutError
from dispatch.gateway import Gateway
from dispatch.submit import submit_task
from events.codec import encode_fields
from events.event import Event, QualityScored, TaskClaimed, TaskCompleted, TaskReclaimed, Timings
from events.keys import REQUEUED_CONSUMER, WORKERS_GROUP, Keys
from events.ledger import Ledger
from events.scripts import LIBRARY
from projections.benchset import REFERENCE, benchset
from projections.projector import Projector
from routeledger.embedded import find_redis_server, redis_version
from sim.backends.hosts import SimHosts
from tasks.payload import Chunk, Message, Result, TaskMessage, encode_chunk, encode_result
from tasks.store import _CANCEL_QUEUED_DEF, _FINISH_DEF, TaskStore
from tests.helpers import events_of, make_test_fleet, wait_until
from tests.reliability.support import acl_line, spawn_worker, stop_all
from workers.reaper import UNACKNOWLEDGED, Reaper, ReaperConfig

PASSWORD = "worker-a-secret"

FORGED = 500


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=23) as sim:
        yield sim


def _slow(task_id: str, worker: str, digest: str, attempt: int = 1) -> TaskCompleted:
    """A completion at 1 token per second."""
    return TaskCompleted(
        task_id=task_id,
        worker=worker,
        digest=digest,
        attempt=attempt,
        timings=Timings(eval_count=10, eval_duration=10 * 10**9),
    )


async def _append(redis: aioredis.Redis, stream: str, events: list[Event]) -> None:
    pipe = redis.pipeline(transaction=False)
    for event in events:
        pipe.xadd(stream, encode_fields(event))  # type: ignore[arg-type]
    await pipe.execute()


async def _submit(redis: aioredis.Redis, ledger: Ledger) -> str:
    queues = TaskStore(redis, Keys(), ledger)
    request = TaskMessage(model="m", messages=[Message(role="user", content="hi")])
    return (await submit_task(queues, request)).task.task_id


async def _completions(ledger: Ledger, task_id: str) -> list[TaskCompleted]:
    return [e for e in await events_of(ledger, TaskCompleted) if e.task_id == task_id]


async def _inbox_dead(redis: aioredis.Redis) -> list[dict[bytes, bytes]]:
    rows: Any = await redis.xrange(Keys().dead)
    return [fields for _, fields in rows if fields.get(b"source") == b"inbox"]


async def test_a_worker_credential_forges_nothing_the_ledger_believes_and_the_worker_keeps_serving(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts, tmp_path: Path
) -> None:
    version = redis_version(find_redis_server())
    if version is None or version < (7,):
        pytest.skip(f"worker ACLs need Redis 7 (selectors, functions); this redis-server is {version}")
    keys = Keys()
    await redis_client.execute_command(*acl_line("a", PASSWORD))
    parts = urlsplit(redis_url)
    worker_url = f"redis://a:{PASSWORD}@{parts.hostname}:{parts.port}/0"
    stop = asyncio.Event()
    projector = asyncio.create_task(Projector(redis_client, keys, lease_ms=2000).run(stop))
    proc = spawn_worker(worker_url, hosts.url("a"), "a", tmp_path / "worker.log", inbox=True)
    mallory = aioredis.Redis.from_url(worker_url)
    try:
        await wait_until(lambda: _has_library(redis_client), timeout=30)
        await wait_until(lambda: _exists(redis_client, keys.live("a")), timeout=60)
        first = await _submit(redis_client, ledger)
        await wait_until(lambda: _completed(ledger, first), timeout=30)
        (done,) = await _completions(ledger, first)
        digest = done.digest

        # Refused by Redis: the ledger, another worker's inbox, any Lua of its own, a keyspace SCAN,
        # the list of inboxes.
        for command in (
            ("XADD", keys.events, "*", "type", "TaskCompleted"),
            ("XADD", keys.inbox("rtx3070ti"), "*", "type", "TaskCompleted"),
            ("EVAL", "while true do end", "0"),
            ("SCRIPT", "LOAD", "while true do end"),
            (
                "FUNCTION",
                "LOAD",
                "#!lua name=x\nredis.register_function('x', function() while true do end end)",
            ),
            ("FUNCTION", "DELETE", LIBRARY),
            ("FUNCTION", "FLUSH"),
            ("SCAN", "0"),
            ("KEYS", "*"),
            # Another worker's inbox off the list the ingest reads: its events would stop moving.
            ("SREM", keys.inboxes, "rtx3070ti"),
        ):
            with pytest.raises(NoPermissionError):
                await mallory.execute_command(*command)

        # Sent to its own inbox, and dead-lettered by the ingest with the reason.
        prompt = benchset()[0]
        zero = QualityScored(digest=digest, domain=prompt.domain, score=0.0, grader=REFERENCE, worker="a")
        forged: list[Event] = [_slow(f"t{i}", "rtx3070ti", digest) for i in range(FORGED)]
        forged += [_slow(first, "a", digest, done.attempt) for _ in range(FORGED)]
        forged += [
            zero,
            QualityScored(
                digest=digest,
                domain=prompt.domain,
                score=0.0,
                grader=REFERENCE,
                worker="a",
                task_id=f"bench-b0-{0}",
                bench_id="b0",
                prompt_id=prompt.id,
            ),
            TaskClaimed(task_id="victim", worker="a", digest=digest, attempt=1),
        ]
        await _append(mallory, keys.inbox("a"), forged)
        await wait_until(lambda: _dead_count(redis_client, len(forged)), timeout=60)
        reasons = [fields[b"reason"].decode() for fields in await _inbox_dead(redis_client)]
        assert len(reasons) == len(forged)
        assert reasons[0] == "TaskCompleted names worker 'rtx3070ti' but came from the inbox of 'a'"
        assert reasons[FORGED].startswith(f"no open claim by a of task {first} attempt {done.attempt}")
        assert "is not of a benchmark task" in reasons[2 * FORGED]
        assert "no claim by a of benchmark task bench-b0-0" in reasons[2 * FORGED + 1]
        assert reasons[-1] == "the claim names no queue entry"

        # The queue entries of its own runs were finished by the ingest (the worker may not).
        await wait_until(lambda: _drained(redis_client, keys.queue(digest)), timeout=30)
        await _queued_tasks_do_not_vanish(redis_client, mallory, keys, ledger)

        await _answers_only_for_its_own_runs(redis_client, mallory, keys, ledger, first)

        # The real worker, on the same credentials, serves the next task end to end, and the API
        # serves its answer from the worker's own keys.
        second = await _submit(redis_client, ledger)
        answer = await Gateway(redis_client, keys).wait(second, timeout_s=30)
        assert (answer.status, answer.worker) == ("completed", "a") and answer.text
        await wait_until(lambda: _completed(ledger, second), timeout=30)
        await wait_until(lambda: _drained(redis_client, keys.queue(digest)), timeout=30)
        assert proc.poll() is None
    finally:
        await mallory.aclose()
        await asyncio.to_thread(stop_all, [proc])
        stop.set()
        await projector
        await redis_client.execute_command("ACL", "DELUSER", "a")

    workers = {e.worker for e in await events_of(ledger, TaskCompleted)}
    assert workers == {"a"}
    assert [(e.worker, e.duplicate) for e in await _completions(ledger, first)] == [("a", False)]
    assert await events_of(ledger, QualityScored) == []
    # The live tables (folded while the forgeries came) still match a rebuild from the ledger.
    await Projector(redis_client, keys).catch_up()
    verify = await asyncio.to_thread(_replay_verify, redis_url, tmp_path / "archive")
    assert verify.returncode == 0, verify.stdout + verify.stderr


async def _queued_tasks_do_not_vanish(
    admin: aioredis.Redis, mallory: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    """Tasks queued for a model the worker's queues let it read: it cannot remove one (Redis refuses),
    and one it reads past without holding it (NOACK, or XCLAIM LASTID) the reaper puts back."""
    queues = TaskStore(admin, keys, ledger)
    queue = keys.queue("c" * 64)
    ids = [
        await queues.enqueue(
            queue, TaskMessage(task_id=f"victim-{i}", model="m", digest="c" * 64, messages=[])
        )
        for i in range(3)
    ]
    for command in (
        ("XACK", queue, WORKERS_GROUP, ids[0]),
        ("XDEL", queue, ids[0]),
        ("XTRIM", queue, "MAXLEN", "0"),
        ("XADD", queue, "MAXLEN", "0", "*", "f", "v"),
        ("DEL", queue),
        ("PEXPIRE", queue, "1"),
        ("XGROUP", "DESTROY", queue, WORKERS_GROUP),
        ("XGROUP", "SETID", queue, WORKERS_GROUP, "$"),
        ("XAUTOCLAIM", queue, WORKERS_GROUP, "m", "0", "0-0"),
    ):
        with pytest.raises(NoPermissionError):
            await mallory.execute_command(*command)
    # The library's functions run under the caller's ACL: the XACK/XDEL inside are refused too.
    await mallory.execute_command(
        "XREADGROUP", "GROUP", WORKERS_GROUP, "a", "COUNT", "1", "STREAMS", queue, ">"
    )
    for function, args in (
        (_FINISH_DEF.function, (WORKERS_GROUP, ids[0], "")),
        (_CANCEL_QUEUED_DEF.function, (WORKERS_GROUP, ids[1], REQUEUED_CONSUMER)),
    ):
        with pytest.raises(ResponseError, match="can't run this command"):
            await mallory.fcall(function, 1, queue, *args)  # type: ignore[no-untyped-call]
    # Read with NOACK (delivered, never pending), and skipped with XCLAIM LASTID: both allowed,
    # and neither leaves the task lost.
    await mallory.execute_command(
        "XREADGROUP", "GROUP", WORKERS_GROUP, "a", "NOACK", "COUNT", "1", "STREAMS", queue, ">"
    )
    await mallory.execute_command("XCLAIM", queue, WORKERS_GROUP, "a", "0", ids[0], "LASTID", ids[2])
    assert await admin.xlen(queue) == 3
    report = await Reaper(admin, keys, ReaperConfig()).sweep()
    assert report.revived == 2
    pending: Any = await admin.xpending_range(queue, WORKERS_GROUP, "-", "+", 10)
    assert {(r["message_id"].decode(), r["consumer"].decode()) for r in pending} == {
        (ids[0], "a"),
        (ids[1], REQUEUED_CONSUMER),
        (ids[2], REQUEUED_CONSUMER),
    }
    revived = [e for e in await events_of(ledger, TaskReclaimed) if e.owner == UNACKNOWLEDGED]
    assert sorted(e.task_id for e in revived) == ["victim-1", "victim-2"]
    await admin.delete(queue)
    await admin.srem(keys.queues, queue)


async def _answers_only_for_its_own_runs(
    admin: aioredis.Redis, mallory: aioredis.Redis, keys: Keys, ledger: Ledger, ran: str
) -> None:
    """It may write no task's shared output or result, nor another worker's; what it writes to its
    own keys for a task it does not run is never served."""
    victim = await _queued_elsewhere(admin, keys, ledger)
    forged = Result(task_id=victim, status="completed", worker="a", attempt=1, text="forged")
    chunk = {"c": encode_chunk(Chunk(attempt=1, text="forged", done=True)), "r": encode_result(forged)}
    for command in (
        ("HSET", keys.result(victim), "result", encode_result(forged), "status", "completed"),
        ("XADD", keys.out(victim), "*", *[x for kv in chunk.items() for x in kv]),
        ("HSET", keys.run_result("rtx3070ti", victim), "result", encode_result(forged)),
        ("XADD", keys.run_out("rtx3070ti", victim), "*", *[x for kv in chunk.items() for x in kv]),
    ):
        with pytest.raises(NoPermissionError):
            await mallory.execute_command(*command)
    # Its own keys it may write, for any task; the API reads them only for a task it runs or ran.
    await mallory.hset(
        keys.run_result("a", victim), mapping={"result": encode_result(forged), "status": "completed"}
    )
    await mallory.xadd(keys.run_out("a", victim), chunk)  # type: ignore[arg-type]
    gateway = Gateway(admin, keys)
    assert await gateway.result(victim) is None
    with pytest.raises(TaskTimeoutError):
        await gateway.wait(victim, timeout_s=1.5)
    # A task it did run is served from its own keys.
    served = await gateway.result(ran)
    assert served is not None and served.worker == "a" and served.text != "forged"


async def _queued_elsewhere(admin: aioredis.Redis, keys: Keys, ledger: Ledger) -> str:
    """A task submitted for a model no live worker serves: it waits in its queue."""
    queues = TaskStore(admin, keys, ledger)
    queue = keys.queue("d" * 64)
    task = TaskMessage(task_id="victim-answer", model="m", digest="d" * 64, messages=[])
    entry = await queues.enqueue(queue, task)
    await admin.hset(keys.task(task.task_id), mapping={"queue": queue, "entry": entry})
    return task.task_id


async def _drained(redis: aioredis.Redis, queue: str) -> bool:
    return int(await redis.xlen(queue)) == 0


def _replay_verify(redis_url: str, archive: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "routeledger", "replay", "verify", "--redis-url", redis_url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ROUTELEDGER_ARCHIVE_DIR": str(archive), "COLUMNS": "200"},
    )


async def _has_library(redis: aioredis.Redis) -> bool:
    return bool(await redis.function_list(library=LIBRARY))


async def _exists(redis: aioredis.Redis, key: str) -> bool:
    return bool(await redis.exists(key))


async def _completed(ledger: Ledger, task_id: str) -> bool:
    return bool(await _completions(ledger, task_id))


async def _dead_count(redis: aioredis.Redis, n: int) -> bool:
    return len(await _inbox_dead(redis)) >= n


async def test_on_redis_6_2_an_inbox_worker_answers_from_its_own_keys_and_the_ingest_finishes_its_entries(
    redis_62_server: Any, hosts: SimHosts, tmp_path: Path
) -> None:
    """Loopback, no ACLs: the same paths run on the bundled 6.2 (scripts by EVALSHA, no functions)."""
    url = redis_62_server.url
    admin = aioredis.Redis.from_url(url)
    await admin.flushall()
    keys = Keys()
    ledger = Ledger(admin, keys)
    stop = asyncio.Event()
    projector = asyncio.create_task(Projector(admin, keys, lease_ms=2000).run(stop))
    proc = spawn_worker(url, hosts.url("a"), "a", tmp_path / "worker.log", inbox=True)
    try:
        await wait_until(lambda: _exists(admin, keys.live("a")), timeout=60)
        task_id = await _submit(admin, ledger)
        answer = await Gateway(admin, keys).wait(task_id, timeout_s=30)
        assert (answer.status, answer.worker) == ("completed", "a") and answer.text
        assert await admin.exists(keys.result(task_id)) == 0
        await wait_until(lambda: _completed(ledger, task_id), timeout=30)
        (done,) = await _completions(ledger, task_id)
        await wait_until(lambda: _drained(admin, keys.queue(done.digest)), timeout=30)
        assert proc.poll() is None
    finally:
        await asyncio.to_thread(stop_all, [proc])
        stop.set()
        await projector
        await admin.aclose()
