"""The projection tables in memory: what the projector folds into and replay rebuilds.

Both sides produce a `Tables`; the store writes one into a namespace and reads it back, and
verify compares two of them field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from projections.snapshot import (
    DEFAULT_DEMAND_HALF_LIFE_S,
    DEFAULT_HALF_LIFE_S,
    DemandRow,
    FleetRow,
    LengthRow,
    PipelineRow,
    QualityRow,
    SpeedRow,
    TaskRow,
)

# Separates the parts of a composite row key in a hash field name (no name or digest holds it).
SEP: Final = "\x1f"

# Task rows and benchmark marks live in day shards that expire this long after their day ends: far
# beyond any retry horizon, so a late event still finds its task's row.
DEFAULT_TASK_RETENTION_DAYS: Final = 30


@dataclass
class Tables:
    """Every projection table of one namespace, at ledger position `checkpoint`."""

    half_life_s: float = DEFAULT_HALF_LIFE_S
    demand_half_life_s: float = DEFAULT_DEMAND_HALF_LIFE_S
    task_retention_days: int = DEFAULT_TASK_RETENTION_DAYS
    checkpoint: str | None = None
    # Ledger entries folded so far, poison ones included (the lag estimate compares it with XLEN).
    folded: int = 0
    speed: dict[tuple[str, str], SpeedRow] = field(default_factory=dict)
    length: dict[tuple[str, str], LengthRow] = field(default_factory=dict)
    quality: dict[tuple[str, str], QualityRow] = field(default_factory=dict)
    fleet: dict[str, FleetRow] = field(default_factory=dict)
    # The live projector holds only the rows of the batch it folds; replay holds them all.
    tasks: dict[str, TaskRow] = field(default_factory=dict)
    demand: dict[str, DemandRow] = field(default_factory=dict)
    # (bench_id, task_id) of every BenchmarkResult already counted (a repeat changes nothing), with
    # the stream-id ms of its ledger entry, which names its day shard. As `tasks`: the live
    # projector holds only the marks its batch touches.
    benched: dict[tuple[str, str], int] = field(default_factory=dict)
    # Where each pipeline's history is in the ledger: day-sharded, and held by the live projector
    # for one batch only, as `tasks`.
    pipelines: dict[str, PipelineRow] = field(default_factory=dict)


def pair_key(a: str, b: str) -> str:
    """The hash field name of a row keyed by two names."""
    return f"{a}{SEP}{b}"


def split_pair(name: str) -> tuple[str, str]:
    """The two names of a composite hash field name."""
    a, _, b = name.partition(SEP)
    return a, b
