"""The router's view of the fleet, built as production builds it: from the live leases."""

from __future__ import annotations

from dispatch.lease import LeaseInfo
from dispatch.view import fleet_view
from events.event import ModelEntry
from projections.snapshot import DemandRow
from tests.router_helpers import NOW, QWEN, backlog, snapshot, stat

QWEN_ENTRY = ModelEntry(name="qwen3:8b", digest=QWEN)


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
