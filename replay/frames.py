"""The ledger as polars frames: one frame per event kind the tables need, columns per field.

Raw ledger rows are routed by their envelope tag (types no table reads are never decoded), each
kind of a chunk is decoded in one pass and its columns taken at once (a C-level `map` per field),
so that the chunk's event objects are dropped early; every `FLUSH_EVERY` events the columns become
frames, and memory stays bounded by the columns. `seq` is the ledger order (0, 1, …) of the entries
as read; only its order matters. `ms` is the time part of each entry's stream id: the day shard of a
task row or benchmark mark is named by the first entry that made it.

Worker reports carry nested values (inventory, loaded models, resources) that only the newest
report of each worker needs: they stay Python objects, and each flush keeps only the reports that
can still win, so a ledger full of heartbeats does not pile them up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any, Final

import msgspec
import polars as pl

from events.codec import DATA, TYPE, decode_event, decode_rows
from events.event import (
    EVENT_TYPES,
    BenchmarkResult,
    Event,
    QualityScored,
    TaskCancelled,
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskExpired,
    TaskFailed,
    TaskReclaimed,
    TaskStalled,
    TaskSubmitted,
    WakeFailed,
    WakeRequested,
    WorkerChanged,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
)
from events.ledger import PoisonHandler, WireEntry
from projections.folder import FOLDED_TYPES
from projections.mention import MENTION_TAGS, Mention, mention_in, mention_of, read_mention
from replay import segment
from replay.segment import IdKey

FLUSH_EVERY: Final = 100_000

ONLINE: Final = 0
HEARTBEAT: Final = 1
CHANGED: Final = 2
# Worker reports: each kind's code in the report frame.
REPORT_KINDS: Final[dict[type[Event], int]] = {
    WorkerOnline: ONLINE,
    WorkerHeartbeat: HEARTBEAT,
    WorkerChanged: CHANGED,
}
Report = WorkerOnline | WorkerHeartbeat | WorkerChanged

_I64: Final = pl.Int64
_F64: Final = pl.Float64
_STR: Final = pl.String
_BOOL: Final = pl.Boolean

# Column name -> (dtype, attribute path on the event).
Columns = dict[str, tuple[pl.DataType | type[pl.DataType], str]]
Getter = Callable[[Any], Any]

_TIMINGS: Final[Columns] = {
    "prompt_eval_count": (_I64, "timings.prompt_eval_count"),
    "prompt_eval_duration": (_I64, "timings.prompt_eval_duration"),
    "prompt_eval_cached_count": (_I64, "timings.prompt_eval_cached_count"),
    "eval_count": (_I64, "timings.eval_count"),
    "eval_duration": (_I64, "timings.eval_duration"),
    "load_duration": (_I64, "timings.load_duration"),
    "ttft_ms": (_F64, "ttft_ms"),
    "in_flight": (_I64, "in_flight"),
    "cold": (_BOOL, "cold"),
    "counted": (_STR, "timings.counted"),
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
            "runtime_options": (_BOOL, "runtime_options"),
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
            "kind": (_STR, "kind"),
            "prompt_bytes": (_I64, "prompt_bytes"),
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
    # An expired task is a cancelled one (projections.status): the same frame.
    TaskExpired: ("cancelled", {"task_id": (_STR, "task_id")}),
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
            "kind": (_STR, "kind"),
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
            "grader": (_STR, "grader"),
            "prompt_id": (_STR, "prompt_id"),
            "truncated": (_BOOL, "truncated"),
        },
    ),
    # A sleeping machine's wakes: with the WorkerOnline events ("online"), they measure each wake.
    WakeRequested: ("wake_requested", {"at": (_I64, "at"), "worker": (_STR, "worker")}),
    WakeFailed: ("wake_failed", {"at": (_I64, "at"), "worker": (_STR, "worker")}),
}

_REPORT_SCHEMA: Final = {"seq": _I64, "at": _I64, "worker": _STR, "kind": pl.Int8, "ref": _I64}


# Names with a handful of values each (models, digests, domains, queues, workers), repeated on
# millions of rows: categorical in the frames, so that each value is held once (a 64-character
# digest on every task's rows is most of a long history's memory otherwise). The archive keeps
# them as strings; the fold's lists turn them back into str.
CATEGORICAL: Final = frozenset({"model", "digest", "domain", "queue", "worker", "owner"})
# Task ids are one per task, but each is on several entries (submitted, claimed, completed): as a
# categorical of their own, each id is held once and the fold's joins and group_bys compare
# integers. Their own categories, apart from the names'.
TASK_ID: Final = pl.Categorical(pl.Categories("task_id", "routeledger.replay"))


def frame_dtype(name: str, dtype: pl.DataType | type[pl.DataType]) -> pl.DataType | type[pl.DataType]:
    """The dtype of column `name` in the frames (its event field's, but categorical for names)."""
    if name == "task_id":
        return TASK_ID
    return pl.Categorical if name in CATEGORICAL else dtype


def _schema(columns: Columns) -> dict[str, Any]:
    return {
        "seq": _I64,
        "ms": _I64,
        "sq": _I64,
        **{name: frame_dtype(name, dtype) for name, (dtype, _) in columns.items()},
    }


def _ms(entry_id: bytes | str) -> int:
    """The ms part of a stream entry id."""
    if isinstance(entry_id, bytes):
        return int(entry_id.partition(b"-")[0])
    return int(entry_id.partition("-")[0])


def _sq(entry_id: bytes | str) -> int:
    """The seq part of a stream entry id."""
    if isinstance(entry_id, bytes):
        return int(entry_id.partition(b"-")[2] or b"0")
    return int(entry_id.partition("-")[2] or "0")


# The entries that name a task or a pipeline without folding into a row (projections/mention.py),
# for the entry index: `task_id` and `pipeline_id` null when the entry names none, `pipe` true for
# a pipeline's own event.
MENTIONS: Final = "mentions"
_MENTION_SCHEMA: Final[dict[str, Any]] = {
    "seq": _I64,
    "ms": _I64,
    "sq": _I64,
    "task_id": TASK_ID,
    "pipeline_id": _STR,
    "pipe": _BOOL,
}
_MENTION_NAMES: Final = {tag.decode(): pipe for tag, pipe in MENTION_TAGS.items()}


# The envelope tags the frames take, and the class each tag's data must decode to.
_TAKEN: Final[tuple[type[Event], ...]] = (*KINDS, *REPORT_KINDS)
_CLASS_OF: Final[dict[bytes, type[Event]]] = {cls.__name__.encode(): cls for cls in _TAKEN}
# Event types no table reads, by their envelope tag: their entries are not decoded at all
# (routing breakdowns are the bulkiest part of the ledger).
UNUSED_TAGS: Final = frozenset(t.__name__.encode() for t in EVENT_TYPES) - _CLASS_OF.keys()
# The live projector skips undecoded what its folder has no handler for: both folds must read the
# same types, or one would count what the other never sees.
if {cls.__name__ for cls in _TAKEN} != FOLDED_TYPES:
    raise RuntimeError(
        f"replay's fold reads {sorted(c.__name__ for c in _TAKEN)}, the live fold {sorted(FOLDED_TYPES)}"
    )
# The codec's decoder: the same decompression and validation, entry by entry.
_decode: Final = decode_event


def _decode_all(data: list[bytes], cls: type[Event]) -> list[Event] | None:
    """Every entry's data as a `cls`, or None when any is not one (the careful path then says why)."""
    try:
        events: list[Event] = list(map(_decode, data))
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None
    return events if set(map(type, events)) == {cls} else None


def _getters(columns: Columns) -> tuple[list[tuple[str, Getter]], list[tuple[str, Getter]]]:
    """Per column, how to take it from an event, and (for `timings.x`) from its Timings."""
    top: list[tuple[str, Getter]] = []
    nested: list[tuple[str, Getter]] = []
    for col, (_, path) in columns.items():
        head, _, tail = path.partition(".")
        if tail:
            assert head == "timings", path
            nested.append((col, attrgetter(tail)))
        else:
            top.append((col, attrgetter(head)))
    return top, nested


_GETTERS: Final = {kind: _getters(columns) for kind, (_, columns) in KINDS.items()}
_timings: Final = attrgetter("timings")


def _typed_columns() -> Columns:
    """The union of every kind's columns: what an archive segment stores typed, beside the envelope."""
    union: Columns = {}
    for cls, (_, columns) in KINDS.items():
        for col, (dtype, path) in columns.items():
            if col in segment.ENVELOPE:
                raise AssertionError(f"{cls.__name__}.{col} would shadow the archive's envelope column")
            seen = union.get(col)
            if seen is not None and seen[0] != dtype:
                raise AssertionError(f"column {col!r} is {seen[0]} in one kind and {dtype} in another")
            union.setdefault(col, (dtype, path))
    return union


# The typed columns of an archive segment (nullable; each from the kinds that have it).
TYPED_COLUMNS: Final = _typed_columns()


def columns_of(kind: type[Event], events: Sequence[Event]) -> dict[str, list[Any]]:
    """The kind's columns of `events` (all of that kind), as the frames take them."""
    out: dict[str, list[Any]] = {}
    top, nested = _GETTERS[kind]
    for col, get in top:
        out[col] = list(map(get, events))
    if nested:
        timings = list(map(_timings, events))
        for col, get in nested:
            out[col] = list(map(get, timings))
    return out


def _ledger_ms(at: int, ms: int) -> int:
    """A worker report's time as projections.folder takes it (Folder._ledger_ms): its `at`, no later
    than its entry's stream-id ms. The report and online frames hold it in their `at` column."""
    return min(at, ms) if ms else at


class Frames:
    """Collects ledger chunks as columns; `frame(name)` is the whole kind as one frame."""

    def __init__(self) -> None:
        self.events = 0
        self._seq = 0
        # Per kind, its columns as Python lists until the next flush.
        self._columns: dict[type[Event], dict[str, list[Any]]] = {}
        self._frames: dict[str, list[pl.DataFrame]] = {name: [] for name, _ in KINDS.values()}
        # Worker reports (WorkerOnline, WorkerHeartbeat, WorkerChanged): the ones that can still
        # win, with their objects in `reports`, indexed by the `ref` column.
        self.reports: list[Report] = []
        self._report_frame = pl.DataFrame(schema=_REPORT_SCHEMA)
        self._new_reports: dict[type[Event], tuple[list[int], list[int], list[Event]]] = {}
        self._pending = 0
        self._mentions: dict[str, list[Any]] = {name: [] for name in _MENTION_SCHEMA}
        # Per kind, the last `seq` of its parts, and the kinds whose parts are not in ledger order
        # (an archive segment's typed frames went in beside buffered events of the kind): `frame`
        # sorts only those.
        self._last_seq: dict[str, int] = {}
        self._unordered: set[str] = set()
        # Kinds whose one part is the whole kind in ledger order (until a part is added to them).
        self._whole: set[str] = set()

    def add_rows(self, rows: Sequence[WireEntry], on_poison: PoisonHandler | None = None) -> None:
        """Take a chunk of ledger rows as Redis sends them, in ledger order, and decode what the
        tables read.

        An entry that is not a valid event is handed to `on_poison` (or raises without it),
        exactly as `events.codec.decode_rows` decides. `seq` is the entry's position in the
        ledger as read, counting every entry.
        """
        base = self._seq
        self._seq = base + len(rows)
        for i, (entry_id, flat) in enumerate(rows, base):
            m = read_mention(flat)
            if m is not None:
                self._mention(i, _ms(entry_id), _sq(entry_id), m)
        self._route(rows, range(base, base + len(rows)), on_poison)

    def _mention(self, seq: int, ms: int, sq: int, m: Mention) -> None:
        columns = self._mentions
        columns["seq"].append(seq)
        columns["ms"].append(ms)
        columns["sq"].append(sq)
        columns["task_id"].append(m.task_id or None)
        columns["pipeline_id"].append(m.pipeline_id or None)
        columns["pipe"].append(m.pipeline_event)

    def _route(self, rows: Sequence[WireEntry], seqs: Sequence[int], on_poison: PoisonHandler | None) -> None:
        """Decode what the tables read of `rows`, the i-th at ledger position `seqs[i]`."""
        unused = UNUSED_TAGS
        routes: dict[bytes, tuple[list[int], list[bytes]]] = {}
        odd = False
        for i, (_, flat) in enumerate(rows):
            if len(flat) == 6 and flat[0] == TYPE:
                tag = flat[1]
                if tag in unused:
                    continue
                if flat[4] == DATA:
                    route = routes.get(tag)
                    if route is None:
                        if tag not in _CLASS_OF:
                            odd = True
                            break
                        route = routes[tag] = ([], [])
                    route[0].append(i)
                    route[1].append(flat[5])
                    continue
            odd = True
            break
        decoded: list[tuple[type[Event], list[int], list[Event]]] = []
        if not odd:
            for tag, (index, data) in routes.items():
                cls = _CLASS_OF[tag]
                events = _decode_all(data, cls)
                if events is None:
                    odd = True
                    break
                decoded.append((cls, index, events))
        if odd:
            # Something unusual in this chunk: the codec's careful per-entry path, in ledger order.
            decoded = self._careful(rows, on_poison)
        for cls, index, events in decoded:
            ids = [rows[i][0] for i in index]
            self._take(cls, [seqs[i] for i in index], list(map(_ms, ids)), list(map(_sq, ids)), events)

    @staticmethod
    def _careful(
        rows: Sequence[WireEntry], on_poison: PoisonHandler | None
    ) -> list[tuple[type[Event], list[int], list[Event]]]:
        """Per kind: the positions of its entries in `rows`, and the events."""
        keep = [
            (entry_id.decode(), flat)
            for entry_id, flat in rows
            if not (len(flat) == 6 and flat[0] == TYPE and flat[1] in UNUSED_TAGS)
        ]
        index_of = {entry_id.decode(): i for i, (entry_id, _) in enumerate(rows)}
        buckets: dict[type[Event], tuple[list[int], list[Event]]] = {}
        for entry_id, event in decode_rows(keep, on_poison):
            kind = type(event)
            if kind not in _GETTERS and kind not in REPORT_KINDS:
                continue
            bucket = buckets.get(kind)
            if bucket is None:
                bucket = buckets[kind] = ([], [])
            bucket[0].append(index_of[entry_id])
            bucket[1].append(event)
        return [(kind, seqs, events) for kind, (seqs, events) in buckets.items()]

    def _take(
        self, kind: type[Event], seqs: list[int], ms: list[int], sq: list[int], events: list[Event]
    ) -> None:
        self.events += len(events)
        self._pending += len(events)
        if kind in REPORT_KINDS:
            pending = self._new_reports.get(kind)
            if pending is None:
                self._new_reports[kind] = (seqs, ms, events)
            else:
                pending[0].extend(seqs)
                pending[1].extend(ms)
                pending[2].extend(events)
        else:
            # Columns are taken at once so that the chunk's event objects are dropped early.
            columns = self._columns.get(kind)
            if columns is None:
                columns = self._columns[kind] = {
                    "seq": [],
                    "ms": [],
                    "sq": [],
                    **{c: [] for c in KINDS[kind][1]},
                }
            columns["seq"].extend(seqs)
            columns["ms"].extend(ms)
            columns["sq"].extend(sq)
            top, nested = _GETTERS[kind]
            for col, get in top:
                columns[col].extend(map(get, events))
            if nested:
                timings = list(map(_timings, events))
                for col, get in nested:
                    columns[col].extend(map(get, timings))
        if self._pending >= FLUSH_EVERY:
            self.flush()

    def add(self, batch: Sequence[tuple[str, Event]]) -> None:
        """Take a decoded batch, in ledger order (each event counts as one ledger position)."""
        base = self._seq
        self._seq = base + len(batch)
        buckets: dict[type[Event], tuple[list[int], list[int], list[int], list[Event]]] = {}
        for i, (entry_id, event) in enumerate(batch, base):
            kind = type(event)
            m = mention_in(event)
            if m is not None:
                self._mention(i, _ms(entry_id), _sq(entry_id), m)
            bucket = buckets.get(kind)
            if bucket is None:
                bucket = buckets[kind] = ([], [], [], [])
            bucket[0].append(i)
            bucket[1].append(_ms(entry_id))
            bucket[2].append(_sq(entry_id))
            bucket[3].append(event)
        for kind, (seqs, ms, sq, events) in buckets.items():
            if kind in _GETTERS or kind in REPORT_KINDS:
                self._take(kind, seqs, ms, sq, events)

    def add_segment(
        self, path: Path, upto: IdKey | None = None, on_poison: PoisonHandler | None = None
    ) -> tuple[int, str | None]:
        """Take an archive segment (its entries up to id `upto`), next in ledger order; returns the
        entries taken and the last one's id.

        A kind whose columns the segment stores typed is taken straight from them, without
        decoding; worker reports, kinds the segment has no columns for (added after it was
        written), and entries that did not decode when archived (the codec decides again, so a
        type added since decodes now) go through `data` as the stream's rows do.
        """
        schema = segment.segment_schema(path)
        where = None if upto is None else segment.in_range((0, 0), upto)
        ends = segment.read_segment(
            path,
            [
                pl.len().alias("n"),
                pl.col(segment.MS).last().alias("ms"),
                pl.col(segment.SEQ).last().alias("id_seq"),
            ],
            where,
        )
        count, last_ms, last_sq = ends.row(0)
        if count == 0:
            return 0, None
        base = self._seq
        self._seq = base + count
        kind, ok = pl.col(segment.KIND), pl.col(segment.DECODED)
        by_data = [cls.__name__ for cls in REPORT_KINDS]
        for cls, (name, columns) in KINDS.items():
            if not all(c in schema for c in columns):
                by_data.append(cls.__name__)
                continue
            # One scan per kind, of its own columns only: a frame of the whole segment with every
            # typed column would be mostly nulls, and its memory outlives it in the allocator.
            mine = (kind == cls.__name__) & ok
            part = segment.read_segment(
                path,
                [
                    (pl.col("pos").cast(_I64) + base).alias("seq"),
                    pl.col(segment.MS).alias("ms"),
                    pl.col(segment.SEQ).cast(_I64).alias("sq"),
                    *[pl.col(c).cast(frame_dtype(c, dtype)) for c, (dtype, _) in columns.items()],
                ],
                mine if where is None else where & mine,
                index="pos",
            )
            if part.height:
                self._append(name, part)
                self.events += part.height
        # What is read from `data`: the kinds above, and every entry that did not decode when
        # archived, except those the stream's path would not decode either (standard entries of
        # types no table reads).
        unused = [tag.decode() for tag in UNUSED_TAGS]
        odd = pl.col(segment.RAW).is_not_null() | kind.is_null() | ~kind.is_in(unused)
        wanted = (kind.is_in(by_data) & ok) | (~ok & odd)
        picked = segment.read_segment(
            path,
            [segment.ID, segment.KIND, segment.V, segment.BODY, segment.RAW, "pos"],
            wanted if where is None else where & wanted,
            index="pos",
        )
        if picked.height:
            seqs = (picked["pos"].cast(_I64) + base).to_list()
            self._route(list(segment.wire_rows(picked)), seqs, on_poison)
        # Mentions are read from each entry's `data` with the names-only decoder, as the live
        # projector reads them (a routing decision has no typed columns in a segment).
        named = kind.is_in(list(_MENTION_NAMES)) & pl.col(segment.RAW).is_null()
        mentioned = segment.read_segment(
            path,
            [segment.MS, segment.SEQ, segment.KIND, segment.BODY, "pos"],
            named if where is None else where & named,
            index="pos",
        )
        for ms, sq, tag, body, pos in mentioned.iter_rows():
            m = None if body is None else mention_of(body, _MENTION_NAMES[tag])
            if m is not None:
                self._mention(pos + base, ms, sq, m)
        return count, f"{last_ms}-{last_sq}"

    def flush(self) -> None:
        """Turn the buffered columns into frames."""
        for kind, columns in self._columns.items():
            name, spec = KINDS[kind]
            self._append(name, pl.DataFrame(columns, schema=_schema(spec)))
        self._columns = {}
        if self._mentions["seq"]:
            self._append(MENTIONS, pl.DataFrame(self._mentions, schema=_MENTION_SCHEMA))
            self._mentions = {name: [] for name in _MENTION_SCHEMA}
        for kind, (seqs, ms, events) in self._new_reports.items():
            self._add_reports(seqs, ms, events, REPORT_KINDS[kind])
            if kind is WorkerOnline:
                self._add_status(seqs, ms, events)
        self._new_reports = {}
        self._pending = 0
        self._compact_reports()

    def _add_status(self, seqs: list[int], ms: list[int], events: list[Event]) -> None:
        online: list[WorkerOnline] = events  # type: ignore[assignment]
        frame = pl.DataFrame(
            {
                "seq": seqs,
                "ms": ms,
                "sq": [0] * len(online),
                "at": [_ledger_ms(e.at, m) for e, m in zip(online, ms, strict=True)],
                "worker": [e.worker for e in online],
                "reason": ["online"] * len(online),
            },
            schema=_schema(KINDS[WorkerOffline][1]),
        )
        self._append("online", frame)

    def _add_reports(self, seqs: list[int], ms: list[int], events: list[Event], kind: int) -> None:
        base = len(self.reports)
        reports: list[Report] = events  # type: ignore[assignment]
        self.reports.extend(reports)
        frame = pl.DataFrame(
            {
                "seq": seqs,
                "at": [_ledger_ms(e.at, m) for e, m in zip(reports, ms, strict=True)],
                "worker": [e.worker for e in reports],
                "kind": [kind] * len(reports),
                "ref": list(range(base, base + len(reports))),
            },
            schema=_REPORT_SCHEMA,
        )
        self._report_frame = pl.concat([self._report_frame, frame])

    def _compact_reports(self) -> None:
        """Keep only each worker's newest report, newest report of loaded models (a heartbeat or a
        change) and newest heartbeat (by producer clock bounded by the ledger's, then order): the
        ones that can still win."""
        frame = self._report_frame
        if frame.height == 0:
            return
        newest = frame.sort("at", "seq").group_by("worker").last()
        kind = pl.col("kind")
        loaded = frame.filter(kind != ONLINE).sort("at", "seq").group_by("worker").last()
        beats = frame.filter(kind == HEARTBEAT).sort("at", "seq").group_by("worker").last()
        keep = pl.concat([newest, loaded, beats]).unique("seq").sort("seq")
        refs = keep["ref"].to_list()
        self.reports = [self.reports[r] for r in refs]
        renumbered = keep.with_columns(pl.int_range(pl.len(), dtype=_I64).alias("ref"))
        self._report_frame = renumbered.select(list(_REPORT_SCHEMA))

    def _append(self, name: str, part: pl.DataFrame) -> None:
        if part.height == 0:
            return
        seq = part["seq"]
        first, last = int(seq.min()), int(seq.max())  # type: ignore[arg-type]
        if not seq.is_sorted() or first <= self._last_seq.get(name, -1):
            self._unordered.add(name)
        self._last_seq[name] = max(self._last_seq.get(name, -1), last)
        self._frames.setdefault(name, []).append(part)
        self._whole.discard(name)

    def frame(self, name: str) -> pl.DataFrame:
        """Every event of one kind as one frame, in ledger (`seq`) order (empty, with the right
        columns, when there is none)."""
        parts = self._frames.get(name, [])
        if len(parts) == 1 and name in self._whole:
            return parts[0]
        if parts:
            whole = pl.concat(parts, rechunk=False)
            whole = whole.sort("seq") if name in self._unordered else whole
            self._unordered.discard(name)
            # The fold asks for some kinds several times: the parts are replaced by their sorted
            # whole, so that it is sorted once and the parts are freed.
            self._frames[name] = [whole]
            self._whole.add(name)
            return whole
        if name == "online":
            return pl.DataFrame(schema=_schema(KINDS[WorkerOffline][1]))
        if name == MENTIONS:
            return pl.DataFrame(schema=_MENTION_SCHEMA)
        columns = next(cols for n, cols in KINDS.values() if n == name)
        return pl.DataFrame(schema=_schema(columns))

    @property
    def report_frame(self) -> pl.DataFrame:
        """Surviving worker reports: seq, at, worker, kind (ONLINE, HEARTBEAT or CHANGED), ref into
        `reports`."""
        return self._report_frame
