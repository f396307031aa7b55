"""The live fold: events one at a time into in-memory tables, remembering which rows changed.

The rules here are the reference; replay's polars rebuild states the same rules as vectorised
expressions, and a property test holds the two together.

Sample values are checked field by field: an absurd or missing value leaves its field untouched
and the rest of the event still counts (missing means unknown, never zero).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any, Final

from events.event import (
    BenchmarkResult,
    Event,
    QualityScored,
    SpeedShiftDetected,
    TaskCancelled,
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskExpired,
    TaskFailed,
    TaskReclaimed,
    TaskStalled,
    TaskSubmitted,
    Timings,
    WakeFailed,
    WakeRequested,
    WorkerChanged,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
)
from projections.mention import Mention
from projections.shift import HELD, WINDOWS, Folded, Shift, detect, fold_sample
from projections.snapshot import (
    CLOCK_WINDOW,
    DemandRow,
    FleetRow,
    LengthRow,
    PipelineRow,
    QualityRow,
    SpeedRow,
    Stamped,
    Stat,
    TaskRow,
    add_entry,
    clock_skew_ms,
    fold,
    grade_mark,
)
from projections.status import fold_status
from projections.tables import Tables

TaskEvent = (
    TaskSubmitted
    | TaskClaimed
    | TaskCompleted
    | TaskFailed
    | TaskReclaimed
    | TaskStalled
    | TaskDeadLettered
    | TaskCancelled
    | TaskExpired
)
# The events that create or change a task row (BenchmarkResult carries a task_id but does not).
TASK_EVENTS: Final = (
    TaskSubmitted,
    TaskClaimed,
    TaskCompleted,
    TaskFailed,
    TaskReclaimed,
    TaskStalled,
    TaskDeadLettered,
    TaskCancelled,
    TaskExpired,
)

NS_PER_S: Final = 1e9
# A TaskCompleted's kind whose prompt rate is an embedding rate (tasks.payload.EMBED).
EMBED: Final = "embed"
# Above this a decode rate is a broken timing, not a fast machine.
MAX_DECODE_TPS: Final = 10_000.0
# Prompt processing is batched and far faster than decoding; only nonsense is above this.
MAX_PROMPT_TPS: Final = 1_000_000.0
# A measurement must be long enough to be one (design rule 14). A run that decoded fewer tokens
# is no decode-speed sample: its time is dominated by per-request overhead and the first token's
# share, and on a machine whose CPU is shared out in slices (a throttled laptop, a cgroup quota)
# a short answer fits in one slice and reads several times faster than the machine is. Real
# llama.cpp servers held to a quarter of a core measured 59-99 tok/s on 8-21 token answers
# against 23 on 128.
MIN_DECODE_TOKENS: Final = 32
# Likewise for the prompt: a run that evaluated fewer prompt tokens (the cached ones took no time
# and do not count) is no prompt-speed sample. llama-server's prompt cache leaves 1-24 of a
# chat's tokens to evaluate, whose rates spread from 2.6 to 144 tok/s on one steady server.
MIN_PROMPT_TOKENS: Final = 32
# No model writes a million tokens in one answer; a larger count is a broken report, and one such
# value would swamp the length table's mean.
MAX_OUTPUT_TOKENS: Final = 1_000_000
# A run's prompt bytes per token outside these bounds is a broken count or a cache hit the backend
# counted only in part (no tokenizer is that far from about 4 bytes a token): not a sample.
MIN_SAMPLE_BYTES_PER_TOKEN: Final = 0.5
MAX_SAMPLE_BYTES_PER_TOKEN: Final = 32.0
# A run that does not say whether it loaded the model (written before completions said so) is a
# load sample only from this many seconds: a warm call reports milliseconds, a load seconds.
MIN_UNKNOWN_LOAD_S: Final = 0.5

RESOURCE_FIELDS: Final = (
    "cpu_percent",
    "mem_used_bytes",
    "mem_total_bytes",
    "gpu_percent",
    "vram_used_bytes",
    "vram_total_bytes",
)


def _rate(count: int | None, duration_ns: int | None, cap: float) -> float | None:
    if count is None or duration_ns is None or count <= 0 or duration_ns <= 0:
        return None
    value = count / (duration_ns / NS_PER_S)
    return value if value <= cap else None


def decode_tps(t: Timings) -> float | None:
    """Decode tokens per second, or None when unknown or absurd."""
    return _rate(t.eval_count, t.eval_duration, MAX_DECODE_TPS)


def decode_sample(t: Timings) -> float | None:
    """The run's decode speed as a sample of the machine's: None when it decoded fewer than
    MIN_DECODE_TOKENS tokens (or the rate is unknown or absurd)."""
    if t.eval_count is None or t.eval_count < MIN_DECODE_TOKENS:
        return None
    return decode_tps(t)


def prompt_sample_tps(t: Timings) -> float | None:
    """The run's prompt speed as a sample: None when it evaluated fewer than MIN_PROMPT_TOKENS
    (cached tokens are not evaluated), or the rate is unknown or absurd."""
    evaluated = t.evaluated_prompt_tokens()
    if evaluated is None or evaluated < MIN_PROMPT_TOKENS:
        return None
    return prompt_tps(t)


def prompt_tps(t: Timings) -> float | None:
    """Prompt tokens per second, or None when unknown or absurd."""
    # Cached tokens took no time: counted, they would make a cache hit look like a fast machine.
    return _rate(t.evaluated_prompt_tokens(), t.prompt_eval_duration, MAX_PROMPT_TPS)


def load_s(t: Timings) -> float | None:
    """Seconds the backend spent loading the model, or None when unknown or not positive."""
    d = t.load_duration
    return d / NS_PER_S if d is not None and d > 0 else None


def cold_load_s(t: Timings, cold: bool | None) -> float | None:
    """Seconds of a load the run really paid, or None: only a cold run is a load sample (a warm
    call's few milliseconds of `load_duration` are not a load); a run that does not say counts
    from `MIN_UNKNOWN_LOAD_S`, so that old history keeps its loads and drops warm calls."""
    seconds = load_s(t)
    if seconds is None or cold is False:
        return None
    if cold is None and seconds < MIN_UNKNOWN_LOAD_S:
        return None
    return seconds


def prompt_sample(prompt_bytes: int | None, t: Timings) -> tuple[float, float] | None:
    """(prompt bytes, prompt tokens) of a run, as a sample of its model's bytes per token, or None.

    The rule: the run says its prompt's text bytes (TaskCompleted.prompt_bytes: not when it read
    images or tools), its backend counted the prompt (`prompt_eval_count` > 0) and reported no
    cached part (`prompt_eval_cached_count` > 0: backends differ on whether the count holds the
    cached tokens), and the ratio lies within [MIN_SAMPLE_BYTES_PER_TOKEN,
    MAX_SAMPLE_BYTES_PER_TOKEN]."""
    count = t.prompt_eval_count
    if prompt_bytes is None or prompt_bytes <= 0 or count is None or count <= 0:
        return None
    if (t.prompt_eval_cached_count or 0) > 0:
        return None
    if not MIN_SAMPLE_BYTES_PER_TOKEN <= prompt_bytes / count <= MAX_SAMPLE_BYTES_PER_TOKEN:
        return None
    return float(prompt_bytes), float(count)


def ttft_s(ttft_ms: float | None) -> float | None:
    """Time to first token in seconds, or None when unknown or absurd."""
    if ttft_ms is None or not math.isfinite(ttft_ms) or ttft_ms <= 0:
        return None
    return ttft_ms / 1000.0


def valid_score(score: float) -> bool:
    """A quality score counts only inside [0, 1]."""
    return math.isfinite(score) and 0.0 <= score <= 1.0


def counts_as_grade(score: float, truncated: bool) -> bool:
    """A valid score counts, except a failed answer the backend cut off at its token budget: that
    says the budget was short, not that the model is wrong."""
    return valid_score(score) and not (truncated and score < 1.0)


def task_error(kind: str, message: str) -> str:
    """The error a failed run leaves on its task row."""
    return f"{kind}: {message}" if message else kind


def resources_dict(event: WorkerHeartbeat) -> dict[str, Any]:
    """Every resource metric, None where the worker could not read it."""
    r = event.resources
    return {name: getattr(r, name) for name in RESOURCE_FIELDS}


def _stamp(current: Stamped, value: object, at: int) -> bool:
    """Set a reported value unless a later report (by producer clock) is already there."""
    if current.at is not None and at < current.at:
        return False
    current.value = value
    current.at = at
    return True


class Folder:
    """Folds events into `tables` and records the keys of the rows that changed."""

    def __init__(self, tables: Tables) -> None:
        self.tables = tables
        self.dirty_speed: set[tuple[str, str]] = set()
        self.dirty_length: set[tuple[str, str]] = set()
        self.dirty_quality: set[tuple[str, str]] = set()
        self.dirty_fleet: set[str] = set()
        self.dirty_tasks: set[str] = set()
        self.dirty_demand: set[str] = set()
        self.new_benched: set[tuple[str, str]] = set()
        self.dirty_pipelines: set[str] = set()
        # Notices of speed fields whose shift state changed, for the projector to append once the
        # batch is written (derived from samples in the ledger; no table folds them).
        self.shifts: list[SpeedShiftDetected] = []
        # The stream id (ms, seq) of the entry being folded: a row or mark it creates lives in the
        # day shard of its ms, and the row lists the id.
        self._entry_ms = 0
        self._entry_seq = 0
        # The in-flight list of each fleet row as a set while folding; written back by `flush_fleet`.
        self._in_flight: dict[str, set[str]] = {w: set(r.in_flight) for w, r in tables.fleet.items()}
        self._handlers: dict[type[Event], Callable[[Any], None]] = {
            kind: getattr(self, name) for kind, name in HANDLERS.items()
        }

    def apply(self, event: Event, entry_ms: int = 0, entry_seq: int = 0) -> None:
        """Fold one event (`entry_ms`, `entry_seq`: the parts of its ledger entry id); types that
        feed no table are ignored. A task row or benchmark mark not in `tables` is taken to be new."""
        handler = self._handlers.get(type(event))
        if handler is not None:
            self._entry_ms, self._entry_seq = entry_ms, entry_seq
            handler(event)

    def mention(self, m: Mention, entry_ms: int, entry_seq: int) -> None:
        """List an entry that names a task or a pipeline (projections/mention.py) on their rows.

        A pipeline's own event creates its row if needed; a mere mention of a task is listed only
        on a row that exists already (a routing decision or a grade makes no task), so that the
        index lists a task's entries from its first event on, as replay's fold does."""
        if m.task_id:
            row = self.tables.tasks.get(m.task_id)
            if row is not None:
                add_entry(row.entries, entry_ms, entry_seq)
                self.dirty_tasks.add(m.task_id)
        if m.pipeline_event and m.pipeline_id:
            self._entry_ms = entry_ms
            pipeline = self._pipeline(m.pipeline_id)
            add_entry(pipeline.entries, entry_ms, entry_seq)
            if m.task_id and m.task_id not in pipeline.tasks:
                pipeline.tasks.append(m.task_id)

    def clear_dirty(self) -> None:
        """Forget which rows changed (after they were written)."""
        for s in (
            self.dirty_speed,
            self.dirty_length,
            self.dirty_quality,
            self.dirty_fleet,
            self.dirty_tasks,
            self.dirty_demand,
            self.new_benched,
            self.dirty_pipelines,
        ):
            s.clear()
        self.shifts.clear()

    def flush_fleet(self) -> None:
        """Write the in-flight sets of changed fleet rows back as sorted lists."""
        for worker in self.dirty_fleet:
            self.tables.fleet[worker].in_flight = sorted(self._in_flight.get(worker, ()))

    # -- rows ----------------------------------------------------------------------------------
    def _task(self, e: TaskEvent) -> TaskRow:
        """The task's row, with its status moved by `e` (projections.status: the one rule)."""
        row = self.tables.tasks.get(e.task_id)
        if row is None:
            row = self.tables.tasks[e.task_id] = TaskRow(task_id=e.task_id, first_ms=self._entry_ms)
        row.status = fold_status(row.status, e)
        add_entry(row.entries, self._entry_ms, self._entry_seq)
        self.dirty_tasks.add(e.task_id)
        return row

    def _pipeline(self, pipeline_id: str) -> PipelineRow:
        row = self.tables.pipelines.get(pipeline_id)
        if row is None:
            row = self.tables.pipelines[pipeline_id] = PipelineRow(
                pipeline_id=pipeline_id, first_ms=self._entry_ms
            )
        self.dirty_pipelines.add(pipeline_id)
        return row

    def _fleet(self, worker: str) -> FleetRow:
        row = self.tables.fleet.get(worker)
        if row is None:
            row = self.tables.fleet[worker] = FleetRow(worker=worker)
        self.dirty_fleet.add(worker)
        return row

    def _speed(self, worker: str, digest: str) -> SpeedRow:
        key = (worker, digest)
        row = self.tables.speed.get(key)
        if row is None:
            row = self.tables.speed[key] = SpeedRow(worker=worker, digest=digest)
        self.dirty_speed.add(key)
        return row

    def _release(self, worker: str, task_id: str) -> None:
        held = self._in_flight.get(worker)
        if held is not None and task_id in held:
            held.discard(task_id)
            self.dirty_fleet.add(worker)

    def _release_everywhere(self, task_id: str) -> None:
        for worker in list(self._in_flight):
            self._release(worker, task_id)

    # -- samples -------------------------------------------------------------------------------
    def _ledger_ms(self, at: int) -> int:
        """A sample's time, bounded by the ledger's clock: no later than its entry's stream-id time
        (Redis's clock when it was appended), so that a worker whose clock runs ahead does not
        look fresh forever. The producer's `at` is believed only when it says the sample is older
        (a sample cannot be taken after the ledger recorded it; a clock that runs behind makes its
        samples age sooner, never fresher, and /v1/fleet flags it). `at` alone where no entry id was
        given (an event folded outside the ledger)."""
        return min(at, self._entry_ms) if self._entry_ms else at

    def _speed_sample(
        self,
        worker: str,
        digest: str,
        t: Timings,
        ttft_ms: float | None,
        in_flight: int,
        at: int,
        cold: bool | None = None,
        kind: str = "chat",
    ) -> None:
        decode, prompt, load, ttft = (
            decode_sample(t),
            prompt_sample_tps(t),
            cold_load_s(t, cold),
            ttft_s(ttft_ms),
        )
        embed = None
        if kind == EMBED:
            # Reading the input is all an embedding does: its rate is a field of its own.
            embed, decode, prompt, ttft = prompt_tps(t), None, None, None
        if decode is None and prompt is None and load is None and ttft is None and embed is None:
            return
        h = self.tables.half_life_s
        at = self._ledger_ms(at)
        row = self._speed(worker, digest)
        if embed is not None:
            row.embed_tps = fold(row.embed_tps, embed, at, h)
        if decode is not None:
            self._shifting_sample(row, "decode_tps", decode, at)
            row.sampled_at = at if row.sampled_at is None else max(row.sampled_at, at)
            if t.counted is not None:
                row.counted_n += 1
            if in_flight >= 0:
                row.in_flight = fold(row.in_flight, float(in_flight), at, h)
        if prompt is not None:
            self._shifting_sample(row, "prompt_tps", prompt, at)
        if load is not None:
            row.load_s = fold(row.load_s, load, at, h)
        if ttft is not None:
            row.ttft_s = fold(row.ttft_s, ttft, at, h)

    def _shifting_sample(self, row: SpeedRow, field: str, x: float, at: int) -> None:
        """Fold one sample of a field with a window (projections.shift.fold_sample) into `row`, and
        note a change of its shift state."""
        window, (held, since) = WINDOWS[field], HELD[field]
        stat: Stat = getattr(row, field)
        recent: list[float] = getattr(row, window)
        before = detect(field, stat, recent)
        h = self.tables.half_life_s
        out = fold_sample(field, stat, recent, x, at, h, getattr(row, held), getattr(row, since))
        setattr(row, field, out.stat)
        setattr(row, window, out.window)
        setattr(row, held, out.held)
        setattr(row, since, out.held_since)
        self._shift_notice(row, field, before, out, at)

    def _shift_notice(self, row: SpeedRow, field: str, before: Shift | None, out: Folded, at: int) -> None:
        """Note a change of the field's shift state: entering one, changing side, clearing, or the
        shift becoming the long run (adopted: `long_run` the old value, `recent` the new one)."""
        after = out.shift
        if out.adopted is not None:
            self._notice(
                row,
                field,
                at,
                long_run=out.adopted.long_run,
                recent=out.stat.decayed_mean,
                samples=len(out.window),
                adopted=True,
            )
            if after is None:
                return
            before = None  # a shift from the new long run at once is a new one
        if after is None and before is None:
            return
        if after is not None and before is not None and before.slower == after.slower:
            return
        self._notice(
            row,
            field,
            at,
            long_run=out.stat.decayed_mean if after is None else after.long_run,
            recent=out.window[-1] if after is None else after.recent,
            samples=0 if after is None else after.samples,
            cleared=after is None,
        )

    def _notice(self, row: SpeedRow, field: str, at: int, **values: Any) -> None:
        """Queue a SpeedShiftDetected for the row's field (appended once the batch is written)."""
        self.shifts.append(
            SpeedShiftDetected(at=at, worker=row.worker, digest=row.digest, field=field, **values)
        )

    # -- tasks ---------------------------------------------------------------------------------
    def _submitted(self, e: TaskSubmitted) -> None:
        row = self._task(e)
        if e.pipeline_id:
            pipeline = self._pipeline(e.pipeline_id)
            if e.task_id not in pipeline.tasks:
                pipeline.tasks.append(e.task_id)
        if row.submitted_at is not None:
            return  # a repeated submission: the first one describes the task and counts as demand
        row.model, row.digest, row.domain, row.queue = e.model, e.digest, e.domain, e.queue
        row.submitted_at = self._ledger_ms(e.at)
        row.pipeline_id = e.pipeline_id
        row.runtime_options = e.runtime_options
        demand = self.tables.demand.get(e.digest)
        if demand is None:
            demand = self.tables.demand[e.digest] = DemandRow(digest=e.digest)
        demand.arrivals = fold(demand.arrivals, 1.0, self._ledger_ms(e.at), self.tables.demand_half_life_s)
        self.dirty_demand.add(e.digest)

    def _claimed(self, e: TaskClaimed) -> None:
        row = self._task(e)
        row.attempts = max(row.attempts, e.attempt)
        row.claimed_at = self._ledger_ms(e.at)
        if row.completed_attempt is None:
            row.worker = e.worker
        fleet = self._fleet(e.worker)
        if self._entry_ms:
            fleet.clock_offset_ms = e.at - self._entry_ms
        self._clock_sample(e.worker, e.at)
        self._in_flight.setdefault(e.worker, set()).add(e.task_id)

    def _clock_sample(self, worker: str, at: int) -> None:
        """One more offset of the worker's clock (its event's `at`) against the ledger's (the entry's
        stream-id ms) into its fleet row's window, and the window's median as its clock skew."""
        if not self._entry_ms:
            return
        row = self._fleet(worker)
        row.clock_window = [*row.clock_window[-(CLOCK_WINDOW - 1) :], at - self._entry_ms]
        row.clock_skew.value = clock_skew_ms(row.clock_window)
        row.clock_skew.at = self._entry_ms

    def _completed(self, e: TaskCompleted) -> None:
        row = self._task(e)
        row.attempts = max(row.attempts, e.attempt)
        self._release(e.worker, e.task_id)
        self._clock_sample(e.worker, e.at)
        if e.duplicate or row.completed_attempt is not None:
            row.duplicates += 1
            return
        t = e.timings
        row.completed_attempt = e.attempt
        row.worker = e.worker
        row.finished_at = self._ledger_ms(e.at)
        row.eval_count = t.eval_count
        row.prompt_eval_count = t.prompt_eval_count
        row.decode_tps = decode_tps(t)
        row.ttft_ms = e.ttft_ms
        row.wall_ms = e.wall_ms
        if e.bench_id is not None:
            # Its BenchmarkResult carries the speed sample; benchmark answers are cut where the
            # benchmark says (or are one-word grades), so they say nothing of output length.
            return
        if not row.runtime_options:
            self._speed_sample(e.worker, e.digest, t, e.ttft_ms, e.in_flight, e.at, e.cold, e.kind)
        key = (e.digest, e.domain)
        at, h = self._ledger_ms(e.at), self.tables.half_life_s
        if t.eval_count is not None and 0 <= t.eval_count <= MAX_OUTPUT_TOKENS:
            length = self._length(key)
            length.output_tokens = fold(length.output_tokens, float(t.eval_count), at, h)
        sample = prompt_sample(e.prompt_bytes, t)
        if sample is not None:
            length = self._length(key)
            length.prompt_bytes = fold(length.prompt_bytes, sample[0], at, h)
            length.prompt_tokens = fold(length.prompt_tokens, sample[1], at, h)

    def _length(self, key: tuple[str, str]) -> LengthRow:
        """The length row of (digest, domain), made if new, marked changed."""
        length = self.tables.length.get(key)
        if length is None:
            length = self.tables.length[key] = LengthRow(digest=key[0], domain=key[1])
        self.dirty_length.add(key)
        return length

    def _failed(self, e: TaskFailed) -> None:
        row = self._task(e)
        row.attempts = max(row.attempts, e.attempt)
        row.error = task_error(e.kind, e.message)
        self._release(e.worker, e.task_id)

    def _reclaimed(self, e: TaskReclaimed) -> None:
        row = self._task(e)
        row.attempts = max(row.attempts, e.attempt)
        self._release(e.owner, e.task_id)

    def _stalled(self, e: TaskStalled) -> None:
        self._task(e)

    def _dead_lettered(self, e: TaskDeadLettered) -> None:
        row = self._task(e)
        row.attempts = max(row.attempts, e.attempts)
        row.error = e.reason
        self._release_everywhere(e.task_id)

    def _cancelled(self, e: TaskCancelled | TaskExpired) -> None:
        self._task(e)
        self._release_everywhere(e.task_id)

    # -- workers -------------------------------------------------------------------------------
    # A worker's reports and its status are timed and ordered like samples (`_ledger_ms`): by the
    # producer's `at`, never later than the ledger recorded it. A WorkerOffline the reaper dates by
    # its clock then still ends a life a worker whose clock runs ahead began "in the future".
    def _status(self, row: FleetRow, status: str, at: int) -> None:
        if row.status_since is None or at >= row.status_since:
            row.status = status
            row.status_since = at

    def _alive_at(self, row: FleetRow, at: int) -> None:
        if row.last_heartbeat is None or at > row.last_heartbeat:
            row.last_heartbeat = at

    def _online(self, e: WorkerOnline) -> None:
        row = self._fleet(e.worker)
        at = self._ledger_ms(e.at)
        self._status(row, "online", at)
        self._alive_at(row, at)
        if _stamp(row.slots, e.slots, at):
            row.inventory.value, row.inventory.at = {m.name: m.digest for m in e.inventory}, at
            row.serves.value, row.serves.at = e.serves, at
        if row.wake_pending is not None:
            # Woken: the wake took from its request to this WorkerOnline, both on the ledger's
            # clock (their stream ids): the two come from different machines' clocks (a negative
            # span measures nothing).
            measured = ((self._entry_ms or e.at) - row.wake_pending) / 1000.0
            if measured >= 0:
                _stamp(row.wake_s, measured, at)
            row.wake_pending = None

    def _wake_requested(self, e: WakeRequested) -> None:
        self._fleet(e.worker).wake_pending = self._entry_ms or e.at

    def _wake_failed(self, e: WakeFailed) -> None:
        # It did not come online in time: whenever it does, that is no measure of a wake.
        self._fleet(e.worker).wake_pending = None

    def _heartbeat(self, e: WorkerHeartbeat) -> None:
        row = self._fleet(e.worker)
        at = self._ledger_ms(e.at)
        self._alive_at(row, at)
        if _stamp(row.slots, e.slots, at):
            row.inventory.value, row.inventory.at = {m.name: m.digest for m in e.inventory}, at
            row.serves.value, row.serves.at = e.serves, at
        _stamp(row.loaded, list(e.loaded), at)
        # Stamped on its own (a WorkerChanged stamps `loaded` but carries no resources); in a ledger
        # of heartbeats only, both come from the newest heartbeat, as they always did.
        _stamp(row.resources, resources_dict(e), at)

    def _changed(self, e: WorkerChanged) -> None:
        """A heartbeat's facts without the machine's figures: those live in the lease only."""
        row = self._fleet(e.worker)
        at = self._ledger_ms(e.at)
        self._alive_at(row, at)
        if _stamp(row.slots, e.slots, at):
            row.inventory.value, row.inventory.at = {m.name: m.digest for m in e.inventory}, at
            row.serves.value, row.serves.at = e.serves, at
        _stamp(row.loaded, list(e.loaded), at)

    def _offline(self, e: WorkerOffline) -> None:
        row = self._fleet(e.worker)
        self._status(row, "forgotten" if e.reason == "forgotten" else "offline", self._ledger_ms(e.at))

    # -- benchmarks and quality ----------------------------------------------------------------
    def _bench(self, e: BenchmarkResult) -> None:
        key = (e.bench_id, e.task_id)
        if key in self.tables.benched:
            return
        self.tables.benched[key] = self._entry_ms
        self.new_benched.add(key)
        self._speed_sample(e.worker, e.digest, e.timings, e.ttft_ms, e.in_flight, e.at, e.cold, e.kind)

    def _quality(self, e: QualityScored) -> None:
        if not counts_as_grade(e.score, e.truncated):
            return
        key = (e.digest, e.domain)
        row = self.tables.quality.get(key)
        if row is None:
            row = self.tables.quality[key] = QualityRow(digest=e.digest, domain=e.domain)
        if e.prompt_id:
            mark = grade_mark(e.grader, e.prompt_id)
            if mark in row.graded:
                return
            bisect.insort(row.graded, mark)
        row.score = fold(row.score, e.score, self._ledger_ms(e.at), self.tables.half_life_s)
        self.dirty_quality.add(key)


# The method that folds each event type; an entry of any other type is not even decoded (routing
# breakdowns are most of the ledger's bytes and feed no table).
HANDLERS: Final[dict[type[Event], str]] = {
    TaskSubmitted: "_submitted",
    TaskClaimed: "_claimed",
    TaskCompleted: "_completed",
    TaskFailed: "_failed",
    TaskReclaimed: "_reclaimed",
    TaskStalled: "_stalled",
    TaskDeadLettered: "_dead_lettered",
    TaskCancelled: "_cancelled",
    TaskExpired: "_cancelled",
    WorkerOnline: "_online",
    WorkerHeartbeat: "_heartbeat",
    WorkerChanged: "_changed",
    WorkerOffline: "_offline",
    BenchmarkResult: "_bench",
    QualityScored: "_quality",
    WakeRequested: "_wake_requested",
    WakeFailed: "_wake_failed",
}
FOLDED_TYPES: Final[frozenset[str]] = frozenset(cls.__name__ for cls in HANDLERS)
