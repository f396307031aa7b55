"""Decomposition: how a decomposer model is asked to split a request, and how its answer is read."""

from __future__ import annotations

import json
from typing import Final

from pipelines.errors import DecompositionError

DECOMPOSER_SYSTEM: Final = (
    "You split a request into independent sub-tasks that can be answered in parallel, each by "
    "someone who sees only that sub-task. Answer with JSON only, no prose: "
    '{"subtasks": ["<self-contained sub-prompt>", ...]} with between 2 and {most} sub-prompts.'
)
DECOMPOSER_RETRY: Final = (
    "That answer could not be used: {problem}. Answer again with JSON only, in exactly the form "
    '{{"subtasks": ["...", "..."]}}.'
)
# Backends get the shape as a schema (Ollama's structured outputs); the simulator answers JSON
# valid against it too (sim/backends/schema.py).
DECOMPOSER_FORMAT: Final = {
    "type": "object",
    "properties": {"subtasks": {"type": "array", "items": {"type": "string"}}},
    "required": ["subtasks"],
}
# Keys a decomposer might reasonably put its list under.
_LIST_KEYS: Final = ("subtasks", "sub_tasks", "tasks", "children", "prompts", "parts", "steps")


def decomposer_system(most: int) -> str:
    """The decomposer's system prompt, asking for at most `most` sub-prompts."""
    return DECOMPOSER_SYSTEM.replace("{most}", str(most))


def retry_prompt(problem: DecompositionError) -> str:
    """What the decomposer is told when its answer could not be used."""
    return DECOMPOSER_RETRY.format(problem=problem)


def parse_subtasks(text: str, most: int) -> list[str]:
    """The sub-prompts of a decomposer's answer: a JSON list of strings, or an object holding one."""
    body = text.strip()
    if body.startswith("```"):
        # Models fence JSON out of habit even in JSON mode.
        body = body.strip("`").removeprefix("json").strip()
    if not body:
        raise DecompositionError("the answer was empty")
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise DecompositionError(
            f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); it began {body[:40]!r}"
        ) from None
    items: object = data
    if isinstance(data, dict):
        items = next((data[k] for k in _LIST_KEYS if k in data), None)
        if items is None:
            raise DecompositionError(
                f"a JSON object without a list of sub-prompts (keys: {', '.join(sorted(data)) or 'none'})"
            )
    if not isinstance(items, list):
        raise DecompositionError(f"JSON {type(items).__name__}, not a list of sub-prompts")
    prompts: list[str] = []
    for i, item in enumerate(items):
        value = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(value, str) or not value.strip():
            raise DecompositionError(f"sub-prompt {i + 1} is not a non-empty string")
        prompts.append(value.strip())
    if not prompts:
        raise DecompositionError("an empty list of sub-prompts")
    if len(prompts) > most:
        raise DecompositionError(f"{len(prompts)} sub-prompts, more than the limit of {most}")
    return prompts
