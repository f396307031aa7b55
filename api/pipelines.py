"""Pipelines: one request split into children that run in parallel on the fleet, then one integration.

`POST /v1/pipelines` takes explicit children (each a prompt with its model or `auto`) or one prompt
that a decomposer model splits (it must answer JSON; an invalid answer is retried once, then the
request fails naming what was wrong and no child is queued). Children go to the shared queues
through the one submission path (dispatch.submit.route_and_submit), so workers pull them through
the router's gate like any task. When they are done (or as the policy says: `fail_fast` fails the
pipeline at the first failed child and cancels the rest; `best_effort` integrates what succeeded
and names what failed) an integration task combines the answers. The model `pipeline` on the
OpenAI and Ollama chat surfaces does the same for the last user message and streams the
integration's output.

State: the API keeps none of its own. The coordinator (a coroutine in the request, or a background
task of the API process for `"wait": false`) is the only writer of the hash `rl:pipeline:{id}`
(events/keys.py, expires with the results), which any API process reads for `GET
/v1/pipelines/{id}`; the ledger records PipelineStarted, PipelineChildAdded and PipelineCompleted,
and every child's TaskSubmitted carries the pipeline id, so the tree outlives the hash.

If the API process dies mid-pipeline, the pipeline is left incomplete: its children are ordinary
tasks and still complete (or are reclaimed and re-run if their worker dies), but nothing submits
the integration, no PipelineCompleted is appended, and the hash keeps saying `running` until it
expires. There is deliberately no daemon that adopts orphaned pipelines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final, Literal

import msgspec
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError
from starlette.responses import Response

from api.common import JSON, encode, finish_reason, gateway, sse, sse_error, usage
from api.errors import (
    OLLAMA,
    OPENAI,
    ApiError,
    BadRequestError,
    GenerationError,
    NotFoundError,
    WaitTimeoutError,
    render,
)
from api.gateway import TRANSIENT, Gateway, model_not_found, unavailable
from api.relay import RelayResponse
from api.schemas import MAX_TOKENS, ChatCompletionCreate, OllamaChat
from dispatch.errors import ModelNotServedError
from dispatch.lease import LeaseInfo, live_workers
from dispatch.payload import Message, Result, TaskMessage, estimate_tokens, result_decoder
from dispatch.queues import RESULT_TTL_MS
from dispatch.serving import find_holders, served_models
from dispatch.submit import TaskRequest, route_and_submit
from dispatch.view import LiveView, worker_views
from events.event import Event, PipelineChildAdded, PipelineCompleted, PipelineStarted, now_ms
from events.keys import Keys
from events.ledger import Ledger
from router.estimate import Estimator
from router.plan import BacklogEntry, FleetView, plan_queue

log = logging.getLogger("routeledger.api")

router = APIRouter(tags=["pipelines"])

PIPELINE_MODEL: Final = "pipeline"
# Above this many children a request is refused: each child holds a connection while it is awaited.
MAX_CHILDREN: Final = 32
FAIL_FAST: Final = "fail_fast"
BEST_EFFORT: Final = "best_effort"

DECOMPOSER_SYSTEM: Final = (
    "You split a request into independent sub-tasks that can be answered in parallel, each by "
    "someone who sees only that sub-task. Answer with JSON only, no prose: "
    '{"subtasks": ["<self-contained sub-prompt>", ...]} with between 2 and {most} sub-prompts.'
)
DECOMPOSER_RETRY: Final = (
    "That answer could not be used: {problem}. Answer again with JSON only, in exactly the form "
    '{{"subtasks": ["...", "..."]}}.'
)
# Real backends get the shape as a schema (Ollama's structured outputs); the simulator only
# notices that JSON was asked for.
DECOMPOSER_FORMAT: Final = {
    "type": "object",
    "properties": {"subtasks": {"type": "array", "items": {"type": "string"}}},
    "required": ["subtasks"],
}
DEFAULT_INTEGRATION: Final = (
    "Combine the answers to the parts below into one coherent answer to the original request. "
    "Do not mention that it was split into parts."
)
# Keys a decomposer might reasonably put its list under.
_LIST_KEYS: Final = ("subtasks", "sub_tasks", "tasks", "children", "prompts", "parts", "steps")
_background: set[asyncio.Task[None]] = set()


# -- request bodies ---------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ChildCreate(_Body):
    """One explicit child: its prompt and the model that answers it."""

    prompt: str = Field(min_length=1)
    model: str | None = Field(
        None, description="a model the fleet serves, or 'auto'; default: the pipeline's"
    )
    domain: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)


class PipelineCreate(_Body):
    """POST /v1/pipelines: explicit `children`, or one `prompt` for the decomposer to split."""

    prompt: str | None = Field(
        None, min_length=1, description="the request to decompose (or the context of children)"
    )
    children: list[ChildCreate] | None = Field(None, min_length=1, max_length=MAX_CHILDREN)
    model: str | None = Field(
        None, description="the children's default model; default: the API's pipeline model"
    )
    decomposer_model: str | None = None
    integration_prompt: str | None = Field(None, description="how to combine the answers")
    integration_model: str | None = None
    policy: Literal["fail_fast", "best_effort"] = FAIL_FAST
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="each child's output limit")
    integration_max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_children: int = Field(8, ge=1, le=MAX_CHILDREN, description="most sub-prompts a decomposer may give")
    wait: bool = Field(
        True, description="answer when the pipeline has finished; false: 202 once children are queued"
    )
    timeout_s: float | None = Field(None, gt=0)


# -- what the coordinator keeps ---------------------------------------------------------------------


class ChildSpec(msgspec.Struct, kw_only=True):
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
    """Everything the hash holds (one JSON field, written only by the coordinator)."""

    pipeline_id: str
    status: str  # decomposing | running | integrating | completed | failed
    policy: str
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


class DecompositionError(ValueError):
    """Raised when a decomposer's answer is not a usable list of sub-prompts; says what is wrong."""


def parse_subtasks(text: str, most: int) -> list[str]:
    """The sub-prompts of a decomposer's answer: a JSON list of strings, or an object holding one."""
    body = text.strip()
    if body.startswith("```"):
        # Models fence JSON out of habit even in JSON mode.
        body = body.strip("`").removeprefix("json").strip()
    if not body:
        raise DecompositionError("the answer was empty")
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise DecompositionError(
            f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); it began {body[:40]!r}"
        ) from None
    items: object = data
    if isinstance(data, dict):
        items = next((data[k] for k in _LIST_KEYS if k in data), None)
        if items is None:
            raise DecompositionError(
                f"a JSON object without a list of sub-prompts (keys: {', '.join(sorted(data)) or 'none'})"
            )
    if not isinstance(items, list):
        raise DecompositionError(f"JSON {type(items).__name__}, not a list of sub-prompts")
    prompts: list[str] = []
    for i, item in enumerate(items):
        value = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(value, str) or not value.strip():
            raise DecompositionError(f"sub-prompt {i + 1} is not a non-empty string")
        prompts.append(value.strip())
    if not prompts:
        raise DecompositionError("an empty list of sub-prompts")
    if len(prompts) > most:
        raise DecompositionError(f"{len(prompts)} sub-prompts, more than the limit of {most}")
    return prompts


# -- the coordinator --------------------------------------------------------------------------------


class Coordinator:
    """Runs one pipeline: decompose, queue the children, await them, integrate, record."""

    def __init__(
        self,
        gw: Gateway,
        *,
        default_model: str,
        prompt: str | None,
        children: Sequence[ChildSpec] | None,
        decomposer_model: str | None = None,
        integration_prompt: str | None = None,
        integration_model: str | None = None,
        policy: str = FAIL_FAST,
        max_tokens: int | None = None,
        integration_max_tokens: int | None = None,
        max_children: int = 8,
        timeout_s: float | None = None,
        client: str | None = None,
    ) -> None:
        self.gw = gw
        self.view = LiveView(gw.redis, gw.keys)
        self.specs = list(children) if children is not None else None
        self.default_model = default_model
        self.decomposer_model = decomposer_model or default_model
        self.integration_prompt = integration_prompt or DEFAULT_INTEGRATION
        self.integration_model = integration_model or default_model
        self.max_tokens = max_tokens
        self.integration_max_tokens = integration_max_tokens
        self.max_children = max_children
        self.client = client
        self.deadline = time.monotonic() + (timeout_s or gw.wait_timeout_s)
        self.state = State(
            pipeline_id=uuid.uuid4().hex,
            status="decomposing",
            policy=policy,
            created_at=now_ms(),
            prompt=prompt,
        )
        self.results: dict[int, Result] = {}
        self.done = False

    @property
    def pipeline_id(self) -> str:
        return self.state.pipeline_id

    def _left_s(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeoutError(
                f"pipeline {self.pipeline_id} did not finish in time",
                hint=f"its children still run: GET /v1/pipelines/{self.pipeline_id}",
            )
        return left

    async def _save(self) -> None:
        key = self.gw.keys.pipeline(self.pipeline_id)
        pipe = self.gw.redis.pipeline(transaction=False)
        pipe.hset(key, mapping={"state": msgspec.json.encode(self.state)})
        pipe.pexpire(key, RESULT_TTL_MS)
        await pipe.execute()

    async def _record(self, *events: Event) -> None:
        await self.gw.retrying(lambda: self.gw.ledger.append_many(list(events)))

    async def _submit(
        self,
        *,
        model: str,
        messages: list[Message],
        domain: str | None = None,
        max_tokens: int | None = None,
        fmt: Any = None,
    ) -> TaskMessage:
        req = TaskRequest(
            model=model,
            messages=messages,
            domain=domain,
            max_tokens=max_tokens,
            format=fmt,
            client=self.client,
            pipeline_id=self.pipeline_id,
        )
        try:
            task = (await self.gw.retrying(lambda: route_and_submit(self.gw.queues, self.view, req))).task
        except ModelNotServedError:
            raise model_not_found(model, await live_workers(self.gw.redis, self.gw.keys)) from None
        return task

    # -- steps ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Decompose if asked, then queue every child; on failure nothing is left queued."""
        await self.gw.retrying(self._save)
        try:
            if self.specs is None:
                self.specs = await self._decompose()
            await self._queue_children(self.specs)
        except BaseException as exc:
            await self._fail(exc)
            raise

    async def _decompose(self) -> list[ChildSpec]:
        prompt = self.state.prompt or ""
        messages = [
            Message(role="system", content=DECOMPOSER_SYSTEM.replace("{most}", str(self.max_children))),
            Message(role="user", content=prompt),
        ]
        problems: list[str] = []
        for attempt in (1, 2):
            task = await self._submit(model=self.decomposer_model, messages=messages, fmt=DECOMPOSER_FORMAT)
            self.state.decomposer.append(Step(task_id=task.task_id, model=task.model, role="decomposer"))
            await self.gw.retrying(self._save)
            result = await self.gw.wait(task.task_id, self._left_s())
            try:
                if result.status != "completed":
                    raise DecompositionError(
                        f"the decomposer's task {result.status}: {result.error or 'no answer'}"
                    )
                subs = parse_subtasks(result.text, self.max_children)
            except DecompositionError as exc:
                problems.append(f"attempt {attempt}: {exc}")
                messages = [
                    *messages,
                    Message(role="assistant", content=result.text),
                    Message(role="user", content=DECOMPOSER_RETRY.format(problem=exc)),
                ]
                continue
            return [ChildSpec(prompt=s, model=self.default_model, max_tokens=self.max_tokens) for s in subs]
        raise GenerationError(
            f"the decomposer ({self.decomposer_model}) did not answer a JSON list of sub-prompts: "
            + "; ".join(problems),
            hint="no child was queued; retry, choose another decomposer_model, or send explicit children",
            extra={
                "pipeline_id": self.pipeline_id,
                "decomposer_tasks": [s.task_id for s in self.state.decomposer],
            },
        )

    async def _queue_children(self, specs: list[ChildSpec]) -> None:
        leases = await self.gw.retrying(lambda: live_workers(self.gw.redis, self.gw.keys))
        # Every named model is checked before the first child is queued, so a typo queues nothing.
        for spec in specs:
            if spec.model == "auto":
                if not served_models(leases):
                    raise model_not_found("auto", leases)
                continue
            digest, holders = find_holders(spec.model, leases)
            if digest is None or not holders:
                raise model_not_found(spec.model, leases)
        # The plan is laid over the backlog as it was before these children joined it.
        fleet, est, now, _ = await self.gw.retrying(lambda: self.view.fleet(None, leases))
        self.state.status = "running"
        self.state.fan_out = len(specs)
        for index, spec in enumerate(specs):
            task = await self._submit(
                model=spec.model,
                messages=[Message(role="user", content=spec.prompt)],
                domain=spec.domain,
                max_tokens=spec.max_tokens,
            )
            self.state.children.append(
                Child(
                    index=index,
                    task_id=task.task_id,
                    prompt=spec.prompt,
                    model=task.model,
                    digest=task.digest,
                )
            )
        self._plan(fleet, est, now, leases, list(zip(self.state.children, specs, strict=True)))
        await self.gw.retrying(self._save)
        await self._record(
            PipelineStarted(
                pipeline_id=self.pipeline_id,
                fan_out=self.state.fan_out,
                capacity=self.state.capacity,
                policy=self.state.policy,
                expected_makespan_s=self.state.expected_makespan_s,
            ),
            *[
                PipelineChildAdded(
                    pipeline_id=self.pipeline_id, task_id=s.task_id, role="decomposer", index=i
                )
                for i, s in enumerate(self.state.decomposer)
            ],
            *[
                PipelineChildAdded(
                    pipeline_id=self.pipeline_id, task_id=c.task_id, role="child", index=c.index
                )
                for c in self.state.children
            ],
        )

    def _plan(
        self,
        fleet: FleetView,
        est: Estimator,
        now: int,
        leases: dict[str, LeaseInfo],
        mine: list[tuple[Child, ChildSpec]],
    ) -> None:
        """Capacity (live slots of the children's models) and the dispatch plan's makespan for them.

        Each model's plan is laid separately: children of two models that share a worker are
        planned as if each had its slots to itself.
        """
        workers = worker_views(leases)
        digests = sorted({c.digest for c, _ in mine})
        self.state.capacity = sum(w.slots for w in workers if w.holds & set(digests))
        self.state.capacity_by_model = {
            c.model: sum(w.slots for w in workers if c.digest in w.holds) for c, _ in mine
        }
        by_task = {c.task_id: c for c, _ in mine}
        finish: list[float] = []
        for digest in digests:
            entries = [
                BacklogEntry(
                    task_id=c.task_id,
                    digest=digest,
                    enqueued_at_ms=now,
                    domain=spec.domain or "general",
                    prompt_tokens=estimate_tokens(spec.prompt),
                    max_tokens=spec.max_tokens,
                )
                for c, spec in mine
                if c.digest == digest
            ]
            plan = plan_queue(fleet, est, digest, now, backlog=[*fleet.backlog.get(digest, []), *entries])
            for a in plan.assignments:
                child = by_task.get(a.task_id)
                if child is not None:
                    child.expected_worker = a.worker
                    child.expected_start_s = round(a.start_s, 3)
                    child.expected_finish_s = round(a.finish_s, 3)
                    finish.append(a.finish_s)
        self.state.expected_makespan_s = round(max(finish), 3) if finish else None

    async def gather(self) -> None:
        """Await every child; `fail_fast` stops at the first failure (the rest are then cancelled)."""
        waits = {
            asyncio.ensure_future(self.gw.wait(c.task_id, self._left_s())): c for c in self.state.children
        }
        try:
            while waits:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    child = waits.pop(fut)
                    result = fut.result()
                    self.results[child.index] = result
                    if result.status != "completed":
                        self.state.failed_children.append(child.task_id)
                        if self.state.policy == FAIL_FAST:
                            raise GenerationError(
                                f"child {child.index} ({child.task_id}) {result.status}: "
                                f"{result.error or 'no answer'}; policy fail_fast cancelled the rest",
                                hint="send policy best_effort to integrate what succeeded",
                                extra={"pipeline_id": self.pipeline_id},
                            )
        finally:
            for fut in waits:
                fut.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if len(self.state.failed_children) == len(self.state.children):
            raise GenerationError(
                f"every child of pipeline {self.pipeline_id} failed", extra={"pipeline_id": self.pipeline_id}
            )

    async def integrate(self) -> TaskMessage:
        """Queue the integration task over the children's answers."""
        parts = [self.integration_prompt]
        if self.state.prompt:
            parts.append(f"Original request:\n{self.state.prompt}")
        failed: list[str] = []
        for c in self.state.children:
            result = self.results.get(c.index)
            if result is None or result.status != "completed":
                failed.append(f"part {c.index + 1} ({c.prompt[:80]})")
                continue
            parts.append(f"Part {c.index + 1}: {c.prompt}\nAnswer:\n{result.text}")
        if failed:
            parts.append("These parts failed and have no answer: " + "; ".join(failed))
        task = await self._submit(
            model=self.integration_model,
            messages=[Message(role="user", content="\n\n".join(parts))],
            max_tokens=self.integration_max_tokens,
        )
        self.state.status = "integrating"
        self.state.integration = Step(task_id=task.task_id, model=task.model, role="integration")
        await self.gw.retrying(self._save)
        await self._record(
            PipelineChildAdded(
                pipeline_id=self.pipeline_id,
                task_id=task.task_id,
                role="integration",
                index=len(self.state.children),
            )
        )
        return task

    async def complete(self, result: Result) -> None:
        """Record the integration's outcome as the pipeline's."""
        if result.status != "completed":
            raise GenerationError(
                f"the integration task {result.task_id} {result.status}: {result.error or 'no answer'}",
                extra={"pipeline_id": self.pipeline_id},
            )
        self.done = True
        self.state.status = "completed"
        self.state.finished_at = now_ms()
        await self.gw.retrying(self._save)
        await self._record(
            PipelineCompleted(
                pipeline_id=self.pipeline_id,
                ok=True,
                failed_children=list(self.state.failed_children),
                integration_task_id=result.task_id,
                message=f"{len(self.state.failed_children)} of {self.state.fan_out} children failed"
                if self.state.failed_children
                else "",
            )
        )

    async def run(self) -> None:
        """The whole pipeline after `start`, waiting for the integration's answer."""
        try:
            await self.gather()
            task = await self.integrate()
            await self.complete(await self.gw.wait(task.task_id, self._left_s()))
        except BaseException as exc:
            await self._fail(exc)
            raise

    async def items(self) -> AsyncIterator[str | Result]:
        """The whole pipeline, yielding the integration's output as it arrives, then its Result."""
        try:
            await self.start()
            await self.gather()
            task = await self.integrate()
            async for item in self.gw.relay(task.task_id, self._left_s()):
                if isinstance(item, Result):
                    await self.complete(item)
                yield item
        except BaseException as exc:
            await self._fail(exc)
            raise

    async def _fail(self, exc: BaseException) -> None:
        """Cancel whatever still runs and record the failure once; never raises."""
        if self.done:
            return
        self.done = True
        message = exc.message if isinstance(exc, ApiError) else f"{type(exc).__name__}: {exc}".strip(": ")
        if isinstance(exc, asyncio.CancelledError):
            message = "the client went away"
        self.state.status = "failed"
        self.state.error = message
        self.state.finished_at = now_ms()
        steps = [c.task_id for c in self.state.children]
        if self.state.integration is not None:
            steps.append(self.state.integration.task_id)
        try:
            for task_id in steps:
                if task_id not in self.state.failed_children and not await self._finished(task_id):
                    await self.gw.cancel_quietly(task_id)
            await self._save()
            if self.state.fan_out == 0:
                # Failed before the children were queued: the ledger still gets the (empty) tree.
                await self.gw.ledger.append_many(
                    [
                        PipelineStarted(pipeline_id=self.pipeline_id, fan_out=0, policy=self.state.policy),
                        *[
                            PipelineChildAdded(
                                pipeline_id=self.pipeline_id, task_id=s.task_id, role="decomposer", index=i
                            )
                            for i, s in enumerate(self.state.decomposer)
                        ],
                    ]
                )
            await self.gw.ledger.append(
                PipelineCompleted(
                    pipeline_id=self.pipeline_id,
                    ok=False,
                    failed_children=list(self.state.failed_children),
                    integration_task_id=self.state.integration.task_id if self.state.integration else None,
                    message=message,
                )
            )
        except (RedisError, *TRANSIENT) as err:
            log.warning("pipeline %s: could not record its failure: %s", self.pipeline_id, err)

    async def _finished(self, task_id: str) -> bool:
        return await self.gw.result(task_id) is not None

    async def abort(self) -> None:
        """After the client left a streamed pipeline: cancel what runs and record the failure."""
        await self._fail(asyncio.CancelledError())


def coordinator(request: Request, body: PipelineCreate) -> Coordinator:
    if body.children is None and body.prompt is None:
        raise BadRequestError(
            "a pipeline needs children or a prompt to decompose", param="children", hint="send one of them"
        )
    default = body.model or default_model(request)
    specs = (
        None
        if body.children is None
        else [
            ChildSpec(
                prompt=c.prompt,
                model=c.model or default,
                domain=c.domain,
                max_tokens=c.max_tokens or body.max_tokens,
            )
            for c in body.children
        ]
    )
    return Coordinator(
        gateway(request),
        default_model=default,
        prompt=body.prompt,
        children=specs,
        decomposer_model=body.decomposer_model,
        integration_prompt=body.integration_prompt,
        integration_model=body.integration_model,
        policy=body.policy,
        max_tokens=body.max_tokens,
        integration_max_tokens=body.integration_max_tokens,
        max_children=body.max_children,
        timeout_s=body.timeout_s,
        client=request.headers.get("user-agent"),
    )


def default_model(request: Request) -> str:
    """The model of decomposers, children and integrations a request does not name (AppConfig)."""
    return str(getattr(request.app.state, "pipeline_model", "auto"))


# -- reading a pipeline -----------------------------------------------------------------------------


async def read_state(redis: Any, keys: Keys, pipeline_id: str) -> State | None:
    raw: Any = await redis.hget(keys.pipeline(pipeline_id), "state")
    return None if raw is None else msgspec.json.decode(raw, type=State)


def _ran(result: Result | None) -> dict[str, Any]:
    """Who ran a task, when and for how long, from its result (None fields while it is not done)."""
    if result is None:
        return {"status": "pending", "worker": None, "started_at": None, "finished_at": None, "wall_s": None}
    wall = result.wall_ms
    return {
        "status": result.status,
        "worker": result.worker,
        "attempt": result.attempt,
        "started_at": None if wall is None else result.finished_at - int(wall),
        "finished_at": result.finished_at,
        "wall_s": None if wall is None else round(wall / 1000, 3),
        "eval_count": result.timings.eval_count,
        "error": result.error,
    }


async def pipeline_view(redis: Any, keys: Keys, pipeline_id: str) -> dict[str, Any] | None:
    """What `GET /v1/pipelines/{id}` and `routeledger pipeline show` print: the tree with timings."""
    state = await read_state(redis, keys, pipeline_id)
    if state is None:
        return None
    ids = [c.task_id for c in state.children] + [s.task_id for s in state.decomposer]
    if state.integration is not None:
        ids.append(state.integration.task_id)
    pipe = redis.pipeline(transaction=False)
    for task_id in ids:
        pipe.hget(keys.result(task_id), "result")
    raw: list[Any] = await pipe.execute()
    results = {t: None if r is None else result_decoder.decode(r) for t, r in zip(ids, raw, strict=True)}
    children = [{**msgspec.to_builtins(c), **_ran(results[c.task_id])} for c in state.children]
    spans = [(c["started_at"], c["finished_at"]) for c in children if c["started_at"] is not None]
    capacity = state.capacity
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
        "decomposer": [{**msgspec.to_builtins(s), **_ran(results[s.task_id])} for s in state.decomposer],
        "children": children,
        "integration": None
        if state.integration is None
        else {**msgspec.to_builtins(state.integration), **_ran(results[state.integration.task_id])},
        "failed_children": state.failed_children,
        "error": state.error,
        "result": None
        if state.integration is None or results[state.integration.task_id] is None
        else {"text": results[state.integration.task_id].text},  # type: ignore[union-attr]
        "links": {"self": f"/v1/pipelines/{state.pipeline_id}"},
    }


async def pipeline_from_ledger(ledger: Ledger, pipeline_id: str) -> dict[str, Any] | None:
    """The tree as the ledger tells it, for a pipeline whose hash expired (no prompts, no text)."""
    from events.event import TaskClaimed, TaskCompleted, TaskFailed, TaskSubmitted

    started: PipelineStarted | None = None
    completed: PipelineCompleted | None = None
    added: list[PipelineChildAdded] = []
    tasks: dict[str, dict[str, Any]] = {}
    async for _, event in ledger.read():
        if isinstance(event, PipelineStarted) and event.pipeline_id == pipeline_id:
            started = event
        elif isinstance(event, PipelineChildAdded) and event.pipeline_id == pipeline_id:
            added.append(event)
        elif isinstance(event, PipelineCompleted) and event.pipeline_id == pipeline_id:
            completed = event
        elif isinstance(event, TaskSubmitted) and event.pipeline_id == pipeline_id:
            tasks[event.task_id] = {"model": event.model, "status": "queued", "worker": None}
        elif isinstance(event, TaskClaimed) and event.task_id in tasks:
            tasks[event.task_id].update(worker=event.worker, started_at=event.at, status="running")
        elif isinstance(event, TaskCompleted) and event.task_id in tasks and not event.duplicate:
            row = tasks[event.task_id]
            row.update(status="completed", worker=event.worker, finished_at=event.at)
            if event.wall_ms is not None:
                row.update(started_at=event.at - int(event.wall_ms), wall_s=round(event.wall_ms / 1000, 3))
        elif isinstance(event, TaskFailed) and event.task_id in tasks and not event.retryable:
            tasks[event.task_id].update(status="failed", error=event.message)
    if started is None and not tasks:
        return None

    def step(e: PipelineChildAdded) -> dict[str, Any]:
        return {"index": e.index, "task_id": e.task_id, "role": e.role, **tasks.get(e.task_id, {})}

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


# -- endpoints --------------------------------------------------------------------------------------


@router.post("/v1/pipelines")
async def create_pipeline(body: PipelineCreate, request: Request) -> Response:
    """Run a pipeline. `wait` (default) answers when it finished, else 202 once its children are queued."""
    coord = coordinator(request, body)
    gw = gateway(request)
    await coord.start()
    if not body.wait:
        task = asyncio.ensure_future(_quietly(coord.run()))
        _background.add(task)
        task.add_done_callback(_background.discard)
        view = await gw.retrying(lambda: pipeline_view(gw.redis, gw.keys, coord.pipeline_id))
        return JSON(view, status_code=202, headers=_headers(coord))
    await coord.run()
    view = await gw.retrying(lambda: pipeline_view(gw.redis, gw.keys, coord.pipeline_id))
    return JSON(view, headers=_headers(coord))


async def _quietly(run: Awaitable[None]) -> None:
    try:
        await run
    except ApiError as exc:
        log.info("background pipeline failed: %s", exc.message)
    except (RedisError, *TRANSIENT) as exc:
        log.warning("background pipeline lost Redis: %s", exc)


def _headers(coord: Coordinator) -> dict[str, str]:
    return {"X-Routeledger-Pipeline": coord.pipeline_id}


@router.get("/v1/pipelines/{pipeline_id}")
async def read_pipeline(pipeline_id: str, request: Request) -> JSON:
    """The pipeline's tree: fan-out vs capacity, the plan, and who ran each child, when and how long."""
    gw = gateway(request)
    view = await gw.retrying(lambda: pipeline_view(gw.redis, gw.keys, pipeline_id))
    if view is None:
        view = await gw.retrying(lambda: pipeline_from_ledger(gw.ledger, pipeline_id))
    if view is None:
        raise NotFoundError(
            f"no pipeline {pipeline_id}", hint="pipeline records expire 24 h after they start"
        )
    return JSON(view)


# -- the `pipeline` model on the chat surfaces ------------------------------------------------------


def model_entry() -> dict[str, Any]:
    """What /v1/models says of the `pipeline` model."""
    return {
        "description": "decompose the last user message, run the parts in parallel on the fleet, integrate",
    }


def _chat_coordinator(request: Request, messages: Sequence[Message], max_tokens: int | None) -> Coordinator:
    prompt = next((m.content for m in reversed(messages) if m.role == "user" and m.content.strip()), None)
    if prompt is None:
        raise BadRequestError(
            "the pipeline model needs a user message to decompose", param="messages", hint="send one"
        )
    model = default_model(request)
    return Coordinator(
        gateway(request),
        default_model=model,
        prompt=prompt,
        children=None,
        integration_max_tokens=max_tokens,
        client=request.headers.get("user-agent"),
    )


def _streamed(
    coord: Coordinator, lines: AsyncIterator[bytes], media_type: str, error_line: Callable[[ApiError], bytes]
) -> RelayResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for line in lines:
                yield line
        except ApiError as exc:
            yield error_line(exc)
        except (RedisError, *TRANSIENT) as exc:
            yield error_line(unavailable(exc))

    return RelayResponse(body(), media_type=media_type, headers=_headers(coord), on_disconnect=coord.abort)


async def openai_chat(body: ChatCompletionCreate, request: Request) -> Response:
    """/v1/chat/completions with model `pipeline`: the integration's answer, streamed or whole."""
    coord = _chat_coordinator(
        request, [m.to_message() for m in body.messages], body.max_completion_tokens or body.max_tokens
    )
    cid, created = f"chatcmpl-{coord.pipeline_id}", int(time.time())
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": PIPELINE_MODEL}
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage

        def chunk(delta: dict[str, Any], reason: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            return sse(encode({**head, "choices": [choice]}))

        async def lines() -> AsyncIterator[bytes]:
            # The role goes out at once: the children run for a while before any text exists.
            yield chunk({"role": "assistant", "content": ""})
            async for item in coord.items():
                if isinstance(item, str):
                    yield chunk({"content": item})
                else:
                    yield chunk({}, finish_reason(item))
                    if include:
                        yield sse(encode({**head, "choices": [], "usage": usage(item)}))
            yield b"data: [DONE]\n\n"

        return _streamed(coord, lines(), "text/event-stream", sse_error(OPENAI))
    result = await _whole(coord)
    return JSON(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": PIPELINE_MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "finish_reason": finish_reason(result),
                    "logprobs": None,
                }
            ],
            "usage": usage(result),
            "system_fingerprint": None,
        },
        headers=_headers(coord),
    )


async def _whole(coord: Coordinator) -> Result:
    last: Result | None = None
    async for item in coord.items():
        if isinstance(item, Result):
            last = item
    if last is None:  # pragma: no cover - items() always ends with the Result or raises
        raise GenerationError(f"pipeline {coord.pipeline_id} ended without an answer")
    return last


def _rfc3339() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f"{t % 1:.6f}"[1:] + "Z"


def _ollama_final(result: Result) -> dict[str, Any]:
    t = result.timings
    out: dict[str, Any] = {
        "model": PIPELINE_MODEL,
        "created_at": _rfc3339(),
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": result.done_reason or "stop",
        "total_duration": t.total_duration,
        "load_duration": t.load_duration,
        "prompt_eval_count": t.prompt_eval_count,
        "prompt_eval_duration": t.prompt_eval_duration,
        "eval_count": t.eval_count,
        "eval_duration": t.eval_duration,
    }
    return {k: v for k, v in out.items() if v is not None}


async def ollama_chat(body: OllamaChat, request: Request) -> Response:
    """/api/chat with model `pipeline`: NDJSON as Ollama streams it, or one object."""
    if not body.messages:
        # As Ollama answers a "load the model" request: nothing to run.
        return JSON(
            {
                "model": PIPELINE_MODEL,
                "created_at": _rfc3339(),
                "message": {"role": "assistant", "content": ""},
                "done": True,
                "done_reason": "load",
            }
        )
    num_predict = (body.options or {}).get("num_predict")
    max_tokens = num_predict if isinstance(num_predict, int) and num_predict > 0 else None
    coord = _chat_coordinator(request, [m.to_message() for m in body.messages or []], max_tokens)
    if body.stream is not False:

        async def lines() -> AsyncIterator[bytes]:
            async for item in coord.items():
                if isinstance(item, str):
                    piece = {"role": "assistant", "content": item}
                    yield encode(
                        {"model": PIPELINE_MODEL, "created_at": _rfc3339(), "message": piece, "done": False}
                    )
                    yield b"\n"
                else:
                    yield encode(_ollama_final(item)) + b"\n"

        return _streamed(coord, lines(), "application/x-ndjson", lambda exc: render(exc, OLLAMA) + b"\n")
    result = await _whole(coord)
    out = _ollama_final(result)
    out["message"] = {"role": "assistant", "content": result.text}
    return JSON(out, headers=_headers(coord))
