"""OpenAI's `response_format` in Ollama's terms (`format`): the one translation of it, for the API's
OpenAI surface (a task carries `format` to whichever backend serves it) and for the simulated
hosts' OpenAI endpoint, so that both accept and refuse the same requests in the same words."""

from __future__ import annotations

from typing import Any, Final

from dispatch.errors import ResponseFormatError

HINT: Final = (
    'send {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}}}'
)


def ollama_format(response_format: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`response_format` as Ollama's `format`: "json" for `json_object`, the schema itself for
    `json_schema`, None for `text` (or none sent). ResponseFormatError for anything else."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ResponseFormatError(
                "response_format json_schema needs its schema in json_schema.schema (an object)", hint=HINT
            )
        return schema
    raise ResponseFormatError(
        f"response_format type {kind!r} is not one of text, json_object, json_schema", hint=HINT
    )
