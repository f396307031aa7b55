"""Ollama's wire format where more than one side of routeledger writes it: the API's
Ollama-compatible surface and the simulated Ollama machines answer with the same pieces."""

from __future__ import annotations

import time
from typing import Any, Final, Protocol

# The Ollama API version both follow (clients check that it is recent enough).
OLLAMA_VERSION: Final = "0.12.3"


class ReportedTimings(Protocol):
    """The durations (ns) and counts Ollama reports with the last chunk of a generation."""

    @property
    def total_duration(self) -> int | None: ...
    @property
    def load_duration(self) -> int | None: ...
    @property
    def prompt_eval_count(self) -> int | None: ...
    @property
    def prompt_eval_duration(self) -> int | None: ...
    @property
    def eval_count(self) -> int | None: ...
    @property
    def eval_duration(self) -> int | None: ...


def rfc3339(epoch_s: float | None = None) -> str:
    """A time as Ollama writes `created_at`: UTC with microseconds (now, when not given)."""
    t = time.time() if epoch_s is None else epoch_s
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f"{t % 1:.6f}"[1:] + "Z"


def final_fields(done_reason: str | None, t: ReportedTimings) -> dict[str, Any]:
    """The fields that close a generation: `done`, why, and every count and duration that is known
    (an unknown one is left out, never sent as 0)."""
    out: dict[str, Any] = {
        "done": True,
        "done_reason": done_reason or "stop",
        "total_duration": t.total_duration,
        "load_duration": t.load_duration,
        "prompt_eval_count": t.prompt_eval_count,
        "prompt_eval_duration": t.prompt_eval_duration,
        "eval_count": t.eval_count,
        "eval_duration": t.eval_duration,
    }
    return {k: v for k, v in out.items() if v is not None}
