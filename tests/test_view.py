"""The router's view of the fleet, built as production builds it: from the live leases."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from dispatch.view import LiveView, fleet_view, with_own, worker_views
from events.event import ModelEntry
from events.keys import Keys
from projections.snapshot import DemandRow
from tasks.lease import LeaseInfo, RunningInfo
from tests.router_helpers import NOW, QWEN, backlog, snapshot, stat

QWEN_ENTRY = ModelEntry(name="qwen3:8b", digest=QWEN)

pytestmark = pytest.mark.cluster_tier


def lease(name: str, *, since: int, **fields: object) -> LeaseInfo:
    return LeaseInfo(worker=name, token="t", slots=1, inventory=[QWEN_ENTRY], since=since, **fields)  # type: ignore[arg-type]


def test_a_fleet_view_keeps_live_servers_only_and_reads_the_arrival_rate_from_demand() -> None:
    snap = snapshot()
    snap.demand[QWEN] = DemandRow(digest=QWEN, arrivals=stat([1.0] * 60))
    # macbookair has no lease: it is offline, whatever the ledger last said of it.
    leases = {
        "rtx3070ti": lease("rtx3070ti", since=1, loaded=[QWEN]),
        "ai-core": lease("ai-core", since=2, serves=[]),
    }
    fv = fleet_view(leases, {QWEN: backlog(QWEN, 2)}, snap, NOW)
    assert [w.name for w in fv.workers] == ["rtx3070ti", "ai-core"]
    assert [w.name for w in fv.holders(QWEN)] == ["rtx3070ti"]
    assert fv.arrival_rate[QWEN] > 0.0


def test_a_draining_worker_is_not_in_the_view_and_holds_nothing_for_the_plan() -> None:
    leases = {
        "rtx3070ti": lease("rtx3070ti", since=1, draining=True),
        "macbookair": lease("macbookair", since=2),
    }
    fv = fleet_view(leases, {QWEN: []}, snapshot(), NOW)
    assert [w.name for w in fv.workers] == ["macbookair"]
    assert [w.name for w in fv.holders(QWEN)] == ["macbookair"]


def test_a_worker_sees_itself_as_it_is_now_in_its_place_among_the_views_of_the_others() -> None:
    leases = {name: lease(name, since=i) for i, name in enumerate(["a", "me", "b"])}
    views = worker_views(leases)
    now = lease("me", since=1, running=[RunningInfo(task_id="t1", digest=QWEN, started_at=NOW)])
    mine = with_own(views, now)
    assert mine is not None and [w.name for w in mine] == ["a", "me", "b"]
    assert [t.task_id for t in mine[1].running] == ["t1"] and not views[1].running
    drained = with_own(views, lease("me", since=1, draining=True))
    assert drained is not None and [w.name for w in drained] == ["a", "b"]
    # Not among them (it came online since the leases were read): only a rebuild knows its place.
    assert with_own(views, lease("new", since=5)) is None


async def test_the_views_of_one_read_of_the_leases_are_built_once(redis_client: aioredis.Redis) -> None:
    view = LiveView(redis_client, Keys.for_client(redis_client))
    first = {"a": lease("a", since=1)}
    assert view.worker_views(first) is view.worker_views(first)
    again = {"a": lease("a", since=1), "b": lease("b", since=2)}
    assert [w.name for w in view.worker_views(again)] == ["a", "b"]


async def test_a_model_is_resolved_once_per_read_of_the_leases(redis_client: aioredis.Redis) -> None:
    view = LiveView(redis_client, Keys.for_client(redis_client))
    first = {"a": lease("a", since=1)}
    assert view.resolve("qwen3:8b", first) == {"qwen3:8b": QWEN}
    assert view.resolve("auto", first) is view.resolve("auto", first)
    assert view.resolve("llama3", first) is None
    # A new read answers from the new leases: nobody serves qwen3 once its only holder drains.
    assert view.resolve("qwen3:8b", {"a": lease("a", since=1, draining=True)}) is None


def test_a_queued_task_read_as_it_streams_reaches_the_plan_paced_and_an_old_entry_does_not() -> None:
    from dispatch.view import _entries
    from tasks.payload import F_TASK, TaskMessage, encode_task

    rows = [
        ("1-0", {F_TASK: encode_task(TaskMessage(task_id="read", model="m", digest=QWEN, paced=True))}),
        ("2-0", {F_TASK: encode_task(TaskMessage(task_id="waited", model="m", digest=QWEN, stream=False))}),
    ]
    read, waited = _entries(QWEN, rows, "q")
    assert (read.task_id, read.paced) == ("read", True)
    assert (waited.task_id, waited.paced) == ("waited", False)


async def test_one_models_backlog_and_several_models_backlogs_are_each_read_whole(
    redis_client: aioredis.Redis,
) -> None:
    # (How many asyncio tasks a read makes is redis-py's business now: routeledger reads through
    # its public client, whose commands make their own.)
    from tasks.store import TaskStore

    keys = Keys.for_client(redis_client)
    view = LiveView(redis_client, keys)
    queues = TaskStore(redis_client, keys)
    for digest in ("d1", "d2"):
        await queues.ensure_group(keys.queue(digest))
        await redis_client.xadd(keys.queue(digest), {"task": b"not a task", "id": f"t-{digest}"})
    one = await view.backlogs(["d1"])
    both = await view.backlogs(["d1", "d2"])
    assert [e.task_id for e in one["d1"]] == ["t-d1"]
    assert {d: [e.task_id for e in q] for d, q in both.items()} == {"d1": ["t-d1"], "d2": ["t-d2"]}
