"""The typed view of the projection tables that readers get: the contract between the projector
(and replay) on one side and the router and the API on the other.

Every field group carries its own sufficient statistics and its own `updated_at`, so that speed
measured on Tuesday and quality graded on Friday never overwrite each other's age, and a reader
can fall back field by field. A value nobody has measured is absent (n = 0), never a sentinel.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from projections.status import TaskStatus

# Half-life of the speed, output-length and quality statistics: a machine's speed drifts over weeks.
DEFAULT_HALF_LIFE_S: Final = 7 * 86_400.0
# Half-life of the demand table: the gate needs the arrival rate of the last minutes, not the week's.
# The projector folds with it (the `demand_half_life_s` setting defaults to it) and the scheduling
# simulator reads the same one, so both decide on the same arrival rate.
DEFAULT_DEMAND_HALF_LIFE_S: Final = 300.0
# Newest samples a speed field keeps beside its long-run statistics: its short time scale, counted
# in samples rather than seconds, so that a machine nothing is sent to keeps its last verdict
# instead of fading back to the long run (projections.shift reads the window).
RECENT_SAMPLES: Final = 5


class Stat(msgspec.Struct, kw_only=True, gc=False):
    """Sufficient statistics of one field: lifetime (n, sum, sumsq) and exponentially time-decayed.

    The decayed sums are referenced to `updated_at` (the newest sample's producer clock, ms): a
    sample taken at t weighs 2 ** (-(updated_at - t) / half_life). A sample older than
    `updated_at` (producer clocks disagree) is added with its weight and does not move the
    reference, so the fold does not depend on arrival order.
    """

    n: int = 0
    sum: float = 0.0
    sumsq: float = 0.0
    dn: float = 0.0
    dsum: float = 0.0
    dsumsq: float = 0.0
    updated_at: int | None = None

    @property
    def mean(self) -> float | None:
        """Lifetime mean, or None when nothing was measured."""
        return self.sum / self.n if self.n else None

    @property
    def decayed_mean(self) -> float | None:
        """Time-weighted mean (recent samples weigh more), or None when nothing was measured."""
        return self.dsum / self.dn if self.dn > 0 else None

    @property
    def variance(self) -> float | None:
        """Lifetime sample variance, or None with fewer than two samples."""
        if self.n < 2:
            return None
        return max(0.0, (self.sumsq - self.sum * self.sum / self.n) / (self.n - 1))

    def weight_at(self, now_ms: int, half_life_s: float) -> float:
        """The decayed sample weight as seen at `now_ms`: how much evidence is left after ageing."""
        if self.updated_at is None or self.dn <= 0:
            return 0.0
        age_s = max(0.0, (now_ms - self.updated_at) / 1000.0)
        return self.dn * math.pow(2.0, -age_s / half_life_s)

    def age_s(self, now_ms: int) -> float | None:
        """Seconds since the newest sample, or None when there is none."""
        return None if self.updated_at is None else max(0.0, (now_ms - self.updated_at) / 1000.0)


def fold(stat: Stat, x: float, at_ms: int, half_life_s: float) -> Stat:
    """`stat` with one more sample `x` taken at `at_ms`. The one definition of folding: the live
    projector, replay's polars rebuild (vectorised, the same formula) and the simulator use it."""
    n, s, ss = stat.n + 1, stat.sum + x, stat.sumsq + x * x
    ref = stat.updated_at
    if ref is None:
        return Stat(n=n, sum=s, sumsq=ss, dn=1.0, dsum=x, dsumsq=x * x, updated_at=at_ms)
    if at_ms >= ref:
        k = math.pow(2.0, -(at_ms - ref) / 1000.0 / half_life_s)
        return Stat(
            n=n,
            sum=s,
            sumsq=ss,
            dn=stat.dn * k + 1.0,
            dsum=stat.dsum * k + x,
            dsumsq=stat.dsumsq * k + x * x,
            updated_at=at_ms,
        )
    w = math.pow(2.0, -(ref - at_ms) / 1000.0 / half_life_s)
    return Stat(
        n=n,
        sum=s,
        sumsq=ss,
        dn=stat.dn + w,
        dsum=stat.dsum + w * x,
        dsumsq=stat.dsumsq + w * x * x,
        updated_at=ref,
    )


class SpeedRow(msgspec.Struct, kw_only=True, gc=False):
    """speed[worker, digest]: what this machine does with this model. Each field has its own clock."""

    worker: str
    digest: str
    decode_tps: Stat = msgspec.field(default_factory=Stat)
    prompt_tps: Stat = msgspec.field(default_factory=Stat)
    load_s: Stat = msgspec.field(default_factory=Stat)
    ttft_s: Stat = msgspec.field(default_factory=Stat)
    # Tasks the worker had in flight when each decode sample was taken (the concurrency fit reads it).
    in_flight: Stat = msgspec.field(default_factory=Stat)
    # Of the decode samples, how many had their output tokens counted from the stream by the worker
    # (the backend reported none): an approximation the breakdown names.
    counted_n: int = 0
    # The newest RECENT_SAMPLES decode and prompt samples, oldest first, in ledger order. A sample
    # taken while its field is shifted (projections.shift.fold_sample) is kept here only, not in
    # the long-run statistics above.
    decode_recent: list[float] = msgspec.field(default_factory=list)
    prompt_recent: list[float] = msgspec.field(default_factory=list)
    # Producer time (ms) of the newest decode sample, kept out of the long run or not: how long a
    # machine has had nothing (a probe's wait) while `decode_tps.updated_at` stays at a shift's start.
    sampled_at: int | None = None
    # Samples in a row each field has kept out of its long run, and the ledger time (ms) of the
    # first: how long its shift has lasted, for adopting one that lasts (projections.shift).
    decode_held: int = 0
    decode_held_since: int | None = None
    prompt_held: int = 0
    prompt_held_since: int | None = None
    # Prompt tokens per second of embedding tasks (kind `embed`): what an embedding costs here.
    embed_tps: Stat = msgspec.field(default_factory=Stat)


def push_recent(window: list[float], x: float) -> list[float]:
    """`window` with sample `x` appended and only the newest RECENT_SAMPLES kept (a new list)."""
    return [*window[1 - RECENT_SAMPLES :], x]


class LengthRow(msgspec.Struct, kw_only=True, gc=False):
    """length[digest, domain]: output tokens, a property of the model and the kind of request."""

    digest: str
    domain: str
    output_tokens: Stat = msgspec.field(default_factory=Stat)
    # A model's bytes per prompt token, learned from the same runs (projections.folder.prompt_sample):
    # each run's prompt text bytes and the prompt tokens its backend counted, folded together, so
    # that the ratio of their decayed sums is the token-weighted, time-decayed bytes per token.
    prompt_bytes: Stat = msgspec.field(default_factory=Stat)
    prompt_tokens: Stat = msgspec.field(default_factory=Stat)


class QualityRow(msgspec.Struct, kw_only=True, gc=False):
    """quality[digest, domain]: graded score in [0, 1]; the same whichever worker answered."""

    digest: str
    domain: str
    score: Stat = msgspec.field(default_factory=Stat)
    # "grader/prompt_id" of every prompt already graded, sorted: a second grade of one (a prompt
    # asked again at temperature 0 answers the same) is not new evidence and is not folded.
    graded: list[str] = msgspec.field(default_factory=list)


def grade_mark(grader: str, prompt_id: str) -> str:
    """The `QualityRow.graded` entry of one prompt graded by one grader."""
    return f"{grader}/{prompt_id}"


# Offsets a worker's clock estimate keeps: its median ignores up to four odd ones (a slow hop, a
# completion appended late), and a clock that was stepped shows after five events.
CLOCK_WINDOW: Final = 9


def clock_skew_ms(window: list[int]) -> int | None:
    """The estimate of a worker's clock offset from its recent offsets: their median (the upper
    one of an even count, so that it is one of them); None when there are none."""
    return sorted(window)[len(window) // 2] if window else None


class Stamped(msgspec.Struct, kw_only=True, gc=False):
    """A reported value with the producer time it was reported at (ms); None value = unknown."""

    value: object = None
    at: int | None = None


class FleetRow(msgspec.Struct, kw_only=True, gc=False):
    """fleet[worker]: what the ledger says about one machine, every field with its own time."""

    worker: str
    status: str = "offline"  # online | offline | draining | forgotten
    status_since: int | None = None
    last_heartbeat: int | None = None
    slots: Stamped = msgspec.field(default_factory=Stamped)
    inventory: Stamped = msgspec.field(default_factory=Stamped)  # {name: digest}
    loaded: Stamped = msgspec.field(default_factory=Stamped)  # [digest]
    serves: Stamped = msgspec.field(default_factory=Stamped)  # [name] or None: all it holds
    resources: Stamped = msgspec.field(default_factory=Stamped)  # {metric: value or None}
    # Claimed-and-not-finished tasks by the ledger's count (never self-reported load).
    in_flight: list[str] = msgspec.field(default_factory=list)
    # The worker's clock minus the ledger's (ms), from its newest TaskClaimed: the event's `at`
    # against its stream id's time. None: not seen claim anything.
    clock_offset_ms: int | None = None
    # The worker's clock minus the ledger's (ms), robustly: the median of `clock_window`, stamped
    # with the stream-id ms of its newest sample (clock_skew_ms). None: no sample yet.
    clock_skew: Stamped = msgspec.field(default_factory=Stamped)
    # Its last CLOCK_WINDOW offsets, oldest first: each TaskClaimed's and TaskCompleted's `at` (the
    # worker's clock) minus its stream id's ms (the ledger's). Stamped before it travels, an event's
    # offset is low by its transit (milliseconds; an inbox worker's also by the ingest's delay).
    clock_window: list[int] = msgspec.field(default_factory=list)
    # A sleeping machine's wake: the stream-id ms (the ledger's clock; `at` for an event folded
    # outside the ledger) of the WakeRequested not yet answered by a WorkerOnline (or given up with
    # WakeFailed), in ledger order; and the last measured wake, seconds from the request to the
    # WorkerOnline that followed it on that clock, stamped with that WorkerOnline's `at`.
    wake_pending: int | None = None
    wake_s: Stamped = msgspec.field(default_factory=Stamped)


class TaskRow(msgspec.Struct, kw_only=True, gc=False):
    """tasks[task_id]: what the API shows for a task."""

    task_id: str
    status: TaskStatus = "queued"
    model: str = ""
    digest: str = ""
    domain: str = "general"
    queue: str = ""
    attempts: int = 0
    worker: str | None = None
    submitted_at: int | None = None
    claimed_at: int | None = None
    finished_at: int | None = None
    eval_count: int | None = None
    prompt_eval_count: int | None = None
    decode_tps: float | None = None
    ttft_ms: float | None = None
    wall_ms: float | None = None
    error: str | None = None
    duplicates: int = 0
    pipeline_id: str | None = None
    # The attempt whose completion counted (the first); None until one did. Later ones are duplicates.
    completed_attempt: int | None = None
    # The stream-id ms of the ledger entry that created this row: its UTC day names the day shard
    # the row lives in (projections/store.py). None only in rows written before shards existed.
    first_ms: int | None = None
    # The ledger entry ids of the task's events, delta-packed (`add_entry`): the events that fold
    # into this row and, once it exists, the entries that only mention the task (projections/
    # mention.py). GET /v1/tasks/{id}/events reads these entries instead of the ledger.
    entries: list[int] = msgspec.field(default_factory=list)
    # Submitted with options that change how the backend runs the model (TaskSubmitted's): its
    # timings say nothing of the machine's speed and are not folded into it.
    runtime_options: bool = False


class PipelineRow(msgspec.Struct, kw_only=True, gc=False):
    """pipelines[pipeline_id]: where a pipeline's history is in the ledger, for when its hash expired."""

    pipeline_id: str
    # The stream-id ms of the entry that created the row (a task submitted for the pipeline, or
    # one of its own events): it names the day shard, as a task row's does.
    first_ms: int | None = None
    # Entry ids of its own events (PipelineStarted, PipelineChildAdded, PipelineCompleted), packed
    # as TaskRow.entries.
    entries: list[int] = msgspec.field(default_factory=list)
    # Its tasks, in the order the ledger first names them (submitted for it, or added as a step).
    tasks: list[str] = msgspec.field(default_factory=list)


def add_entry(entries: list[int], ms: int, seq: int) -> None:
    """Append ledger entry id `ms-seq` to a packed list: the first id as its ms and seq, every next
    one as the ms since the one before it and its seq. A task's events are seconds apart, so each
    costs a few bytes of msgpack (a delta under 65.5 s in 3 bytes, a small seq in 1)."""
    entries.append(ms - sum(entries[0::2]) if entries else ms)
    entries.append(seq)


def entry_ids(entries: list[int]) -> list[str]:
    """The ledger entry ids of a packed list, in ledger order."""
    out: list[str] = []
    ms = 0
    for i in range(0, len(entries) - 1, 2):
        ms += entries[i]
        out.append(f"{ms}-{entries[i + 1]}")
    return out


class DemandRow(msgspec.Struct, kw_only=True, gc=False):
    """demand[digest]: submissions over time, for the arrival rate the gate needs.

    `arrivals` folds the value 1 per TaskSubmitted, so its decayed weight divided by the mean life
    of the decay (half_life / ln 2) is the recent arrival rate per second.
    """

    digest: str
    arrivals: Stat = msgspec.field(default_factory=Stat)


class Snapshot(msgspec.Struct, kw_only=True, gc=False):
    """All tables at one ledger position, as plain structs (what the router takes)."""

    checkpoint: str | None = None
    taken_at: int = 0
    half_life_s: float = DEFAULT_HALF_LIFE_S
    speed: dict[tuple[str, str], SpeedRow] = msgspec.field(default_factory=dict)
    length: dict[tuple[str, str], LengthRow] = msgspec.field(default_factory=dict)
    quality: dict[tuple[str, str], QualityRow] = msgspec.field(default_factory=dict)
    fleet: dict[str, FleetRow] = msgspec.field(default_factory=dict)
    demand: dict[str, DemandRow] = msgspec.field(default_factory=dict)
    # demand is folded with its own, short half-life (the gate needs the recent arrival rate).
    demand_half_life_s: float = DEFAULT_DEMAND_HALF_LIFE_S
    # Workers whose lease key exists right now: live state read beside the tables, not a projection.
    live: list[str] = msgspec.field(default_factory=list)
