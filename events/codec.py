"""The envelope of a ledger entry and the one typed decoder.

A stream entry holds three fields: `type` (the event's tag, so that readers can filter without
decoding), `v` (the schema version of the writer) and `data` (the event as msgpack, compressed with
the ledger's dictionary: events/compression.py; entries written before that hold plain msgpack).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgspec

from events.compression import pack, unpack
from events.errors import UndecodableEntryError
from events.event import EVENT_TYPES, AnyEvent, Event

TYPE: Final = b"type"
VERSION: Final = b"v"
DATA: Final = b"data"

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(AnyEvent)
# The envelope's `type` and `v` of every class, computed once: they are on the hot path.
_ENVELOPE: Final[dict[type[Event], tuple[bytes, bytes]]] = {
    cls: (cls.__name__.encode(), str(cls.version).encode()) for cls in EVENT_TYPES
}
_BATCH_HEADER: Final = struct.Struct(">HHI")


def encode_event(event: Event) -> tuple[bytes, bytes, bytes]:
    """The (type, v, data) triple of an event, ready to XADD."""
    kind, version = _ENVELOPE[type(event)]
    return kind, version, pack(_encoder.encode(event))


def encode_batch(events: Sequence[Event]) -> bytes:
    """Events packed for the append-many script: per event a big-endian header of the three
    lengths (u16, u16, u32), then type, v and data. One argument instead of 3N keeps redis-py's
    command packing and Redis's argument parsing off the hot path."""
    parts: list[bytes] = []
    add = parts.append
    header = _BATCH_HEADER.pack
    encode = _encoder.encode
    compress = pack
    for event in events:
        kind, version = _ENVELOPE[type(event)]
        data = compress(encode(event))
        add(header(len(kind), len(version), len(data)))
        add(kind)
        add(version)
        add(data)
    return b"".join(parts)


def encode_fields(event: Event) -> dict[bytes, bytes]:
    """An event as the field map of one stream entry."""
    kind, version, data = encode_event(event)
    return {TYPE: kind, VERSION: version, DATA: data}


def encode_flat(event: Event) -> list[bytes]:
    """An event as one stream entry's names and values in turn: an XADD's arguments after its id."""
    kind, version, data = encode_event(event)
    return [TYPE, kind, VERSION, version, DATA, data]


def decode_data(entry_id: str, kind: bytes | None, data: bytes | None) -> Event:
    """Decode an entry's `data`, checking it against the envelope's `type`."""
    if data is None or kind is None:
        raise UndecodableEntryError(entry_id, "the entry has no `type` or no `data` field")
    try:
        event: Event = _decoder.decode(unpack(data))
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise UndecodableEntryError(entry_id, f"{kind!r}: {exc}") from None
    if _ENVELOPE[type(event)][0] != kind:
        raise UndecodableEntryError(entry_id, f"envelope says {kind!r} but data is {type(event).__name__}")
    return event


def decode_entry(entry_id: str, fields: dict[bytes, bytes] | Sequence[bytes]) -> Event:
    """Decode one stream entry, given as a field map or as Redis's flat [field, value, ...] list.

    Anything that is not a valid event raises UndecodableEntryError.
    """
    if isinstance(fields, dict):
        kind, data = fields.get(TYPE), fields.get(DATA)
    elif len(fields) == 6 and fields[0] == TYPE and fields[4] == DATA:
        # The layout every routeledger writer produces: the fast path.
        kind, data = fields[1], fields[5]
    else:
        fields = flat_to_dict(fields)
        kind, data = fields.get(TYPE), fields.get(DATA)
    try:
        return decode_data(entry_id, kind, data)
    except UndecodableEntryError as exc:
        exc.fields = fields if isinstance(fields, dict) else flat_to_dict(fields)
        raise


def decode_rows(
    rows: Sequence[tuple[str, Sequence[bytes]]],
    on_poison: Callable[[UndecodableEntryError], None] | None = None,
) -> list[tuple[str, Event]]:
    """Decode a batch of (id, flat fields) rows in one tight loop (the ledger's read path).

    A row that is not a valid event raises UndecodableEntryError, or is handed to `on_poison`
    and left out.
    """
    out: list[tuple[str, Event]] = []
    add = out.append
    decode = _decoder.decode
    envelope = _ENVELOPE
    for entry_id, flat in rows:
        try:
            if len(flat) == 6 and flat[0] == TYPE and flat[4] == DATA:
                event = decode(unpack(flat[5]))
                if envelope[type(event)][0] == flat[1]:
                    add((entry_id, event))
                    continue
            # Anything unusual takes the careful path, which raises with the reason.
            add((entry_id, decode_entry(entry_id, flat)))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, UndecodableEntryError) as exc:
            error = exc if isinstance(exc, UndecodableEntryError) else _poison(entry_id, flat)
            if on_poison is None:
                raise error from None
            on_poison(error)
    return out


def _poison(entry_id: str, flat: Sequence[bytes]) -> UndecodableEntryError:
    try:
        decode_entry(entry_id, flat)
    except UndecodableEntryError as exc:
        return exc
    return UndecodableEntryError(entry_id, "undecodable", flat_to_dict(flat))


def decode_event(data: bytes) -> Event:
    """An entry's `data` as its event (no envelope check): for bulk readers that grouped entries by
    their `type` already. Raises msgspec's errors, or ValueError for a compressed entry that
    cannot be read."""
    event: Event = _decoder.decode(unpack(data))
    return event


def event_fields(event: Event) -> dict[str, Any]:
    """An event as plain data with every field, defaults included: the wire form leaves defaults
    out (omit_defaults), what people and clients read shows each field."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        out[name] = msgspec.to_builtins(getattr(event, name))
    return out


def as_str(raw: bytes | str) -> str:
    """A Redis reply as text: bytes from a client that does not decode, str from one that does."""
    return raw.decode() if isinstance(raw, bytes) else raw


def flat_to_dict(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    """Redis's flat [field, value, ...] list as a dict (an odd trailing item is dropped)."""
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}
