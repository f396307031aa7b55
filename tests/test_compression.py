"""The ledger's wire compression: smaller entries, old plain entries still read, bad frames are poison."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest
import zstandard

from events.codec import decode_rows, encode_fields
from events.compression import DICTIONARIES, MAGIC, WRITE_WITH, pack, unpack
from events.errors import UndecodableEntryError
from events.event import TaskCompleted, TaskSubmitted, Timings

# A shipped dictionary may never change: entries in every ledger and archive were compressed with it.
FROZEN = {1: "13d030c0843a3cdf11b1d5b9f052966b64410010a79f649401864e1a676bd7e3"}

EVENT = TaskCompleted(
    at=1_764_000_000_000,
    task_id="5f0c3a1e9b2d4c6a8e7f1a3b5c7d9e0f",
    worker="gamingpc",
    digest="500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41",
    attempt=1,
    timings=Timings(
        prompt_eval_count=812, prompt_eval_duration=412_000_000, eval_count=377, eval_duration=4_510_000_000
    ),
    ttft_ms=431.5,
    wall_ms=4_990.2,
    output_bytes=1_604,
    output_sha256="9c1d8f2a6b4e7d9c0a5f1e3b8d6c2a4f9e7b5d3c1a8f6e4d2b0c9a7e5f3d1b8c",
)


def _row(data: bytes, kind: bytes = b"TaskCompleted") -> tuple[str, list[bytes]]:
    return ("1-0", [b"type", kind, b"v", b"1", b"data", data])


def test_a_shipped_dictionary_never_changes() -> None:
    here = Path(__file__).resolve().parent.parent / "events"
    for dict_id, name in DICTIONARIES.items():
        assert hashlib.sha256((here / name).read_bytes()).hexdigest() == FROZEN[dict_id], name
    assert WRITE_WITH in DICTIONARIES


def test_a_new_entry_is_compressed_to_well_under_half_and_decodes_to_the_same_event() -> None:
    plain = msgspec.msgpack.encode(EVENT)
    data = encode_fields(EVENT)[b"data"]
    assert data[:4] == MAGIC
    assert len(data) < len(plain) / 2
    assert decode_rows([_row(data)]) == [("1-0", EVENT)]


def test_an_entry_written_before_compression_still_decodes() -> None:
    plain = msgspec.msgpack.encode(EVENT)
    assert unpack(plain) == plain
    assert decode_rows([_row(plain)]) == [("1-0", EVENT)]


@pytest.mark.parametrize(
    "data",
    [
        pack(msgspec.msgpack.encode(EVENT))[:-3],  # cut short
        MAGIC + b"\x00" * 12,  # a header and nothing else
        zstandard.ZstdCompressor(
            dict_data=zstandard.train_dictionary(
                1024, [msgspec.msgpack.encode({"n": i, "s": "x" * (i % 50)}) for i in range(400)], dict_id=99
            )
        ).compress(b"\x80"),  # a dictionary this version does not ship
    ],
    ids=["truncated", "empty", "unknown-dictionary"],
)
def test_a_compressed_entry_that_cannot_be_read_is_poison_with_its_reason(data: bytes) -> None:
    poison: list[UndecodableEntryError] = []
    good = pack(msgspec.msgpack.encode(TaskSubmitted(task_id="t", model="m", digest="d", queue="q")))
    rows = [_row(data), _row(good, b"TaskSubmitted")]
    assert [type(e).__name__ for _, e in decode_rows(rows, poison.append)] == ["TaskSubmitted"]
    assert len(poison) == 1 and poison[0].entry_id == "1-0"
