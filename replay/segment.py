"""One archive segment: a Parquet file of consecutive ledger entries, and its manifest.

A segment holds the envelope of every entry (`id`, `ms` and `seq` from the id, `type`, `v`, and
`data`, the exact msgpack), so that nothing is lost and any later event type still decodes, plus
the typed columns replay's fold reads (replay/frames.py `TYPED_COLUMNS`), so that a rebuild scans
them without decoding msgpack. An entry that is not in the layout every writer produces keeps its
whole field list in `raw`; `decoded` says whether the entry decoded as the event its type names
when it was archived.

The manifest (`manifest.json`) lists the segments in ledger order. History is the manifest's
segments, then the stream after the manifest's last id: a segment is listed only once it has been
read back, and the stream is trimmed only up to a listed segment, so no entry is ever in neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import polars as pl

from events.codec import DATA, TYPE, VERSION
from events.ledger import WireEntry
from replay.errors import ArchiveError, SegmentError

MANIFEST: Final = "manifest.json"
MANIFEST_VERSION: Final = 1
SEGMENT_GLOB: Final = "events-*.parquet"

# The envelope columns, in every segment.
ID: Final = "id"
MS: Final = "ms"
SEQ: Final = "seq"
KIND: Final = "type"
V: Final = "v"
BODY: Final = "data"
RAW: Final = "raw"
DECODED: Final = "decoded"
ENVELOPE: Final[dict[str, Any]] = {
    ID: pl.String,
    MS: pl.Int64,
    SEQ: pl.Int64,
    KIND: pl.String,
    V: pl.String,
    BODY: pl.Binary,
    RAW: pl.Binary,
    DECODED: pl.Boolean,
}

IdKey = tuple[int, int]
# Larger than any sequence number Redis hands out (a u64).
_MAX_SEQ: Final = 2**64


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """One segment file as the manifest lists it."""

    file: str
    first_id: str
    last_id: str
    count: int
    bytes: int
    sha256: str


class Manifest(msgspec.Struct, kw_only=True):
    """The archive's table of contents; `ledger` names the ledger (Redis) it belongs to."""

    version: int = MANIFEST_VERSION
    ledger: str = ""
    stream: str = ""
    segments: list[Segment] = msgspec.field(default_factory=list)

    @property
    def last_id(self) -> str | None:
        return self.segments[-1].last_id if self.segments else None

    @property
    def events(self) -> int:
        return sum(s.count for s in self.segments)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.segments)


def id_key(entry_id: str, *, upper: bool = False) -> IdKey:
    """A stream id as a comparable (ms, seq); `-`, `+` and an id without a sequence (`1764…` as
    XRANGE takes it) as the lowest or, with `upper`, the highest id they stand for."""
    if entry_id == "-":
        return (0, 0)
    if entry_id == "+":
        return (_MAX_SEQ, _MAX_SEQ)
    ms, sep, seq = entry_id.partition("-")
    if not sep:
        return (int(ms), _MAX_SEQ if upper else 0)
    return (int(ms), int(seq))


def segment_name(first_id: str, last_id: str) -> str:
    """`events-<first>-<last>.parquet`, ids zero-padded with `_` for their dash, so names sort as ids."""

    def part(entry_id: str) -> str:
        ms, seq = id_key(entry_id)
        return f"{ms:015d}_{seq:06d}"

    return f"events-{part(first_id)}-{part(last_id)}.parquet"


def in_range(lo: IdKey, hi: IdKey) -> pl.Expr:
    """Rows whose id lies in [lo, hi]."""
    ms, seq = pl.col(MS), pl.col(SEQ)
    after = (ms > lo[0]) | ((ms == lo[0]) & (seq >= lo[1]))
    before = (ms < hi[0]) | ((ms == hi[0]) & (seq <= min(hi[1], 2**63 - 1)))
    return after & before


# -- files ---------------------------------------------------------------------------------------


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (where the platform allows opening a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_durably(path: Path, write: Any) -> None:
    """Write through a temporary file, fsync it, rename it over `path`, fsync the directory: a crash
    leaves the old file or the new one, never half of one. `write(tmp_path)` writes the content."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_manifest(directory: Path) -> Manifest | None:
    """The archive's manifest, or None when `directory` holds none."""
    path = directory / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ArchiveError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ArchiveError(f"{path} is not an archive manifest ({exc}); restore it from a backup") from None


def save_manifest(directory: Path, manifest: Manifest) -> None:
    data = msgspec.json.format(msgspec.json.encode(manifest), indent=1)
    write_durably(directory / MANIFEST, lambda tmp: tmp.write_bytes(data))


def segment_path(directory: Path, segment: Segment) -> Path:
    """The segment's file, checked to be there with the size the manifest recorded."""
    path = directory / segment.file
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise SegmentError(
            f"archive segment {path} is missing (the manifest lists it with {segment.count:,} entries "
            f"{segment.first_id}…{segment.last_id}); restore it, or point archive_dir at the directory "
            "that has it"
        ) from None
    except OSError as exc:
        raise SegmentError(f"cannot read archive segment {path}: {exc.strerror}") from None
    if size != segment.bytes:
        raise SegmentError(
            f"archive segment {path} has {size:,} bytes but the manifest recorded {segment.bytes:,} "
            f"(sha256 {segment.sha256}); the file is damaged: restore it from a backup"
        )
    return path


def read_segment(
    path: Path,
    columns: Sequence[str | pl.Expr] | None = None,
    where: pl.Expr | None = None,
    *,
    index: str | None = None,
) -> pl.DataFrame:
    """A segment's rows (in ledger order), with a Parquet error turned into a SegmentError; `index`
    names a column of each row's position in the file (taken before `where` filters)."""
    try:
        scan = pl.scan_parquet(path)
        if index is not None:
            scan = scan.with_row_index(index)
        if where is not None:
            scan = scan.filter(where)
        if columns is not None:
            scan = scan.select(columns)
        return scan.collect()
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise SegmentError(f"archive segment {path} does not read as Parquet ({exc}); restore it") from None


def segment_schema(path: Path) -> dict[str, Any]:
    try:
        return dict(pl.read_parquet_schema(path))
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise SegmentError(f"archive segment {path} does not read as Parquet ({exc}); restore it") from None


# -- rows ----------------------------------------------------------------------------------------


def is_standard(flat: Sequence[bytes]) -> bool:
    """The layout every routeledger writer produces: type, v, data, in that order."""
    return len(flat) == 6 and flat[0] == TYPE and flat[2] == VERSION and flat[4] == DATA


def wire_rows(frame: pl.DataFrame) -> Iterator[WireEntry]:
    """Rows of a segment frame (id, type, v, data, raw) as Redis sends them: [id, [field, value, …]]."""
    unpack = msgspec.msgpack.decode
    for entry_id, kind, v, data, raw in frame.select(ID, KIND, V, BODY, RAW).iter_rows():
        if raw is not None:
            yield [entry_id.encode(), unpack(raw, type=list[bytes])]
        else:
            yield [entry_id.encode(), [TYPE, kind.encode(), VERSION, v.encode(), DATA, data]]
