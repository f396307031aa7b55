"""Submission with a routing decision: resolve `auto`, rank the holders, record it, queue the task.

The API and the CLI submit through here. The decision (every candidate, every term and source) is
appended as TaskRouted together with TaskSubmitted, before any worker can see the task; workers
still pull, so the decision's taker is the plan's expectation, checked later against who ran it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from events.errors import ModelNotServedError
from events.event import TaskRouted
from events.lease import LeaseInfo
from events.queue import TaskQueues, describe_fleet, find_holders, require_model, submit_task
from events.task import Message, TaskMessage, estimate_tokens
from router.choose import Decision, classify_domain, decide
from router.errors import RouterError
from router.preview import preview
from workers.view import LiveView, served_models

log = logging.getLogger("routeledger.dispatch")

POLICY = "routeledger"
POLICY_VERSION = 1


async def route_and_submit(
    queues: TaskQueues,
    view: LiveView,
    *,
    model: str,
    messages: Sequence[Message] = (),
    prompt: str | None = None,
    system: str | None = None,
    kind: str = "chat",
    domain: str | None = None,
    options: dict[str, Any] | None = None,
    max_tokens: int | None = None,
    format: Any = None,
    priority: int = 0,
    task_id: str | None = None,
    client: str | None = None,
    pipeline_id: str | None = None,
    stream: bool = True,
) -> tuple[TaskMessage, str, Decision | None]:
    """Route and queue one request; `model` may be `auto`. The one submission path of the API,
    the CLI and pipelines.

    Raises ModelNotServedError at once when no live worker serves the model. A named model the
    router cannot rank (it never should) is still queued, without a TaskRouted.
    """
    text = (system or "") + (prompt or "") + "".join(m.content for m in messages)
    dom = domain or classify_domain(text)
    leases = await view.leases()
    candidates = _candidates(model, leases)
    if candidates is None:
        # A worker that came online since the cached read is found at once.
        leases = await view.leases(fresh=True)
        candidates = _candidates(model, leases)
    if candidates is None:
        require_model(model, leases)  # raises, naming what is served
        raise ModelNotServedError(f"no live worker serves any model ({describe_fleet(leases)})", model=model)
    fleet, est, now, _ = await view.fleet(set(candidates.values()), leases)
    decision: Decision | None
    try:
        decision = decide(
            model,
            candidates,
            fleet,
            est,
            now,
            domain=dom,
            prompt_tokens=estimate_tokens(text),
            max_tokens=max_tokens,
        )
    except RouterError as exc:
        if model == "auto":
            raise ModelNotServedError(f"the router could not choose a model: {exc}", model=model) from None
        log.warning("router could not rank the holders of %s: %s", model, exc)
        decision = None
    name = decision.model if decision is not None else model
    digest = decision.digest if decision is not None else candidates[model]

    def routed(task: TaskMessage, queue: str) -> TaskRouted:
        assert decision is not None
        best = decision.ranking.best
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
        model=name,
        messages=messages,
        prompt=prompt,
        system=system,
        kind=kind,
        domain=dom,
        options=options,
        max_tokens=max_tokens,
        format=format,
        priority=priority,
        task_id=task_id,
        client=client,
        pipeline_id=pipeline_id,
        leases=leases,
        digest=digest,
        routed=routed if decision is not None else None,
        stream=stream,
    )
    return task, queue, decision


def _candidates(model: str, leases: dict[str, LeaseInfo]) -> dict[str, str] | None:
    """The models a request may go to, name -> digest; None when the live fleet serves none of them."""
    if model == "auto":
        return served_models(leases) or None
    digest, holders = find_holders(model, leases)
    return {model: digest} if digest is not None and holders else None


async def preview_request(
    view: LiveView, *, model: str, domain: str = "general", tokens: int | None = None
) -> dict[str, object]:
    """The preview JSON (router/preview.py) for a request now: the CLI and the API print this.

    Raises ModelNotServedError when no live worker serves `model`.
    """
    leases = await view.leases(fresh=True)
    models = served_models(leases)
    if model != "auto":
        models = {model: require_model(model, leases)}
    elif not models:
        raise ModelNotServedError(f"no live worker serves any model ({describe_fleet(leases)})", model=model)
    fleet, est, now, _ = await view.fleet(set(models.values()), leases)
    return preview(fleet, est, now, model=model, models=models, domain=domain, max_tokens=tokens)
