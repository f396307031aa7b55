"""What the simulated machines read: the request bodies of Ollama's and OpenAI's APIs and of the
operator controls, decoded with msgspec."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from sim.errors import BadRequestError


class ChatMessageBody(msgspec.Struct):
    role: str = "user"
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(msgspec.Struct):
    model: str
    messages: list[ChatMessageBody] | None = None
    stream: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    format: str | dict[str, Any] | None = None


class GenerateRequest(msgspec.Struct):
    model: str
    prompt: str | None = None
    system: str | None = None
    stream: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    format: str | dict[str, Any] | None = None


class OpenAIChatRequest(msgspec.Struct):
    model: str
    messages: list[ChatMessageBody]
    stream: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    stream_options: dict[str, Any] | None = None


class ModelRequest(msgspec.Struct):
    model: str | None = None
    name: str | None = None
    stream: bool | None = None

    @property
    def which(self) -> str:
        return self.model or self.name or ""


class SpeedRequest(msgspec.Struct):
    factor: float


class FaultsRequest(msgspec.Struct):
    error_rate: float | None = None
    hang_rate: float | None = None
    disconnect_rate: float | None = None


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI's content parts: only the text parts count.
    return "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")


def int_option(options: dict[str, Any] | None, key: str) -> int | None:
    if not options:
        return None
    value = options.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


_T = TypeVar("_T")


def decode_body(body: bytes, kind: type[_T]) -> _T:
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.DecodeError as exc:
        raise BadRequestError(str(exc)) from None
