"""The FastAPI application: factory, middleware, error handlers, and the operations endpoints.

It keeps no state of its own beyond connections and short caches, so several can run behind a
balancer. The surfaces live in their own modules (native, openai, ollama, fleet, pipelines,
dashboard); what they share lives in common.py, and everything below HTTP in dispatch/.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match, Route

from api import dashboard, embeddings, fleet, native, ollama, openai, pipelines, pulls
from api.auth import BODY_METHODS, OLLAMA_PATHS, OPEN_PATHS, Guard
from api.common import JSON, RequestLimits
from api.errors import (
    NATIVE,
    ApiError,
    BadRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    UnprocessableError,
    answer,
    documented,
    error_schemas,
    malformed_json,
    render,
    surface_of,
    too_deep,
)
from api.metrics import CONTENT_TYPE, Metrics
from api.schemas import MAX_DEPTH, TOO_DEEP, options_schema, refine
from dispatch.gateway import TRANSIENT, Gateway, unavailable
from dispatch.memory import archive_info
from dispatch.options import DEFAULT_DOMAINS, DEFAULT_MAX_NUM_CTX, OptionsPolicy
from events.connection import is_cluster_url, redis_client
from events.keys import DEFAULT_PREFIX, Keys
from projections.benchset import domains as bench_domains
from projections.errors import ProjectionError
from projections.reader import lag
from tasks.errors import TaskError
from tasks.quota import ApiKey, named_keys

log = logging.getLogger("routeledger.api")


# Every surface's routes, included without a prefix, in this order.
ROUTERS: Final = (
    native.router,
    openai.router,
    ollama.router,
    pulls.router,
    embeddings.router,
    fleet.router,
    pipelines.router,
    dashboard.router,
)


class AppConfig(msgspec.Struct, kw_only=True):
    """What the API needs to know; built by the composition root."""

    redis_url: str
    prefix: str = DEFAULT_PREFIX
    # Plain keys (named key-1, key-2… in order, no limits) and named keys with limits.
    api_keys: list[str] = msgspec.field(default_factory=list)
    keys: list[ApiKey] = msgspec.field(default_factory=list)
    # Most tasks one model's queue holds (all its bands together); past it a submission is a 503.
    max_queue_depth: int = 10_000
    max_body_bytes: int = 4 * 1024 * 1024
    max_messages: int = 256
    # How long a non-streaming request waits for its task before answering 504.
    wait_timeout_s: float = 600.0
    # Longest a task may wait for a worker before it expires unrun (a waiting client's, sooner).
    max_queue_s: float = 3_600.0
    # How long a request retries while Redis is unreachable before answering 503.
    retry_budget_s: float = 1.5
    # Each waiting or streaming request blocks one connection on its output stream.
    redis_max_connections: int = 2048
    # The model of a pipeline's decomposer, children and integration when a request names none.
    pipeline_model: str = "auto"
    # Host names the API answers to besides loopback's (api/auth.py); `*`: any.
    allowed_hosts: list[str] = msgspec.field(default_factory=list)
    # Web origins besides the API's own whose pages may call it; `*`: any.
    allowed_origins: list[str] = msgspec.field(default_factory=list)
    # The address the server binds: a host name it answers to too, unless it binds every interface.
    bound_host: str | None = None
    # The domains a request may name; whether runtime options are accepted (dispatch/options.py).
    domains: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_DOMAINS))
    allow_runtime_options: bool = False
    max_num_ctx: int = DEFAULT_MAX_NUM_CTX
    # Price what workers' slots hold of a prompt (router.prefix); False: every prompt is uncached.
    prefix_pricing: bool = True
    # Streamed answers are placed for their readers (router.plan, BacklogEntry.paced); False: by finish.
    paced_streams: bool = False


def create_app(config: AppConfig) -> FastAPI:
    """The API application over the Redis at `config.redis_url`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = redis_client(
            config.redis_url, socket_timeout=5, max_connections=config.redis_max_connections
        )
        keys = Keys(config.prefix, cluster=is_cluster_url(config.redis_url))
        app.state.redis = client
        app.state.keys = keys
        app.state.gateway = Gateway(
            client,
            keys,
            retry_budget_s=config.retry_budget_s,
            wait_timeout_s=config.wait_timeout_s,
            max_queue_s=config.max_queue_s,
            max_queue_depth=config.max_queue_depth,
            keyed=bool(api_keys),
            prefix_pricing=config.prefix_pricing,
            paced_streams=config.paced_streams,
        )
        app.state.gateway.on_lost = lambda _task_id: metrics.tasks_lost.inc()
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="routeledger", version="0.1.0", lifespan=lifespan)
    api_keys = named_keys(config.api_keys, config.keys)
    app.state.api_keys = api_keys
    metrics = Metrics()
    app.state.metrics = metrics
    app.state.pipeline_model = config.pipeline_model
    app.state.limits = RequestLimits(max_body_bytes=config.max_body_bytes, max_messages=config.max_messages)
    app.state.options = OptionsPolicy(
        domains=tuple(config.domains),
        allow_runtime_options=config.allow_runtime_options,
        max_num_ctx=config.max_num_ctx,
    )
    # The shell is inside the guard (added first): its page loads only under an allowed host name,
    # and without a key (a browser cannot send one with a page load; with keys configured the shell
    # holds no data).
    app.add_middleware(dashboard.Shell, keyed=bool(api_keys))
    app.add_middleware(
        Guard,
        api_keys=api_keys,
        max_body_bytes=config.max_body_bytes,
        metrics=metrics,
        allowed_hosts=config.allowed_hosts,
        allowed_origins=config.allowed_origins,
        bound_host=config.bound_host,
        pages=dashboard.SHELL_PATHS,
    )
    _handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    _document(app, keyed=bool(api_keys), policy=app.state.options, max_messages=config.max_messages)

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> JSON:
        """The process is up; says nothing of Redis."""
        return JSON({"status": "ok"})

    @app.get(
        "/readyz",
        tags=["operations"],
        responses={503: {"description": "Redis does not answer", "content": {"application/json": {}}}},
    )
    async def readyz() -> JSON:
        """Ready when Redis answers; reports how far the projector lags behind the ledger, Redis's
        memory against its limit (with a warning from 80%; new tasks are refused from 95%) and the
        archive's last run."""
        client: aioredis.Redis = app.state.redis
        try:
            await client.ping()
        except (RedisError, *TRANSIENT) as exc:
            return JSON(
                {"status": "unavailable", "redis": "unreachable", "detail": str(exc) or type(exc).__name__},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        projector: dict[str, Any]
        try:
            entries, ms = await lag(client, app.state.keys)
            projector = {"lag_entries": entries, "lag_ms": ms}
        except ProjectionError as exc:
            projector = {"lag_entries": None, "lag_ms": None, "detail": str(exc)}
        gw: Gateway = app.state.gateway
        memory = await gw.retrying(gw.memory.state)
        archive = await gw.retrying(lambda: archive_info(client, app.state.keys))
        return JSON(
            {
                "status": "ready",
                "redis": "ok",
                "projector": projector,
                "memory": memory.to_dict(),
                "archive": archive.to_dict(),
            }
        )

    @app.get(
        "/metrics",
        tags=["operations"],
        response_class=Response,
        responses={
            200: {"description": "Prometheus's text format", "content": {CONTENT_TYPE: {}}},
            **documented(NATIVE, 503),
        },
    )
    async def prometheus() -> Response:
        """Prometheus metrics: requests and latency by route and model, queues, workers, projector,
        Redis memory, the ledger's length, the archive, and each API key's use."""
        gw: Gateway = app.state.gateway
        leases = await gw.retrying(lambda: gw.fleet.leases(fresh=True))
        memory = await gw.retrying(gw.memory.state)
        usage = await gw.retrying(lambda: gw.quotas.usage(api_keys))
        body = await gw.retrying(
            lambda: metrics.scrape(app.state.redis, app.state.keys, leases, memory, usage)
        )
        return Response(body, media_type=CONTENT_TYPE)

    return app


def _document(app: FastAPI, *, keyed: bool, policy: OptionsPolicy, max_messages: int) -> None:
    """FastAPI's OpenAPI document, completed once (FastAPI keeps it as app.openapi_schema) with
    what it cannot know: see _complete."""

    made = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _complete(made(), keyed=keyed, policy=policy, max_messages=max_messages)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# FastAPI's own schema of a 422, which this API never answers (its handler below answers in the
# surface's shape).
_FASTAPI_422: Final = ("HTTPValidationError", "ValidationError")


def _complete(doc: dict[str, Any], *, keyed: bool, policy: OptionsPolicy, max_messages: int) -> None:
    """The error shapes beside the bodies' schemas; what the bodies' checks refuse under
    this configuration (api.schemas.refine); on every operation, the answers of the guard in front
    of all of them (api.auth: 401 where keys are configured, 403, 413, and 415 for a body that must
    be JSON), and each 422 in the surface's shape rather than FastAPI's."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(error_schemas())
    for name in _FASTAPI_422:
        schemas.pop(name, None)
    refine(
        schemas,
        domains=policy.domains,
        bench_domains=bench_domains(),
        options=options_schema(policy),
        max_messages=max_messages,
    )
    for parameter in doc["paths"].get("/v1/route/preview", {}).get("get", {}).get("parameters", []):
        if parameter.get("name") == "domain":
            parameter["schema"]["enum"] = list(policy.domains)
    if keyed:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc.get("paths", {}).items():
        surface = surface_of(path)
        for method, operation in operations.items():
            responses: dict[str, Any] = operation.setdefault("responses", {})
            if "HTTPValidationError" in str(responses.get("422", "")):
                responses["422"] = documented(surface, 422)[422]
            guard = [403, 413]
            if keyed and path not in OPEN_PATHS:
                guard.append(401)
                operation["security"] = [{"bearer": []}]
            # A body sent as anything but JSON, outside Ollama's routes (which read any body as JSON).
            if method.upper() in BODY_METHODS and not path.startswith(OLLAMA_PATHS):
                guard.append(415)
            for status, response in documented(surface, *guard).items():
                responses.setdefault(str(status), response)
            # In order of status, as FastAPI lists its own.
            operation["responses"] = dict(sorted(responses.items()))


def _error_response(request: Request, exc: ApiError) -> Response:
    return Response(
        render(exc, surface_of(request.url.path)),
        status_code=exc.status,
        media_type="application/json",
        headers=exc.headers,
    )


def _methods(request: Request) -> list[str]:
    """Every method of the request's path. Starlette names only the first route that matched the
    path, and a path's methods are often routes of their own (GET and DELETE /v1/tasks/{id})."""
    # From the routers as declared: FastAPI keeps an included router as an internal wrapper.
    routes = [*request.app.router.routes, *(route for router in ROUTERS for route in router.routes)]
    methods: set[str] = set()
    for route in routes:
        if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    return sorted(methods)


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(request, exc)

    @app.exception_handler(TaskError)
    async def dispatch_error(request: Request, exc: TaskError) -> Response:
        return _error_response(request, answer(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _error_response(request, malformed_json())
        if any(e.get("type") == TOO_DEEP for e in errors):
            return _error_response(request, too_deep(MAX_DEPTH))
        # Only where and what, never the value: a value may be a prompt.
        parts = [
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:5]
        ]
        param = ".".join(str(p) for p in errors[0].get("loc", ())[1:]) if errors else None
        return _error_response(
            request, UnprocessableError("; ".join(parts), hint="see the schema at /docs", param=param or None)
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if isinstance(exc.__cause__, ApiError):
            # FastAPI wraps an error raised while it reads the body (the guard's size limit).
            return _error_response(request, exc.__cause__)
        err: ApiError
        if exc.status_code == 404:
            err = NotFoundError(f"no route {request.method} {request.url.path}", hint="see /docs")
        elif exc.status_code == 413:
            err = PayloadTooLargeError(str(exc.detail))
        elif isinstance(exc.__cause__, RecursionError):
            # Python's JSON parser (FastAPI's, for the pydantic bodies) ran out of stack.
            err = too_deep(MAX_DEPTH)
        elif exc.status_code == 400 and isinstance(exc.__cause__, ValueError):
            # Not JSON in a way Python's parser does not call a JSONDecodeError (bytes not UTF-8).
            err = malformed_json()
        elif exc.status_code == 405:
            allowed = _methods(request)
            if request.method == "OPTIONS":
                # What OPTIONS is for (RFC 9110): the methods of the path, itself included.
                return Response(status_code=204, headers={"Allow": ", ".join([*allowed, "OPTIONS"])})
            err = MethodNotAllowedError(
                f"{request.url.path} takes {', '.join(allowed)}, not {request.method}",
                headers={"Allow": ", ".join(allowed)},
            )
        else:
            err = BadRequestError(str(exc.detail))
            return Response(
                render(err, surface_of(request.url.path)),
                status_code=exc.status_code,
                media_type="application/json",
                headers=dict(exc.headers or {}),
            )
        return _error_response(request, err)

    @app.exception_handler(RedisError)
    async def redis_down(request: Request, exc: RedisError) -> Response:
        log.warning("Redis error on %s: %s", request.url.path, exc)
        return _error_response(request, answer(unavailable(exc)))

    @app.exception_handler(ConnectionError)
    async def connection_down(request: Request, exc: ConnectionError) -> Response:
        return _error_response(request, answer(unavailable(exc)))
