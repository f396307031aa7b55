"""The shipped benchmark prompt set and its reference check: what a grade is measured against.

Read by the projector, which takes a worker's grade only for a shipped prompt of its domain
(projections.ingest), and by dispatch, which sends the prompts (dispatch.benchmark). The set is
package data (benchset.toml beside this module).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Final

import msgspec

from projections.errors import BenchSetError

# The token budget of a benchmark answer. A thinking model (qwen3-class) reasons for a few hundred
# tokens before its one-word answer to these prompts; cut at 32 it never answers and grades 0. A
# model that answers at once stops after a few tokens, so the cap costs it nothing; a thinking one
# costs at most this many tokens per prompt (about 12 s at 83 tok/s, 90 s at 11 tok/s).
GRADE_MAX_TOKENS: Final = 1024
# The token budget of a speed benchmark's answer: long enough that its rate is the machine's, not
# the request's overhead or one slice of a shared CPU (128 tokens: 3.5 s at 37 tok/s, 11 s at 12).
SPEED_MAX_TOKENS: Final = 128
# The grader whose grades the schedule counts (a judge's are extra).
REFERENCE: Final = "reference"
_THINKING = re.compile(r"<think>.*?(</think>|\Z)", re.DOTALL)


class BenchPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """One shipped benchmark prompt with its reference check."""

    id: str
    domain: str
    prompt: str
    expect: list[str]
    # The canonical answer: the simulated backends answer with it when they answer right.
    answer: str = ""
    max_tokens: int = GRADE_MAX_TOKENS

    def passes(self, text: str) -> bool:
        """Whether `text` matches any of the expected patterns."""
        return any(re.search(pattern, text) for pattern in self.expect)


class SpeedPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """One shipped speed prompt: its answer runs long, and is never graded."""

    id: str
    prompt: str
    max_tokens: int = SPEED_MAX_TOKENS


class _Set(msgspec.Struct):
    prompt: list[BenchPrompt]
    speed: list[SpeedPrompt] = msgspec.field(default_factory=list)


def parse_benchset(text: str, source: str = "benchset.toml") -> list[BenchPrompt]:
    """Prompts from TOML text; a malformed set or a bad regex raises BenchSetError naming it."""
    try:
        prompts = msgspec.toml.decode(text, type=_Set).prompt
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BenchSetError(f"{source} is not a valid benchmark set: {exc}") from None
    for p in prompts:
        for pattern in p.expect:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise BenchSetError(f"{source}: prompt {p.id} has a bad regex {pattern!r}: {exc}") from None
    return prompts


@cache
def _shipped() -> _Set:
    text = (resources.files("projections") / "benchset.toml").read_text(encoding="utf-8")
    try:
        return msgspec.toml.decode(text, type=_Set)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BenchSetError(f"benchset.toml is not a valid benchmark set: {exc}") from None


@cache
def benchset() -> tuple[BenchPrompt, ...]:
    """The graded prompts shipped in projections/benchset.toml (package data)."""
    text = (resources.files("projections") / "benchset.toml").read_text(encoding="utf-8")
    return tuple(parse_benchset(text))


@cache
def speed_prompts() -> tuple[SpeedPrompt, ...]:
    """The speed prompts shipped in projections/benchset.toml."""
    return tuple(_shipped().speed)


def pick_speed(count: int, start: int = 0) -> list[SpeedPrompt]:
    """`count` speed prompts, rotating from `start`."""
    pool = speed_prompts()
    return [pool[(start + i) % len(pool)] for i in range(count)]


def prompt_by_id(prompt_id: str) -> BenchPrompt | None:
    return next((p for p in benchset() if p.id == prompt_id), None)


def domains() -> list[str]:
    return sorted({p.domain for p in benchset()})


def final_answer(text: str) -> str:
    """The answer without a thinking model's reasoning (`<think>…</think>`, or an unclosed one cut
    off by the budget): what it reasons about is not what it answers."""
    return _THINKING.sub("", text)


def grade(prompt: BenchPrompt, answer: str) -> float:
    """1.0 when the final answer matches any of the prompt's expected patterns, else 0.0."""
    return 1.0 if prompt.passes(final_answer(answer)) else 0.0
