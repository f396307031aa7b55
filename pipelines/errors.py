"""Errors of pipelines."""

from __future__ import annotations

from dispatch.errors import TaskFailedError
from events.errors import RouteledgerError


class DecompositionError(RouteledgerError):
    """Raised when a decomposer's answer is not a usable list of sub-prompts; says what is wrong."""


class PipelineFailedError(TaskFailedError):
    """Raised when a pipeline ends without an answer: a failed child (fail_fast), every child failed,
    the decomposer never gave a usable list, or the integration failed."""
