"""The event types of the ledger.

Every event is a frozen msgspec Struct under `Event`, tagged by its class name in the field
`type`. Schemas evolve only by appending fields with defaults: never rename, retype, remove or
reorder a field, so that every entry ever written still decodes. `at` is the producer's clock in
milliseconds since the epoch; the stream id gives the ledger's own order.

The ledger records sizes, token counts and digests of prompts and outputs, never their text.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Final

import msgspec
from msgspec import Meta

# The producer clock (events/clock.py): re-exported, every producer imports it from here.
from events.clock import now_ms as now_ms

# -- ranges -------------------------------------------------------------------------------------
# Every number an event carries has a range the decoder enforces, so that a column of them fits a
# 64-bit integer or a finite float and no decoded event can break a columnar rebuild. A value
# outside its range makes the whole entry poison (dead-lettered with the reason), the same way for
# the live fold and for replay.
#
# What a backend reports (timings, token counts, scores) may be nonsense and still representable: a
# negative duration decodes, and the fold skips that one field while the rest of the event counts.
# Only what cannot be held (2**64 - 1, 1e20, NaN) is refused. Producers turn an out-of-range report
# into None (unknown) before they append.

# Counts: integers a float64 still holds exactly.
MAX_COUNT: Final = 2**53
# Nanosecond durations: 146 years.
MAX_NS: Final = 2**62
# Milliseconds as floats, and any other reported float: 31 years of milliseconds.
MAX_REPORTED: Final = 1e12
# Seconds a plan may expect a task or a pipeline to take: 31 years.
MAX_SECONDS: Final = 1e9
# Attempts, slots, in-flight tasks, fan-outs, indexes: far beyond any fleet.
MAX_SMALL: Final = 1_000_000

Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
EpochMs = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Meta(ge=0.0, le=MAX_SECONDS)]
Small = Annotated[int, Meta(ge=0, le=MAX_SMALL)]
Priority = Annotated[int, Meta(ge=-1000, le=1000)]
# CPU and GPU utilisation; psutil reports up to 100 per core on some platforms.
Percent = Annotated[float, Meta(ge=0.0, le=100_000.0)]
# Reported by a backend or a grader: the fold checks their sense, the schema only their size.
ReportedCount = Annotated[int, Meta(ge=-MAX_COUNT, le=MAX_COUNT)]
ReportedNs = Annotated[int, Meta(ge=-MAX_NS, le=MAX_NS)]
ReportedFloat = Annotated[float, Meta(ge=-MAX_REPORTED, le=MAX_REPORTED)]


def bounded_count(value: object, limit: int = MAX_COUNT) -> int | None:
    """A reported non-negative integer inside `limit`, or None (unknown) for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not (0 <= value <= limit):  # also false for NaN
        return None
    return int(value)


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

    at: EpochMs = msgspec.field(default_factory=now_ms)


class Timings(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """A backend's own timings for one generation, as Ollama reports them (durations in ns).

    A value the backend did not report is None: unknown, never zero.
    """

    prompt_eval_count: ReportedCount | None = None
    prompt_eval_duration: ReportedNs | None = None
    eval_count: ReportedCount | None = None
    eval_duration: ReportedNs | None = None
    load_duration: ReportedNs | None = None
    total_duration: ReportedNs | None = None
    # How `eval_count` was obtained: None, the backend reported it; "stream", the worker counted the
    # streamed pieces because the backend did not (an OpenAI-compatible server sending no `usage`).
    counted: str | None = None
    # Of `prompt_eval_count`, the tokens a slot's KV cache held and the backend did not evaluate
    # (Ollama's `prompt_eval_cached_count`, OpenAI's `usage.prompt_tokens_details.cached_tokens`):
    # `prompt_eval_duration` is the time of the rest alone. None: not reported.
    prompt_eval_cached_count: ReportedCount | None = None

    def evaluated_prompt_tokens(self) -> int | None:
        """The prompt tokens the backend evaluated: the ones its cache did not hold."""
        if self.prompt_eval_count is None:
            return None
        cached = max(0, self.prompt_eval_cached_count or 0)
        return self.prompt_eval_count - min(cached, self.prompt_eval_count)


class Resources(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """What a worker could read of its machine; None wherever it could not (never -1 or 0).

    Shown to operators only: no score may use it (self-reported load misled the story's router).
    """

    cpu_percent: Percent | None = None
    mem_used_bytes: Count | None = None
    mem_total_bytes: Count | None = None
    gpu_percent: Percent | None = None
    vram_used_bytes: Count | None = None
    vram_total_bytes: Count | None = None


class ModelEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """One model a backend holds: a name (or alias) and the digest that is its identity."""

    name: str
    digest: str
    size: Count | None = None
    family: str | None = None
    parameter_size: str | None = None
    quantization: str | None = None
    # What the model can do, as its backend reports it (Ollama's /api/show `capabilities`:
    # completion, tools, vision, embedding, thinking…); None: the backend cannot say.
    capabilities: list[str] | None = None
    # More of what the backend reports (Ollama's /api/show and /api/tags `details`, and the
    # `*.context_length` of its `model_info`); None: it does not say. Small, unlike the template
    # and parameters (dispatch.modelcard keeps those out of leases and the ledger).
    families: list[str] | None = None
    format: str | None = None
    context_length: Count | None = None
    # When the backend last changed its copy (Ollama's /api/tags `modified_at`, RFC 3339).
    modified_at: str | None = None
    # Capabilities the backend was seen to refuse for this model (a 501 to an embedding request:
    # llama-server started without --embeddings), learned by the worker; None: none refused.
    lacks: list[str] | None = None


# -- tasks -------------------------------------------------------------------------------------


class TaskSubmitted(Event, frozen=True, kw_only=True):
    """A client's request was accepted; the task is about to enter `queue`."""

    task_id: str
    model: str
    digest: str
    queue: str
    domain: str = "general"
    kind: str = "chat"
    prompt_tokens: Count | None = None
    max_tokens: Count | None = None
    priority: Priority = 0
    prompt_bytes: Count = 0
    prompt_sha256: str = ""
    pipeline_id: str | None = None
    client: str | None = None
    # Its options change how the backend runs the model (num_gpu, a large num_ctx…; accepted only
    # with allow_runtime_options): its run's timings are never folded into the speed table.
    runtime_options: bool = False
    # The name of the API key it came with (never the key); None where keys are not configured.
    key: str | None = None
    # Its fair-share round within its priority band (tasks.quota.round_of).
    share_round: Small = 0
    # One part of a request split across holders (router.split): the id the parts share, this
    # part's place (0-based) and how many there are; None, 0 and 1 for a task that is whole.
    split_of: str | None = None
    part: Small = 0
    parts: Small = 1


class TaskRouted(Event, frozen=True, kw_only=True):
    """The routing decision for a task, with every candidate's terms and their sources."""

    task_id: str
    digest: str
    queue: str
    policy: str = "routeledger"
    policy_version: Small = 1
    breakdown: dict[str, object] = msgspec.field(default_factory=dict)
    expected_worker: str | None = None
    expected_finish_s: Seconds | None = None


class TaskClaimed(Event, frozen=True, kw_only=True):
    """A worker took a task's queue entry and is about to run it."""

    task_id: str
    worker: str
    digest: str
    attempt: Small
    queue: str = ""
    entry_id: str = ""
    in_flight: Small = 1


class TaskCompleted(Event, frozen=True, kw_only=True):
    """A worker finished a task; `duplicate` marks a completion that lost to an earlier one."""

    task_id: str
    worker: str
    digest: str
    attempt: Small
    domain: str = "general"
    timings: Timings = Timings()
    ttft_ms: ReportedFloat | None = None
    wall_ms: ReportedFloat | None = None
    in_flight: Small = 1
    output_bytes: Count = 0
    output_sha256: str = ""
    done_reason: str | None = None
    duplicate: bool = False
    bench_id: str | None = None
    # Whether the model was loaded before the run, from the worker's own view of what its backend
    # had loaded (`/api/ps`): True, it was not (the run paid a load: a load sample); False, it was
    # (any `load_duration` is a warm call's few milliseconds, not a load); None, unknown (events
    # written before this field, a backend that cannot say and showed no load).
    cold: bool | None = None
    # The task's kind (TaskSubmitted.kind): an `embed` run's prompt tokens over its prompt duration
    # is an embedding-rate sample, not a prompt-speed one, and it has no decode or output length.
    kind: str = "chat"
    # The UTF-8 bytes of the prompt's text (what the submission's token estimate counts,
    # tasks.payload.estimate_tokens), against which `timings.prompt_eval_count` is a sample of
    # the model's bytes per token. None: unknown (events written before this field), or the run
    # read more than its text (images, tools), whose tokens the text does not hold.
    prompt_bytes: Count | None = None


class TaskFailed(Event, frozen=True, kw_only=True):
    """A run of a task failed; a retryable failure puts the task back for another worker."""

    task_id: str
    worker: str
    digest: str
    attempt: Small
    kind: str
    retryable: bool
    message: str = ""
    # What the run had done when it stopped, where its worker counted it (a run cancelled while
    # running: the prompt tokens once the backend had evaluated them, the output tokens streamed):
    # the projector charges them to the task's API key (Projector._charge).
    timings: Timings = Timings()


class TaskReclaimed(Event, frozen=True, kw_only=True):
    """A delivered entry whose owner's lease expired was re-queued with the next attempt."""

    task_id: str
    queue: str
    old_entry: str
    new_entry: str
    owner: str
    attempt: Small
    idle_ms: Count = 0
    # Why it was taken back, in words (its owner's lease expired, its owner let it go without an
    # acknowledgement, it was acknowledged but never finished): the task's history says why it
    # ran again. Empty: an event written before this field.
    reason: str = ""


class TaskStalled(Event, frozen=True, kw_only=True):
    """An entry nobody took for `stall_after`; it stays where it is, and this says so once."""

    task_id: str
    queue: str
    entry_id: str
    waited_ms: Count


class TaskDeadLettered(Event, frozen=True, kw_only=True):
    """A task left the queues for `rl:dead`, with the reason."""

    task_id: str
    queue: str
    reason: str
    attempts: Small = 0


class TaskCancelled(Event, frozen=True, kw_only=True):
    """A client withdrew a task: removed if queued, told to stop if running."""

    task_id: str
    queue: str = ""
    was_running: bool = False


class TaskExpired(Event, frozen=True, kw_only=True):
    """A worker took a task after its deadline (its client had stopped waiting, or it queued longer
    than a task may): it was not run, and counts as cancelled."""

    task_id: str
    queue: str = ""
    worker: str = ""
    # The task's deadline (epoch ms) and how long it had waited since its submission.
    deadline: EpochMs = 0
    waited_ms: Count = 0
    # The queue entry it was taken from: the ingest finishes it (a worker under its ACL cannot).
    entry_id: str = ""


# -- workers -----------------------------------------------------------------------------------


class WorkerHeartbeat(Event, frozen=True, kw_only=True):
    """A worker is alive: what it holds, what is loaded, its slots and what it could read of its machine.

    No longer appended (liveness lives in the lease, changes in WorkerChanged); older ledgers hold
    one per worker every beat, and they still decode and fold as they always did.
    """

    worker: str
    slots: Small
    in_flight: Small = 0
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
    slots: Small
    backend: str = ""
    backend_kind: str = "ollama"
    host: str = ""
    inventory: list[ModelEntry] = msgspec.field(default_factory=list)
    serves: list[str] | None = None


class WorkerOffline(Event, frozen=True, kw_only=True):
    """A worker left: it shut down, its lease expired, or an operator forgot it."""

    worker: str
    reason: str


class WakeRequested(Event, frozen=True, kw_only=True):
    """A magic packet went to a sleeping machine: the plan said waking it finishes the queued work
    sooner ("plan", with that gain in seconds), or an operator asked ("manual")."""

    worker: str
    why: str = "plan"
    # Seconds sooner the plan expects the queued work of `digest` to finish with the machine awake.
    gain_s: Seconds | None = None
    digest: str = ""
    # The wake time the decision counted, and where it came from ("configured", "measured ...").
    wake_s: Seconds | None = None
    wake_source: str = ""


class WakeFailed(Event, frozen=True, kw_only=True):
    """A machine sent a magic packet did not come online (no lease) within the bound."""

    worker: str
    waited_s: Seconds


# -- benchmarks and quality ---------------------------------------------------------------------


class BenchmarkRequested(Event, frozen=True, kw_only=True):
    """A benchmark was sent to one worker's background stream (its pinned one, in older history)
    for one model."""

    bench_id: str
    worker: str
    digest: str
    model: str = ""
    domain: str = "general"
    prompts: Small = 1
    reason: str = "manual"


class BenchmarkResult(Event, frozen=True, kw_only=True):
    """One benchmark prompt ran on one worker: a speed sample, never a quality one."""

    bench_id: str
    worker: str
    digest: str
    domain: str = "general"
    task_id: str = ""
    timings: Timings = Timings()
    ttft_ms: ReportedFloat | None = None
    wall_ms: ReportedFloat | None = None
    in_flight: Small = 1
    prompt_id: str = ""
    # As TaskCompleted.cold: whether this run had to load the model first.
    cold: bool | None = None
    # As TaskCompleted.kind: an embedding model is benchmarked with embeddings.
    kind: str = "chat"


class QualityScored(Event, frozen=True, kw_only=True):
    """A graded answer: quality belongs to the model digest and domain, whichever worker answered."""

    digest: str
    domain: str
    score: ReportedFloat
    grader: str = "reference"
    task_id: str = ""
    bench_id: str = ""
    worker: str = ""
    # The benchmark prompt answered: one grade per (prompt, grader) counts, since a prompt asked
    # again at temperature 0 gets the same answer and is no new evidence ("" in older events:
    # every such grade counts).
    prompt_id: str = ""
    # The answer's token budget, and whether the backend stopped it there: a cut-off answer that
    # failed says the budget was short, not that the model was wrong, and is not folded.
    max_tokens: Count | None = None
    truncated: bool = False


class SpeedShiftDetected(Event, frozen=True, kw_only=True):
    """A speed field of (worker, digest) left its long-run value (or came back to it): the
    projector's notice, appended once per change of state. Derived from samples already in the
    ledger, so no table folds it (a replay recomputes the state from the samples themselves)."""

    worker: str
    digest: str
    field: str = "decode_tps"
    long_run: ReportedFloat | None = None
    recent: ReportedFloat | None = None
    # Recent samples the shift rests on.
    samples: Small = 0
    # True: the recent samples agree with the long run again (the shift is over).
    cleared: bool = False
    # True: the shift lasted (projections.shift.ADOPT_SAMPLES, ADOPT_AFTER_S) and became the long
    # run, restarted from the recent window: `long_run` is the old value, `recent` the new one.
    adopted: bool = False


# -- pipelines ----------------------------------------------------------------------------------


class PipelineStarted(Event, frozen=True, kw_only=True):
    """A pipeline request was accepted: its fan-out, the capacity beside it and the plan's makespan."""

    pipeline_id: str
    fan_out: Small
    capacity: Small | None = None
    policy: str = "all"
    expected_makespan_s: Seconds | None = None


class PipelineChildAdded(Event, frozen=True, kw_only=True):
    """A child task (or the integration step) joined a pipeline."""

    pipeline_id: str
    task_id: str
    role: str = "child"
    index: Small = 0


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
    TaskExpired,
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
    SpeedShiftDetected,
    WakeRequested,
    WakeFailed,
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
    | TaskExpired
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
    | SpeedShiftDetected
    | WakeRequested
    | WakeFailed
)

TYPE_NAMES: frozenset[str] = frozenset(t.__name__ for t in EVENT_TYPES)
