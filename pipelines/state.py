"""What a pipeline's coordinator keeps, in the hash `rl:pipeline:{id}` that any API process reads.

The coordinator is the hash's only writer; it holds one JSON field, the whole State, rewritten at
each step. Prompts are in it (the ledger never holds them); it expires with the results.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis

from events.keys import Keys
from tasks.store import RESULT_TTL_MS

Policy = Literal["fail_fast", "best_effort"]
PipelineStatus = Literal["decomposing", "running", "integrating", "completed", "failed"]


class ChildSpec(msgspec.Struct, kw_only=True):
    """One child as asked for (or as the decomposer gave it), before it is queued."""

    prompt: str
    model: str
    domain: str | None = None
    max_tokens: int | None = None


class Child(msgspec.Struct, kw_only=True):
    """A child as queued, with the plan's expectation for it."""

    index: int
    task_id: str
    prompt: str
    model: str
    digest: str
    expected_worker: str | None = None
    expected_start_s: float | None = None
    expected_finish_s: float | None = None


class Step(msgspec.Struct, kw_only=True):
    """The decomposer's or the integration's task."""

    task_id: str
    model: str
    role: str


class State(msgspec.Struct, kw_only=True):
    """Everything the hash holds."""

    pipeline_id: str
    status: PipelineStatus
    policy: Policy
    created_at: int
    prompt: str | None = None
    fan_out: int = 0
    capacity: int | None = None
    capacity_by_model: dict[str, int] = msgspec.field(default_factory=dict)
    expected_makespan_s: float | None = None
    children: list[Child] = msgspec.field(default_factory=list)
    decomposer: list[Step] = msgspec.field(default_factory=list)
    integration: Step | None = None
    failed_children: list[str] = msgspec.field(default_factory=list)
    finished_at: int | None = None
    error: str | None = None

    def task_ids(self) -> list[str]:
        """Every task of the pipeline: children, decomposer runs, the integration."""
        ids = [c.task_id for c in self.children] + [s.task_id for s in self.decomposer]
        if self.integration is not None:
            ids.append(self.integration.task_id)
        return ids


async def save_state(redis: aioredis.Redis, keys: Keys, state: State) -> None:
    key = keys.pipeline(state.pipeline_id)
    pipe = redis.pipeline(transaction=False)
    pipe.hset(key, mapping={"state": msgspec.json.encode(state)})
    pipe.pexpire(key, RESULT_TTL_MS)
    await pipe.execute()


async def read_state(redis: aioredis.Redis, keys: Keys, pipeline_id: str) -> State | None:
    raw: Any = await redis.hget(keys.pipeline(pipeline_id), "state")
    return None if raw is None else msgspec.json.decode(raw, type=State)
