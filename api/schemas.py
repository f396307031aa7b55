"""Request bodies of every surface, as they appear in the OpenAPI schema: pydantic models, which
FastAPI decodes and checks before an endpoint runs (errors: api.app's handlers).

Fields a client library sends that routeledger does not use are accepted and ignored, as the
original servers do; wrong types are refused with 422, and so is a value of another JSON type
than the schema says (`"wait": 0`, `"max_tokens": "5"`; 5.0 is an integer, as JSON Schema counts
it): the document is the contract, and OpenAI's and Ollama's own servers refuse such values too,
so no client written against them sends one. A body whose fields nest arrays and objects more
than MAX_DEPTH deep is a 400.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Annotated, Any, Final

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

from api.images import part_images
from api.tools import message_calls
from dispatch.options import RUNTIME_OPTIONS, SAMPLING_OPTIONS, OptionsPolicy
from tasks.payload import Message

# Far above any model's context, and small enough to travel to a backend as a 64-bit integer.
MAX_TOKENS = 1_000_000
# The longest a request may ask to wait (`timeout_s`): longer than anyone holds a connection open
# for an answer, and short enough that deadlines stay finite numbers (1e308 s would not).
MAX_WAIT_S: Final = 86_400.0
# The deepest nesting of arrays and objects a body may have. Real requests stay far below it (a
# JSON schema for structured output or a tool's parameters nests a few levels; OpenAI allows 10
# levels of objects there), and it keeps every recursive step after decoding (the msgpack
# encoder, the worker's JSON encoder, repr) far from Python's recursion limit of 1000, which a body
# about 1000 deep reaches wherever it happens to be read. serde_json stops at the same depth.
MAX_DEPTH: Final = 128
# The type of the pydantic error a body nested too deep gets (answered as a 400: api.app).
TOO_DEEP: Final = "json_too_deep"


def nested_deeper(value: object, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests arrays and objects more than `limit` deep. Iterative, so that no depth
    of input can exhaust the stack here."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[object]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def integral(value: Any) -> Any:
    """A number without a fraction (1.0) as an int: JSON Schema, and so the document, counts it as
    an integer, which strict types would refuse. For the pydantic bodies' integer fields, declared
    as Annotated[int, Field(ge=…, le=…), BeforeValidator(integral)]: bounds first, or pydantic
    would leave them out of the document."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS), BeforeValidator(integral)]


def _untitled(schema: JsonDict) -> None:
    """A body's schema without its properties' titles: each would only repeat the property's name."""
    properties = schema.get("properties")
    if isinstance(properties, dict):
        for prop in properties.values():
            if isinstance(prop, dict):
                prop.pop("title", None)


class Part(BaseModel):
    """An object inside a request body: unknown fields ignored, types strict (see above), no
    infinities (which Python's JSON parser reads, and no backend does)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, json_schema_extra=_untitled)


class Body(Part):
    """A request body: a Part nested at most MAX_DEPTH deep, its parts counted within it (so they
    are not walked again)."""

    @model_validator(mode="before")
    @classmethod
    def _shallow(cls, data: Any) -> Any:
        # Only the fields it reads: a field it ignores reaches nothing.
        read = [v for k, v in data.items() if k in cls.model_fields] if isinstance(data, dict) else data
        if nested_deeper(read):
            raise PydanticCustomError(TOO_DEEP, "nested more than {limit} deep", {"limit": MAX_DEPTH})
        return data


def _base64_images(images: list[str] | None) -> list[str] | None:
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
    return images


Images = Annotated[list[str] | None, AfterValidator(_base64_images)]

Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1), BeforeValidator(integral)]


class ChatMessage(Part):
    """A chat message; `content` is text or OpenAI's list of content parts (text parts are its
    text, inline `image_url` parts join its `images`: api.images). An assistant's `tool_calls` and
    a `tool` message's `tool_call_id` (OpenAI) or `tool_name` (Ollama; OpenAI's older `name`)
    travel with it to the backend."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    images: Images = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    name: str | None = None

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


class TaskCreate(Body):
    """POST /v1/tasks: a generation request in routeledger's own terms."""

    model: Annotated[
        str, Field(description="a model name or alias the fleet serves, a digest prefix, or 'auto'")
    ]
    domain: Annotated[
        str | None, Field(description="general, code, japanese…; classified from the text if absent")
    ] = None
    messages: list[ChatMessage] | None = None
    prompt: Annotated[str | None, Field(description="instead of messages: a plain completion prompt")] = None
    system: str | None = None
    options: dict[str, Any] | None = None
    tools: Annotated[list[Any] | None, Field(description="function tools, in OpenAI's shape (chat only)")] = (
        None
    )
    images: Annotated[
        Images, Field(description="with `prompt`: base64 images (a chat's ride on its messages)")
    ] = None
    format: Annotated[
        str | dict[str, Any] | None, Field(description='"json", or a JSON schema the answer follows')
    ] = None
    think: Annotated[
        bool | str | None, Field(description="whether the model thinks first (true/false or a level)")
    ] = None
    max_tokens: TokenCount | None = None
    priority: Annotated[int, Field(ge=-1000, le=1000), BeforeValidator(integral)] = 0
    stream: bool = False
    wait: Annotated[bool, Field(description="answer when the task has finished (with its result)")] = False
    # At least a second: a shorter wait could only ever end in a 504.
    timeout_s: Annotated[
        Annotated[float, Field(ge=1, le=MAX_WAIT_S)] | None,
        Field(description="how long a waiting or streaming request waits (1 s to a day)"),
    ] = None


class StreamOptions(Part):
    """OpenAI's `stream_options`: `include_usage` adds a last chunk with the usage."""

    include_usage: bool = False


class ChatCompletionCreate(Body):
    """POST /v1/chat/completions (OpenAI)."""

    model: str
    messages: list[ChatMessage]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: TokenCount | None = 1
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


class OllamaChat(Body):
    """POST /api/chat (Ollama); streams unless `stream` is false."""

    model: str
    messages: list[ChatMessage] | None = None
    stream: bool | None = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    think: bool | str | None = None
    tools: list[Any] | None = None


class CompletionCreate(Body):
    """POST /v1/completions (OpenAI, legacy)."""

    model: str
    prompt: str | list[str]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: TokenCount | None = 1
    suffix: str | None = None
    user: str | None = None
    domain: str | None = None


class OllamaGenerate(Body):
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


class OllamaShow(Body):
    """POST /api/show (Ollama); `name` is the older spelling of `model`."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None


class OllamaPull(Body):
    """POST /api/pull (Ollama) over the fleet; `name` is the older spelling of `model`. `worker` (an
    extension): the machine to pull onto; without it, every live Ollama worker that lacks the model."""

    model: str | None = None
    name: str | None = None
    insecure: bool = False
    stream: bool | None = None
    worker: str | None = None


class OllamaDelete(Body):
    """DELETE /api/delete (Ollama) over the fleet. `worker` (an extension): the machine to delete it
    from; without it, every live Ollama worker that holds it."""

    model: str | None = None
    name: str | None = None
    worker: str | None = None


class BenchCreate(Body):
    """POST /v1/bench: benchmark every live holder of a model (or of every model)."""

    model: str | None = None
    worker: str | None = None
    domain: str | None = None
    count: Annotated[int, Field(ge=1, le=50), BeforeValidator(integral)] | None = None


class EmbeddingsCreate(Body):
    """POST /v1/embeddings (OpenAI): `input` is a string, a list of strings, or token arrays
    (a list of integers, or a list of them), which api.embeddings decodes with cl100k_base."""

    model: str
    input: Any = None
    encoding_format: str | None = None
    dimensions: TokenCount | None = None
    user: str | None = None


class OllamaEmbed(Body):
    """POST /api/embed (Ollama): `input` is a string or a list of strings; none only loads the model."""

    model: str
    input: str | list[str] | None = None
    truncate: bool | None = None
    dimensions: TokenCount | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None


class OllamaEmbeddings(Body):
    """POST /api/embeddings (Ollama's older endpoint): one `prompt`, one vector."""

    model: str
    prompt: str | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None


# -- what the checks after decoding refuse, told in the document -----------------------------------
# The types above say what decodes; these say what is then served: each refusal that a schema can
# state (a tool without a name, an empty message list, a domain outside the configured ones…), so
# that a client generated from the document, or a fuzzer, sends what is accepted. What no schema
# can state (a capability the serving model lacks, two tools of one name, a tool_choice naming a tool
# not offered, an integer over 64 bits inside free-form values) is listed in the README ("HTTP API").

# Base64 as the image checks take it (binascii's strict mode: the alphabet, then padding).
BASE64: Final = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
_IMAGES: Final = {"items": {"type": "string", "pattern": BASE64}}
# A function tool as api.tools.check_tools takes it.
_TOOLS: Final = {
    "items": {
        "type": "object",
        "required": ["function"],
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": r"\S"},
                    "description": {"type": ["string", "null"]},
                    "parameters": {
                        "anyOf": [
                            {"type": "null"},
                            {"type": "object", "properties": {"type": {"const": "object"}}},
                        ]
                    },
                },
            },
        },
    }
}
# An earlier call sent back on an assistant message (api.tools.message_calls).
_TOOL_CALLS: Final = {
    "items": {
        "type": "object",
        "required": ["function"],
        "properties": {
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string", "minLength": 1}},
            }
        },
    }
}
# OpenAI's response_format as api.openai reads it.
_RESPONSE_FORMAT: Final = {
    "anyOf": [
        {"type": "null"},
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {"schema": {"type": "object"}},
                },
            },
        },
    ]
}
_TOOL_CHOICE: Final = {
    "anyOf": [
        {"type": "null"},
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["function"],
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
            },
        },
    ]
}


# A seed's exact bounds: FastAPI writes pydantic's bounds as floats, and 2**63 - 1 is not one.
_SEED: Final = {"anyOf": [{"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}, {"type": "null"}]}

# Most inputs one embedding request may carry (OpenAI's own limit; api.embeddings).
MAX_INPUTS: Final = 2048
# A token id of cl100k_base, the encoding OpenAI's `input` token arrays are decoded with: its
# 100256 ordinary tokens and its five special ones (the ids between are unused).
_TOKEN: Final = {
    "type": "integer",
    "anyOf": [{"minimum": 0, "maximum": 100_255}, {"enum": [100_257, 100_258, 100_259, 100_260, 100_276]}],
}
# OpenAI's embedding `input`: a text, texts, one token array, or token arrays; nothing empty.
_EMBEDDING_INPUT: Final = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_INPUTS,
            "items": {"type": "string", "minLength": 1},
        },
        {"type": "array", "minItems": 1, "items": _TOKEN},
        {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_INPUTS,
            "items": {"type": "array", "minItems": 1, "items": _TOKEN},
        },
    ]
}


def _named(*, stripped: bool) -> dict[str, Any]:
    """A body that names its model as `model` or, where that is null or empty, as `name` (Ollama's
    older spelling). `stripped`: a name of spaces is no name."""
    name = {"type": "string", "pattern": r"\S"} if stripped else {"type": "string", "minLength": 1}
    unset = {"anyOf": [{"type": "null"}, {"const": ""}]}
    return {
        "anyOf": [
            {"required": ["model"], "properties": {"model": name}},
            {"required": ["name"], "properties": {"model": unset, "name": name}},
        ]
    }


def options_schema(policy: OptionsPolicy) -> dict[str, Any]:
    """What `options` may hold under `policy` (dispatch.options): its names, and num_ctx's limit
    where runtime options are refused; the values go to the backend as they are."""
    names = SAMPLING_OPTIONS | (RUNTIME_OPTIONS if policy.allow_runtime_options else {"num_ctx"})
    properties: dict[str, Any] = {name: {} for name in sorted(names)}
    if not policy.allow_runtime_options:
        properties["num_ctx"] = {"type": "integer", "maximum": policy.max_num_ctx}
    return {"properties": properties, "additionalProperties": False}


def refine(
    components: dict[str, Any],
    *,
    domains: Iterable[str],
    bench_domains: Iterable[str],
    options: dict[str, Any],
    max_messages: int,
) -> None:
    """Add to the bodies' component schemas what is refused after they decode (see above), under
    the app's configuration: its domains, its options policy (`options`: the schema of what it
    accepts) and its message limit."""
    domain = {"enum": [*domains, None]}
    messages = {"maxItems": max_messages}
    # A task is a chat (messages) or a completion (a prompt, which cannot call tools).
    task = {
        "anyOf": [
            {"required": ["messages"], "properties": {"messages": {"type": "array", "minItems": 1}}},
            {
                "required": ["prompt"],
                "properties": {
                    "prompt": {"type": "string"},
                    "tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
                },
            },
        ]
    }
    refined: dict[str, dict[str | None, dict[str, Any]]] = {
        "ChatMessage": {"images": _IMAGES, "tool_calls": _TOOL_CALLS},
        "TaskCreate": {
            None: task,
            "domain": domain,
            "messages": messages,
            "options": options,
            "tools": _TOOLS,
            "images": _IMAGES,
        },
        "ChatCompletionCreate": {
            "seed": _SEED,
            "domain": domain,
            "messages": {"minItems": 1, **messages},
            "n": {"enum": [1, None]},
            "response_format": _RESPONSE_FORMAT,
            "tools": _TOOLS,
            "tool_choice": _TOOL_CHOICE,
        },
        "OllamaChat": {"messages": messages, "options": options, "tools": _TOOLS},
        "CompletionCreate": {
            "seed": _SEED,
            "domain": domain,
            "n": {"enum": [1, None]},
            "prompt": {"minItems": 1, "maxItems": 1},
        },
        "OllamaGenerate": {"images": _IMAGES, "options": options},
        "OllamaShow": {None: _named(stripped=False)},
        "OllamaPull": {None: _named(stripped=True)},
        "OllamaDelete": {None: _named(stripped=True)},
        "EmbeddingsCreate": {
            None: {"required": ["model", "input"]},
            "input": _EMBEDDING_INPUT,
            "encoding_format": {"enum": ["float", "base64", None]},
        },
        "OllamaEmbed": {"input": {"items": {"minLength": 1}, "maxItems": MAX_INPUTS}, "options": options},
        "OllamaEmbeddings": {"options": options},
        "BenchCreate": {"domain": {"enum": [*bench_domains, None]}},
        "PipelineCreate": {
            None: {
                "anyOf": [
                    {"required": ["children"], "properties": {"children": {"type": "array"}}},
                    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                ]
            }
        },
        "ChildCreate": {"domain": domain},
    }
    for name, fields in refined.items():
        schema = components.get(name)
        if schema is None:
            continue
        for field, extra in fields.items():
            target = schema if field is None else schema.get("properties", {}).get(field)
            if target is not None:
                target.update(extra)
