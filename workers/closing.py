"""The ledger events that close a run: what a worker appends once a generation has finished.

A benchmark run's speed is a BenchmarkResult and its reference grade a QualityScored (quality
belongs to the model, recorded apart from speed and only for the run that counts); every run ends
with a TaskCompleted, marked a duplicate when another run's completion already counted.
"""

from __future__ import annotations

import hashlib

import msgspec

from events.event import BenchmarkResult, Event, QualityScored, TaskCompleted
from projections.benchset import REFERENCE, grade, prompt_by_id
from tasks.payload import TaskMessage
from workers.backend import Generated


class FinishedRun(msgspec.Struct, kw_only=True, frozen=True):
    """One run of a task that reached the backend's last chunk."""

    worker: str
    task: TaskMessage
    attempt: int
    generated: Generated
    text: str
    ttft_ms: float | None
    wall_ms: float
    # Tasks the worker had in flight when this one finished (the concurrency fit reads it).
    in_flight: int
    # Whether the run had to load the model first (workers.warmth); None: unknown.
    cold: bool | None = None

    def closing_events(self, counts: bool) -> list[Event]:
        """The events to append, in order; `counts` says this run's completion is the one that counts."""
        task = self.task
        # The output's size and digest: the text, or an embedding's packed vectors.
        embeddings = self.generated.embeddings
        output = b"".join(embeddings) if embeddings is not None else self.text.encode()
        out: list[Event] = []
        if task.bench_id and counts:
            out.append(
                BenchmarkResult(
                    bench_id=task.bench_id,
                    worker=self.worker,
                    digest=task.digest,
                    domain=task.domain_or_general(),
                    task_id=task.task_id,
                    timings=self.generated.timings,
                    ttft_ms=self.ttft_ms,
                    wall_ms=self.wall_ms,
                    in_flight=self.in_flight,
                    prompt_id=task.bench_prompt or "",
                    cold=self.cold,
                    kind=task.kind,
                )
            )
            graded = self.graded()
            if graded is not None:
                out.append(graded)
        out.append(
            TaskCompleted(
                task_id=task.task_id,
                worker=self.worker,
                digest=task.digest,
                attempt=self.attempt,
                domain=task.domain_or_general(),
                timings=self.generated.timings,
                ttft_ms=self.ttft_ms,
                wall_ms=self.wall_ms,
                in_flight=self.in_flight,
                output_bytes=len(output),
                output_sha256=hashlib.sha256(output).hexdigest(),
                done_reason=self.generated.done_reason,
                duplicate=not counts,
                bench_id=task.bench_id,
                cold=self.cold,
                kind=task.kind,
                prompt_bytes=text_prompt_bytes(task),
            )
        )
        return out

    def graded(self) -> QualityScored | None:
        """A benchmark answer graded by its prompt's reference check, or None for other runs."""
        task = self.task
        prompt = prompt_by_id(task.bench_prompt) if task.bench_prompt else None
        if prompt is None or task.bench_id is None:
            return None
        return QualityScored(
            digest=task.digest,
            domain=task.domain_or_general(),
            score=grade(prompt, self.text),
            grader=REFERENCE,
            task_id=task.task_id,
            bench_id=task.bench_id,
            worker=self.worker,
            prompt_id=prompt.id,
            max_tokens=task.max_tokens,
            truncated=self.generated.done_reason == "length",
        )


def text_prompt_bytes(task: TaskMessage) -> int | None:
    """The bytes of the text a task's model read, when its prompt is that text alone: None when it
    also read images or tool definitions (their tokens are not in the text; the learned bytes per
    token, projections.folder.prompt_sample, would take them for the text's)."""
    if task.images or task.tools or any(m.images for m in task.messages):
        return None
    return len(task.prompt_text().encode())
