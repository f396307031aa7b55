"""The simulated models' tool-call rule.

When a request offers function tools to a model with the `tools` capability (Ollama's `tools` on
/api/chat; OpenAI's `tools`, unless `tool_choice` is "none"), the model answers as follows:

1. If the conversation ends with `tool` messages (results of earlier calls), it answers in prose
   that quotes each result: `The tool answered: "<result>".` (or JSON, when a format asks for it).
2. Otherwise it calls tools, with no content:
   - `tool_choice` naming a function: that function;
   - else every offered tool whose name occurs in the last user message (case-insensitively, with
     `_` also matching a space), in the order offered; with `parallel_tool_calls: false` only the
     first of them;
   - else the first tool offered.
   Each call's arguments are drawn from its `parameters` schema by sim.backends.schema (valid against
   its required properties and types), from a generator seeded by the request's seed, so that a
   seeded request gets the same call every time. The OpenAI id is `call_` and 24 hex digits from the
   same generator.

Ollama answers the calls in `message.tool_calls` (arguments as an object); OpenAI in `tool_calls`
(arguments as a JSON string, streamed as an `id`/name delta then argument chunks), with
`finish_reason: "tool_calls"`. A call costs its name and its arguments' JSON, four bytes a token, in
`eval_count` and decode time; the offered tools' JSON counts in the prompt.
"""

from __future__ import annotations

import json
import random
from typing import Any

from sim.backends.ask import Ask, ToolCall
from sim.backends.schema import schema_value
from sim.errors import BadRequestError


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """The names of offered function tools; a tool without one is a bad request."""
    names: list[str] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRequestError(
                f"tools[{i}] has no function name: give each tool "
                '{"type": "function", "function": {"name": …, "parameters": {…}}}'
            )
        names.append(name)
    return names


def chosen_tools(ask: Ask) -> list[dict[str, Any]]:
    """The tools the rule calls for `ask` (which offers tools and ends with no tool results)."""
    tools = ask.tools or []
    names = tool_names(tools)
    choice = ask.tool_choice
    if isinstance(choice, dict):
        function = choice.get("function")
        wanted = function.get("name") if isinstance(function, dict) else None
        if wanted not in names:
            raise BadRequestError(
                f"tool_choice names the function {wanted!r}, which is not among the tools offered "
                f"({', '.join(names)})"
            )
        return [tools[names.index(str(wanted))]]
    text = ask.last_user.lower()
    named = [
        tool
        for tool, name in zip(tools, names, strict=True)
        if name.lower() in text or name.lower().replace("_", " ") in text
    ]
    if not named:
        return tools[:1]
    return named if ask.parallel_tool_calls else named[:1]


def plan_calls(ask: Ask, rng: random.Random) -> list[ToolCall]:
    """The calls the model makes for `ask`, drawn from `rng`."""
    calls: list[ToolCall] = []
    for tool in chosen_tools(ask):
        function = tool["function"]
        parameters = function.get("parameters")
        arguments = schema_value(parameters, rng) if isinstance(parameters, dict) else {}
        if not isinstance(arguments, dict):
            arguments = {}
        text = json.dumps(arguments, ensure_ascii=False)
        pieces = [function["name"], *(text[i : i + 4] for i in range(0, len(text), 4))]
        calls.append(
            ToolCall(
                id=f"call_{rng.getrandbits(96):024x}",
                name=function["name"],
                arguments=arguments,
                pieces=pieces,
            )
        )
    return calls


def quote_results(results: list[str]) -> list[str]:
    """Tokens of a prose answer quoting each tool result."""
    text = " ".join(f'The tool answered: "{r}".' for r in results)
    words = text.split(" ")
    return [words[0], *(" " + w for w in words[1:])]
