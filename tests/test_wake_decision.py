"""Whether waking a sleeping machine pays (router.wake), and the magic packet that wakes it
(dispatch.wake): pure tests, and a packet sent only to a UDP listener on loopback."""

from __future__ import annotations

import socket

import pytest

from dispatch.errors import WakeError
from dispatch.wake import (
    CONFIGURED,
    MEASURED,
    SleepRecord,
    WakeTime,
    magic_packet,
    normalize_mac,
    send_magic_packet,
)
from events.event import WakeFailed, WakeRequested, WorkerOnline
from projections.folder import Folder
from projections.snapshot import FleetRow, Stamped
from projections.tables import Tables
from router.choose import RouteQuery
from router.estimate import Estimator, build_estimator
from router.plan import BacklogEntry, FleetView, WorkerView
from router.wake import Sleeper, WakeParams, decide_wake, sleeping_candidate
from tests.router_helpers import NOW, QWEN, snapshot, speed_row

MAC = "AA:BB:CC:DD:EE:FF"


def _seed_estimator() -> Estimator:
    """The story's two machines as the tables remember them: the laptop at 11.4 tok/s, the GPU PC
    (asleep now) at 83, answers of 600 tokens."""
    snap = snapshot(
        [
            speed_row("macbookair", QWEN, 11.4, 50, prompt=120.0, load=8.0),
            speed_row("rtx3070ti", QWEN, 83.0, 50, prompt=2000.0, load=3.0),
        ],
        lengths={(QWEN, "general"): 600.0},
    )
    return build_estimator(snap, NOW)


def _view(tasks: int, cap: int | None = None) -> FleetView:
    laptop = WorkerView(name="macbookair", slots=1, holds={QWEN}, loaded={QWEN})
    backlog = [
        BacklogEntry(task_id=f"t{i}", digest=QWEN, enqueued_at_ms=NOW, prompt_tokens=64, max_tokens=cap)
        for i in range(tasks)
    ]
    return FleetView(workers=[laptop], backlog={QWEN: backlog})


GPU = Sleeper(name="rtx3070ti", slots=1, holds=frozenset({QWEN}), wake_s=90.0)


def test_a_burst_the_laptop_would_take_minutes_over_wakes_the_gpu_pc() -> None:
    d = decide_wake(_view(10), _seed_estimator(), QWEN, GPU, NOW)
    assert d.wake, d.reason
    # The laptop alone: ten answers of 600 tokens at about 11-13 tok/s (its speed shrunk a little
    # to the prior), some eight minutes.
    assert 400 < d.makespan_without_s < 600
    # Awake after 90 s, the GPU PC (3 s load, 7 s an answer) takes most of the burst.
    assert d.makespan_with_s < 200
    assert d.given >= 6
    assert d.gain_s == pytest.approx(d.makespan_without_s - d.makespan_with_s)
    assert d.wake_s == 90.0 and d.wake_source == "configured"


def test_a_short_task_the_awake_laptop_finishes_sooner_wakes_nothing() -> None:
    d = decide_wake(_view(1, cap=8), _seed_estimator(), QWEN, GPU, NOW)
    assert not d.wake
    assert d.given == 0
    assert d.makespan_with_s == d.makespan_without_s
    assert "awake" in d.reason


def test_a_gain_under_the_margin_wakes_nothing() -> None:
    # Three tasks: the laptop alone finishes the third at about 140 s; the GPU PC, awake at 90 s,
    # would finish it at about 100 s. That pays by the default margin, not by one of 60 s.
    est = _seed_estimator()
    assert decide_wake(_view(3), est, QWEN, GPU, NOW).wake
    d = decide_wake(_view(3), est, QWEN, GPU, NOW, params=WakeParams(margin_s=60.0))
    assert not d.wake
    assert d.given == 1
    assert 0 < d.gain_s <= d.needed_s


def test_a_slow_wake_is_counted_against_the_gain() -> None:
    slow = Sleeper(name="rtx3070ti", slots=1, holds=frozenset({QWEN}), wake_s=600.0)
    d = decide_wake(_view(10), _seed_estimator(), QWEN, slow, NOW)
    assert not d.wake
    assert d.given == 0


def test_a_machine_that_does_not_serve_the_model_is_not_woken_for_it() -> None:
    other = Sleeper(name="rtx3070ti", slots=1, holds=frozenset({"f" * 64}), wake_s=1.0)
    d = decide_wake(_view(10), _seed_estimator(), QWEN, other, NOW)
    assert not d.wake and d.reason == "it does not serve this model"


def test_nothing_queued_wakes_nothing() -> None:
    d = decide_wake(_view(0), _seed_estimator(), QWEN, GPU, NOW)
    assert not d.wake and d.tasks == 0


def test_the_decision_leaves_the_view_as_it_was() -> None:
    view = _view(10)
    before = [(w.name, sorted(w.holds), sorted(w.loaded)) for w in view.workers]
    decide_wake(view, _seed_estimator(), QWEN, GPU, NOW)
    assert [(w.name, sorted(w.holds), sorted(w.loaded)) for w in view.workers] == before
    assert len(view.backlog[QWEN]) == 10


def test_the_magic_packet_is_six_ff_then_the_mac_sixteen_times() -> None:
    packet = magic_packet("aa-bb-cc-dd-ee-ff")
    assert len(packet) == 102
    assert packet[:6] == b"\xff" * 6
    assert packet[6:] == bytes.fromhex("aabbccddeeff") * 16


@pytest.mark.parametrize(
    "bad", ["", "AA:BB:CC:DD:EE", "AA:BB:CC:DD:EE:GG", "AA:BB-CC:DD:EE:FF", "AABBCCDDEEFF00"]
)
def test_a_malformed_mac_is_refused(bad: str) -> None:
    with pytest.raises(WakeError):
        normalize_mac(bad)


def test_a_mac_is_normalised_to_upper_case_pairs_with_colons() -> None:
    assert normalize_mac("aabbccddeeff") == MAC
    assert normalize_mac("aa-bb-cc-dd-ee-ff") == MAC


def test_the_packet_arrives_at_a_loopback_listener() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.settimeout(5.0)
        port = listener.getsockname()[1]
        send_magic_packet(MAC, "127.0.0.1", port)
        data, _ = listener.recvfrom(1024)
    assert data == magic_packet(MAC)


def test_the_record_counts_the_wake_time_the_ledger_measured_once_there_is_one() -> None:
    rec = SleepRecord(worker="rtx3070ti", mac=MAC, wake_s=90.0)
    assert rec.wake_time() == WakeTime(seconds=90.0, source=CONFIGURED)
    assert rec.bound_s() == 270.0
    row = FleetRow(worker="rtx3070ti")
    assert rec.wake_time(row, NOW).source == CONFIGURED
    row.wake_s = Stamped(value=5.0, at=NOW - 60_000)
    assert rec.wake_time(row, NOW) == WakeTime(seconds=5.0, source=MEASURED, age_s=60.0)
    # Never a bound shorter than the minimum: a fast wake may still be slow once.
    assert rec.bound_s(5.0) == 30.0


def test_a_sleeping_machine_is_a_candidate_with_its_wake_time_and_its_source() -> None:
    view = _view(3)
    measured = Sleeper(
        name="rtx3070ti", slots=1, holds=frozenset({QWEN}), wake_s=75.0, wake_source="measured"
    )
    row = sleeping_candidate(view, _seed_estimator(), QWEN, measured, NOW, RouteQuery(max_tokens=200))
    assert row is not None
    terms, fields = row["terms"], row["fields"]
    assert isinstance(terms, dict) and isinstance(fields, dict)
    assert row["asleep"] is True
    assert terms["wake_s"] == 75.0 and fields["wake_s"]["source"] == "measured"
    # It waits for its wake and for the queued task the plan gives it (which pays the load).
    assert terms["wait_s"] > 75.0 and terms["load_s"] == 0
    assert row["expected_finish_s"] == pytest.approx(
        terms["wait_s"] + terms["load_s"] + terms["prompt_s"] + terms["decode_s"]
    )
    assert isinstance(row["wake"], dict) and row["wake"]["wake"] is True
    assert sleeping_candidate(view, _seed_estimator(), "f" * 64, measured, NOW) is None
    # Nothing queued: it waits for its wake alone, and a machine that just booted loads the model.
    idle = sleeping_candidate(_view(0), _seed_estimator(), QWEN, measured, NOW)
    assert idle is not None and isinstance(idle["terms"], dict)
    assert idle["terms"]["wait_s"] == 75.0 and idle["terms"]["load_s"] > 0


def test_the_fold_measures_a_wake_from_its_request_to_the_next_worker_online() -> None:
    tables = Tables()
    folder = Folder(tables)
    t0 = NOW
    folder.apply(WakeRequested(at=t0, worker="rtx3070ti", why="plan"))
    assert tables.fleet["rtx3070ti"].wake_pending == t0
    folder.apply(WorkerOnline(at=t0 + 75_000, worker="rtx3070ti", slots=1))
    row = tables.fleet["rtx3070ti"]
    assert row.wake_s.value == 75.0 and row.wake_s.at == t0 + 75_000 and row.wake_pending is None
    # A later start with no request measures nothing; a request given up on measures nothing either.
    folder.apply(WorkerOnline(at=t0 + 500_000, worker="rtx3070ti", slots=1))
    folder.apply(WakeRequested(at=t0 + 600_000, worker="rtx3070ti", why="plan"))
    folder.apply(WakeFailed(at=t0 + 900_000, worker="rtx3070ti", waited_s=300.0))
    folder.apply(WorkerOnline(at=t0 + 4_000_000, worker="rtx3070ti", slots=1))
    assert row.wake_s.value == 75.0 and row.wake_pending is None
