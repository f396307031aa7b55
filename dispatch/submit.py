"""The one submission path: resolve the model (or `auto`), rank its holders, record it, queue the task.

The API, the CLI, pipelines and the demo traffic submit through the gateway's one way in
(`dispatch.gateway.Gateway.submit`), each with one TaskMessage, the task as the request made it:
the gateway holds it to its checks (memory, the queue's depth cap, the key's limits, a deadline)
and then calls `route_and_submit` here, which nothing else calls (tests/test_layers.py checks);
`submit_task` fills in its id, digest, domain and planned size and queues it. The decision (every
candidate, every term and source) is appended as TaskRouted together with TaskSubmitted, before any
worker can see the task; workers still pull, so the decision's taker is the plan's expectation,
checked later against who ran it.
"""

from __future__ import annotations

import logging
import uuid
from typing import Final

import msgspec

from dispatch.errors import CapabilityMissingError, ModelNotServedError, QueueFullError
from dispatch.prefix import task_chain
from dispatch.serving import (
    capabilities,
    catalog,
    describe_fleet,
    entry_lacks,
    lacks,
    require_model,
    served,
    served_models,
)
from dispatch.view import LiveView
from dispatch.wake import sleeping_candidates
from events.event import Event, TaskRouted, TaskSubmitted, now_ms
from events.keys import band_order
from router.choose import STORED_CANDIDATES, Decision, RouteQuery, classify_domain, decide, learned_tokens
from router.errors import RouterError
from router.estimate import DEFAULT_IMAGE_TOKENS
from router.handoff import handoff_worker
from router.preview import preview
from router.split import SPLIT_MIN_INPUTS, Reader, split_sizes
from tasks.lease import LeaseInfo, live_workers
from tasks.payload import EMBED, TaskMessage, estimate_tokens, sha256_hex
from tasks.store import AtCapError, TaskStore

log = logging.getLogger("routeledger.dispatch")

# The oldest leases a request whose prompt has a chain is routed on (seconds; see route_and_submit).
PREFIX_LEASES_MAX_AGE_S: Final = 0.05

POLICY: Final = "routeledger"
POLICY_VERSION: Final = 1
# Seconds a client refused for a full queue is told to wait.
QUEUE_FULL_RETRY_S: Final = 5


def text_tokens(task: TaskMessage) -> int:
    """The prompt's text size before the backend counts it: an embedding's inputs one by one (each
    is a sequence of its own), anything else as one text; at its model's learned ratio
    (`task.bytes_per_token`) where routing found one."""
    if task.bytes_per_token is not None:
        ratio = task.bytes_per_token
        if task.kind == EMBED and task.inputs:
            return sum(learned_tokens(len(text.encode()), ratio) for text in task.inputs)
        return learned_tokens(len(task.prompt_text().encode()), ratio)
    if task.kind == EMBED and task.inputs:
        return sum(estimate_tokens(text) for text in task.inputs)
    return estimate_tokens(task.prompt_text())


def planned_prompt_tokens(task: TaskMessage) -> int:
    """Its prompt tokens as planned before the backend counts them: the text's estimate and each
    image at the router's per-image figure (router.estimate.DEFAULT_IMAGE_TOKENS), which the
    backend's prompt_eval_count includes too."""
    return text_tokens(task) + task.image_count() * DEFAULT_IMAGE_TOKENS


class Submitted(msgspec.Struct, kw_only=True):
    """A task accepted and queued, with the routing decision it was queued under (if any)."""

    task: TaskMessage
    queue: str
    decision: Decision | None = None
    # The name of the API key it came with: its result is charged to that key (Gateway.settle).
    key: str | None = None

    @property
    def task_id(self) -> str:
        return self.task.task_id


async def route_and_submit(
    queues: TaskStore,
    view: LiveView,
    req: TaskMessage,
    *,
    max_depth: int | None = None,
    prefixes: bool = True,
) -> Submitted:
    """Route and queue one request; `req.model` may be `auto`. `prefixes`: its prompt's chain is
    computed and priced (router.prefix), and it may be handed off (router.handoff); False: it is
    planned as uncached everywhere.

    Raises ModelNotServedError at once when no live worker serves the model, and QueueFullError
    when the chosen model's queue holds `max_depth` tasks already. A named model the router cannot
    rank (it never should) is still queued, without a TaskRouted.
    """
    text = req.prompt_text()
    domain = req.domain or classify_domain(text)
    chain = task_chain(req) if prefixes else None
    # What the workers' slots hold changes as each run ends, and a chat's next turn can follow its
    # answer within a moment: a prompt with a chain is planned on leases no older than that.
    leases = await view.leases(max_age_s=PREFIX_LEASES_MAX_AGE_S if chain is not None else None)
    candidates = view.resolve(req.model, leases)
    if candidates is None:
        # A worker that came online since the cached read is found at once.
        leases = await view.leases(fresh=True)
        candidates = view.resolve(req.model, leases)
    if candidates is None:
        require_model(req.model, leases)  # raises, naming what is served
        raise ModelNotServedError(
            f"no live worker serves any model ({describe_fleet(leases)})", model=req.model
        )
    for capability in needs(req):
        candidates = _able(req.model, capability, candidates, leases)
    fleet, est, now, _ = await view.fleet(set(candidates.values()), leases)
    query = RouteQuery(
        model=req.model,
        domain=domain,
        prompt_tokens=text_tokens(req),
        prompt_bytes=len(text.encode()),
        max_tokens=req.max_tokens,
        images=req.image_count(),
        prefix=chain,
        paced=req.paced,
    )
    decision: Decision | None
    try:
        decision = decide(query, candidates, fleet, est, now)
    except RouterError as exc:
        if req.model == "auto":
            raise ModelNotServedError(
                f"the router could not choose a model: {exc}", model=req.model
            ) from None
        log.warning("router could not rank the holders of %s: %s", req.model, exc)
        decision = None
    routed = msgspec.structs.replace(
        req,
        model=decision.model if decision is not None else req.model,
        domain=domain,
        prefix=chain,
    )
    digest = decision.digest if decision is not None else candidates[req.model]
    learned = est.bytes_per_token(digest)
    if learned is not None:
        routed = msgspec.structs.replace(routed, bytes_per_token=learned.value)
    # Straight to one worker when the plan's lead is wide (router.handoff); only for the model's
    # plain queue: a priority band or a fair-share round keeps its place among the bands.
    pin = None
    if decision is not None and req.priority == 0 and req.share_round == 0 and req.kind != EMBED:
        pin = handoff_worker(decision)
        lease = leases.get(pin) if pin is not None else None
        handed = view.handed_off.get(pin) if pin is not None else None
        if pin is not None and (lease is None or (handed is not None and lease.renewed_at <= handed)):
            # No plan sees a hand-off until its worker claims it and writes its lease again: until
            # then this worker is not free for another (its lease would still say it is).
            pin = None
        elif pin is not None and lease is not None:
            view.handed_off[pin] = lease.renewed_at
    if decision is not None and pin is None and req.priority == 0 and req.share_round == 0:
        pin = _able_holder(decision, digest, needs(req), leases)
    return await submit_task(
        queues,
        routed,
        leases=leases,
        digest=digest,
        decision=decision,
        max_depth=max_depth,
        pin=pin,
        prefixes=prefixes,
    )


def _able_holder(
    decision: Decision, digest: str, wanted: list[str], leases: dict[str, LeaseInfo]
) -> str | None:
    """Where some holders of the model lack a capability the request needs (their server refused
    it, or says so) and others may have it: the best-ranked of those others, to pin the task to,
    so that it is not given to one that would refuse it again. None when no holder lacks one."""
    if not wanted:
        return None

    def lacking(worker: str) -> bool:
        info = leases.get(worker)
        if info is None:
            return True
        held = [e for e in served(info) if e.digest == digest]
        return any(entry_lacks(e, c) for e in held for c in wanted)

    ranked = [c.worker for c in decision.ranking.candidates]
    if not any(lacking(w) for w in ranked):
        return None
    return next((w for w in ranked if not lacking(w)), None)


# What each capability a request may need is called in messages: (what the request sends, what
# to send instead).
_NEEDS: Final = {
    "tools": ("tools", "send the request without tools"),
    "vision": ("images", "send the request without images"),
    "thinking": ("think", "send the request without think (or with think false)"),
    "embedding": ("input", "send it to a model that embeds"),
}


def needs(req: TaskMessage) -> list[str]:
    """The capabilities the request needs of its model (`_NEEDS`)."""
    if req.kind == EMBED:
        return ["embedding"]
    # `auto` weighs only models that may answer a generation: an embedding model (its holders say it
    # embeds and does not complete) decodes nothing, so it would look fastest of all, then refuse.
    # A named model is left to its backend, which refuses what it cannot answer.
    out = ["completion"] if req.model == "auto" else []
    if req.tools and req.tool_choice != "none":
        out.append("tools")
    if req.image_count():
        out.append("vision")
    if req.think is True or (isinstance(req.think, str) and req.think.lower() not in ("", "none", "false")):
        out.append("thinking")
    return out


def _able(
    model: str, capability: str, candidates: dict[str, str], leases: dict[str, LeaseInfo]
) -> dict[str, str]:
    """The candidates that have `capability`: a model is left out only when every live holder says
    it lacks it (a holder that reports no capabilities may have it). CapabilityMissingError when
    none is left."""
    able = {name: digest for name, digest in candidates.items() if not lacks(digest, capability, leases)}
    if able:
        return able
    if capability == "embedding":
        raise _cannot_embed(model, candidates, leases)
    if capability == "completion":
        # Only `auto` asks for it (needs): every model the fleet serves only embeds.
        raise CapabilityMissingError(
            "no model the live fleet serves answers chats or completions: the models it serves only "
            f"embed ({', '.join(sorted(candidates))})",
            hint="send embeddings to /v1/embeddings or /api/embed, or serve a model whose capabilities "
            "include completion",
            param="model",
        )
    sent, instead = _NEEDS[capability]
    if model == "auto":
        raise CapabilityMissingError(
            f"no model the live fleet serves supports {sent} (capability {capability!r})",
            hint=f"{instead}, or serve a model whose capabilities include {capability}",
            param=sent,
        )
    digest = candidates[model]
    raise CapabilityMissingError(
        f"model {model!r} does not support {sent} (its holders report capabilities: "
        f"{', '.join(capabilities(digest, leases))})",
        hint=f"choose a model whose capabilities include {capability} (/api/show lists them), or {instead}",
        param=sent,
    )


async def embedding_parts(view: LiveView, req: TaskMessage) -> list[TaskMessage]:
    """The requests an embedding request runs as: itself, or (a large batch the plan finishes
    sooner on several holders: router.split) its parts, in input order, each for the model the
    whole batch was routed to (the parts of an `auto` request must share one model's vectors),
    each recorded as a part of the request's id.

    Never raises for a model it cannot route: the request then goes whole to `route_and_submit`,
    which says what is wrong.
    """
    inputs = req.inputs or []
    if req.kind != EMBED or len(inputs) < SPLIT_MIN_INPUTS:
        return [req]
    leases = await view.leases()
    candidates = view.resolve(req.model, leases)
    if candidates is None:
        return [req]
    try:
        candidates = _able(req.model, "embedding", candidates, leases)
    except CapabilityMissingError:
        return [req]
    fleet, est, now, _ = await view.fleet(set(candidates.values()), leases)
    domain = req.domain or classify_domain(req.prompt_text())
    tokens = [estimate_tokens(text) for text in inputs]
    query = RouteQuery(model=req.model, domain=domain, prompt_tokens=sum(tokens))
    try:
        decision = decide(query, candidates, fleet, est, now)
    except RouterError:
        return [req]
    # A holder with no reading time has no rate to split by: it is left out.
    readers = [
        Reader(
            worker=c.worker,
            start_s=c.terms["wait_s"] + c.terms["load_s"],
            rate_tps=sum(tokens) / c.terms["prompt_s"],
        )
        for c in decision.ranking.candidates
        if c.terms["prompt_s"] > 0
    ]
    sizes = split_sizes(readers, tokens)
    if len(sizes) < 2:
        return [req]
    split_of = req.task_id or uuid.uuid4().hex
    parts, start = [], 0
    for i, (_, n) in enumerate(sizes):
        parts.append(
            msgspec.structs.replace(
                req,
                model=decision.model,
                domain=domain,
                inputs=inputs[start : start + n],
                task_id="",
                split_of=split_of,
                part=i,
                parts=len(sizes),
            )
        )
        start += n
    return parts


def _cannot_embed(
    model: str, candidates: dict[str, str], leases: dict[str, LeaseInfo]
) -> CapabilityMissingError:
    """The refusal of an embedding request for a model that cannot embed, naming those that can."""
    able = [m.name for m in catalog(leases) if "embedding" in capabilities(m.entry.digest, leases)]
    can = f"models that can: {', '.join(able)}" if able else "no model the live fleet serves can"
    if model == "auto":
        message = f"no model the live fleet serves reports the embedding capability ({can})"
    else:
        reported = ", ".join(capabilities(candidates[model], leases))
        said = (
            f"its holders report capabilities: {reported}"
            if reported
            else "its holders' servers refused to embed with it (llama-server needs --embeddings)"
        )
        message = f"model {model!r} cannot embed ({said}); {can}"
    return CapabilityMissingError(
        message,
        hint="send the request to a model whose capabilities include embedding (/api/show lists them)",
        param="model",
    )


async def submit_task(
    queues: TaskStore,
    req: TaskMessage,
    *,
    leases: dict[str, LeaseInfo] | None = None,
    digest: str | None = None,
    decision: Decision | None = None,
    max_depth: int | None = None,
    pin: str | None = None,
    prefixes: bool = True,
) -> Submitted:
    """Record TaskSubmitted (and TaskRouted, given the decision) and queue the task, resolving
    `req.model` among live workers unless `digest` says what it is. The queued task is `req` with
    its id (drawn where it has none), digest, domain (classified where it has none), planned prompt
    tokens, chain and time of submission filled in, and its request-only fields cleared.

    Everything is written in one script keyed by the task id (TaskStore.submit): the ledger
    events, the queue entry, the task's lookup hash, so that no worker sees a task the ledger has
    not recorded, and a second submission of the same id (a re-send after a lost reply) queues
    nothing. Raises ModelNotServedError at once when no live worker serves the model, and
    QueueFullError when its queue holds `max_depth` tasks (every band together).

    The task joins its model's band queue for its priority and fair-share round
    (events.keys.Keys.band_queue): workers serve a model's bands highest priority first, and within
    a priority the earlier round first. With `pin` (router.handoff) it goes to that worker's
    pinned stream instead, and its lookup hash names the queue it would have joined (`fallback`),
    where the reaper moves it if that worker does not take it (TaskStore.hand_back).
    """
    if digest is None:
        live = leases if leases is not None else await live_workers(queues.redis, queues.keys)
        digest = require_model(req.model, live)
    text = req.prompt_text()
    domain = req.domain or classify_domain(text)
    task = msgspec.structs.replace(
        req,
        task_id=req.task_id or uuid.uuid4().hex,
        digest=digest,
        domain=domain,
        prompt_tokens=planned_prompt_tokens(req),
        prefix=(req.prefix or task_chain(req)) if prefixes else None,
        # Its time of submission, not of the request's making.
        submitted_at=now_ms(),
        # What only submission reads (recorded on TaskSubmitted below, or read to route it) is
        # cleared in the queued copy: no worker needs it (nor the name of the key it came with),
        # and its entry holds what it held when a request was a struct of its own.
        client=None,
        runtime_options=False,
        key=None,
        share_round=0,
        split_of=None,
        part=0,
        parts=1,
        bytes_per_token=None,
    )
    keys = queues.keys
    shared = keys.band_queue(digest, task.priority, req.share_round)
    queue = keys.pinned(pin) if pin is not None else shared
    events: list[Event] = [
        TaskSubmitted(
            task_id=task.task_id,
            model=task.model,
            digest=digest,
            queue=queue,
            domain=domain,
            kind=task.kind,
            prompt_tokens=task.prompt_tokens,
            max_tokens=task.max_tokens,
            priority=task.priority,
            prompt_bytes=len(text.encode()),
            prompt_sha256=sha256_hex(text),
            pipeline_id=task.pipeline_id,
            client=req.client,
            runtime_options=req.runtime_options,
            key=req.key,
            share_round=req.share_round,
            split_of=req.split_of,
            part=req.part,
            parts=req.parts,
        )
    ]
    breakdown = b""
    if decision is not None:
        events.append(routed_event(task.task_id, queue, decision))
        # The whole breakdown (every candidate, up to a bound) stays readable while the task is recent.
        breakdown = msgspec.json.encode(decision.to_dict(top=STORED_CANDIDATES))
    info: dict[str, str | bytes] = {
        "queue": queue,
        "model": task.model,
        "digest": digest,
        "domain": domain,
        "submitted_at": str(task.submitted_at),
        "routed": breakdown,
    }
    if req.key is not None:
        info["key"] = req.key
    if pin is not None:
        info["fallback"] = shared
    try:
        await queues.submit(
            queue,
            task,
            events,
            info,
            # The plain queue is always read, listed or not: only the other bands join the zset.
            bands=keys.bands(digest) if queue == shared and queue != keys.queue(digest) else "",
            order=band_order(task.priority, req.share_round),
            # The cap is checked in the same call: a submission is one round trip.
            cap=max_depth,
        )
    except AtCapError as exc:
        raise QueueFullError(
            f"the queue of {req.model} holds {exc.held} tasks: at its cap max_queue_depth={max_depth}",
            hint="try again later, or another model; the operator may raise max_queue_depth",
            cap=max_depth or exc.held,
            retry_after_s=QUEUE_FULL_RETRY_S,
        ) from None
    return Submitted(task=task, queue=queue, decision=decision, key=req.key)


def routed_event(task_id: str, queue: str, decision: Decision) -> TaskRouted:
    """The ledger's record of a decision: the chosen worker and the compact breakdown (the top
    candidates in full, the rest counted); the task's lookup hash keeps the whole one."""
    best = decision.ranking.best
    return TaskRouted(
        task_id=task_id,
        digest=decision.digest,
        queue=queue,
        policy=POLICY,
        policy_version=POLICY_VERSION,
        breakdown=decision.to_record(),
        expected_worker=best.worker,
        expected_finish_s=best.expected_finish_s,
    )


async def preview_request(view: LiveView, query: RouteQuery) -> dict[str, object]:
    """The preview JSON (router/preview.py) for a request now: the CLI and the API print this.

    Raises ModelNotServedError when no live worker serves `query.model`.
    """
    leases = await view.leases(fresh=True)
    models = served_models(leases)
    if query.model != "auto":
        models = {query.model: require_model(query.model, leases)}
    elif not models:
        raise ModelNotServedError(
            f"no live worker serves any model ({describe_fleet(leases)})", model=query.model
        )
    else:
        # A preview is of a generation: `auto` weighs the models that may complete, as it does for a
        # chat (needs); a fleet that only embeds is previewed as it is.
        models = {n: d for n, d in models.items() if not lacks(d, "completion", leases)} or models
    fleet, est, now, _ = await view.fleet(set(models.values()), leases)
    out = preview(query, models, fleet, est, now)
    # Machines asleep that serve the model: what each would do if woken now (dispatch.wake).
    snap, _ = await view.estimates()
    digest = str(out["digest"])
    sleeping = await sleeping_candidates(
        view.redis, view.keys, fleet, est, digest, now, leases, snap.fleet, query
    )
    if sleeping:
        out["sleeping"] = sleeping
    return out
