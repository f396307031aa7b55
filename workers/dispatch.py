"""Submission with a routing decision: resolve `auto`, rank the holders, record it, queue the task.

The API and the CLI submit through here. The decision (every candidate, every term and source) is
appended as TaskRouted together with TaskSubmitted, before any worker can see the task; workers
still pull, so the decision's taker is the plan's expectation, checked later against who ran it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from events.errors import ModelNotServedError
from events.event import TaskRouted
from events.lease import live_workers
from events.queue import TaskQueues, describe_fleet, require_model, submit_task
from events.task import Message, TaskMessage
from router.choose import Decision, classify_domain, decide
from router.preview import preview
from workers.view import LiveView, served_models

POLICY = "routeledger"
POLICY_VERSION = 1


async def route_and_submit(
    queues: TaskQueues,
    view: LiveView,
    *,
    model: str,
    messages: Sequence[Message] = (),
    prompt: str | None = None,
    kind: str = "chat",
    domain: str | None = None,
    options: dict[str, Any] | None = None,
    max_tokens: int | None = None,
    priority: int = 0,
    task_id: str | None = None,
    client: str | None = None,
    pipeline_id: str | None = None,
) -> tuple[TaskMessage, str, Decision]:
    """Route and queue one request; `model` may be `auto`.

    Raises ModelNotServedError at once when no live worker serves the model.
    """
    leases = await live_workers(queues.redis, queues.keys)
    text = (prompt or "") + "".join(m.content for m in messages)
    dom = domain or classify_domain(text)
    models = served_models(leases)
    if model == "auto":
        if not models:
            raise ModelNotServedError(
                f"no live worker serves any model ({describe_fleet(leases)})", model=model
            )
        candidates = models
    else:
        candidates = {model: require_model(model, leases)}
    fleet, est, now, _ = await view.fleet(set(candidates.values()), leases)
    prompt_tokens = max(1, len(text.encode()) // 4)
    decision = decide(
        model, candidates, fleet, est, now, domain=dom, prompt_tokens=prompt_tokens, max_tokens=max_tokens
    )
    best = decision.ranking.best

    def routed(task: TaskMessage, queue: str) -> TaskRouted:
        return TaskRouted(
            task_id=task.task_id,
            digest=decision.digest,
            queue=queue,
            policy=POLICY,
            policy_version=POLICY_VERSION,
            breakdown=decision.to_dict(),
            expected_worker=best.worker,
            expected_finish_s=best.expected_finish_s,
        )

    task, queue = await submit_task(
        queues,
        model=decision.model,
        messages=messages,
        prompt=prompt,
        kind=kind,
        domain=dom,
        options=options,
        max_tokens=max_tokens,
        priority=priority,
        task_id=task_id,
        client=client,
        pipeline_id=pipeline_id,
        leases=leases,
        digest=decision.digest,
        routed=routed,
    )
    return task, queue, decision


async def preview_request(
    view: LiveView, *, model: str, domain: str = "general", tokens: int | None = None
) -> dict[str, object]:
    """The preview JSON (router/preview.py) for a request now: the CLI and the API print this.

    Raises ModelNotServedError when no live worker serves `model`.
    """
    leases = await live_workers(view.redis, view.keys)
    models = served_models(leases)
    if model != "auto":
        models = {model: require_model(model, leases)}
    elif not models:
        raise ModelNotServedError(f"no live worker serves any model ({describe_fleet(leases)})", model=model)
    fleet, est, now, _ = await view.fleet(set(models.values()), leases)
    return preview(fleet, est, now, model=model, models=models, domain=domain, max_tokens=tokens)
