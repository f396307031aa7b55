"""What the entry index needs of an event that names a task or a pipeline but folds into no row.

A task's events are its rows' events (TaskSubmitted, TaskClaimed, …) and the entries that only
mention it: the routing decision (TaskRouted), a benchmark's result or grade (BenchmarkResult,
QualityScored) and a pipeline's step (PipelineChildAdded). A pipeline's own events are
PipelineStarted, PipelineChildAdded and PipelineCompleted. Of those entries the index keeps only
the ids, so they are read with a decoder that takes two strings and skips the rest (a routing
breakdown is most of the ledger's bytes): the live projector and replay's fold read them the same
way, from the same bytes, so both list the same entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

from events.codec import DATA, TYPE
from events.compression import unpack
from events.event import (
    BenchmarkResult,
    Event,
    PipelineChildAdded,
    PipelineCompleted,
    PipelineStarted,
    QualityScored,
    TaskRouted,
)


class Mention(msgspec.Struct, frozen=True, gc=False):
    """The task and pipeline one entry names ('' for none) and whether it is a pipeline's own event."""

    task_id: str = ""
    pipeline_id: str = ""
    pipeline_event: bool = False


class _Names(msgspec.Struct, gc=False):
    task_id: str = ""
    pipeline_id: str | None = None


# The envelope tags of the entries read as mentions, and whether each is a pipeline's own event.
MENTION_TAGS: Final[dict[bytes, bool]] = {
    TaskRouted.__name__.encode(): False,
    BenchmarkResult.__name__.encode(): False,
    QualityScored.__name__.encode(): False,
    PipelineStarted.__name__.encode(): True,
    PipelineChildAdded.__name__.encode(): True,
    PipelineCompleted.__name__.encode(): True,
}
# Types read as mentions only: the live projector otherwise skips their entries undecoded.
MENTION_ONLY: Final = frozenset(
    t.__name__.encode() for t in (TaskRouted, PipelineStarted, PipelineChildAdded, PipelineCompleted)
)

_names: Final = msgspec.msgpack.Decoder(_Names)


def read_mention(flat: Sequence[bytes]) -> Mention | None:
    """The mention in a stream entry's flat fields, or None when its type mentions nothing or its
    data does not decode (such an entry is left out of the index, never dead-lettered from here)."""
    if len(flat) != 6 or flat[0] != TYPE or flat[4] != DATA:
        return None
    pipeline_event = MENTION_TAGS.get(flat[1])
    if pipeline_event is None:
        return None
    return mention_of(flat[5], pipeline_event)


def mention_of(data: bytes, pipeline_event: bool) -> Mention | None:
    """The mention in an entry's `data` (as stored, compressed or not); None when it does not decode."""
    try:
        names = _names.decode(unpack(data))
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None
    if not names.task_id and not names.pipeline_id:
        return None
    return Mention(names.task_id, names.pipeline_id or "", pipeline_event)


def mention_in(event: Event) -> Mention | None:
    """The mention of a decoded event: what `read_mention` reads from its entry."""
    pipeline_event = MENTION_TAGS.get(type(event).__name__.encode())
    if pipeline_event is None:
        return None
    task_id = getattr(event, "task_id", "") or ""
    pipeline_id = getattr(event, "pipeline_id", "") or ""
    if not task_id and not pipeline_id:
        return None
    return Mention(task_id, pipeline_id, pipeline_event)
