"""Errors of the task store. Each says what went wrong and, in `hint`, what the caller can do about
it; the HTTP API turns each into its status code and each surface's error shape (api/errors.py),
as it does the dispatch layer's, whose base (dispatch.errors.DispatchError) is this one's.
"""

from __future__ import annotations

from typing import Any

from events.errors import RouteledgerError


class TaskError(RouteledgerError):
    """Raised when a task cannot be submitted, taken, awaited or changed as asked; base of the task
    store's errors and of the dispatch layer's."""

    def __init__(self, message: str, *, hint: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        # Plain data a client may act on (ids of what was queued, say), rendered with the error.
        self.extra = extra or {}


class QuotaExceededError(TaskError):
    """Raised when an API key is over one of its limits (requests per minute, tokens per day, tasks
    queued); `limit` names it and `retry_after_s` says when to try again."""

    def __init__(self, message: str, *, hint: str, limit: str, retry_after_s: int) -> None:
        super().__init__(message, hint=hint, extra={"limit": limit, "retry_after_s": retry_after_s})
        self.limit = limit
        self.retry_after_s = retry_after_s
