"""A pipeline as a tree with timings: from its hash while it lasts, then from the ledger.

What `GET /v1/pipelines/{id}` answers and `routeledger pipeline show` prints. Every part's status
follows the one rule of projections.status.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import redis.asyncio as aioredis

from dispatch.gateway import task_status
from events.event import (
    Event,
    PipelineChildAdded,
    PipelineCompleted,
    PipelineStarted,
    TaskClaimed,
    TaskCompleted,
    TaskFailed,
    TaskSubmitted,
)
from events.keys import Keys
from events.ledger import Ledger
from pipelines.state import read_state
from projections.errors import ProjectionError
from projections.index import pipeline_events
from projections.reader import get_tasks
from projections.snapshot import TaskRow
from projections.status import TaskStatus, fold_status
from tasks.payload import Result
from tasks.store import TaskStore


def _ran(status: TaskStatus, result: Result | None) -> dict[str, Any]:
    """Who ran a task, when and for how long, from its result (None fields while it is not done)."""
    if result is None:
        return {"status": status, "worker": None, "started_at": None, "finished_at": None, "wall_s": None}
    wall = result.wall_ms
    return {
        "status": status,
        "worker": result.worker,
        "attempt": result.attempt,
        "started_at": None if wall is None else result.finished_at - int(wall),
        "finished_at": result.finished_at,
        "wall_s": None if wall is None else round(wall / 1000, 3),
        "eval_count": result.timings.eval_count,
        "error": result.error,
    }


async def pipeline_view(redis: aioredis.Redis, keys: Keys, pipeline_id: str) -> dict[str, Any] | None:
    """The tree from the pipeline's hash (prompts included), with each part's result and status."""
    state = await read_state(redis, keys, pipeline_id)
    if state is None:
        return None
    ids = state.task_ids()
    store = TaskStore(redis, keys)
    found = await asyncio.gather(*(store.result(t) for t in ids))
    results = dict(zip(ids, found, strict=True))
    try:
        rows: dict[str, TaskRow] = await get_tasks(redis, keys, ids)
    except ProjectionError:
        rows = {}

    def part(struct: msgspec.Struct, task_id: str) -> dict[str, Any]:
        status = task_status(rows.get(task_id), results[task_id])
        return {**msgspec.to_builtins(struct), **_ran(status, results[task_id])}

    children = [part(c, c.task_id) for c in state.children]
    spans = [(c["started_at"], c["finished_at"]) for c in children if c["started_at"] is not None]
    capacity = state.capacity
    integration = state.integration
    answer = None if integration is None else results[integration.task_id]
    return {
        "pipeline_id": state.pipeline_id,
        "status": state.status,
        "policy": state.policy,
        "fan_out": state.fan_out,
        "capacity": capacity,
        "capacity_by_model": state.capacity_by_model,
        "fan_out_vs_capacity": None if capacity is None else f"{state.fan_out} vs {capacity}",
        "over_capacity": capacity is not None and state.fan_out > capacity,
        "expected_makespan_s": state.expected_makespan_s,
        "makespan_s": round((max(f for _, f in spans) - min(s for s, _ in spans)) / 1000, 3)
        if spans and len(spans) == len(children)
        else None,
        "created_at": state.created_at,
        "finished_at": state.finished_at,
        "elapsed_s": None
        if state.finished_at is None
        else round((state.finished_at - state.created_at) / 1000, 3),
        "decomposer": [part(s, s.task_id) for s in state.decomposer],
        "children": children,
        "integration": None if integration is None else part(integration, integration.task_id),
        "failed_children": state.failed_children,
        "error": state.error,
        "result": None if answer is None else {"text": answer.text},
        "links": {"self": f"/v1/pipelines/{state.pipeline_id}"},
    }


class _Part:
    """One task of a pipeline as the ledger tells it."""

    def __init__(self, model: str) -> None:
        self.status: TaskStatus = "submitted"
        self.fields: dict[str, Any] = {"model": model, "worker": None}

    def fold(self, event: Event) -> None:
        self.status = fold_status(self.status, event)
        if isinstance(event, TaskClaimed):
            if "finished_at" not in self.fields:
                self.fields.update(worker=event.worker, started_at=event.at)
        elif isinstance(event, TaskCompleted) and not event.duplicate:
            self.fields.update(worker=event.worker, finished_at=event.at)
            if event.wall_ms is not None:
                wall = event.wall_ms
                self.fields.update(started_at=event.at - int(wall), wall_s=round(wall / 1000, 3))
        elif isinstance(event, TaskFailed) and not event.retryable:
            self.fields.update(error=event.message)

    def to_dict(self) -> dict[str, Any]:
        return {**self.fields, "status": self.status}


async def pipeline_from_ledger(ledger: Ledger, pipeline_id: str) -> dict[str, Any] | None:
    """The tree as the ledger tells it, for a pipeline whose hash expired (no prompts, no text).

    Only the pipeline's own events and its tasks' are read, through the entry index
    (projections/index.py); an unknown id costs a few row lookups, not a scan of the ledger."""
    found = await pipeline_events(ledger.redis, ledger.keys, pipeline_id)
    started: PipelineStarted | None = None
    completed: PipelineCompleted | None = None
    added: list[PipelineChildAdded] = []
    tasks: dict[str, _Part] = {}
    for _, event in found.events:
        if isinstance(event, PipelineStarted) and event.pipeline_id == pipeline_id:
            started = event
        elif isinstance(event, PipelineChildAdded) and event.pipeline_id == pipeline_id:
            added.append(event)
        elif isinstance(event, PipelineCompleted) and event.pipeline_id == pipeline_id:
            completed = event
        elif isinstance(event, TaskSubmitted) and event.pipeline_id == pipeline_id:
            tasks[event.task_id] = _Part(event.model)
            tasks[event.task_id].fold(event)
        else:
            task_id = getattr(event, "task_id", None)
            if isinstance(task_id, str) and task_id in tasks:
                tasks[task_id].fold(event)
    if started is None and not tasks:
        return None

    def step(e: PipelineChildAdded) -> dict[str, Any]:
        part = tasks.get(e.task_id)
        return {"index": e.index, "task_id": e.task_id, "role": e.role, **(part.to_dict() if part else {})}

    children = [step(e) for e in added if e.role == "child"]
    integration = next((step(e) for e in added if e.role == "integration"), None)
    fan_out = started.fan_out if started else len(children)
    capacity = started.capacity if started else None
    return {
        "pipeline_id": pipeline_id,
        "status": "running" if completed is None else "completed" if completed.ok else "failed",
        "policy": started.policy if started else None,
        "fan_out": fan_out,
        "capacity": capacity,
        "fan_out_vs_capacity": None if capacity is None else f"{fan_out} vs {capacity}",
        "expected_makespan_s": started.expected_makespan_s if started else None,
        "created_at": started.at if started else None,
        "finished_at": completed.at if completed else None,
        "decomposer": [step(e) for e in added if e.role == "decomposer"],
        "children": children,
        "integration": integration,
        "failed_children": completed.failed_children if completed else [],
        "error": None if completed is None or completed.ok else completed.message,
        "from_ledger": True,
    }
