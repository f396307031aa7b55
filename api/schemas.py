"""Request bodies of every surface, as they appear in the OpenAPI schema: msgspec for the hot
routes, pydantic (through FastAPI) for the rest.

Fields a client library sends that routeledger does not use are accepted and ignored, as the
original servers do; wrong types are refused with 422.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Final

import msgspec
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from api.images import part_images
from api.tools import message_calls
from dispatch.payload import Message

# Far above any model's context, and small enough to travel to a backend as a 64-bit integer.
MAX_TOKENS = 1_000_000


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _check_base64(images: list[str] | None) -> None:
    """Each image must be base64 (as Ollama takes them): refused here, not by a backend after the
    task was queued (which could only end in a failed task). ValueError names the first bad one."""
    for i, image in enumerate(images or ()):
        try:
            base64.b64decode(image, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(
                f"image {i} is not valid base64: send each image's bytes base64-encoded, "
                "without a data: prefix"
            ) from None


def _base64_images(images: list[str] | None) -> list[str] | None:
    _check_base64(images)
    return images


Images = Annotated[list[str] | None, AfterValidator(_base64_images)]

# -- the hot routes' bodies: msgspec ----------------------------------------------------------------
# POST /v1/chat/completions, /api/chat and /v1/tasks are decoded and checked by msgspec in one pass
# (api.common.read_body), without pydantic; their OpenAPI schemas come from these same types
# (hot_schemas). Unknown fields are ignored, as by the pydantic bodies.

Tokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class ChatMessage(msgspec.Struct, kw_only=True):
    """A chat message; `content` is text or OpenAI's list of content parts (text parts are its
    text, inline `image_url` parts join its `images`: api.images). An assistant's `tool_calls` and
    a `tool` message's `tool_call_id` (OpenAI) or `tool_name` (Ollama; OpenAI's older `name`)
    travel with it to the backend."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    images: list[str] | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        _check_base64(self.images)

    def to_message(self) -> Message:
        content = self.content
        images = list(self.images or [])
        if isinstance(content, list):
            images += part_images(content)
            content = "".join(str(p.get("text", "")) for p in content if p.get("type") == "text")
        tool_name = self.tool_name or (self.name if self.role == "tool" else None)
        return Message(
            role=self.role,
            content=content or "",
            images=images or None,
            tool_calls=message_calls(self.tool_calls),
            tool_call_id=self.tool_call_id,
            tool_name=tool_name,
        )


class TaskCreate(msgspec.Struct, kw_only=True):
    """POST /v1/tasks: a generation request in routeledger's own terms."""

    model: Annotated[
        str, msgspec.Meta(description="a model name or alias the fleet serves, a digest prefix, or 'auto'")
    ]
    domain: Annotated[
        str | None, msgspec.Meta(description="general, code, japanese…; classified from the text if absent")
    ] = None
    messages: list[ChatMessage] | None = None
    prompt: Annotated[
        str | None, msgspec.Meta(description="instead of messages: a plain completion prompt")
    ] = None
    system: str | None = None
    options: dict[str, Any] | None = None
    tools: Annotated[
        list[Any] | None, msgspec.Meta(description="function tools, in OpenAI's shape (chat only)")
    ] = None
    images: Annotated[
        list[str] | None,
        msgspec.Meta(description="with `prompt`: base64 images (a chat's ride on its messages)"),
    ] = None
    format: Annotated[
        str | dict[str, Any] | None, msgspec.Meta(description='"json", or a JSON schema the answer follows')
    ] = None
    think: Annotated[
        bool | str | None, msgspec.Meta(description="whether the model thinks first (true/false or a level)")
    ] = None
    max_tokens: Tokens | None = None
    priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] = 0
    stream: bool = False
    wait: Annotated[bool, msgspec.Meta(description="answer when the task has finished (with its result)")] = (
        False
    )
    # At least a second: a shorter wait could only ever end in a 504.
    timeout_s: Annotated[
        Annotated[float, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(description="how long a waiting or streaming request waits (at least 1 s)"),
    ] = None

    def __post_init__(self) -> None:
        _check_base64(self.images)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatCompletionCreate(msgspec.Struct, kw_only=True):
    """POST /v1/chat/completions (OpenAI)."""

    model: str
    messages: list[ChatMessage]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: Tokens | None = 1
    response_format: dict[str, Any] | None = None
    # OpenAI's reasoning models' effort ("none", "minimal", "low", "medium", "high"): Ollama's `think`.
    reasoning_effort: str | None = None
    user: str | None = None
    # Function tools (checked by api.tools: a malformed one is a 400, not a 422).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # routeledger's own extension: the domain the router should choose for.
    domain: str | None = None


class OllamaChat(msgspec.Struct, kw_only=True):
    """POST /api/chat (Ollama); streams unless `stream` is false."""

    model: str
    messages: list[ChatMessage] | None = None
    stream: bool | None = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    think: bool | str | None = None
    tools: list[Any] | None = None


HOT_BODIES: Final = (TaskCreate, ChatCompletionCreate, OllamaChat)
# Where the hot bodies' schemas sit in the OpenAPI document (beside pydantic's).
REF: Final = "#/components/schemas/{name}"


def hot_schemas() -> dict[str, Any]:
    """The OpenAPI component schemas of the hot routes' bodies (and of what they hold)."""
    _, components = msgspec.json.schema_components(HOT_BODIES, ref_template=REF)
    return components


def request_body(kind: type[msgspec.Struct]) -> dict[str, Any]:
    """A route's `openapi_extra` saying that its JSON body is `kind` (see hot_schemas)."""
    ref = {"$ref": REF.format(name=kind.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


class StreamOptionsBody(_Body):
    include_usage: bool = False


class CompletionCreate(_Body):
    """POST /v1/completions (OpenAI, legacy)."""

    model: str
    prompt: str | list[str]
    stream: bool | None = False
    stream_options: StreamOptionsBody | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1, le=MAX_TOKENS)
    suffix: str | None = None
    user: str | None = None
    domain: str | None = None


class OllamaGenerate(_Body):
    """POST /api/generate (Ollama); an empty prompt only loads the model, as Ollama does."""

    model: str
    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None
    stream: bool | None = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    images: Images = None
    raw: bool | None = None
    keep_alive: str | float | None = None
    think: bool | str | None = None


class OllamaShow(_Body):
    """POST /api/show (Ollama); `name` is the older spelling of `model`."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None


class BenchCreate(_Body):
    """POST /v1/bench: benchmark every live holder of a model (or of every model)."""

    model: str | None = None
    worker: str | None = None
    domain: str | None = None
    count: int | None = Field(default=None, ge=1, le=50)


class EmbeddingsCreate(_Body):
    """POST /v1/embeddings (OpenAI): `input` is a string, a list of strings, or token arrays
    (a list of integers, or a list of them), which api.embeddings decodes with cl100k_base."""

    model: str
    input: Any = None
    encoding_format: str | None = None
    dimensions: int | None = Field(None, ge=1, le=MAX_TOKENS)
    user: str | None = None


class OllamaEmbed(_Body):
    """POST /api/embed (Ollama): `input` is a string or a list of strings; none only loads the model."""

    model: str
    input: str | list[str] | None = None
    truncate: bool | None = None
    dimensions: int | None = Field(None, ge=1, le=MAX_TOKENS)
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None


class OllamaEmbeddings(_Body):
    """POST /api/embeddings (Ollama's older endpoint): one `prompt`, one vector."""

    model: str
    prompt: str | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
