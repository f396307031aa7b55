"""Errors the API answers with, and how each client family expects to read them.

Every error is an ApiError with an HTTP status, a type, a message and a hint. The native API
renders it as `{"error": {"type", "message", "hint"}}`; the OpenAI-compatible endpoints as
OpenAI does (`{"error": {"message", "type", "param", "code"}}`); the Ollama-compatible ones as
Ollama does (`{"error": "..."}`), so that each client library raises its own error type.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import msgspec

from dispatch.errors import (
    CapabilityMissingError,
    ModelNotServedError,
    QueueFullError,
    RedisMemoryFullError,
    RedisUnavailableError,
    RequestRefusedError,
    ResponseFormatError,
    TaskFailedError,
    TaskFinishedError,
    TaskLostError,
    TaskNotFoundError,
    TaskRefusedError,
    TaskTimeoutError,
)
from dispatch.serving import catalog, describe_fleet
from events.errors import RouteledgerError
from tasks.errors import QuotaExceededError, TaskError
from tasks.lease import LeaseInfo

NATIVE: Final = "native"
OPENAI: Final = "openai"
OLLAMA: Final = "ollama"


class ApiError(RouteledgerError):
    """Raised when a request cannot be served; the base of every error the API answers with."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    # OpenAI's `code` for the same condition, where it has one.
    openai_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.param = param
        self.headers = headers or {}
        self.extra = extra or {}


class BadRequestError(ApiError):
    """Raised when a request is well-formed JSON but asks for something impossible (empty messages)."""

    status = 400
    type = "invalid_request"
    openai_code = "invalid_request_error"


class UnauthorizedError(ApiError):
    """Raised when API keys are configured and the request carries none or a wrong one."""

    status = 401
    type = "unauthorized"
    openai_code = "invalid_api_key"


class ForbiddenError(ApiError):
    """Raised when a request comes to a host name, or from a browser origin, the API does not serve."""

    status = 403
    type = "forbidden"
    openai_code = "forbidden"


class ClientGoneError(ApiError):
    """Raised when a client stopped waiting for its answer (it disconnected); nobody reads the reply."""

    # nginx's "client closed request": no client sees it, access logs and metrics do.
    status = 499
    type = "client_closed_request"


class NotFoundError(ApiError):
    """Raised when a task, route or other named thing does not exist."""

    status = 404
    type = "not_found"


class ModelNotFoundError(ApiError):
    """Raised when no live worker serves the model a request names; the message lists what is served."""

    status = 404
    type = "model_not_found"
    openai_code = "model_not_found"


class MethodNotAllowedError(ApiError):
    """Raised when a path exists but not with the request's method; `Allow` lists the ones it has."""

    status = 405
    type = "method_not_allowed"
    openai_code = "method_not_allowed"


class ConflictError(ApiError):
    """Raised when a request conflicts with the task's state (cancelling a finished task)."""

    status = 409
    type = "conflict"


class PayloadTooLargeError(ApiError):
    """Raised when a request body, or its list of messages, is over the configured limit."""

    status = 413
    type = "payload_too_large"
    openai_code = "request_too_large"


class UnsupportedMediaTypeError(ApiError):
    """Raised when a request body is sent as anything but `Content-Type: application/json`."""

    status = 415
    type = "unsupported_media_type"
    openai_code = "invalid_request_error"


class UnprocessableError(ApiError):
    """Raised when a request body does not match the endpoint's schema (wrong types, missing fields)."""

    status = 422
    type = "validation_error"
    openai_code = "invalid_request_error"


class RateLimitedError(ApiError):
    """Raised when the request's API key is over one of its limits; the body names the limit and
    Retry-After says when to try again."""

    status = 429
    type = "rate_limited"
    openai_code = "rate_limit_exceeded"


class QueueDepthError(ApiError):
    """Raised when the model's queue is at max_queue_depth; the body names the cap."""

    status = 503
    type = "queue_full"


class GenerationError(ApiError):
    """Raised when a task ended without an answer: it failed, was dead-lettered or cancelled."""

    status = 502
    type = "generation_failed"


class UnavailableError(ApiError):
    """Raised when Redis cannot be reached within the retry budget; the client should retry later."""

    status = 503
    type = "unavailable"


class LostTaskError(ApiError):
    """Raised when an accepted task was lost by Redis (a failover) before it ran; the client should
    submit it again."""

    status = 503
    type = "task_lost"


class MemoryFullError(ApiError):
    """Raised when Redis is too close to its memory limit to take new work; accepted work goes on."""

    status = 503
    type = "redis_memory_full"


class WaitTimeoutError(ApiError):
    """Raised when a task did not finish within the time the API waits for it."""

    status = 504
    type = "timeout"


_enc: Final = msgspec.json.Encoder()

# How each condition the dispatch layer reports is answered over HTTP.
_ANSWERS: Final[dict[type[TaskError], type[ApiError]]] = {
    TaskNotFoundError: NotFoundError,
    TaskFinishedError: ConflictError,
    TaskFailedError: GenerationError,
    TaskRefusedError: BadRequestError,
    TaskTimeoutError: WaitTimeoutError,
    RedisUnavailableError: UnavailableError,
    RedisMemoryFullError: MemoryFullError,
    TaskLostError: LostTaskError,
}
# Seconds a client is told to wait before trying again, per condition.
_RETRY_AFTER: Final[dict[type[TaskError], str]] = {
    RedisUnavailableError: "2",
    RedisMemoryFullError: "30",
    TaskLostError: "1",
}


def answer(exc: TaskError) -> ApiError:
    """The HTTP error that answers a task store's or dispatch error, with its message, hint and extra data."""
    if isinstance(exc, ModelNotServedError):
        return model_not_found(exc.model, exc.fleet if isinstance(exc.fleet, dict) else {})
    if isinstance(exc, RequestRefusedError):
        return BadRequestError(exc.message, hint=exc.hint, param=exc.param, extra=exc.extra)
    if isinstance(exc, QuotaExceededError | QueueFullError):
        kind_ = RateLimitedError if isinstance(exc, QuotaExceededError) else QueueDepthError
        return kind_(
            exc.message,
            hint=exc.hint,
            param=str(exc.extra["limit"]),
            headers={"Retry-After": str(exc.retry_after_s)},
            extra=exc.extra,
        )
    if isinstance(exc, CapabilityMissingError | ResponseFormatError):
        return BadRequestError(exc.message, hint=exc.hint, param=exc.param, extra=exc.extra)
    kind = next((api for cls, api in _ANSWERS.items() if isinstance(exc, cls)), GenerationError)
    retry = next((after for cls, after in _RETRY_AFTER.items() if isinstance(exc, cls)), None)
    headers = {"Retry-After": retry} if retry is not None else None
    return kind(exc.message, hint=exc.hint, headers=headers, extra=exc.extra)


def model_not_found(model: str, leases: dict[str, LeaseInfo]) -> ModelNotFoundError:
    """404 naming what the live fleet serves, so that a client can pick another model."""
    names = [m.name for m in catalog(leases)]
    available = ", ".join(names) if names else "none (no live worker serves anything)"
    return ModelNotFoundError(
        f"model {model!r} is not served by any live worker; available: {available}",
        hint=f"fleet: {describe_fleet(leases)}",
        param="model",
        extra={"available": names},
    )


def render(exc: ApiError, surface: str) -> bytes:
    """The JSON body of `exc` in the shape the clients of `surface` expect."""
    if surface == OLLAMA:
        message = exc.message if exc.hint is None else f"{exc.message} ({exc.hint})"
        return _enc.encode({"error": message})
    if surface == OPENAI:
        message = exc.message if exc.hint is None else f"{exc.message}. {exc.hint}"
        return _enc.encode(
            {
                "error": {
                    "message": message,
                    "type": _openai_type(exc),
                    "param": exc.param,
                    "code": exc.openai_code or exc.type,
                }
            }
        )
    return _enc.encode({"error": {"type": exc.type, "message": exc.message, "hint": exc.hint, **exc.extra}})


def malformed_json() -> BadRequestError:
    """A body that is not JSON at all."""
    return BadRequestError("the body is not valid JSON", hint="send a JSON object")


def too_deep(limit: int) -> BadRequestError:
    """A body nested deeper than the API reads: refused by depth, never by running out of stack."""
    return BadRequestError(
        f"the body is not valid JSON for this API: it nests arrays and objects more than {limit} deep",
        hint=f"send a flatter body (at most {limit} levels of arrays and objects)",
    )


def _openai_type(exc: ApiError) -> str:
    # OpenAI's `type` is a coarse family; clients branch on the status code and `code`.
    if exc.status in (400, 404, 405, 409, 413, 415, 422):
        return "invalid_request_error"
    if exc.status == 401:
        return "authentication_error"
    if exc.status == 403:
        return "permission_error"
    if exc.status == 429:
        return "rate_limit_error"
    return "server_error" if exc.status >= 500 else "api_error"


def surface_of(path: str) -> str:
    """Which client family a path belongs to, for the shape of its errors."""
    if path.startswith("/api/"):
        return OLLAMA
    if path.startswith(("/v1/chat/", "/v1/completions", "/v1/models", "/v1/embeddings")):
        return OPENAI
    return NATIVE


# -- the error shapes in the OpenAPI document --------------------------------------------------------
# What render() writes, as schemas: each route documents its errors in its surface's shape.


class NativeErrorDetail(msgspec.Struct, kw_only=True):
    """What went wrong; some errors add data of their own (`available` models, the `limit` hit…)."""

    type: str
    message: str
    hint: str | None


class NativeError(msgspec.Struct, kw_only=True):
    """An error of the native API (and of the fleet, pipeline, dashboard and operations routes)."""

    error: NativeErrorDetail


class OpenAIErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str


class OpenAIError(msgspec.Struct, kw_only=True):
    """An error as OpenAI's API answers it (the `openai` client raises it as its own error)."""

    error: OpenAIErrorDetail


class OllamaError(msgspec.Struct, kw_only=True):
    """An error as Ollama answers it."""

    error: str


_SHAPES: Final[dict[str, type[msgspec.Struct]]] = {
    NATIVE: NativeError,
    OPENAI: OpenAIError,
    OLLAMA: OllamaError,
}
# What a route that reads Redis may answer besides its own errors; what one that submits a task may.
READS: Final = (503,)
SUBMITS: Final = (400, 404, 413, 422, 429, 502, 503, 504)
_REF: Final = "#/components/schemas/{name}"
# Why each status may be answered, as the document says it.
_WHY: Final[dict[int, str]] = {
    400: "malformed JSON, a body nested too deep, or a request the fleet cannot serve as asked "
    "(see the message)",
    401: "missing or wrong API key (only where keys are configured)",
    403: "a host name or web origin this API does not answer to",
    404: "nothing by that name (model, task, pipeline)",
    409: "the task has finished already",
    413: "the body, or its list of messages, is over the configured limit",
    415: "the body is not sent as application/json",
    422: "a body or a parameter of the wrong type or out of range",
    429: "the API key is over one of its limits (see Retry-After)",
    502: "the task ended without an answer",
    503: "Redis is unreachable or near its memory limit, or the model's queue is full (see Retry-After)",
    504: "the answer did not come within the time the API waits",
}


def error_schemas() -> dict[str, Any]:
    """The OpenAPI component schemas of the three error shapes."""
    _, components = msgspec.json.schema_components(tuple(_SHAPES.values()), ref_template=_REF)
    return components


def documented(surface: str, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses`: each status with its reason, in the error shape of `surface`. The
    guard's own (401, 403, 413, 415) are added to every route by api.app."""
    ref = {"$ref": _REF.format(name=_SHAPES[surface].__name__)}
    return {
        status: {"description": _WHY[status], "content": {"application/json": {"schema": ref}}}
        for status in statuses
    }


# One Server-Sent Event, as a client reads it off the stream.
SSE_EVENT: Final = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}},
}


def streamed(media_type: str, status: int = 200) -> dict[int | str, dict[str, Any]]:
    """A route's `responses` for an answer that comes whole as JSON or, when asked, streamed."""
    # Before OpenAPI 3.2, an event stream's schema is that of each event.
    stream = {"schema": SSE_EVENT} if media_type == "text/event-stream" else {}
    return {
        status: {
            "description": f"the answer: whole, or streamed as {media_type} when the request asks",
            "content": {"application/json": {"schema": {}}, media_type: stream},
        }
    }
