"""The coordinator: runs one pipeline, from decomposition to the integration's answer.

Children go to the shared queues through the one submission path (dispatch.submit), so workers
pull them through the router's gate like any task. When they are done (or as the policy says:
`fail_fast` fails the pipeline at the first failed child and cancels the rest; `best_effort`
integrates what succeeded and names what failed) an integration task combines the answers.

State: the coordinator (a coroutine in an API request, or a background task of that API process)
is the only writer of its pipeline's hash (pipelines/state.py); the ledger records
PipelineStarted, PipelineChildAdded and PipelineCompleted, and every child's TaskSubmitted
carries the pipeline id, so the tree outlives the hash.

If the process running it dies mid-pipeline, the pipeline is left incomplete: its children are
ordinary tasks and still complete (or are reclaimed and re-run if their worker dies), but nothing
submits the integration, no PipelineCompleted is appended, and the hash keeps saying `running`
until it expires. There is deliberately no daemon that adopts orphaned pipelines.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Final

import msgspec
from redis.exceptions import RedisError

from dispatch.errors import ModelNotServedError, TaskTimeoutError
from dispatch.gateway import TRANSIENT, Gateway
from dispatch.serving import describe_fleet, require_model, served_models
from dispatch.view import LiveView, worker_views
from events.cancellation import cancel_and_wait
from events.event import Event, PipelineChildAdded, PipelineCompleted, PipelineStarted, now_ms
from pipelines.decompose import DECOMPOSER_FORMAT, decomposer_system, parse_subtasks, retry_prompt
from pipelines.errors import DecompositionError, PipelineFailedError
from pipelines.state import Child, ChildSpec, Policy, State, Step, save_state
from router.estimate import Estimator
from router.plan import BacklogEntry, FleetView, plan_queue
from tasks.errors import TaskError
from tasks.lease import LeaseInfo, live_workers
from tasks.payload import Message, Relayed, Result, TaskMessage, estimate_tokens
from tasks.quota import ApiKey

log = logging.getLogger("routeledger.pipelines")

# The model name that asks the chat surfaces for a pipeline.
PIPELINE_MODEL: Final = "pipeline"
# Above this many children a request is refused: each child holds a connection while it is awaited.
MAX_CHILDREN: Final = 32
FAIL_FAST: Final = "fail_fast"
BEST_EFFORT: Final = "best_effort"
DEFAULT_INTEGRATION: Final = (
    "Combine the answers to the parts below into one coherent answer to the original request. "
    "Do not mention that it was split into parts."
)


class PipelineRequest(msgspec.Struct, kw_only=True):
    """One pipeline, as a surface asks for it: explicit children, or a prompt to decompose."""

    # The children's model when a child names none, and the decomposer's and the integration's.
    default_model: str
    prompt: str | None = None
    children: list[ChildSpec] | None = None
    decomposer_model: str | None = None
    integration_prompt: str | None = None
    integration_model: str | None = None
    policy: Policy = "fail_fast"
    # Each child's output limit (a decomposed child's; an explicit child may carry its own).
    max_tokens: int | None = None
    integration_max_tokens: int | None = None
    max_children: int = 8
    timeout_s: float | None = None
    client: str | None = None
    # The API key the pipeline was asked with: its children (decomposer and integration included)
    # carry its name and are held to its limits and charged to it. The first task a pipeline
    # queues is held to the key's rpm like any request; later ones are not (one request is one
    # pipeline), but every one counts against tokens_per_day and max_queued.
    key: ApiKey | None = None


class Coordinator:
    """Runs one pipeline: decompose, queue the children, await them, integrate, record."""

    def __init__(self, gw: Gateway, req: PipelineRequest) -> None:
        self.gw = gw
        self.req = req
        self.view = LiveView(gw.redis, gw.keys)
        self.specs = list(req.children) if req.children is not None else None
        self.decomposer_model = req.decomposer_model or req.default_model
        self.integration_prompt = req.integration_prompt or DEFAULT_INTEGRATION
        self.integration_model = req.integration_model or req.default_model
        self.deadline = time.monotonic() + (req.timeout_s or gw.wait_timeout_s)
        self.state = State(
            pipeline_id=uuid.uuid4().hex,
            status="decomposing",
            policy=req.policy,
            created_at=now_ms(),
            prompt=req.prompt,
        )
        self.results: dict[int, Result] = {}
        self.done = False
        # Whether a task of this pipeline was held to its key's rpm already (`_submit`).
        self._rated = False
        # Every task's deadline, on the ledger's clock (set at the first `_submit`).
        self.deadline_ms: int | None = None

    @property
    def pipeline_id(self) -> str:
        return self.state.pipeline_id

    def _left_s(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TaskTimeoutError(
                f"pipeline {self.pipeline_id} did not finish in time",
                hint=f"its children still run: GET /v1/pipelines/{self.pipeline_id}",
            )
        return left

    async def _save(self) -> None:
        await save_state(self.gw.redis, self.gw.keys, self.state)

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
        if self.deadline_ms is None:
            # On the ledger's clock, as every task's deadline: the pipeline's, for all its tasks.
            self.deadline_ms = await self.gw.fleet.clock.now_ms() + int(self._left_s() * 1000)
        req = TaskMessage(
            model=model,
            messages=messages,
            domain=domain,
            max_tokens=max_tokens,
            format=fmt,
            client=self.req.client,
            pipeline_id=self.pipeline_id,
            task_id=uuid.uuid4().hex,
            deadline_ms=self.deadline_ms,
        )
        # Through the gateway's one way in, as a client's request: memory, the queue's depth cap,
        # the key's limits (the first task held to its rpm, later ones not) and the deadline.
        submitted = await self.gw.submit(req, waits=False, key=self.req.key, child=self._rated)
        self._rated = self.req.key is not None
        return submitted.task

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
            Message(role="system", content=decomposer_system(self.req.max_children)),
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
                subs = parse_subtasks(result.text, self.req.max_children)
            except DecompositionError as exc:
                problems.append(f"attempt {attempt}: {exc}")
                messages = [
                    *messages,
                    Message(role="assistant", content=result.text),
                    Message(role="user", content=retry_prompt(exc)),
                ]
                continue
            return [
                ChildSpec(prompt=s, model=self.req.default_model, max_tokens=self.req.max_tokens)
                for s in subs
            ]
        raise PipelineFailedError(
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
            if spec.model != "auto":
                require_model(spec.model, leases)
            elif not served_models(leases):
                raise ModelNotServedError(
                    f"no live worker serves any model ({describe_fleet(leases)})", model="auto", fleet=leases
                )
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
            *self._added("decomposer", self.state.decomposer),
            *[
                PipelineChildAdded(
                    pipeline_id=self.pipeline_id, task_id=c.task_id, role="child", index=c.index
                )
                for c in self.state.children
            ],
        )

    def _added(self, role: str, steps: list[Step]) -> list[PipelineChildAdded]:
        return [
            PipelineChildAdded(pipeline_id=self.pipeline_id, task_id=s.task_id, role=role, index=i)
            for i, s in enumerate(steps)
        ]

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
                            raise PipelineFailedError(
                                f"child {child.index} ({child.task_id}) {result.status}: "
                                f"{result.error or 'no answer'}; policy fail_fast cancelled the rest",
                                hint="send policy best_effort to integrate what succeeded",
                                extra={"pipeline_id": self.pipeline_id},
                            )
        finally:
            await cancel_and_wait(waits)
            await asyncio.gather(*waits, return_exceptions=True)
        if len(self.state.failed_children) == len(self.state.children):
            raise PipelineFailedError(
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
            max_tokens=self.req.integration_max_tokens,
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
            raise PipelineFailedError(
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

    async def items(self) -> AsyncIterator[Relayed]:
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

    async def whole(self) -> Result:
        """The whole pipeline, then the integration's Result."""
        last: Result | None = None
        async for item in self.items():
            if isinstance(item, Result):
                last = item
        if last is None:  # pragma: no cover - items() always ends with the Result or raises
            raise PipelineFailedError(f"pipeline {self.pipeline_id} ended without an answer")
        return last

    async def _fail(self, exc: BaseException) -> None:
        """Cancel whatever still runs and record the failure once; never raises."""
        if self.done:
            return
        self.done = True
        message = exc.message if isinstance(exc, TaskError) else f"{type(exc).__name__}: {exc}".strip(": ")
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
                if task_id not in self.state.failed_children and await self.gw.result(task_id) is None:
                    await self.gw.cancel_quietly(task_id)
            await self._save()
            if self.state.fan_out == 0:
                # Failed before the children were queued: the ledger still gets the (empty) tree.
                await self.gw.ledger.append_many(
                    [
                        PipelineStarted(pipeline_id=self.pipeline_id, fan_out=0, policy=self.state.policy),
                        *self._added("decomposer", self.state.decomposer),
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

    async def abort(self) -> None:
        """After the client left a streamed pipeline: cancel what runs and record the failure."""
        await self._fail(asyncio.CancelledError())
