"""The event types of the ledger.

Every event is a frozen msgspec Struct under `Event`, tagged by its class name in the field
`type`. Schemas evolve only by appending fields with defaults: never rename, retype, remove or
reorder a field, so that every entry ever written still decodes. `at` is the producer's clock in
milliseconds since the epoch; the stream id gives the ledger's own order.

The ledger records sizes, token counts and digests of prompts and outputs, never their text.
"""

from __future__ import annotations

import time
from typing import ClassVar

import msgspec


def now_ms() -> int:
    """The producer clock, in milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


class Event(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True, gc=False, omit_defaults=True
):
    """Base of every ledger event.

    gc=False: an event holds only decoded msgpack values, which cannot form reference cycles, so the
    cyclic garbage collector need not track millions of them (it tripled the cost of a replay).
    omit_defaults=True: a field at its default is not written (the decoder fills it back in), which
    shrinks every entry; entries written before, with every field, decode to the same event.
    """

    # Bumped when a type gains fields; readers accept any version, since fields only get added.
    version: ClassVar[int] = 1

    at: int = msgspec.field(default_factory=now_ms)


class Timings(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """A backend's own timings for one generation, as Ollama reports them (durations in ns).

    A value the backend did not report is None: unknown, never zero.
    """

    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    load_duration: int | None = None
    total_duration: int | None = None


class Resources(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """What a worker could read of its machine; None wherever it could not (never -1 or 0).

    Shown to operators only: no score may use it (self-reported load misled the story's router).
    """

    cpu_percent: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    gpu_percent: float | None = None
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None


class ModelEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """One model a backend holds: a name (or alias) and the digest that is its identity."""

    name: str
    digest: str
    size: int | None = None
    family: str | None = None
    parameter_size: str | None = None
    quantization: str | None = None


# -- tasks -------------------------------------------------------------------------------------


class TaskSubmitted(Event, frozen=True, kw_only=True):
    """A client's request was accepted; the task is about to enter `queue`."""

    task_id: str
    model: str
    digest: str
    queue: str
    domain: str = "general"
    kind: str = "chat"
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    priority: int = 0
    prompt_bytes: int = 0
    prompt_sha256: str = ""
    pipeline_id: str | None = None
    client: str | None = None


class TaskRouted(Event, frozen=True, kw_only=True):
    """The routing decision for a task, with every candidate's terms and their sources."""

    task_id: str
    digest: str
    queue: str
    policy: str = "routeledger"
    policy_version: int = 1
    breakdown: dict[str, object] = msgspec.field(default_factory=dict)
    expected_worker: str | None = None
    expected_finish_s: float | None = None


class TaskClaimed(Event, frozen=True, kw_only=True):
    """A worker took a task's queue entry and is about to run it."""

    task_id: str
    worker: str
    digest: str
    attempt: int
    queue: str = ""
    entry_id: str = ""
    in_flight: int = 1


class TaskCompleted(Event, frozen=True, kw_only=True):
    """A worker finished a task; `duplicate` marks a completion that lost to an earlier one."""

    task_id: str
    worker: str
    digest: str
    attempt: int
    domain: str = "general"
    timings: Timings = Timings()
    ttft_ms: float | None = None
    wall_ms: float | None = None
    in_flight: int = 1
    output_bytes: int = 0
    output_sha256: str = ""
    done_reason: str | None = None
    duplicate: bool = False
    bench_id: str | None = None


class TaskFailed(Event, frozen=True, kw_only=True):
    """A run of a task failed; a retryable failure puts the task back for another worker."""

    task_id: str
    worker: str
    digest: str
    attempt: int
    kind: str
    retryable: bool
    message: str = ""


class TaskReclaimed(Event, frozen=True, kw_only=True):
    """A delivered entry whose owner's lease expired was re-queued with the next attempt."""

    task_id: str
    queue: str
    old_entry: str
    new_entry: str
    owner: str
    attempt: int
    idle_ms: int = 0


class TaskStalled(Event, frozen=True, kw_only=True):
    """An entry nobody took for `stall_after`; it stays where it is, and this says so once."""

    task_id: str
    queue: str
    entry_id: str
    waited_ms: int


class TaskDeadLettered(Event, frozen=True, kw_only=True):
    """A task left the queues for `rl:dead`, with the reason."""

    task_id: str
    queue: str
    reason: str
    attempts: int = 0


class TaskCancelled(Event, frozen=True, kw_only=True):
    """A client withdrew a task: removed if queued, told to stop if running."""

    task_id: str
    queue: str = ""
    was_running: bool = False


# -- workers -----------------------------------------------------------------------------------


class WorkerHeartbeat(Event, frozen=True, kw_only=True):
    """A worker is alive: what it holds, what is loaded, its slots and what it could read of its machine.

    No longer appended (liveness lives in the lease, changes in WorkerChanged); older ledgers hold
    one per worker every beat, and they still decode and fold as they always did.
    """

    worker: str
    slots: int
    in_flight: int = 0
    inventory: list[ModelEntry] = msgspec.field(default_factory=list)
    loaded: list[str] = msgspec.field(default_factory=list)
    serves: list[str] | None = None
    resources: Resources = Resources()


class WorkerChanged(Event, frozen=True, kw_only=True):
    """What a live worker holds, has loaded, serves or offers changed since it last said so.

    Liveness itself is not history: a running worker refreshes its lease (`rl:live:{worker}`, with
    its resources) and appends this only when one of these facts differs from what it last appended.
    """

    worker: str
    slots: int
    inventory: list[ModelEntry] = msgspec.field(default_factory=list)
    loaded: list[str] = msgspec.field(default_factory=list)
    serves: list[str] | None = None


class WorkerOnline(Event, frozen=True, kw_only=True):
    """A worker started and took its lease; it is benchmarked at once."""

    worker: str
    slots: int
    backend: str = ""
    backend_kind: str = "ollama"
    host: str = ""
    inventory: list[ModelEntry] = msgspec.field(default_factory=list)
    serves: list[str] | None = None


class WorkerOffline(Event, frozen=True, kw_only=True):
    """A worker left: it shut down, its lease expired, or an operator forgot it."""

    worker: str
    reason: str


# -- benchmarks and quality ---------------------------------------------------------------------


class BenchmarkRequested(Event, frozen=True, kw_only=True):
    """A benchmark was sent to one worker's pinned stream for one model."""

    bench_id: str
    worker: str
    digest: str
    model: str = ""
    domain: str = "general"
    prompts: int = 1
    reason: str = "manual"


class BenchmarkResult(Event, frozen=True, kw_only=True):
    """One benchmark prompt ran on one worker: a speed sample, never a quality one."""

    bench_id: str
    worker: str
    digest: str
    domain: str = "general"
    task_id: str = ""
    timings: Timings = Timings()
    ttft_ms: float | None = None
    wall_ms: float | None = None
    in_flight: int = 1
    prompt_id: str = ""


class QualityScored(Event, frozen=True, kw_only=True):
    """A graded answer: quality belongs to the model digest and domain, whichever worker answered."""

    digest: str
    domain: str
    score: float
    grader: str = "reference"
    task_id: str = ""
    bench_id: str = ""
    worker: str = ""


# -- pipelines ----------------------------------------------------------------------------------


class PipelineStarted(Event, frozen=True, kw_only=True):
    """A pipeline request was accepted: its fan-out, the capacity beside it and the plan's makespan."""

    pipeline_id: str
    fan_out: int
    capacity: int | None = None
    policy: str = "all"
    expected_makespan_s: float | None = None


class PipelineChildAdded(Event, frozen=True, kw_only=True):
    """A child task (or the integration step) joined a pipeline."""

    pipeline_id: str
    task_id: str
    role: str = "child"
    index: int = 0


class PipelineCompleted(Event, frozen=True, kw_only=True):
    """A pipeline finished, or failed, with which children failed."""

    pipeline_id: str
    ok: bool
    failed_children: list[str] = msgspec.field(default_factory=list)
    integration_task_id: str | None = None
    message: str = ""


EVENT_TYPES: tuple[type[Event], ...] = (
    TaskSubmitted,
    TaskRouted,
    TaskClaimed,
    TaskCompleted,
    TaskFailed,
    TaskReclaimed,
    TaskStalled,
    TaskDeadLettered,
    TaskCancelled,
    WorkerHeartbeat,
    WorkerOnline,
    WorkerOffline,
    BenchmarkRequested,
    BenchmarkResult,
    QualityScored,
    PipelineStarted,
    PipelineChildAdded,
    PipelineCompleted,
    WorkerChanged,
)

AnyEvent = (
    TaskSubmitted
    | TaskRouted
    | TaskClaimed
    | TaskCompleted
    | TaskFailed
    | TaskReclaimed
    | TaskStalled
    | TaskDeadLettered
    | TaskCancelled
    | WorkerHeartbeat
    | WorkerOnline
    | WorkerOffline
    | BenchmarkRequested
    | BenchmarkResult
    | QualityScored
    | PipelineStarted
    | PipelineChildAdded
    | PipelineCompleted
    | WorkerChanged
)

TYPE_NAMES: frozenset[str] = frozenset(t.__name__ for t in EVENT_TYPES)
