"""The entry index: a task's or a pipeline's events come from the ids its row lists and the unfolded
tail, never from a scan of the ledger."""

from __future__ import annotations

from typing import Any

import httpx
import redis.asyncio as aioredis

from api.app import AppConfig
from events.event import (
    Event,
    PipelineChildAdded,
    PipelineCompleted,
    PipelineStarted,
    QualityScored,
    TaskClaimed,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskSubmitted,
    Timings,
)
from events.keys import Keys
from events.ledger import Ledger
from pipelines.history import pipeline_from_ledger
from projections import store
from projections.index import pipeline_events, task_events
from projections.projector import Projector
from projections.snapshot import add_entry, entry_ids
from replay.rebuild import rebuild
from replay.verify import verify
from tests.test_api_support import ghost_worker, serving

D = "d" * 64
Q = "rl:q:dddddddddddd"


def task_story(task_id: str, at: int, pipeline_id: str | None = None, worker: str = "w1") -> list[Event]:
    """A task that fails once, runs again and completes: six events, routing decision included."""
    return [
        TaskSubmitted(at=at, task_id=task_id, model="m", digest=D, queue=Q, pipeline_id=pipeline_id),
        TaskRouted(at=at, task_id=task_id, digest=D, queue=Q, breakdown={"w1": {"score": 1.0}}),
        TaskClaimed(at=at + 1, task_id=task_id, worker=worker, digest=D, attempt=1),
        TaskFailed(
            at=at + 2, task_id=task_id, worker=worker, digest=D, attempt=1, kind="backend", retryable=True
        ),
        TaskClaimed(at=at + 3, task_id=task_id, worker=worker, digest=D, attempt=2),
        TaskCompleted(
            at=at + 4,
            task_id=task_id,
            worker=worker,
            digest=D,
            attempt=2,
            timings=Timings(eval_count=10, eval_duration=10**9),
            wall_ms=500.0,
        ),
    ]


async def append_tasks(ledger: Ledger, n: int, prefix: str = "other") -> None:
    """`n` tasks of six events each, appended in batches (the long ledger the index must not read)."""
    events = [e for i in range(n) for e in task_story(f"{prefix}-{i}", 1_764_000_000_000 + i)]
    for start in range(0, len(events), 2000):
        await ledger.append_many(events[start : start + 2000])


async def project(redis: aioredis.Redis, keys: Keys) -> Projector:
    projector = Projector(redis, keys)
    await projector.start()
    await projector.catch_up()
    return projector


async def xrange_calls(redis: aioredis.Redis) -> int:
    """XRANGE commands Redis has run so far (INFO commandstats)."""
    stats: Any = await redis.info("commandstats")
    return int(stats.get("cmdstat_xrange", {}).get("calls", 0))


async def scanned(ledger: Ledger, task_id: str) -> list[tuple[str, Event]]:
    """What the whole-ledger scan found: every event naming the task, in order (the reference)."""
    return [(i, e) async for i, e in ledger.read() if getattr(e, "task_id", None) == task_id]


def test_entry_ids_survive_packing_and_cost_a_few_bytes_each() -> None:
    ids = [(1_764_000_000_000, 0), (1_764_000_000_000, 1), (1_764_000_000_050, 0), (1_764_000_030_050, 7)]
    packed: list[int] = []
    for ms, seq in ids:
        add_entry(packed, ms, seq)
    assert entry_ids(packed) == [f"{ms}-{seq}" for ms, seq in ids]
    assert packed[2:] == [0, 1, 50, 0, 30_000, 7]


async def test_a_folded_task_s_events_come_back_complete_and_in_order_from_its_row(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await append_tasks(ledger, 200, "before")
    await ledger.append_many(task_story("t1", 1_764_100_000_000))
    await append_tasks(ledger, 200, "after")
    await project(redis_client, keys)

    before = await xrange_calls(redis_client)
    found = await task_events(redis_client, keys, "t1")
    calls = await xrange_calls(redis_client) - before

    assert found.events == await scanned(ledger, "t1")
    assert [type(e).__name__ for _, e in found.events] == [type(e).__name__ for e in task_story("t1", 0)]
    # One XRANGE per listed entry and one for the (empty) tail: nothing else of 2,406 entries.
    assert (found.indexed, found.tail_read, found.tail_cut) == (6, 0, False)
    assert calls == 7


async def test_a_task_s_events_come_back_from_the_unfolded_tail_and_across_the_checkpoint(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    story = task_story("t1", 1_764_100_000_000)
    await append_tasks(ledger, 50)
    await ledger.append_many(story[:3])
    projector = await project(redis_client, keys)
    await ledger.append_many(story[3:])
    await append_tasks(ledger, 5, "late")

    across = await task_events(redis_client, keys, "t1")
    assert across.events == await scanned(ledger, "t1")
    assert (across.indexed, across.tail_read) == (3, 3 + 5 * 6)

    await redis_client.delete(keys.current)  # no projection at all: everything is tail
    only_tail = await task_events(redis_client, keys, "t1", tail_max=100_000)
    assert only_tail.events == across.events and only_tail.indexed == 0
    assert projector.folded > 0


async def test_a_stopped_projector_cuts_the_tail_at_its_bound_and_says_so(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await project(redis_client, keys)  # an empty namespace, checkpoint at the start
    await append_tasks(ledger, 20)
    await ledger.append_many(task_story("t1", 1_764_100_000_000))

    cut = await task_events(redis_client, keys, "t1", tail_max=60)
    whole = await task_events(redis_client, keys, "t1", tail_max=1000)

    assert cut.tail_cut and cut.tail_read == 60 and cut.events == []
    assert not whole.tail_cut and whole.events == await scanned(ledger, "t1")


async def test_unknown_task_and_pipeline_ids_are_answered_without_reading_the_ledger(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await append_tasks(ledger, 500)
    await project(redis_client, keys)
    assert await ledger.length() == 3000

    before = await xrange_calls(redis_client)
    task = await task_events(redis_client, keys, "nope")
    pipeline = await pipeline_events(redis_client, keys, "nope")
    tree = await pipeline_from_ledger(ledger, "nope")
    calls = await xrange_calls(redis_client) - before

    assert task.events == pipeline.events == [] and tree is None
    assert (task.indexed, task.tail_read, pipeline.indexed, pipeline.tail_read) == (0, 0, 0, 0)
    # Each lookup's one XRANGE is the tail after the checkpoint, which is empty.
    assert calls == 3


async def test_deleting_an_unknown_task_is_a_404_that_reads_no_ledger_entry(
    redis_client: aioredis.Redis, redis_url: str, keys: Keys, ledger: Ledger
) -> None:
    await append_tasks(ledger, 500)
    await project(redis_client, keys)
    await ghost_worker(redis_client)
    async with serving(AppConfig(redis_url=redis_url)) as base, httpx.AsyncClient(base_url=base) as http:
        before = await xrange_calls(redis_client)
        gone = await http.delete("/v1/tasks/nope")
        history = await http.get("/v1/tasks/nope/events")
        calls = await xrange_calls(redis_client) - before
    assert gone.status_code == history.status_code == 404
    assert gone.json()["error"]["type"] == "not_found"
    assert calls == 2


def pipeline_story(pid: str, at: int) -> list[Event]:
    """A pipeline of a decomposer, two children and an integration, all completed."""
    parts = [("dec", "decomposer", 0), ("c0", "child", 0), ("c1", "child", 1), ("int", "integration", 0)]
    out: list[Event] = []
    for n, (name, role, index) in enumerate(parts):
        story = task_story(f"{pid}-{name}", at + 10 * n, pid, worker=f"w{index}")
        if name == "c0":
            out.append(PipelineStarted(at=at + 10 * n, pipeline_id=pid, fan_out=2, capacity=2))
        out += story[:2]
        out.append(
            PipelineChildAdded(
                at=at + 10 * n, pipeline_id=pid, task_id=f"{pid}-{name}", role=role, index=index
            )
        )
        out += story[2:]
    out.append(PipelineCompleted(at=at + 100, pipeline_id=pid, ok=True, integration_task_id=f"{pid}-int"))
    return out


async def test_a_pipeline_whose_hash_expired_is_told_from_the_index_folded_or_not(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await append_tasks(ledger, 100)
    await ledger.append_many(pipeline_story("p1", 1_764_100_000_000))
    await project(redis_client, keys)
    story = pipeline_story("p2", 1_764_200_000_000)
    await ledger.append_many(story[:9])
    await project(redis_client, keys)
    await ledger.append_many(story[9:])  # the rest of p2 only in the tail

    for pid in ("p1", "p2"):
        assert not await redis_client.exists(keys.pipeline(pid))
        view = await pipeline_from_ledger(ledger, pid)
        assert view is not None and view["from_ledger"]
        assert view["status"] == "completed" and view["fan_out"] == 2
        assert [(c["task_id"], c["worker"], c["status"]) for c in view["children"]] == [
            (f"{pid}-c0", "w0", "completed"),
            (f"{pid}-c1", "w1", "completed"),
        ]
        assert view["integration"]["status"] == "completed"
        assert [d["task_id"] for d in view["decomposer"]] == [f"{pid}-dec"]
    folded = await pipeline_events(redis_client, keys, "p1")
    assert folded.indexed == len(pipeline_story("p1", 0)) and folded.tail_read == len(story) - 9


async def test_a_rebuild_reproduces_the_entry_lists_of_tasks_and_pipelines(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await ledger.append_many(
        [
            # Mentions of a task before it exists, and of one that never does: listed nowhere.
            TaskRouted(at=1, task_id="early", digest=D, queue=Q),
            QualityScored(digest=D, domain="general", score=0.5, task_id="ghost"),
            *task_story("early", 2),
            QualityScored(digest=D, domain="general", score=0.5, task_id="early"),
        ]
    )
    await append_tasks(ledger, 30)
    await ledger.append_many(pipeline_story("p1", 1_764_100_000_000))
    await project(redis_client, keys)
    live_ns = await store.current(redis_client, keys)
    assert live_ns is not None
    live = await store.load(redis_client, keys, live_ns)

    result = await rebuild(redis_client, keys)
    assert result.namespace is not None
    rebuilt = await store.load(redis_client, keys, result.namespace)

    assert {t: r.entries for t, r in rebuilt.tasks.items()} == {t: r.entries for t, r in live.tasks.items()}
    assert rebuilt.pipelines == live.pipelines and set(live.pipelines) == {"p1"}
    assert "ghost" not in live.tasks and len(entry_ids(live.tasks["early"].entries)) == 7
    assert live.pipelines["p1"].tasks == ["p1-dec", "p1-c0", "p1-c1", "p1-int"]
    _, differences = await verify(redis_client, keys)
    assert differences == []
