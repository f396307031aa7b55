"""The ledger's wire compression: an event's msgpack, zstd-compressed with a shared dictionary.

Most of a small event is structure that every entry repeats: field names, the shape of a routing
breakdown, the templates of its sources. Plain zstd cannot compress a few hundred bytes; with a
dictionary that knows the structure, a task's four events shrink about threefold, so that Redis holds
about three times more hot history in the same memory.

The dictionary was trained on synthetic events with random names, digests and numbers
(`python -m sim.dictionary`), so it knows the schema and nothing of any fleet. A dictionary is
frozen once written: entries name the dictionary they were compressed with (zstd's dictionary id),
and every dictionary ever shipped stays here so that old entries decode. A new one gets the next
id; `WRITE_WITH` says which one new entries use.

Entries written before compression hold plain msgpack: a msgpack event is a map, whose first byte is
never zstd's magic, so the reader tells the two apart by the first four bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import zstandard

# zstd's frame magic number, little-endian, as the first four bytes of a frame.
MAGIC: Final = b"\x28\xb5\x2f\xfd"
# No event comes near this; a frame that claims more is poison, not a reason to allocate.
MAX_EVENT_BYTES: Final = 16 * 1024 * 1024
LEVEL: Final = 3

_HERE: Final = Path(__file__).resolve().parent
# Dictionary id -> its file. Never remove or change an entry: the ledger and its archive refer to it.
DICTIONARIES: Final[dict[int, str]] = {1: "ledger-1.zdict"}
WRITE_WITH: Final = 1


class Compression:
    """The compressor for new entries and a decompressor for every shipped dictionary."""

    def __init__(self) -> None:
        self._dicts = {
            i: zstandard.ZstdCompressionDict((_HERE / name).read_bytes()) for i, name in DICTIONARIES.items()
        }
        for i, d in self._dicts.items():
            if d.dict_id() != i:
                raise RuntimeError(f"dictionary file {DICTIONARIES[i]} has id {d.dict_id()}, not {i}")
        self._compressor = zstandard.ZstdCompressor(
            level=LEVEL, dict_data=self._dicts[WRITE_WITH], write_checksum=False, write_content_size=True
        )
        # One decompressor serves frames of any shipped dictionary: each frame names its own.
        self._decompressors = {
            i: zstandard.ZstdDecompressor(dict_data=d, max_window_size=MAX_EVENT_BYTES)
            for i, d in self._dicts.items()
        }
        self._current = self._decompressors[WRITE_WITH]

    def pack(self, data: bytes) -> bytes:
        """An event's msgpack as it goes into the ledger."""
        return self._compressor.compress(data)

    def unpack(self, data: bytes) -> bytes:
        """An entry's `data` as msgpack, whichever way it was written.

        Raises ValueError when a compressed entry cannot be read (corrupt, an unknown dictionary, or
        larger than any event)."""
        if data[:4] != MAGIC:
            return data
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise ValueError(f"corrupt compressed entry: {exc}") from None
        if size < 0 or size > MAX_EVENT_BYTES:
            raise ValueError(f"a compressed entry that does not say its size or claims {size} bytes")
        try:
            # Nearly every frame is of the dictionary new entries use: try it first. A frame of
            # another one is refused by zstd (its header names its dictionary).
            out: bytes = self._current.decompress(data)
        except zstandard.ZstdError:
            return self._other(data)
        return out

    def _other(self, data: bytes) -> bytes:
        try:
            dict_id = zstandard.get_frame_parameters(data).dict_id
        except zstandard.ZstdError as exc:
            raise ValueError(f"corrupt compressed entry: {exc}") from None
        decompressor = self._decompressors.get(dict_id)
        if decompressor is None:
            raise ValueError(f"compressed with dictionary {dict_id}, which this version does not ship")
        try:
            out: bytes = decompressor.decompress(data)
        except zstandard.ZstdError as exc:
            raise ValueError(f"corrupt compressed entry: {exc}") from None
        return out


COMPRESSION: Final = Compression()
pack: Final = COMPRESSION.pack
unpack: Final = COMPRESSION.unpack
