"""A task's prompt as the KV cache sees it (router.prefix): one canonical rendering of its text,
the same at submission, where the task's chain is computed, and in the worker, which tracks what
each of its backend's slots holds after a run (the prompt, then the answer it generated: the next
turn of a chat resends both, then adds its own message).

The rendering is not the backend's template: it need only be the same for the same conversation,
and differ where the backend's prompt would. Roles, contents, tool calls and images are in it
(an image by its size and first characters: hashing megabytes of base64 on every submission
would cost more than it tells).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from router.prefix import PromptChain, chain_of
from tasks.payload import EMBED, Message, TaskMessage, ToolCall

# Separators that message text seldom holds: a message boundary is never mistaken for content.
_ROLE, _END = "\x1d", "\x1e"


def _render_message(m: Message) -> str:
    parts = [m.role, _ROLE, m.content]
    if m.images:
        parts += [f"<image {len(img)} {img[:32]}>" for img in m.images]
    if m.tool_calls:
        parts += [f"<call {c.name} {c.arguments}>" for c in m.tool_calls]
    if m.tool_call_id or m.tool_name:
        parts.append(f"<answer {m.tool_call_id or ''} {m.tool_name or ''}>")
    parts.append(_END)
    return "".join(parts)


class Prompted(Protocol):
    """What the rendering reads of a task, as a request or as queued (tasks.payload.TaskMessage)."""

    @property
    def kind(self) -> str: ...
    @property
    def messages(self) -> list[Message]: ...
    @property
    def prompt(self) -> str | None: ...
    @property
    def system(self) -> str | None: ...
    @property
    def tools(self) -> list[dict[str, Any]] | None: ...
    @property
    def format(self) -> Any: ...
    @property
    def response_format(self) -> dict[str, Any] | None: ...
    @property
    def images(self) -> list[str] | None: ...


def _head(p: Prompted) -> str:
    """What the backend puts ahead of the conversation, or that changes it from the start: the
    tools offered (rendered into the system prompt), a schema to answer in, a completion's
    images. Requests that differ there share no cache."""
    parts: list[str] = []
    if p.tools:
        parts.append(f"<tools {json.dumps(p.tools, sort_keys=True, default=str)}>")
    if p.format is not None or p.response_format is not None:
        parts.append(f"<format {json.dumps([p.format, p.response_format], sort_keys=True, default=str)}>")
    if p.images:
        parts += [f"<image {len(img)} {img[:32]}>" for img in p.images]
    return "".join(parts)


def render(p: Prompted, reply: str | None = None, calls: Sequence[ToolCall] | None = None) -> str | None:
    """The canonical text of a prompt, followed by `reply` (what the model answered, with the
    tool `calls` it made) where given; None for a task the cache does not apply to (embeddings)."""
    if p.kind == EMBED:
        return None
    if p.kind == "generate":
        text = f"{_head(p)}system{_ROLE}{p.system or ''}{_END}user{_ROLE}{p.prompt or ''}{_END}"
    else:
        text = _head(p) + "".join(map(_render_message, p.messages))
    if reply is not None:
        text += _render_message(
            Message(role="assistant", content=reply, tool_calls=list(calls) if calls else None)
        )
    return text


def held_after(task: TaskMessage, reply: str, calls: Sequence[ToolCall] | None = None) -> PromptChain | None:
    """What the slot that ran `task` holds once it answered `reply` (and made tool `calls`): the
    prompt and the answer (the chain a chat's next turn extends)."""
    return _chain(render(task, reply, calls))


def render_messages(messages: Sequence[Message], reply: str | None = None) -> str:
    """The canonical text of a chat's messages (and the assistant's `reply`, where given), for a
    request with no tools, format or images."""
    text = "".join(map(_render_message, messages))
    if reply is not None:
        text += _render_message(Message(role="assistant", content=reply))
    return text


def task_chain(p: Prompted) -> PromptChain | None:
    """The prompt chain of a request or a task; None where the cache does not apply or the prompt
    is under a block."""
    return _chain(render(p))


def _chain(text: str | None) -> PromptChain | None:
    if text is None:
        return None
    chain = chain_of(text)
    return chain if chain.hashes else None
