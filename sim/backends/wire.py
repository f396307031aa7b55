"""What the simulated machines read: the request bodies of Ollama's and OpenAI's APIs and of the
operator controls, decoded with msgspec."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from sim.errors import BadRequestError


class ChatMessageBody(msgspec.Struct):
    role: str = "user"
    content: str | list[dict[str, Any]] | None = None
    # Ollama: base64 images on a message.
    images: list[str] | None = None
    # An assistant's earlier tool calls (both APIs), and which call a `tool` message answers.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    name: str | None = None
    thinking: str | None = None


class ChatRequest(msgspec.Struct):
    model: str
    messages: list[ChatMessageBody] | None = None
    stream: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    format: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    # True/False, or a level ("low", "medium", "high") that also means think.
    think: bool | str | None = None


class GenerateRequest(msgspec.Struct):
    model: str
    prompt: str | None = None
    system: str | None = None
    stream: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    format: str | dict[str, Any] | None = None
    images: list[str] | None = None
    think: bool | str | None = None


class OpenAIChatRequest(msgspec.Struct):
    model: str
    messages: list[ChatMessageBody]
    stream: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    stream_options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # "none" turns thinking off; "minimal", "low", "medium", "high" turn it on (Ollama's own mapping).
    reasoning_effort: str | None = None
    # Not OpenAI's: Ollama's `think`, which some clients send through `extra_body`.
    think: bool | str | None = None


class EmbedRequest(msgspec.Struct):
    """Ollama's /api/embed."""

    model: str
    input: str | list[str] = ""
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    dimensions: int | None = None


class EmbeddingsRequest(msgspec.Struct):
    """Ollama's older /api/embeddings: one prompt, one vector."""

    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None


class OpenAIEmbeddingsRequest(msgspec.Struct):
    """OpenAI's /v1/embeddings (token-id inputs are not taken: the sim has no tokenizer)."""

    model: str
    input: str | list[str]
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None


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


def image_parts(content: str | list[dict[str, Any]] | None) -> list[str]:
    """The `image_url` URLs of OpenAI content parts (a string or a `{"url": …}` object)."""
    if not isinstance(content, list):
        return []
    urls: list[str] = []
    for part in content:
        if part.get("type") != "image_url":
            continue
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        urls.append(str(url or ""))
    return urls


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
