"""The synthetic history the long-run test and benchmark fold: seeded, realistic, consistent."""

from __future__ import annotations

from collections import Counter

import msgspec

from events.codec import decode_rows, encode_fields
from events.event import TaskCompleted, TaskRouted, TaskSubmitted
from sim.synthetic import HistoryMaker


def test_the_same_arguments_give_the_same_events_and_every_event_decodes_again() -> None:
    a = [e for batch in HistoryMaker(2_000, seed=3).batches(500) for e in batch]
    b = [e for batch in HistoryMaker(2_000, seed=3).batches(700) for e in batch]
    assert a == b
    rows = [(f"{i + 1}-0", _flat(encode_fields(e))) for i, e in enumerate(a)]
    poison: list[object] = []
    assert [e for _, e in decode_rows(rows, poison.append)] == a
    assert poison == []


def test_most_tasks_complete_once_and_each_carries_a_real_routing_decision() -> None:
    events = [e for batch in HistoryMaker(5_000).batches() for e in batch]
    kinds = Counter(type(e).__name__ for e in events)
    assert kinds["TaskSubmitted"] == kinds["TaskRouted"] == 5_000
    completed = {e.task_id for e in events if isinstance(e, TaskCompleted) and e.bench_id is None}
    assert 0.9 * 5_000 < len(completed) < 0.97 * 5_000
    routed = next(e for e in events if isinstance(e, TaskRouted))
    assert routed.expected_worker == "w00" and routed.breakdown
    submitted = [e.at for e in events if isinstance(e, TaskSubmitted)]
    assert submitted == sorted(submitted)


def _flat(fields: dict[str | bytes, object]) -> list[bytes]:
    out: list[bytes] = []
    for k, v in fields.items():
        out.append(k if isinstance(k, bytes) else k.encode())
        out.append(v if isinstance(v, bytes) else str(v).encode())
    return out


def test_an_event_of_the_history_fits_the_schema_bounds() -> None:
    for batch in HistoryMaker(1_000).batches():
        for e in batch:
            assert msgspec.msgpack.decode(msgspec.msgpack.encode(e), type=type(e)) == e
