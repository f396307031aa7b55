"""The whole ledger as one history: the archive's segments in order, then the stream after the
manifest's last id (so that an entry archived but not yet trimmed is read once).

Readers take the archive directory from the settings (`archive_dir`); without one they use the
directory `Keys.archive` records. Either way the manifest is checked against what Redis recorded:
a manifest of another ledger, or none where Redis says segments were written, is an error that says
what to fix, never a history with a hole in it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Final

import redis.asyncio as aioredis

from events.codec import decode_rows
from events.event import Event
from events.keys import Keys
from events.ledger import Ledger, PoisonHandler, WireEntry, next_id
from replay import segment
from replay.archive import read_state
from replay.errors import ArchiveError
from replay.frames import Frames
from replay.segment import IdKey, Manifest, id_key

# Archived rows handed out at a time by `read_wire`, as the stream's chunks are.
CHUNK: Final = 5_000


class History:
    """Archive + stream of one ledger, read as one."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys | None = None, archive_dir: str | Path | None = None
    ) -> None:
        self.redis = redis
        self.keys = keys or Keys.for_client(redis)
        self.ledger = Ledger(redis, self.keys)
        self.archive_dir = Path(archive_dir) if archive_dir else None
        self._manifest: Manifest | None = None
        self._directory: Path | None = None

    async def manifest(self) -> tuple[Path | None, Manifest]:
        """The archive's directory and manifest (empty when this ledger has no archive)."""
        if self._manifest is not None:
            return self._directory, self._manifest
        state = await read_state(self.redis, self.keys)
        directory = self.archive_dir or (Path(state.dir) if state.dir else None)
        found = None if directory is None else segment.load_manifest(directory)
        if found is None:
            if state.segments:
                raise ArchiveError(
                    f"this ledger's oldest {state.events:,} entries are archived in {state.segments} "
                    f"segment(s) in {state.dir} ({self.keys.archive}), but {directory} has no manifest: "
                    "set archive_dir (ROUTELEDGER_ARCHIVE_DIR) to the directory that holds it"
                )
            found = Manifest(ledger=state.ledger, stream=self.keys.events)
        elif found.segments and found.ledger != state.ledger:
            raise ArchiveError(
                f"the archive in {directory} belongs to another ledger (token {found.ledger!r}, this "
                f"Redis has {state.ledger or 'none'!r}); set archive_dir to this ledger's archive"
            )
        self._directory, self._manifest = directory, found
        return directory, found

    async def count(self) -> int:
        """Entries in the whole history (an entry archived but not yet trimmed may count twice)."""
        _, manifest = await self.manifest()
        return manifest.events + await self.ledger.length()

    async def _stream_start(self, start: str) -> str:
        _, manifest = await self.manifest()
        last = manifest.last_id
        if last is None or id_key(start) > id_key(last):
            return start
        return next_id(last)

    async def read_wire(
        self, start: str = "-", stop: str = "+", chunk: int = CHUNK
    ) -> AsyncGenerator[list[WireEntry], None]:
        """Entries from `start` to `stop` (both inclusive, as XRANGE takes them) as Redis sends
        them, in chunks: archived ones first, then the stream's (`Ledger.read_wire`)."""
        directory, manifest = await self.manifest()
        lo, hi = id_key(start), id_key(stop, upper=True)
        for seg in manifest.segments:
            if id_key(seg.last_id) < lo:
                continue
            if id_key(seg.first_id) > hi:
                return
            assert directory is not None
            path = segment.segment_path(directory, seg)
            frame = segment.read_segment(
                path,
                [segment.ID, segment.KIND, segment.V, segment.BODY, segment.RAW],
                segment.in_range(lo, hi),
            )
            for offset in range(0, frame.height, chunk):
                yield list(segment.wire_rows(frame.slice(offset, chunk)))
        begin = await self._stream_start(start)
        if id_key(begin) > hi:
            return
        async with contextlib.aclosing(self.ledger.read_wire(begin, stop, chunk=chunk)) as chunks:
            async for rows in chunks:
                yield rows

    async def read_raw(
        self, start: str = "-", stop: str = "+", chunk: int = CHUNK
    ) -> AsyncGenerator[list[tuple[str, list[bytes]]], None]:
        """As `read_wire`, with ids as strings (as `Ledger.read_raw`)."""
        async with contextlib.aclosing(self.read_wire(start, stop, chunk)) as chunks:
            async for rows in chunks:
                yield [(row[0].decode(), row[1]) for row in rows]

    async def tail(
        self, from_id: str = "$", block_ms: int = 1000, *, on_poison: PoisonHandler | None = None
    ) -> AsyncIterator[tuple[str, Event]]:
        """Follow the ledger after `from_id` forever, the archived part first (`$`: only new entries)."""
        cursor = from_id
        if from_id != "$":
            start = next_id(from_id) if "-" in from_id else f"{int(from_id) + 1}-0"
            _, manifest = await self.manifest()
            last = manifest.last_id
            if last is not None and id_key(start) <= id_key(last):
                async with contextlib.aclosing(self.read_raw(start, last)) as chunks:
                    async for rows in chunks:
                        for item in decode_rows(rows, on_poison):
                            yield item
                cursor = last
        async for item in self.ledger.tail(cursor, block_ms, on_poison=on_poison):
            yield item

    async def fold_into(
        self,
        frames: Frames,
        stop: str = "+",
        *,
        on_poison: PoisonHandler | None = None,
        progress: Callable[[int], None] | None = None,
        chunk: int = CHUNK,
    ) -> tuple[int, str | None]:
        """Every entry up to `stop` into `frames`, in ledger order: archived segments through their
        typed columns, the stream through `Frames.add_rows`. Returns the entries read and the last id."""
        directory, manifest = await self.manifest()
        hi: IdKey = id_key(stop, upper=True)
        read = 0
        last_id: str | None = None
        for seg in manifest.segments:
            if id_key(seg.first_id) > hi:
                break
            assert directory is not None
            path = segment.segment_path(directory, seg)
            n, last = frames.add_segment(path, None if id_key(seg.last_id) <= hi else hi, on_poison)
            read += n
            last_id = last or last_id
            if progress is not None:
                progress(n)
        begin = await self._stream_start("-")
        if id_key(begin) > hi:
            return read, last_id
        async with contextlib.aclosing(self.ledger.read_wire(begin, stop, chunk=chunk)) as chunks:
            async for rows in chunks:
                frames.add_rows(rows, on_poison)
                read += len(rows)
                last_id = rows[-1][0].decode()
                if progress is not None:
                    progress(len(rows))
        return read, last_id
