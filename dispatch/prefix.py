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

from collections.abc import Sequence

from dispatch.payload import EMBED, Message, TaskMessage
from router.prefix import PromptChain, chain_of

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


def render(task: TaskMessage, reply: str | None = None) -> str | None:
    """The canonical text of `task`'s prompt, followed by `reply` (what the model answered) where
    given; None for a task the cache does not apply to (embeddings)."""
    if task.kind == EMBED:
        return None
    if task.kind == "generate":
        text = f"system{_ROLE}{task.system or ''}{_END}user{_ROLE}{task.prompt or ''}{_END}"
        return text if reply is None else f"{text}assistant{_ROLE}{reply}{_END}"
    return render_messages(task.messages, reply)


def held_after(task: TaskMessage, reply: str) -> PromptChain | None:
    """What the slot that ran `task` holds once it answered `reply`: the prompt and the answer
    (the chain a chat's next turn extends)."""
    text = render(task, reply)
    if text is None:
        return None
    chain = chain_of(text)
    return chain if chain.hashes else None


def render_messages(messages: Sequence[Message], reply: str | None = None) -> str:
    """The canonical text of a chat's messages (and the assistant's `reply`, where given)."""
    text = "".join(map(_render_message, messages))
    if reply is not None:
        text += f"assistant{_ROLE}{reply}{_END}"
    return text


def task_chain(task: TaskMessage) -> PromptChain | None:
    """`task`'s prompt chain; None where the cache does not apply or the prompt is under a block."""
    return request_chain(task.kind, task.messages, task.prompt, task.system)


def request_chain(
    kind: str, messages: Sequence[Message], prompt: str | None, system: str | None
) -> PromptChain | None:
    """The prompt chain of a request of `kind` (`task_chain` before there is a task)."""
    if kind == EMBED:
        return None
    if kind == "generate":
        text = f"system{_ROLE}{system or ''}{_END}user{_ROLE}{prompt or ''}{_END}"
    else:
        text = render_messages(messages)
    chain = chain_of(text)
    return chain if chain.hashes else None
