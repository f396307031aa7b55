"""The ledger as polars frames: one frame per event kind the tables need, columns per field.

Decoded events are bucketed by type and turned into columns in bulk (a list comprehension per
field, every `FLUSH_EVERY` events), so that the Python objects of a chunk are dropped early and
memory stays bounded by the columns. `seq` is the ledger order (0, 1, …) of decodable entries.

Worker reports carry nested values (inventory, loaded models, resources) that only the newest
report of each worker needs: they stay Python objects, and each flush keeps only the reports that
can still win, so a ledger full of heartbeats does not pile them up.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any, Final

import polars as pl

from events.event import (
    BenchmarkResult,
    Event,
    QualityScored,
    TaskCancelled,
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskFailed,
    TaskReclaimed,
    TaskStalled,
    TaskSubmitted,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
)

FLUSH_EVERY: Final = 100_000

ONLINE: Final = 0
HEARTBEAT: Final = 1

_I64: Final = pl.Int64
_F64: Final = pl.Float64
_STR: Final = pl.String
_BOOL: Final = pl.Boolean

# Column name -> (dtype, attribute path on the event).
Columns = dict[str, tuple[pl.DataType | type[pl.DataType], str]]

_TIMINGS: Final[Columns] = {
    "prompt_eval_count": (_I64, "timings.prompt_eval_count"),
    "prompt_eval_duration": (_I64, "timings.prompt_eval_duration"),
    "eval_count": (_I64, "timings.eval_count"),
    "eval_duration": (_I64, "timings.eval_duration"),
    "load_duration": (_I64, "timings.load_duration"),
    "ttft_ms": (_F64, "ttft_ms"),
    "in_flight": (_I64, "in_flight"),
}

# Per event kind: its frame name and the columns taken from it (besides `seq`).
KINDS: Final[dict[type[Event], tuple[str, Columns]]] = {
    TaskSubmitted: (
        "submitted",
        {
            "at": (_I64, "at"),
            "task_id": (_STR, "task_id"),
            "model": (_STR, "model"),
            "digest": (_STR, "digest"),
            "domain": (_STR, "domain"),
            "queue": (_STR, "queue"),
            "pipeline_id": (_STR, "pipeline_id"),
        },
    ),
    TaskClaimed: (
        "claimed",
        {
            "at": (_I64, "at"),
            "task_id": (_STR, "task_id"),
            "worker": (_STR, "worker"),
            "attempt": (_I64, "attempt"),
        },
    ),
    TaskCompleted: (
        "completed",
        {
            "at": (_I64, "at"),
            "task_id": (_STR, "task_id"),
            "worker": (_STR, "worker"),
            "digest": (_STR, "digest"),
            "domain": (_STR, "domain"),
            "attempt": (_I64, "attempt"),
            "duplicate": (_BOOL, "duplicate"),
            "bench_id": (_STR, "bench_id"),
            "wall_ms": (_F64, "wall_ms"),
            **_TIMINGS,
        },
    ),
    TaskFailed: (
        "failed",
        {
            "task_id": (_STR, "task_id"),
            "worker": (_STR, "worker"),
            "attempt": (_I64, "attempt"),
            "kind": (_STR, "kind"),
            "retryable": (_BOOL, "retryable"),
            "message": (_STR, "message"),
        },
    ),
    TaskReclaimed: (
        "reclaimed",
        {
            "task_id": (_STR, "task_id"),
            "owner": (_STR, "owner"),
            "attempt": (_I64, "attempt"),
        },
    ),
    TaskStalled: ("stalled", {"task_id": (_STR, "task_id")}),
    TaskDeadLettered: (
        "dead",
        {
            "task_id": (_STR, "task_id"),
            "reason": (_STR, "reason"),
            "attempts": (_I64, "attempts"),
        },
    ),
    TaskCancelled: ("cancelled", {"task_id": (_STR, "task_id")}),
    WorkerOffline: (
        "offline",
        {
            "at": (_I64, "at"),
            "worker": (_STR, "worker"),
            "reason": (_STR, "reason"),
        },
    ),
    BenchmarkResult: (
        "bench",
        {
            "at": (_I64, "at"),
            "bench_id": (_STR, "bench_id"),
            "task_id": (_STR, "task_id"),
            "worker": (_STR, "worker"),
            "digest": (_STR, "digest"),
            **_TIMINGS,
        },
    ),
    QualityScored: (
        "quality",
        {
            "at": (_I64, "at"),
            "digest": (_STR, "digest"),
            "domain": (_STR, "domain"),
            "score": (_F64, "score"),
        },
    ),
}

_REPORT_SCHEMA: Final = {"seq": _I64, "at": _I64, "worker": _STR, "kind": pl.Int8, "ref": _I64}


def _schema(columns: Columns) -> dict[str, Any]:
    return {"seq": _I64, **{name: dtype for name, (dtype, _) in columns.items()}}


class Frames:
    """Collects decoded ledger batches as columns; `frame(name)` is the whole kind as one frame."""

    def __init__(self) -> None:
        self.events = 0
        self._seq = 0
        self._buckets: dict[type[Event], tuple[list[int], list[Event]]] = {}
        self._frames: dict[str, list[pl.DataFrame]] = {name: [] for name, _ in KINDS.values()}
        # Worker reports (WorkerOnline and WorkerHeartbeat): the ones that can still win, with
        # their objects in `reports`, indexed by the `ref` column.
        self.reports: list[WorkerOnline | WorkerHeartbeat] = []
        self._report_frame = pl.DataFrame(schema=_REPORT_SCHEMA)
        self._pending = 0

    def add(self, batch: Sequence[tuple[str, Event]]) -> None:
        """Take a decoded batch, in ledger order."""
        buckets = self._buckets
        seq = self._seq
        for _, event in batch:
            kind = type(event)
            bucket = buckets.get(kind)
            if bucket is None:
                bucket = buckets[kind] = ([], [])
            bucket[0].append(seq)
            bucket[1].append(event)
            seq += 1
        self._pending += seq - self._seq
        self._seq = seq
        self.events += len(batch)
        if self._pending >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Turn the buffered events into columns."""
        for kind, (seqs, events) in self._buckets.items():
            if kind in (WorkerOnline, WorkerHeartbeat):
                self._add_reports(seqs, events, ONLINE if kind is WorkerOnline else HEARTBEAT)
                if kind is WorkerOnline:
                    self._add_status(seqs, events)
                continue
            spec = KINDS.get(kind)
            if spec is None:
                continue
            name, columns = spec
            data: dict[str, list[Any]] = {"seq": seqs}
            for col, (_, path) in columns.items():
                data[col] = list(map(attrgetter(path), events))
            self._frames[name].append(pl.DataFrame(data, schema=_schema(columns)))
        self._buckets = {}
        self._pending = 0
        self._compact_reports()

    def _add_status(self, seqs: list[int], events: list[Event]) -> None:
        online: list[WorkerOnline] = events  # type: ignore[assignment]
        frame = pl.DataFrame(
            {
                "seq": seqs,
                "at": [e.at for e in online],
                "worker": [e.worker for e in online],
                "reason": ["online"] * len(online),
            },
            schema=_schema(KINDS[WorkerOffline][1]),
        )
        self._frames["online"] = [*self._frames.get("online", []), frame]

    def _add_reports(self, seqs: list[int], events: list[Event], kind: int) -> None:
        base = len(self.reports)
        reports: list[WorkerOnline | WorkerHeartbeat] = events  # type: ignore[assignment]
        self.reports.extend(reports)
        frame = pl.DataFrame(
            {
                "seq": seqs,
                "at": [e.at for e in reports],
                "worker": [e.worker for e in reports],
                "kind": [kind] * len(reports),
                "ref": list(range(base, base + len(reports))),
            },
            schema=_REPORT_SCHEMA,
        )
        self._report_frame = pl.concat([self._report_frame, frame])

    def _compact_reports(self) -> None:
        """Keep only each worker's newest report and newest heartbeat (by producer clock, then order)."""
        frame = self._report_frame
        if frame.height == 0:
            return
        newest = frame.sort("at", "seq").group_by("worker").last()
        beats = frame.filter(pl.col("kind") == HEARTBEAT).sort("at", "seq").group_by("worker").last()
        keep = pl.concat([newest, beats]).unique("seq").sort("seq")
        refs = keep["ref"].to_list()
        self.reports = [self.reports[r] for r in refs]
        renumbered = keep.with_columns(pl.int_range(pl.len(), dtype=_I64).alias("ref"))
        self._report_frame = renumbered.select(list(_REPORT_SCHEMA))

    def frame(self, name: str) -> pl.DataFrame:
        """Every event of one kind as one frame (empty, with the right columns, when there is none)."""
        parts = self._frames.get(name, [])
        if parts:
            return pl.concat(parts)
        if name == "online":
            return pl.DataFrame(schema=_schema(KINDS[WorkerOffline][1]))
        columns = next(cols for n, cols in KINDS.values() if n == name)
        return pl.DataFrame(schema=_schema(columns))

    @property
    def report_frame(self) -> pl.DataFrame:
        """Surviving worker reports: seq, at, worker, kind (ONLINE or HEARTBEAT), ref into `reports`."""
        return self._report_frame
