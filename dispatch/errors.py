"""Errors of the dispatch layer: submitting, waiting on, relaying, cancelling and looking up tasks.

Each says what went wrong and, in `hint`, what the caller can do about it; the HTTP API turns
each into its status code and each surface's error shape (api/errors.py).
"""

from __future__ import annotations

from typing import Any

from tasks.errors import TaskError


class DispatchError(TaskError):
    """Raised when a task cannot be submitted, awaited or changed as asked; base of this layer's
    errors (the task store's own, such as a key over its quota, share its base, TaskError)."""


class ModelNotServedError(DispatchError):
    """Raised when no live worker serves the model a request names."""

    def __init__(self, message: str, *, model: str, fleet: object = None) -> None:
        super().__init__(message)
        self.model = model
        # The leases the model was looked for in (dict[str, LeaseInfo]), when the raiser had them.
        self.fleet = fleet


class RequestRefusedError(DispatchError):
    """Raised when a request names an option or a domain the configuration does not accept; `param`
    says which."""

    def __init__(
        self, message: str, *, param: str, hint: str | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message, hint=hint, extra=extra)
        self.param = param


class CapabilityMissingError(DispatchError):
    """Raised when a request needs a capability (tools, vision, thinking) that every live holder of
    its model says the model lacks; `param` names what in the request needs it."""

    def __init__(self, message: str, *, param: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.param = param


class ResponseFormatError(DispatchError):
    """Raised when OpenAI's `response_format` is not one a backend can be asked for: a type other
    than text, json_object and json_schema, or a json_schema without its schema; `param` names it."""

    param = "response_format"


class TaskNotFoundError(DispatchError):
    """Raised when a task id names no task that Redis or the ledger still knows."""


class TaskFinishedError(DispatchError):
    """Raised when a change is asked of a task that already has its outcome (cancelling a done task)."""


class TaskFailedError(DispatchError):
    """Raised when a task (or a pipeline) ended without an answer: failed, dead-lettered, cancelled, or
    re-run after its streamed output had started."""


class TaskRefusedError(DispatchError):
    """Raised when a task's backend refused the request itself (a 4xx, or a 501 for what its server
    cannot do, such as embeddings from a llama-server started without --embeddings): the client
    asked for something that machine cannot serve, and asking again would not help."""


class TaskTimeoutError(DispatchError):
    """Raised when a task did not finish within the time its caller waits for it."""


class TaskLostError(DispatchError):
    """Raised when a task that was acknowledged is gone from Redis with no outcome (a failover lost
    the writes that queued it); the caller should submit it again."""


class RedisUnavailableError(DispatchError):
    """Raised when Redis cannot be reached within the retry budget; the caller should try again later."""


class RedisMemoryFullError(DispatchError):
    """Raised when Redis is past the memory high-water mark (or refused a write: OOM), so a new task is
    refused while there is still room for the accepted ones to finish."""


class QueueFullError(DispatchError):
    """Raised when a model's queue holds as many tasks as max_queue_depth allows; new ones wait outside."""

    def __init__(self, message: str, *, hint: str, cap: int, retry_after_s: int) -> None:
        super().__init__(
            message, hint=hint, extra={"limit": "max_queue_depth", "cap": cap, "retry_after_s": retry_after_s}
        )
        self.cap = cap
        self.retry_after_s = retry_after_s


class WakeError(DispatchError):
    """Raised when a sleeping machine cannot be woken as asked: no record, a malformed MAC address, or
    the magic packet refused by the network."""
