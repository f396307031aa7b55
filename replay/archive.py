"""The archiver: moves ledger entries older than the hot window into Parquet segments, then trims them
off the stream, so that Redis holds a bounded ledger and history stays whole on disk.

One run: finish the trim a killed run left undone, find the limit (entries older than the hot
window, or beyond `max_hot_entries`, and never past the live projector's checkpoint: trimming what
it has not folded would lose it), then per segment of at most `segment_entries` entries: write the
file (temporary name, fsync, rename), read it back, list it in the manifest (the same way), record
the state in `Keys.archive`, and only then `XTRIM MINID` (exact) past its last id. A kill -9 at any
step loses nothing and duplicates nothing: readers take the manifest's segments, then the stream
after the manifest's last id; a file not in the manifest is written again; a listed segment whose
entries are still in the stream is trimmed by the next run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import polars as pl
import redis.asyncio as aioredis

from events.codec import DATA, TYPE, VERSION, as_str, decode_rows, flat_to_dict
from events.errors import UndecodableEntryError
from events.event import Event
from events.keys import Keys
from events.ledger import Ledger, WireEntry, next_id
from events.singleton import SingletonLease
from projections import store
from replay import segment
from replay.errors import ArchiveError
from replay.frames import KINDS, TYPED_COLUMNS, UNUSED_TAGS, columns_of
from replay.segment import Manifest, Segment

log = logging.getLogger("routeledger.archive")

# The default bounds of the hot part of the ledger (routeledger/config.py takes these).
DEFAULT_HOT_WINDOW_S: Final = 7 * 86_400.0
DEFAULT_MAX_HOT_ENTRIES: Final = 2_000_000
DEFAULT_EVERY_S: Final = 3_600.0
# Large enough that a rebuild reads few files, small enough that a segment is built in memory.
SEGMENT_ENTRIES: Final = 500_000
READ_CHUNK: Final = 5_000
# Rows turned into one frame at a time while a segment is built: bounds the Python objects alive.
_FRAME_ROWS: Final = 50_000
ROLE: Final = "archiver"

# Test hook, off by default: `ROUTELEDGER_TEST_ARCHIVE_CRASH=POINT[@N]` kills this process with
# SIGKILL at POINT of the N-th segment of the run (default the first), so that the tests crash it
# at an exact step. Its own variable: the worker's hook (workers/crash.py) refuses points it
# does not know. Never set it outside tests.
TEST_CRASH_ENV: Final = "ROUTELEDGER_TEST_ARCHIVE_CRASH"
CRASH_POINTS: Final = ("archive:after-file", "archive:after-manifest", "archive:before-trim")


def crash_here(point: str, ordinal: int) -> None:
    """Kill -9 this process if the test hook names this point (a no-op when the variable is unset)."""
    spec = os.environ.get(TEST_CRASH_ENV)
    if not spec:
        return
    where, _, nth = spec.partition("@")
    if where not in CRASH_POINTS or (nth and not nth.isdigit()):
        raise ValueError(f"{TEST_CRASH_ENV}={spec!r}: expected POINT[@N] with POINT in {CRASH_POINTS}")
    if where == point and int(nth or 1) == ordinal:
        sys.stderr.write(f"routeledger test hook: kill -9 at {point} of segment #{ordinal}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class ArchiveOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how much to archive."""

    directory: str
    hot_window_s: float = DEFAULT_HOT_WINDOW_S
    max_hot_entries: int = DEFAULT_MAX_HOT_ENTRIES
    segment_entries: int = SEGMENT_ENTRIES


class ArchiveReport(msgspec.Struct, kw_only=True):
    """What one run did, and the archive as it stands after it."""

    directory: str
    archived: int = 0
    written: list[str] = msgspec.field(default_factory=list)
    trimmed: int = 0
    hot: int = 0
    checkpoint: str | None = None
    last_id: str | None = None
    segments: int = 0
    events: int = 0
    bytes: int = 0
    # Why nothing could be archived, when that is so (no projection yet).
    note: str = ""


class ArchiveState(msgspec.Struct, kw_only=True):
    """The archive as `Keys.archive` records it, for status surfaces and for readers' checks."""

    ledger: str = ""
    last_id: str = ""
    segments: int = 0
    events: int = 0
    bytes: int = 0
    ran_at: int = 0
    error: str = ""
    dir: str = ""


async def read_state(redis: aioredis.Redis, keys: Keys) -> ArchiveState:
    raw: dict[Any, Any] = await redis.hgetall(keys.archive)
    fields = {as_str(k): as_str(v) for k, v in raw.items()}
    try:
        return msgspec.convert(fields, ArchiveState, strict=False)
    except msgspec.ValidationError as exc:
        raise ArchiveError(
            f"{keys.archive} holds a field that is not what the archiver writes: {exc}"
        ) from None


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- building a segment ------------------------------------------------------------------------


def segment_frame(rows: Sequence[WireEntry]) -> pl.DataFrame:
    """Ledger rows as segment rows: the envelope of each, and the typed columns of every entry
    that decodes as one of the kinds the fold reads. Nothing here raises on a poison entry: it
    goes in with its envelope only (`decoded` false)."""
    ids: list[str] = []
    ms: list[int] = []
    seqs: list[int] = []
    kinds: list[str | None] = []
    versions: list[str | None] = []
    bodies: list[bytes | None] = []
    raws: list[bytes | None] = []
    keep: list[tuple[str, Sequence[bytes]]] = []
    encode = msgspec.msgpack.encode
    for entry_id, flat in rows:
        text = entry_id.decode()
        left, _, right = text.partition("-")
        ids.append(text)
        ms.append(int(left))
        seqs.append(int(right))
        if segment.is_standard(flat):
            try:
                kind, version = flat[1].decode(), flat[3].decode()
            except UnicodeDecodeError:
                pass
            else:
                if flat[1] not in UNUSED_TAGS:
                    keep.append((text, flat))
                kinds.append(kind)
                versions.append(version)
                bodies.append(flat[5])
                raws.append(None)
                continue
        # Anything else keeps its whole field list, so that a reader gets back what Redis held.
        keep.append((text, flat))
        fields = flat_to_dict(flat)
        kinds.append(_text(fields.get(TYPE)))
        versions.append(_text(fields.get(VERSION)))
        bodies.append(fields.get(DATA))
        raws.append(encode(list(flat)))
    poison: list[UndecodableEntryError] = []
    # Types no table reads are not decoded (routing breakdowns are most of the ledger's bytes):
    # their `decoded` is null, unknown, and no reader takes them from a segment but export.
    events = decode_rows(keep, poison.append)
    position = {text: i for i, text in enumerate(ids)}
    checked = {text for text, _ in keep}
    decoded: list[bool | None] = [False if text in checked else None for text in ids]
    by_kind: dict[type[Event], tuple[list[int], list[Event]]] = {}
    for text, event in events:
        i = position[text]
        decoded[i] = True
        cls = type(event)
        if cls in KINDS:
            bucket = by_kind.setdefault(cls, ([], []))
            bucket[0].append(i)
            bucket[1].append(event)
    envelope = pl.DataFrame(
        {
            "pos": list(range(len(ids))),
            segment.ID: ids,
            segment.MS: ms,
            segment.SEQ: seqs,
            segment.KIND: kinds,
            segment.V: versions,
            segment.BODY: bodies,
            segment.RAW: raws,
            segment.DECODED: decoded,
        },
        schema={"pos": pl.Int64, **segment.ENVELOPE},
    )
    typed_parts = [
        pl.DataFrame(
            {"pos": index, **columns_of(cls, found)},
            schema={"pos": pl.Int64, **{c: dtype for c, (dtype, _) in KINDS[cls][1].items()}},
        )
        for cls, (index, found) in by_kind.items()
    ]
    if typed_parts:
        typed = pl.concat(typed_parts, how="diagonal")
        envelope = envelope.join(typed, on="pos", how="left").sort("pos")
    missing = [
        pl.lit(None, dtype).alias(c) for c, (dtype, _) in TYPED_COLUMNS.items() if c not in envelope.columns
    ]
    return envelope.with_columns(missing).select(*segment.ENVELOPE, *TYPED_COLUMNS)


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode(errors="replace")


def write_segment(directory: Path, frame: pl.DataFrame) -> Segment:
    """Write `frame` as a segment file durably, read it back, and describe it for the manifest."""
    first_id, last_id = frame[segment.ID][0], frame[segment.ID][-1]
    name = segment.segment_name(first_id, last_id)
    path = directory / name
    try:
        segment.write_durably(path, lambda tmp: frame.write_parquet(tmp, compression="zstd", statistics=True))
    except OSError as exc:
        raise ArchiveError(f"cannot write archive segment {path}: {exc.strerror}") from None
    written = Segment(
        file=name,
        first_id=first_id,
        last_id=last_id,
        count=frame.height,
        bytes=path.stat().st_size,
        sha256=segment.sha256_of(path),
    )
    check_segment(directory, written)
    return written


def check_segment(directory: Path, seg: Segment) -> None:
    """Read a segment back: its size, row count, first and last id, and typed columns of the right
    types that hold what the fold would take from `data` (the first entry of each kind)."""
    path = segment.segment_path(directory, seg)
    schema = segment.segment_schema(path)
    wrong = {
        c: str(schema.get(c))
        for c, dtype in {**segment.ENVELOPE, **{c: d for c, (d, _) in TYPED_COLUMNS.items()}}.items()
        if schema.get(c) != dtype
    }
    if wrong:
        raise ArchiveError(f"archive segment {path} read back with wrong column types {wrong}")
    ends = segment.read_segment(
        path,
        [
            pl.len().alias("n"),
            pl.col(segment.ID).first().alias("first"),
            pl.col(segment.ID).last().alias("last"),
        ],
    )
    n, first, last = ends.row(0)
    if (n, first, last) != (seg.count, seg.first_id, seg.last_id):
        raise ArchiveError(
            f"archive segment {path} read back as {n} rows {first}…{last}, "
            f"written as {seg.count} rows {seg.first_id}…{seg.last_id}"
        )
    # One entry of each kind, decoded again from `data`, must equal its typed columns.
    firsts = segment.read_segment(
        path, where=pl.col(segment.DECODED) & pl.col(segment.KIND).is_in([c.__name__ for c in KINDS])
    ).unique(segment.KIND, keep="first", maintain_order=True)
    for row in firsts.iter_rows(named=True):
        event = decode_rows([(row[segment.ID], [TYPE, row[segment.KIND].encode(), DATA, row[segment.BODY]])])
        cls = type(event[0][1])
        expected = {c: v[0] for c, v in columns_of(cls, [event[0][1]]).items()}
        got = {c: row[c] for c in KINDS[cls][1]}
        if not _same_values(expected, got):
            raise ArchiveError(
                f"archive segment {path}: typed columns of {row[segment.ID]} read back as {got}"
            )


def _same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    # NaN is a legitimate TTFT or score value, and NaN != NaN.
    return all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)


# -- one run -----------------------------------------------------------------------------------


class Archiver:
    """One archiver run against one Redis and one archive directory."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        options: ArchiveOptions,
        *,
        lease: SingletonLease | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.options = options
        self.directory = Path(options.directory)
        self.ledger = Ledger(redis, keys)
        self.lease = lease

    async def run(self, now_ms: int | None = None) -> ArchiveReport:
        """Archive what is due; on failure the error is recorded in `Keys.archive` and raised."""
        try:
            return await self._run(_now_ms() if now_ms is None else now_ms)
        except (ArchiveError, OSError) as exc:
            message = str(exc) if isinstance(exc, ArchiveError) else f"{self.directory}: {exc}"
            with contextlib.suppress(Exception):
                await self.redis.hset(
                    self.keys.archive,
                    mapping={"error": message, "ran_at": _now_ms(), "dir": str(self.directory)},
                )
            if isinstance(exc, ArchiveError):
                raise
            raise ArchiveError(message) from None

    async def _run(self, now_ms: int) -> ArchiveReport:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ArchiveError(
                f"cannot create the archive directory {self.directory}: {exc.strerror}"
            ) from None
        manifest = await self._open_manifest()
        self._drop_orphans(manifest)
        report = ArchiveReport(directory=str(self.directory))
        if manifest.last_id is not None:
            # A run killed after listing a segment left its entries in the stream.
            report.trimmed += await self._trim(manifest.last_id)
        ns = await store.current(self.redis, self.keys)
        checkpoint = None if ns is None else await self.redis.get(self.keys.checkpoint(ns))
        if checkpoint is None:
            report.note = "no projection has folded anything yet: nothing may be archived"
        else:
            report.checkpoint = as_str(checkpoint)
            await self._archive(manifest, report, report.checkpoint, now_ms)
        report.hot = await self.ledger.length()
        report.last_id = manifest.last_id
        report.segments = len(manifest.segments)
        report.events = manifest.events
        report.bytes = manifest.bytes
        await self._record(manifest)
        return report

    async def _open_manifest(self) -> Manifest:
        """The manifest, checked against the ledger `Keys.archive` names; a new one for a new archive."""
        state = await read_state(self.redis, self.keys)
        manifest = segment.load_manifest(self.directory)
        if manifest is None:
            if state.segments:
                raise ArchiveError(
                    f"{self.directory} has no archive manifest, but this ledger's archive holds "
                    f"{state.segments} segment(s) in {state.dir or 'another directory'} "
                    f"({self.keys.archive}); "
                    "set archive_dir (or --archive-dir) to that directory"
                )
            token = state.ledger or secrets.token_hex(8)
            # The ledger's token first: a manifest exists only where Redis knows the token.
            await self.redis.hsetnx(self.keys.archive, "ledger", token)
            token = (await read_state(self.redis, self.keys)).ledger
            manifest = Manifest(ledger=token, stream=self.keys.events)
            self._save(manifest)
            return manifest
        if manifest.ledger != state.ledger:
            raise ArchiveError(
                f"the archive in {self.directory} belongs to another ledger (token {manifest.ledger!r}, "
                f"this Redis has {state.ledger or 'none'!r}); give this ledger its own archive_dir"
            )
        return manifest

    def _drop_orphans(self, manifest: Manifest) -> None:
        """Remove segment files the manifest does not list: written by a run killed before listing
        them; this run writes them again."""
        listed = {s.file for s in manifest.segments}
        for path in [*self.directory.glob(segment.SEGMENT_GLOB), *self.directory.glob("*.tmp")]:
            if path.name not in listed:
                log.info("removing %s: not in the manifest (left by an interrupted run)", path)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _save(self, manifest: Manifest) -> None:
        try:
            segment.save_manifest(self.directory, manifest)
        except OSError as exc:
            raise ArchiveError(f"cannot write {self.directory / segment.MANIFEST}: {exc.strerror}") from None

    async def _trim(self, last_id: str) -> int:
        # MINID drops every entry below the threshold; exact (no `~`), so nothing past the segment goes.
        trimmed: Any = await self.redis.xtrim(self.keys.events, minid=next_id(last_id), approximate=False)
        return int(trimmed)

    async def _archive(self, manifest: Manifest, report: ArchiveReport, checkpoint: str, now_ms: int) -> None:
        """Archive, segment by segment, the entries up to the checkpoint that are older than the hot
        window or beyond the hot size bound."""
        cutoff_ms = now_ms - int(self.options.hot_window_s * 1000)
        excess = max(0, await self.ledger.length() - self.options.max_hot_entries)
        position = 0
        pending: list[WireEntry] = []
        parts: list[pl.DataFrame] = []
        count = 0
        ordinal = 0
        start = "-" if manifest.last_id is None else next_id(manifest.last_id)
        async with contextlib.aclosing(self.ledger.read_wire(start, checkpoint, chunk=READ_CHUNK)) as chunks:
            async for rows in chunks:
                due = 0
                for row in rows:
                    if position + due >= excess and int(row[0].split(b"-")[0]) >= cutoff_ms:
                        break
                    due += 1
                position += due
                for row in rows[:due]:
                    pending.append(row)
                    count += 1
                    if len(pending) >= _FRAME_ROWS:
                        parts.append(segment_frame(pending))
                        pending = []
                    if count >= self.options.segment_entries:
                        ordinal += 1
                        parts.append(segment_frame(pending))
                        await self._seal(manifest, report, pl.concat(parts), ordinal)
                        pending, parts, count = [], [], 0
                if due < len(rows):
                    break
        if count:
            parts.append(segment_frame(pending))
            await self._seal(manifest, report, pl.concat(parts), ordinal + 1)

    async def _seal(
        self, manifest: Manifest, report: ArchiveReport, frame: pl.DataFrame, ordinal: int
    ) -> None:
        """Write one segment, list it, record it, then trim its entries off the stream."""
        seg = write_segment(self.directory, frame)
        crash_here("archive:after-file", ordinal)
        if self.lease is not None and self.lease.lost.is_set():
            raise ArchiveError(f"lost the {ROLE} lease to another instance; {seg.file} is left unlisted")
        manifest.segments.append(seg)
        self._save(manifest)
        crash_here("archive:after-manifest", ordinal)
        await self._record(manifest)
        crash_here("archive:before-trim", ordinal)
        report.trimmed += await self._trim(seg.last_id)
        report.archived += seg.count
        report.written.append(seg.file)
        log.info("archived %s entries %s…%s into %s", seg.count, seg.first_id, seg.last_id, seg.file)

    async def _record(self, manifest: Manifest) -> None:
        await self.redis.hset(
            self.keys.archive,
            mapping={
                "last_id": manifest.last_id or "",
                "segments": len(manifest.segments),
                "events": manifest.events,
                "bytes": manifest.bytes,
                "ran_at": _now_ms(),
                "error": "",
                "dir": str(self.directory),
            },
        )


async def archive(
    redis: aioredis.Redis,
    keys: Keys,
    options: ArchiveOptions,
    *,
    lease: SingletonLease | None = None,
    now_ms: int | None = None,
) -> ArchiveReport:
    """Run the archiver once (see the module's docstring)."""
    return await Archiver(redis, keys, options, lease=lease).run(now_ms)
