"""Tools on the API: checking what clients offer and send back, and spelling calls per surface.

Clients offer function tools in OpenAI's shape on both surfaces (`{"type": "function", "function":
{"name", "description", "parameters"}}`; the `ollama` client sends the same). A definition that is
not one is refused with a 400 that says which tool and what is wrong, before anything is queued.

A call travels as tasks.payload.ToolCall whatever the backend spoke, and each surface spells it
its own way: OpenAI's `tool_calls` (arguments as a JSON string; streamed as a delta with the call's
index, id and name, then a delta with its arguments), Ollama's `message.tool_calls` (arguments as
an object). So a request that came in on one surface is answered in that surface's shape whichever
backend ran it.
"""

from __future__ import annotations

import json
from typing import Any

from api.errors import BadRequestError
from tasks.payload import ToolCall

_TOOL_SHAPE = '{"type": "function", "function": {"name": "...", "parameters": {"type": "object", ...}}}'
# What OpenAI's tool_choice may be besides a named function.
_CHOICES = ("none", "auto", "required")


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """The offered tools, each checked to be a function definition; None when none is offered
    (an empty list offers nothing). BadRequestError naming the first malformed one."""
    if not tools:
        return None
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} is not an object")
        kind = tool.get("type", "function")
        if kind != "function":
            raise _bad(f"{where} has type {kind!r}: only function tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad(f"{where} has no `function` object")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise _bad(f"{where}.function has no name")
        if name in names:
            raise _bad(f"{where}: two tools are named {name!r}; give each tool its own name")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema object")
        if isinstance(parameters, dict) and parameters.get("type", "object") != "object":
            raise _bad(f"{where}.function.parameters must be a schema of type object")
    return [dict(t) for t in tools]


def check_tool_choice(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None
) -> str | dict[str, Any] | None:
    """OpenAI's `tool_choice`, checked against the tools offered."""
    if choice is None:
        return None
    if tools is None:
        raise BadRequestError(
            "tool_choice is only allowed when tools are offered",
            param="tool_choice",
            hint="send tools with it, or leave tool_choice out",
        )
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise BadRequestError(
                f"tool_choice {choice!r} is not one of {', '.join(_CHOICES)} or a named function",
                param="tool_choice",
            )
        return choice
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    offered = [t["function"]["name"] for t in tools]
    if choice.get("type", "function") != "function" or name not in offered:
        raise BadRequestError(
            f"tool_choice must name one of the tools offered ({', '.join(offered)})",
            param="tool_choice",
            hint='{"type": "function", "function": {"name": "..."}}',
        )
    return choice


def message_calls(raw: list[Any] | None) -> list[ToolCall] | None:
    """An assistant message's earlier calls, as either surface sends them back (OpenAI: arguments
    as a JSON string, with the call's id; Ollama: arguments as an object)."""
    if not raw:
        return None
    calls: list[ToolCall] = []
    for i, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            raise BadRequestError(
                f"tool_calls[{i}] of an assistant message has no function name",
                param="messages",
                hint='send each call back as the answer gave it: {"function": {"name", "arguments"}}',
            )
        arguments = function.get("arguments")
        if arguments is None:
            text = "{}"
        elif isinstance(arguments, str):
            text = arguments
        else:
            text = json.dumps(arguments, ensure_ascii=False)
        ident = call.get("id")
        calls.append(ToolCall(name=name, arguments=text, id=ident if isinstance(ident, str) else ""))
    return calls


# -- OpenAI ---------------------------------------------------------------------------------------


def openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's `message.tool_calls`."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def openai_deltas(calls: list[ToolCall], first: int) -> list[dict[str, Any]]:
    """The streamed `delta.tool_calls` entries of `calls`, numbered from index `first`: each call's
    index, id, type and name, then its arguments (clients join a call's argument deltas by index)."""
    deltas: list[dict[str, Any]] = []
    for index, c in enumerate(calls, first):
        deltas.append(
            {"index": index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
        )
        deltas.append({"index": index, "function": {"arguments": c.arguments}})
    return deltas


# -- Ollama ---------------------------------------------------------------------------------------


def ollama_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Ollama's `message.tool_calls` (with the call's id, which Ollama's own API also sends)."""
    return [{"id": c.id, "function": {"name": c.name, "arguments": c.arguments_object()}} for c in calls]


def _bad(message: str) -> BadRequestError:
    return BadRequestError(message, param="tools", hint=f"define each tool as {_TOOL_SHAPE}")
