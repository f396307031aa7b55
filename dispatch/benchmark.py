"""Benchmarks for every holder: the shipped prompt set, requests to each worker's background stream,
reference grading.

Design rule 4: measure every machine, when it is awake. A worker benchmarks itself when it comes
online, when it gains a model, and whenever one of its (worker, digest) speed rows has fewer than
`min_samples` samples or only stale ones. Speed is measured with the set's speed prompts, whose
answers run long (design rule 14: a measurement must be long enough to be one; the answers are cut
at SPEED_MAX_TOKENS); quality with its graded prompts, whose short answers are no speed samples.
`routeledger bench run` sends both to every live holder, never only to the current winner. Speed
comes from the runs (BenchmarkResult); grades are recorded separately (QualityScored), at their own
time.

Benchmark and grading tasks go to the worker's background stream (`Keys.background`): the lowest
priority on its worker, started only while no user work waits for the worker's models, one at a
time, and given up (handed back for later) when user work comes (workers.agent).

Grading, per (digest, domain): quality belongs to the model, and a grade of a fixed digest stays
true, so each shipped prompt is graded once per digest (a prompt asked again at temperature 0 gets
the same answer: no new evidence). One holder grades a digest (`grader_for`: the live holder with
the fastest measured decode, so the answers cost the least time), `GRADE_BATCH` prompts at a time,
until every prompt of every domain is graded: at most the shipped set (7 prompts a domain) times
`GRADE_MAX_TOKENS` tokens per digest, ever, and on demand more through `POST /v1/bench` or
`routeledger bench run --domain D`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Final

from events.event import BenchmarkRequested
from projections.benchset import (
    REFERENCE,
    BenchPrompt,
    SpeedPrompt,
    benchset,
    pick_speed,
)
from projections.shift import CONFIRM, detect
from projections.snapshot import Snapshot, grade_mark
from tasks.payload import EMBED, Message, TaskMessage, estimate_tokens
from tasks.store import TaskStore

# A worker benchmarks a (worker, digest) pair whose speed row has fewer samples than this, or whose
# newest sample is older than BENCH_STALE_AFTER_S (the worker's defaults; the simulator's too).
BENCH_MIN_SAMPLES: Final = 3
BENCH_STALE_AFTER_S: Final = 7 * 86_400.0
# A machine that looks slower than its long run (projections.shift) and has had no sample for this
# long is probed with PROBE_PROMPTS speed prompts on its background stream, so that it can be seen fast
# again: nothing else is sent to a machine that looks slow. Each probe's samples restart the wait,
# so probes are at most PROBE_PROMPTS per PROBE_AFTER_S per (worker, model).
PROBE_AFTER_S: Final = 120.0
PROBE_PROMPTS: Final = CONFIRM

# Prompts one scheduled grading request sends (then the next batch once these are folded).
GRADE_BATCH: Final = 3
# Prompts one embedding benchmark embeds at once: a batch long enough that reading it, not the
# request's own overhead, is what its time measures.
EMBED_BENCH_INPUTS: Final = 16


def pick(domain: str, count: int, start: int = 0) -> list[BenchPrompt]:
    """`count` prompts of `domain`, rotating from `start` so that repeated runs vary."""
    pool = [p for p in benchset() if p.domain == domain] or list(benchset())
    return [pool[(start + i) % len(pool)] for i in range(count)]


async def request_benchmark(
    queues: TaskStore,
    *,
    worker: str,
    model: str,
    digest: str,
    domain: str = "general",
    count: int = 3,
    reason: str = "manual",
    start: int = 0,
    prompts: Sequence[BenchPrompt | SpeedPrompt] | None = None,
    embed: bool = False,
) -> str:
    """Queue `count` speed prompts (or exactly `prompts`: graded ones, speed ones or both) on
    `worker`'s background stream; returns the bench id. `embed`: the model is an embedding model,
    so each of the `count` tasks embeds a batch of `EMBED_BENCH_INPUTS` prompts (a sample of its
    embedding rate; nothing to grade)."""
    bench_id = uuid.uuid4().hex[:16]
    queue = queues.keys.background(worker)
    chosen: list[BenchPrompt | SpeedPrompt] = (
        list(prompts) if prompts is not None else list(pick_speed(count, start))
    )
    count = len(chosen)
    for i, prompt in enumerate(chosen):
        if embed:
            batch = [p.prompt for p in pick(domain, EMBED_BENCH_INPUTS, start + i)]
            await queues.enqueue(
                queue,
                TaskMessage(
                    task_id=f"bench-{bench_id}-{i}",
                    model=model,
                    digest=digest,
                    kind=EMBED,
                    inputs=batch,
                    domain=domain,
                    prompt_tokens=sum(estimate_tokens(text) for text in batch),
                    bench_id=bench_id,
                ),
            )
            continue
        task = TaskMessage(
            task_id=f"bench-{bench_id}-{i}",
            model=model,
            digest=digest,
            messages=[Message(role="user", content=prompt.prompt)],
            domain=prompt.domain if isinstance(prompt, BenchPrompt) else domain,
            max_tokens=prompt.max_tokens,
            options={"temperature": 0},
            bench_id=bench_id,
            bench_prompt=prompt.id,
        )
        await queues.enqueue(queue, task)
    await queues.ledger.append(
        BenchmarkRequested(
            bench_id=bench_id,
            worker=worker,
            digest=digest,
            model=model,
            domain=domain,
            prompts=count,
            reason=reason,
        )
    )
    return bench_id


def needs_benchmark(
    snapshot: Snapshot,
    worker: str,
    digest: str,
    now_ms: int,
    *,
    min_samples: int,
    stale_after_s: float,
    probe_after_s: float | None = None,
    embed: bool = False,
) -> tuple[int, str] | None:
    """How many samples (worker, digest) lacks and why, or None when its speed row is enough.
    With `probe_after_s`: also a probe of a machine that looks slow and got nothing that long.
    `embed`: the model is an embedding model, whose samples are embedding rates."""
    row = snapshot.speed.get((worker, digest))
    if embed:
        # An embedding model is measured by its embedding rate (no decode, no probe of one).
        n = row.embed_tps.n if row is not None else 0
        if n < min_samples:
            return min_samples - n, f"{n} of {min_samples} embedding samples"
        age = row.embed_tps.age_s(now_ms) if row is not None else None
        if age is not None and age > stale_after_s:
            return min_samples, f"newest embedding sample {age / 3600:.1f} h old"
        return None
    n = row.decode_tps.n if row is not None else 0
    if n < min_samples:
        return min_samples - n, f"{n} of {min_samples} samples"
    age = row.decode_tps.age_s(now_ms) if row is not None else None
    if age is not None and age > stale_after_s:
        return min_samples, f"newest sample {age / 3600:.1f} h old"
    # A sample kept out of the long run (a shifted field's) is still a sample: the probe's wait
    # counts from the newest one.
    newest = None if row is None else row.sampled_at or row.decode_tps.updated_at
    quiet = None if newest is None else max(0.0, (now_ms - newest) / 1000.0)
    if probe_after_s is not None and row is not None and quiet is not None and quiet >= probe_after_s:
        shift = detect("decode_tps", row.decode_tps, row.decode_recent)
        if shift is not None and shift.slower:
            return PROBE_PROMPTS, (
                f"probe: looks slow ({shift.recent:.3g} vs long-run {shift.long_run:.3g} tok/s), "
                f"nothing for {quiet:.0f} s"
            )
    return None


def is_probe(reason: str) -> bool:
    """Whether a `needs_benchmark` reason is a probe (asked again sooner than other benchmarks)."""
    return reason.startswith("probe:")


def ungraded(snapshot: Snapshot, digest: str, domain: str) -> list[BenchPrompt]:
    """The shipped prompts of `domain` that the reference check has not graded for `digest`."""
    row = snapshot.quality.get((digest, domain))
    done = set(row.graded) if row is not None else set()
    return [p for p in benchset() if p.domain == domain and grade_mark(REFERENCE, p.id) not in done]


def grader_for(snapshot: Snapshot, digest: str) -> str | None:
    """The live holder that grades `digest`: the fastest measured decode (lifetime mean), then the
    first name; None when no live worker holds it. One holder grades, so the answers are not
    bought twice; every holder computes the same one from the same snapshot."""
    live = set(snapshot.live)
    best: tuple[float, str] | None = None
    for worker, row in snapshot.fleet.items():
        inventory = row.inventory.value
        if worker not in live or not isinstance(inventory, dict) or digest not in inventory.values():
            continue
        speed = snapshot.speed.get((worker, digest))
        tps = speed.decode_tps.mean if speed is not None else None
        key = (-(tps or 0.0), worker)
        if best is None or key < best:
            best = key
    return None if best is None else best[1]


def on_demand(snapshot: Snapshot, digest: str, domain: str, count: int) -> list[BenchPrompt]:
    """`count` prompts of `domain` for a benchmark someone asked for: the ones `digest` has not been
    graded on first (each is new evidence), then the graded ones (speed samples, no new grade)."""
    pool = [p for p in benchset() if p.domain == domain] or list(benchset())
    fresh = {p.id for p in ungraded(snapshot, digest, domain)}
    ordered = [p for p in pool if p.id in fresh] + [p for p in pool if p.id not in fresh]
    return [ordered[i % len(ordered)] for i in range(count)]
