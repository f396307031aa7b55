"""The pipeline routes: `POST /v1/pipelines`, `GET /v1/pipelines/{id}`, and the `pipeline` model's
answer on the chat surfaces.

`POST /v1/pipelines` takes explicit children (each a prompt with its model or `auto`) or one prompt
that a decomposer model splits (pipelines/decompose.py). The model `pipeline` on the OpenAI and
Ollama chat surfaces decomposes the last user message and answers with the integration's output,
rendered by each surface's own code (api/common.Answer). How a pipeline runs, and what is left
when its API process dies, is told in pipelines/coordinator.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BeforeValidator, Field
from redis.exceptions import RedisError
from starlette.responses import Response

from api.auth import API_KEY
from api.common import JSON, Answer, gateway, options_policy
from api.errors import NATIVE, READS, SUBMITS, BadRequestError, NotFoundError, answer, documented
from api.schemas import MAX_WAIT_S, Body, Part, TokenCount, integral
from dispatch.gateway import TRANSIENT
from pipelines.coordinator import FAIL_FAST, MAX_CHILDREN, PIPELINE_MODEL, Coordinator, PipelineRequest
from pipelines.history import pipeline_from_ledger, pipeline_view
from pipelines.state import ChildSpec
from tasks.errors import TaskError
from tasks.payload import Message, Result

log = logging.getLogger("routeledger.api")

router = APIRouter(tags=["pipelines"])

_background: set[asyncio.Task[None]] = set()


class ChildCreate(Part):
    """One explicit child: its prompt and the model that answers it."""

    prompt: str = Field(min_length=1)
    model: str | None = Field(
        None, description="a model the fleet serves, or 'auto'; default: the pipeline's"
    )
    domain: str | None = None
    max_tokens: TokenCount | None = None


class PipelineCreate(Body):
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
    max_tokens: TokenCount | None = Field(None, description="each child's output limit")
    integration_max_tokens: TokenCount | None = None
    max_children: Annotated[int, Field(ge=1, le=MAX_CHILDREN), BeforeValidator(integral)] = Field(
        8, description="most sub-prompts a decomposer may give"
    )
    wait: bool = Field(
        True, description="answer when the pipeline has finished; false: 202 once children are queued"
    )
    # At least a second: a shorter wait could only ever end in a 504.
    timeout_s: float | None = Field(
        None, ge=1, le=MAX_WAIT_S, description="how long a waiting request waits (1 s to a day)"
    )


def default_model(request: Request) -> str:
    """The model of decomposers, children and integrations a request does not name (AppConfig)."""
    return str(getattr(request.app.state, "pipeline_model", "auto"))


def coordinator(request: Request, body: PipelineCreate) -> Coordinator:
    if body.children is None and body.prompt is None:
        raise BadRequestError(
            "a pipeline needs children or a prompt to decompose", param="children", hint="send one of them"
        )
    policy = options_policy(request)
    for c in body.children or []:
        try:
            policy.check_domain(c.domain)
        except TaskError as exc:
            raise answer(exc) from None
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
    req = PipelineRequest(
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
        key=request.scope.get(API_KEY),
    )
    return Coordinator(gateway(request), req)


def _headers(coord: Coordinator) -> dict[str, str]:
    return {"X-Routeledger-Pipeline": coord.pipeline_id}


@router.post(
    "/v1/pipelines",
    responses={
        202: {"description": "the children are queued (`wait`: false)", "content": {"application/json": {}}},
        **documented(NATIVE, *SUBMITS),
    },
)
async def create_pipeline(body: PipelineCreate, request: Request) -> Response:
    """Run a pipeline. `wait` (default) answers when it finished, else 202 once its children are queued."""
    coord = coordinator(request, body)
    gw = gateway(request)
    # A pipeline is new work: refused near Redis's memory limit like a task (its children are
    # submitted by the coordinator, past the gateway's own check).
    await gw.retrying(gw.memory.admit)
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
    except TaskError as exc:
        log.info("background pipeline failed: %s", exc.message)
    except (RedisError, *TRANSIENT) as exc:
        log.warning("background pipeline lost Redis: %s", exc)


@router.get("/v1/pipelines/{pipeline_id}", responses=documented(NATIVE, 404, *READS))
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


def refuse_unsupported(messages: Sequence[Message], **sent: object) -> None:
    """The pipeline model answers prose from text: a request with images, a format or thinking
    (`sent`, by parameter name) is refused with a 400 rather than answered without them."""
    if any(m.images for m in messages):
        raise BadRequestError(
            f"the {PIPELINE_MODEL} model does not take images", param="messages", hint="choose another model"
        )
    for name, value in sent.items():
        if value is not None and value is not False:
            raise BadRequestError(
                f"the {PIPELINE_MODEL} model does not support {name}",
                param=name,
                hint=f"choose another model, or send the request without {name}",
            )


def pipeline_answer(request: Request, messages: Sequence[Message], max_tokens: int | None) -> Answer:
    """The answer of a chat request for the `pipeline` model: the last user message decomposed, the
    parts run in parallel, the integration's output streamed (or whole)."""
    prompt = next((m.content for m in reversed(messages) if m.role == "user" and m.content.strip()), None)
    if prompt is None:
        raise BadRequestError(
            "the pipeline model needs a user message to decompose", param="messages", hint="send one"
        )
    req = PipelineRequest(
        default_model=default_model(request),
        prompt=prompt,
        integration_max_tokens=max_tokens,
        client=request.headers.get("user-agent"),
        key=request.scope.get(API_KEY),
    )
    coord = Coordinator(gateway(request), req)

    def headers(result: Result | None) -> dict[str, str]:
        return _headers(coord)

    return Answer(
        ident=coord.pipeline_id,
        model=PIPELINE_MODEL,
        pieces=coord.items,
        whole=coord.whole,
        headers=headers,
        on_disconnect=coord.abort,
    )
