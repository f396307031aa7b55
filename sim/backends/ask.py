"""What one generation request asks of a simulated model, in terms common to Ollama's and OpenAI's
APIs, and the shape of the answer the model plans for it.

The HTTP layer (sim/backends/host.py) reads a request into an `Ask`; the machine
(sim/backends/machine.py) checks it against the model's capabilities and plans an `Answer`; the
wire formats (sim/backends/formats.py) spell that answer in each API's own shape.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

# Prompt tokens an image costs a `vision` model (one 336-pixel tile of a CLIP-style encoder: 24 x 24
# patches), in `prompt_eval_count` and in prompt-evaluation time.
IMAGE_TOKENS: Final = 576


class Ask(msgspec.Struct, kw_only=True):
    """One chat or generate request, read from either API."""

    model: str
    # The whole input as text (system, history, the last message).
    prompt: str
    # The text of the last user message (the benchmark prompts are recognised by it).
    last_user: str
    seed: int | None = None
    max_tokens: int | None = None
    keep_alive: object = None
    # Nothing to generate: the request only loads (or, with keep_alive 0, unloads) the model.
    load_only: bool = False
    # None: prose; "json": any JSON (JSON mode); a dict: a JSON schema the answer must satisfy.
    format: str | dict[str, Any] | None = None
    # Function tools offered, each `{"type": "function", "function": {"name", "parameters", …}}`.
    tools: list[dict[str, Any]] | None = None
    # OpenAI's `tool_choice`: "none", "auto", "required" or `{"function": {"name": …}}`.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # The contents of the tool messages that end the conversation (results of earlier calls).
    tool_results: list[str] = msgspec.field(default_factory=list)
    # How many images the request carries (already checked to be inline base64).
    images: int = 0
    # The request asked the model to think (Ollama's truthy `think`, OpenAI's `reasoning_effort`).
    think: bool = False
    # How the API calls the generation, for Ollama's "does not support chat/generate".
    surface: str = "chat"

    @property
    def wants_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class ToolCall(msgspec.Struct, kw_only=True, frozen=True):
    """One call the model makes: the function, its arguments, and the id OpenAI's API reports."""

    id: str
    name: str
    arguments: dict[str, Any]
    # The call as the model emits it: the name, then the arguments' JSON in pieces (one token each).
    pieces: list[str]

    @property
    def arguments_json(self) -> str:
        return "".join(self.pieces[1:])


class Answer(msgspec.Struct, kw_only=True):
    """The tokens a model will emit for an `Ask`, in order: thinking first, then content or calls.

    `tokens[:thinking]` are thinking; the rest are the content, or, when `calls` is not empty, the
    calls' pieces one after another (each call's first piece is its name).
    """

    tokens: list[str]
    thinking: int = 0
    calls: list[ToolCall] = msgspec.field(default_factory=list)
