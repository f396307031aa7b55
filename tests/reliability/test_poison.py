"""Hostile input: undecodable ledger entries, unknown event types, absurd values and a task for a
model its worker does not hold are dead-lettered or rejected with a reason, and never reach the
statistics."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
import redis.asyncio as aioredis

from events.event import QualityScored, TaskCompleted, TaskDeadLettered, TaskFailed, Timings
from events.keys import Keys
from events.ledger import Ledger
from projections import store
from projections.projector import Projector
from projections.reader import lag, snapshot
from replay.rebuild import build
from replay.verify import diff_tables
from sim.backends.hosts import SimHosts
from tasks.payload import TaskMessage
from tasks.store import TaskStore
from tests.helpers import events_of, fast_config, make_test_fleet, running_agent, wait_until

D1 = "a" * 64
T0 = 1_764_000_000_000


def done(task: str, timings: Timings, **kw: object) -> TaskCompleted:
    fields: dict[str, object] = {"attempt": 1, **kw}
    return TaskCompleted(at=T0, task_id=task, worker="w1", digest=D1, timings=timings, **fields)  # type: ignore[arg-type]


async def test_poison_ledger_entries_are_dead_lettered_with_a_reason_and_absurd_values_never_count(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    honest = Timings(
        eval_count=100, eval_duration=2 * 10**9, prompt_eval_count=50, prompt_eval_duration=10**8
    )
    await ledger.append(done("good", honest, ttft_ms=120.0))
    garbage = await redis_client.xadd(keys.events, {"type": "TaskCompleted", "v": "1", "data": b"\xc1\xff"})
    unknown = await redis_client.xadd(
        keys.events,
        {
            "type": "TaskTeleported",
            "v": "1",
            "data": msgspec.msgpack.encode({"type": "TaskTeleported", "at": T0}),
        },
    )
    no_data = await redis_client.xadd(keys.events, {"type": "TaskCompleted"})
    mislabelled = await redis_client.xadd(
        keys.events, {"type": "TaskFailed", "v": "1", "data": msgspec.msgpack.encode(done("x", honest))}
    )
    sane_ids = await ledger.append_many(
        [
            done("negative", Timings(eval_count=100, eval_duration=-(10**9), load_duration=-5), ttft_ms=-3.0),
            done(
                "warp",
                Timings(
                    eval_count=10**9, eval_duration=10**9, prompt_eval_count=10**12, prompt_eval_duration=1
                ),
            ),
            done("small-nonsense", Timings(eval_count=-7, eval_duration=10**9), ttft_ms=-1.0),
            QualityScored(at=T0, digest=D1, domain="general", score=7.0),
        ]
    )
    # What no column can hold (NaN, infinities) fails the schema: poison like the rest.
    nan, infinite = await ledger.append_many(
        [
            done("nan", Timings(eval_count=5, eval_duration=10**9), ttft_ms=float("nan")),
            QualityScored(at=T0, digest=D1, domain="general", score=float("-inf")),
        ]
    )
    assert len(sane_ids) == 4
    projector = Projector(redis_client, keys)
    await projector.start()
    await projector.catch_up()
    assert await lag(redis_client, keys) == (0, 0)

    letters = {f[b"entry_id"]: f[b"reason"].decode() for _, f in await redis_client.xrange(keys.dead)}
    assert {k.decode() for k in letters} == {
        x.decode() if isinstance(x, bytes) else x
        for x in (garbage, unknown, no_data, mislabelled, nan, infinite)
    }
    assert all(reason for reason in letters.values())
    assert "TaskTeleported" in letters[unknown] and "envelope says" in letters[mislabelled]
    assert "Expected" in letters[nan.encode()] and "Expected" in letters[infinite.encode()]

    snap = await snapshot(redis_client, keys)
    row = snap.speed["w1", D1]
    # Only the honest completion counts: 50 tok/s, 500 prompt tok/s, 0.12 s to the first token.
    assert (row.decode_tps.n, row.decode_tps.mean) == (1, pytest.approx(50.0))
    assert (row.prompt_tps.n, row.prompt_tps.mean) == (1, pytest.approx(500.0))
    assert (row.ttft_s.n, row.load_s.n) == (1, 0)
    # 100 tokens twice (good, negative: the count is sound, the duration is not); never 10^9.
    assert snap.length[D1, "general"].output_tokens.n == 2
    assert snap.length[D1, "general"].output_tokens.mean == pytest.approx(100.0)
    assert snap.quality == {}
    # The live tables and a rebuild agree on all of it.
    rebuilt, _ = await build(redis_client, keys)
    ns = await store.current(redis_client, keys)
    assert ns is not None
    assert diff_tables(await store.load(redis_client, keys, ns), rebuilt) == []
    assert rebuilt.speed["w1", D1].decode_tps.n == 1 and rebuilt.quality == {}


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=17) as sim:
        yield sim


async def test_a_task_for_a_model_its_worker_does_not_hold_and_a_malformed_entry_are_dead_lettered(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger, hosts: SimHosts
) -> None:
    queues = TaskStore(redis_client, keys, ledger)
    other = make_test_fleet().model["other"].digest
    # Pinned to `a`, which holds only `m`: a forged or stale pin.
    await queues.enqueue(keys.pinned("a"), TaskMessage(task_id="not-held", model="other", digest=other))
    await redis_client.xadd(keys.pinned("a"), {"task": b"\x00not msgpack", "attempt": "1", "id": "junk"})
    async with running_agent(redis_client, hosts.url("a"), fast_config("a", cooldown_s=0.05)):
        await wait_until(lambda: _letters(redis_client, keys, 2), timeout=30)
    reasons = sorted(f[b"reason"].decode() for _, f in await redis_client.xrange(keys.dead))
    assert reasons[0].startswith("delivery limit 3 reached; last failure: model_missing")
    assert reasons[1].startswith("malformed entry")
    failed = [f for f in await events_of(ledger, TaskFailed) if f.task_id == "not-held"]
    assert {f.kind for f in failed} == {"model_missing"} and len(failed) == 3
    assert [d.task_id for d in await events_of(ledger, TaskDeadLettered)] == ["not-held"]
    assert await events_of(ledger, TaskCompleted) == []
    assert await redis_client.xlen(keys.pinned("a")) == 0


async def _letters(redis: aioredis.Redis, keys: Keys, n: int) -> bool:
    return int(await redis.xlen(keys.dead)) >= n
