"""The envelope and the typed decoder, without Redis."""

from __future__ import annotations

import msgspec
import pytest

from events.codec import decode_entry, encode_fields, event_fields
from events.errors import UndecodableEntryError
from events.event import Event, TaskFailed
from tests.factories import one_of_each


@pytest.mark.parametrize("event", one_of_each(), ids=lambda e: type(e).__name__)
def test_every_event_type_survives_the_envelope(event: object) -> None:
    fields = encode_fields(event)  # type: ignore[arg-type]
    assert fields[b"type"] == type(event).__name__.encode()
    assert fields[b"v"] == b"1"
    assert decode_entry("1-0", fields) == event


@pytest.mark.parametrize("event", one_of_each(), ids=lambda e: type(e).__name__)
def test_an_entry_written_with_every_field_as_before_decodes_to_the_same_event(event: Event) -> None:
    # Before defaults were left out of the wire form, every field was written.
    full = msgspec.msgpack.encode(event_fields(event))
    fields = {b"type": type(event).__name__.encode(), b"v": b"1", b"data": full}
    assert decode_entry("1-0", fields) == event
    assert len(encode_fields(event)[b"data"]) <= len(full)


def test_event_fields_shows_every_field_with_defaults_though_the_wire_form_omits_them() -> None:
    event = TaskFailed(at=5, task_id="t", worker="w", digest="d", attempt=1, kind="timeout", retryable=True)
    assert b"message" not in encode_fields(event)[b"data"]
    assert event_fields(event) == {
        "type": "TaskFailed",
        "at": 5,
        "task_id": "t",
        "worker": "w",
        "digest": "d",
        "attempt": 1,
        "kind": "timeout",
        "retryable": True,
        "message": "",
        "timings": {},
    }


class _OldBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    at: int


class _TaskFailedBeforeMessage(_OldBase, frozen=True, kw_only=True, tag="TaskFailed"):
    """TaskFailed as an older writer knew it: no `message` field yet."""

    task_id: str
    worker: str
    digest: str
    attempt: int
    kind: str
    retryable: bool


def test_an_entry_written_by_an_older_schema_decodes_with_the_new_fields_defaulted() -> None:
    old = _TaskFailedBeforeMessage(
        at=5, task_id="t", worker="w", digest="d", attempt=1, kind="http_500", retryable=True
    )
    fields = {b"type": b"TaskFailed", b"v": b"0", b"data": msgspec.msgpack.encode(old)}
    event = decode_entry("7-0", fields)
    assert event == TaskFailed(
        at=5, task_id="t", worker="w", digest="d", attempt=1, kind="http_500", retryable=True, message=""
    )


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({b"type": b"TaskFailed", b"v": b"1", b"data": b"\xc1garbage"}, "TaskFailed"),
        (
            {b"type": b"NoSuchEvent", b"v": b"1", b"data": msgspec.msgpack.encode({"type": "NoSuchEvent"})},
            "NoSuch",
        ),
        ({b"v": b"1", b"data": b""}, "no `type`"),
        (
            {b"type": b"TaskStalled", b"v": b"1", b"data": msgspec.msgpack.encode({"type": "TaskStalled"})},
            "missing",
        ),
    ],
    ids=["garbage-bytes", "unknown-type", "no-type-field", "missing-required-field"],
)
def test_anything_that_is_not_an_event_raises_the_named_error_with_its_id(
    fields: dict[bytes, bytes], reason: str
) -> None:
    with pytest.raises(UndecodableEntryError) as info:
        decode_entry("42-7", fields)
    assert info.value.entry_id == "42-7"
    assert reason in str(info.value)
    assert info.value.fields == fields


def test_an_envelope_whose_type_disagrees_with_its_data_is_rejected() -> None:
    fields = encode_fields(one_of_each()[0])
    fields[b"type"] = b"TaskFailed"
    with pytest.raises(UndecodableEntryError, match="envelope says"):
        decode_entry("9-0", fields)
