"""Backend adapters: Ollama's HTTP API, and OpenAI-compatible servers.

A generation is an async iterator of text pieces, thinking (Thought: Ollama's `thinking`, an
OpenAI-compatible server's `reasoning_content` or `reasoning`) and tool calls (a list of ToolCall,
each whole, as the backend completed them) that ends with one `Generated` carrying the backend's
own timings. Images, structured output and thinking are asked for in each backend's own terms
(Ollama: `images`, `format`, `think`; OpenAI: `image_url` parts with data URLs, `response_format`,
`reasoning_effort`).
Each adapter speaks its backend's tool dialect both ways: the offered tools, earlier calls and tool
results in the request; the calls in its stream (Ollama: `message.tool_calls`, arguments as an
object and no id, so the adapter draws one; OpenAI: `tool_calls` deltas joined by index). Ollama's
inventory also says what each model is and can do (`/api/show`, asked once per digest: capabilities,
details and context length for the lease, template, parameters and model_info for the worker's
cards, dispatch.modelcard) and what is loaded with its sizes and expiry (`/api/ps`). An
OpenAI-compatible server says none of it (`/v1/models` lists ids), so none of it is reported.
An `embed` task goes to the backend's embedding endpoint instead (Ollama's /api/embed, or
/v1/embeddings) and yields only its Generated, which carries the vectors. Ollama reports no time
for reading the input apart from the load, so the adapter records `total_duration - load_duration`
as the prompt's duration; for an OpenAI-compatible server (no durations at all) it is the wall time
of the request: either way, prompt tokens over it is the embedding rate the estimates learn.
Every failure becomes a BackendError with a kind:

| kind | retryable | when |
|---|---|---|
| unreachable | yes | the connection was refused or could not be made |
| timeout | yes | no byte for `idle_timeout_s`, or the whole run exceeded `timeout_s` |
| disconnect | yes | the stream broke before its final chunk |
| http_5xx | yes | the backend answered with a server error |
| model_missing | yes | the backend does not have the model (another worker may) |
| bad_request | no | the backend rejected the request itself (4xx) |
| unsupported | no | the backend cannot do this for the model (501: llama-server without --embeddings) |
| protocol | yes | the backend sent something that is not its protocol |

Every request goes through httpx, on kept-alive connections that are not reused after
`KEEPALIVE_EXPIRY_S` idle (below the 5 s after which llama.cpp's server closes them), and a request
that meets a connection the server closed before answering is sent again on a fresh one: a stale
connection never surfaces as a task's failure.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Final, Protocol, runtime_checkable

import httpcore
import httpx
import msgspec

from dispatch.modelcard import ModelCard
from events.event import MAX_NS, ModelEntry, Timings, bounded_count
from tasks.lease import LoadedModel
from tasks.payload import EMBED, Message, TaskMessage, Thought, ToolCall, pack_vector
from workers.errors import BackendError

log = logging.getLogger("routeledger.worker")

# A kept-alive connection idle longer than this is not reused. llama.cpp's server (cpp-httplib)
# closes one after 5 s, httpx's default expiry is 5 s too: the two raced, and the first request
# after an idle gap met a closed socket ("Server disconnected without sending a response").
KEEPALIVE_EXPIRY_S: Final = 2.0
# A request whose connection was closed before any answer came is sent again on a fresh connection
# this many times. That is a kept-alive socket the server had closed, which never read the request;
# a server that read it and died before answering gets it once more.
STALE_RETRIES: Final = 1
# A capability the server refused is taken as missing this long, then asked for again (its server
# may have been restarted with it, llama-server with --embeddings).
REFUSAL_KEPT_S: Final = 600.0
_STALE: Final = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class Generated(msgspec.Struct, frozen=True, kw_only=True):
    """The end of a generation: the backend's timings and why it stopped."""

    timings: Timings
    done_reason: str | None = None
    # An embedding task's vectors (tasks.payload.pack_vector), one per input in order; such a
    # task yields nothing before its Generated.
    embeddings: list[bytes] | None = None


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend holds (name → digest) and which digests are loaded now."""

    models: list[ModelEntry]
    loaded: list[str]
    # False: the backend cannot say what is loaded (`loaded` is then empty and means nothing).
    loaded_known: bool = True
    # Bytes each loaded digest takes in memory, as the backend reports it (/api/ps `size`).
    loaded_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    # Each loaded model as the backend reports it (/api/ps: name, sizes, expiry), for the lease.
    loaded_models: list[LoadedModel] = msgspec.field(default_factory=list)
    # digest -> what /api/show says of it beyond the entry's facts (template, parameters…).
    cards: dict[str, ModelCard] = msgspec.field(default_factory=dict)

    def routing(self) -> tuple[object, ...]:
        """What routing reads of it: a change here is news at once; the expiry of a loaded model
        (which moves with every request) rides the next renewal of the lease."""
        return (self.models, self.loaded, self.loaded_known, self.loaded_bytes)


class Backend(Protocol):
    """The seam between the worker agent and a model server."""

    url: str
    kind: str

    async def inventory(self) -> Inventory: ...

    def generate(
        self, task: TaskMessage, local_name: str
    ) -> AsyncIterator[str | Thought | list[ToolCall] | Generated]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Pulling(Protocol):
    """A backend whose server can fetch a model and remove one (Ollama: workers/control.py)."""

    def pull(self, model: str, *, insecure: bool = False) -> AsyncGenerator[dict[str, Any], None]: ...

    async def delete(self, model: str) -> None: ...


@runtime_checkable
class Refusing(Protocol):
    """A backend that learns from its server's refusals what a model cannot do (OpenAIBackend):
    its next inventory lists the capability in the model's `lacks`."""

    def refused(self, local_name: str, capability: str) -> None: ...


# Longest silence of a pull's progress (dispatch.control.NEXT_LINE_S, which the API waits).
PULL_IDLE_S: Final = 600.0


def _timeout(idle_timeout_s: float) -> httpx.Timeout:
    return httpx.Timeout(connect=5.0, read=idle_timeout_s, write=30.0, pool=30.0)


def _classify(exc: Exception, started: bool) -> BackendError:
    if isinstance(exc, BackendError):
        return exc
    if isinstance(
        exc, httpx.ConnectError | httpx.ConnectTimeout | httpcore.ConnectError | httpcore.ConnectTimeout
    ):
        return BackendError("unreachable", str(exc) or "connection refused", retryable=True)
    if isinstance(exc, httpx.TimeoutException | httpcore.TimeoutException | TimeoutError):
        return BackendError("timeout", str(exc) or "no answer in time", retryable=True)
    if isinstance(
        exc,
        httpx.RemoteProtocolError
        | httpx.ReadError
        | httpx.WriteError
        | httpcore.RemoteProtocolError
        | httpcore.ReadError
        | httpcore.WriteError,
    ):
        kind = "disconnect" if started else "unreachable"
        return BackendError(kind, str(exc) or "connection closed", retryable=True)
    if isinstance(exc, msgspec.DecodeError | ValueError):
        return BackendError("protocol", str(exc), retryable=True)
    return BackendError("protocol", f"{type(exc).__name__}: {exc}", retryable=True)


async def _raise_for_status(resp: httpx.Response, model: str) -> None:
    if resp.status_code < 400:
        return
    _raise_status(resp.status_code, await resp.aread(), model)


def _raise_status(status: int, raw: bytes, model: str) -> None:
    """The BackendError of an answer with HTTP status `status` (400 or more) and body `raw`."""
    body = raw.decode(errors="replace")[:500]
    try:
        said: Any = msgspec.json.decode(body).get("error", body)
    except (msgspec.DecodeError, AttributeError):
        said = body
    # Ollama says {"error": "..."}; OpenAI-compatible servers {"error": {"message": "...", ...}}.
    message = str(said.get("message", said) if isinstance(said, dict) else said)
    if status == 404:
        raise BackendError("model_missing", f"{model}: {message}", retryable=True)
    if status == 501:
        # Not implemented for this model or server (llama-server without --embeddings): asking
        # again, here or after a pause, gets the same answer.
        raise BackendError("unsupported", f"HTTP 501: {message}", retryable=False)
    if status >= 500:
        raise BackendError("http_5xx", f"HTTP {status}: {message}", retryable=True)
    raise BackendError("bad_request", f"HTTP {status}: {message}", retryable=False)


def backend_client(
    url: str, idle_timeout_s: float, headers: dict[str, str] | None = None
) -> httpx.AsyncClient:
    """The httpx client an adapter talks to its backend through (see the module's note on kept-alive
    connections)."""
    return httpx.AsyncClient(
        base_url=url,
        timeout=_timeout(idle_timeout_s),
        headers=headers or {},
        limits=httpx.Limits(
            max_connections=64, max_keepalive_connections=32, keepalive_expiry=KEEPALIVE_EXPIRY_S
        ),
    )


async def open_stream(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    accept: str,
    limits: httpx.Timeout | None = None,
) -> httpx.Response:
    """POST `body` as JSON at `path` and return the answer once its head came, its body unread. A
    connection that closes before any answer is a stale kept-alive one the server had closed: the
    request goes again on a fresh connection (STALE_RETRIES times)."""
    request = client.build_request(
        "POST",
        path,
        content=msgspec.json.encode(body),
        headers={"Content-Type": "application/json", "Accept": accept},
        timeout=limits if limits is not None else httpx.USE_CLIENT_DEFAULT,
    )
    for attempt in range(STALE_RETRIES + 1):
        try:
            return await client.send(request, stream=True)
        except _STALE as exc:
            if attempt == STALE_RETRIES:
                raise
            log.debug(
                "%s%s: the connection closed before an answer (%s); sending again", client.base_url, path, exc
            )
    raise AssertionError("unreachable")


class LineStreams:
    """POSTs of JSON whose answer is read line by line (Ollama's NDJSON), over the adapter's httpx
    client (kept-alive connections, stale ones replaced: `open_stream`)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def batches(
        self, path: str, body: dict[str, Any], model: str, limits: httpx.Timeout | None = None
    ) -> AsyncGenerator[list[bytes], None]:
        """The non-blank lines of the answer to POST `body` (as JSON) at `path`, as they arrive: one
        list for each read (a backend that answers at once sends many lines in one); BackendError
        for an HTTP error status. Closing the iterator early closes the connection."""
        answer = await open_stream(self._client, path, body, "application/x-ndjson", limits)
        try:
            if answer.status_code >= 400:
                _raise_status(answer.status_code, await answer.aread(), model)
            rest = b""
            async for chunk in answer.aiter_bytes():
                if rest:
                    chunk = rest + chunk
                *whole, rest = chunk.split(b"\n")
                batch = [line for line in whole if line.strip()]
                if batch:
                    yield batch
            if rest.strip():
                yield [rest]
        finally:
            await answer.aclose()

    async def lines(
        self, path: str, body: dict[str, Any], model: str, limits: httpx.Timeout | None = None
    ) -> AsyncGenerator[bytes, None]:
        """Each non-blank line of the answer (see `batches`)."""
        batches = self.batches(path, body, model, limits)
        try:
            async for batch in batches:
                for line in batch:
                    yield line
        finally:
            await batches.aclose()


async def _post_json(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], model: str, timeout_s: float
) -> dict[str, Any]:
    """POST `body` and decode the JSON answer, every failure a BackendError of its kind."""
    try:
        async with asyncio.timeout(timeout_s):
            resp = await open_stream(client, path, body, "application/json")
            try:
                await _raise_for_status(resp, model)
                return _line_decoder.decode(await resp.aread())
            finally:
                await resp.aclose()
    except BackendError:
        raise
    except Exception as exc:
        raise _classify(exc, started=False) from None


def _options(task: TaskMessage) -> dict[str, Any]:
    options = dict(task.options)
    if task.max_tokens is not None:
        options["num_predict"] = task.max_tokens
    return options


_line_decoder = msgspec.json.Decoder(dict[str, Any])


def _call_id() -> str:
    """An id for a call the backend named none for (OpenAI's spelling: `call_` and 24 hex digits)."""
    return f"call_{secrets.token_hex(12)}"


def ollama_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as Ollama's /api/chat reads them: earlier calls with their arguments as objects, and
    each `tool` message naming its function (found from the call it answers when the client named
    only the call's id, as OpenAI clients do)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        body: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.images:
            body["images"] = m.images
        if m.tool_calls:
            body["tool_calls"] = [
                {"function": {"name": c.name, "arguments": c.arguments_object()}} for c in m.tool_calls
            ]
            names.update({c.id: c.name for c in m.tool_calls if c.id})
        if m.role == "tool":
            name = m.tool_name or names.get(m.tool_call_id or "")
            if name:
                body["tool_name"] = name
        out.append(body)
    return out


def openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as an OpenAI-compatible server reads them: every earlier call with an id (calls sent
    back without one, as Ollama clients do, get one from their place), and each `tool` message
    naming the call it answers (when the client named only the function: its earliest unanswered
    call, else the earliest unanswered call of all)."""
    unanswered: list[tuple[str, str]] = []  # (id, function name), in order
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        body: dict[str, Any] = {"role": m.role, "content": image_content(m.content, m.images)}
        if m.tool_calls:
            calls = []
            for k, c in enumerate(m.tool_calls):
                ident = c.id or f"call_{i}_{k}"
                calls.append(
                    {"id": ident, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                )
                unanswered.append((ident, c.name))
            body["tool_calls"] = calls
            if not m.content:
                body["content"] = None
        if m.role == "tool":
            answers = m.tool_call_id or next(
                (call for call, name in unanswered if name == m.tool_name),
                unanswered[0][0] if unanswered else None,
            )
            if answers:
                body["tool_call_id"] = answers
                unanswered = [u for u in unanswered if u[0] != answers]
        out.append(body)
    return out


def mime_type(image: str) -> str:
    """The media type of base64 image bytes, from their first bytes (PNG when none is recognised),
    for the data URL an OpenAI-compatible server reads."""
    head = image[:16]
    try:
        raw = base64.b64decode(head + "=" * (-len(head) % 4))
    except (binascii.Error, ValueError):
        return "image/png"
    if raw.startswith(b"\xff\xd8"):
        return "image/jpeg"
    if raw.startswith(b"GIF8"):
        return "image/gif"
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return "image/png"


def image_content(text: str, images: list[str] | None) -> str | list[dict[str, Any]]:
    """A message's content as an OpenAI-compatible server reads it: the text alone, or with images
    its text part and one `image_url` part (a data URL) per image."""
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    parts += [{"type": "image_url", "image_url": {"url": f"data:{mime_type(i)};base64,{i}"}} for i in images]
    return parts


def _openai_format(task: TaskMessage) -> dict[str, Any] | None:
    """The `response_format` for an OpenAI-compatible server: the client's own, when it came in
    OpenAI's terms; else Ollama's `format` spelled OpenAI's way."""
    if task.response_format is not None:
        return task.response_format
    if task.format == "json":
        return {"type": "json_object"}
    if isinstance(task.format, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": task.format}}
    return None


def _effort(think: bool | str | None) -> str | None:
    """Ollama's `think` as OpenAI's `reasoning_effort`: a level as it is, true as "medium"."""
    if think is None:
        return None
    if isinstance(think, str):
        return think
    return "medium" if think else "none"


def _ollama_calls(raw: Any) -> list[ToolCall]:
    """The calls of an Ollama chunk's `message.tool_calls`."""
    calls: list[ToolCall] = []
    for call in raw if isinstance(raw, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            raise BackendError(
                "protocol", f"a tool call without a function name: {call!r}"[:300], retryable=True
            )
        arguments = function.get("arguments")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
        ident = call.get("id")
        calls.append(
            ToolCall(name=name, arguments=text, id=ident if isinstance(ident, str) and ident else _call_id())
        )
    return calls


class _CallsBeingStreamed:
    """OpenAI's streamed `tool_calls` deltas, joined by index: the first delta of a call names its
    id and function, later ones add chunks of its arguments."""

    def __init__(self) -> None:
        self.ids: dict[int, str] = {}
        self.names: dict[int, str] = {}
        self.arguments: dict[int, list[str]] = {}

    def add(self, deltas: Any) -> bool:
        """Take one chunk's deltas; whether there were any."""
        took = False
        for delta in deltas if isinstance(deltas, list) else []:
            if not isinstance(delta, dict):
                continue
            index = delta.get("index")
            index = index if isinstance(index, int) else len(self.arguments)
            took = True
            parts = self.arguments.setdefault(index, [])
            if isinstance(delta.get("id"), str) and delta["id"]:
                self.ids[index] = delta["id"]
            function = delta.get("function") or {}
            if isinstance(function.get("name"), str) and function["name"] and index not in self.names:
                self.names[index] = function["name"]
            if isinstance(function.get("arguments"), str):
                parts.append(function["arguments"])
        return took

    def calls(self) -> list[ToolCall]:
        out: list[ToolCall] = []
        for index in sorted(self.arguments):
            name = self.names.get(index)
            if not name:
                raise BackendError(
                    "protocol", f"tool call {index} was streamed without a name", retryable=True
                )
            text = "".join(self.arguments[index]) or "{}"
            out.append(ToolCall(name=name, arguments=text, id=self.ids.get(index) or _call_id()))
        return out


def _text(value: Any) -> str | None:
    """A reported text fact, or None (unknown) when it is absent, empty or not text."""
    return value if isinstance(value, str) and value else None


def _texts(value: Any) -> list[str] | None:
    if not isinstance(value, list):
        return None
    items = [v for v in value if isinstance(v, str) and v]
    return items or None


def _context_length(info: dict[str, Any]) -> int | None:
    """The model's context length in Ollama's `model_info`: `{architecture}.context_length`."""
    arch = info.get("general.architecture")
    if isinstance(arch, str) and arch:
        return bounded_count(info.get(f"{arch}.context_length"))
    found = [bounded_count(v) for k, v in info.items() if k.endswith(".context_length")]
    return found[0] if len(found) == 1 else None


class _Shown(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend's /api/show said of one digest: the small facts for the lease, the card for
    the worker's hash (dispatch.modelcard). None anywhere: it did not say."""

    capabilities: list[str] | None = None
    family: str | None = None
    families: list[str] | None = None
    parameter_size: str | None = None
    quantization: str | None = None
    format: str | None = None
    context_length: int | None = None
    card: ModelCard | None = None

    @classmethod
    def read(cls, body: dict[str, Any]) -> _Shown:
        caps: Any = body.get("capabilities")
        ok = isinstance(caps, list) and all(isinstance(c, str) for c in caps)
        raw_details, raw_info = body.get("details"), body.get("model_info")
        details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
        info: dict[str, Any] | None = raw_info if isinstance(raw_info, dict) else None
        card = ModelCard(
            template=body.get("template") if isinstance(body.get("template"), str) else None,
            parameters=body.get("parameters") if isinstance(body.get("parameters"), str) else None,
            model_info=info or None,
        )
        return cls(
            capabilities=list(caps) if ok else None,
            family=_text(details.get("family")),
            families=_texts(details.get("families")),
            parameter_size=_text(details.get("parameter_size")),
            quantization=_text(details.get("quantization_level")),
            format=_text(details.get("format")),
            context_length=_context_length(info or {}),
            card=None if card.empty() else card,
        )

    def onto(self, m: ModelEntry) -> ModelEntry:
        """`m` (from /api/tags) with these facts where /api/show gave them."""
        return msgspec.structs.replace(
            m,
            capabilities=self.capabilities if self.capabilities is not None else m.capabilities,
            family=self.family or m.family,
            families=self.families or m.families,
            parameter_size=self.parameter_size or m.parameter_size,
            quantization=self.quantization or m.quantization,
            format=self.format or m.format,
            context_length=self.context_length if self.context_length is not None else m.context_length,
        )


class OllamaBackend:
    """Ollama's native API: /api/tags, /api/ps, /api/chat and /api/generate (NDJSON)."""

    kind = "ollama"

    def __init__(self, url: str, *, timeout_s: float = 300.0, idle_timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.client = backend_client(self.url, idle_timeout_s)
        self.streams = LineStreams(self.client)
        # digest -> what its /api/show says (`_Shown`: None where the backend did not answer with
        # one), asked once a digest.
        self._shown: dict[str, _Shown] = {}

    async def inventory(self) -> Inventory:
        try:
            tags = await self.client.get("/api/tags", timeout=10.0)
            await _raise_for_status(tags, "*")
            ps = await self.client.get("/api/ps", timeout=10.0)
            await _raise_for_status(ps, "*")
        except Exception as exc:
            raise _classify(exc, started=False) from None
        models = []
        for m in tags.json().get("models", []):
            details = m.get("details") or {}
            models.append(
                ModelEntry(
                    name=m.get("name") or m.get("model"),
                    digest=str(m.get("digest", "")).removeprefix("sha256:"),
                    size=bounded_count(m.get("size")),
                    family=_text(details.get("family")),
                    families=_texts(details.get("families")),
                    parameter_size=_text(details.get("parameter_size")),
                    quantization=_text(details.get("quantization_level")),
                    format=_text(details.get("format")),
                    modified_at=_text(m.get("modified_at")),
                )
            )
        models = await self._with_show(models)
        loaded: list[str] = []
        loaded_bytes: dict[str, int] = {}
        loaded_models: list[LoadedModel] = []
        for m in ps.json().get("models", []):
            digest = str(m.get("digest", "")).removeprefix("sha256:")
            if not digest:
                continue
            loaded.append(digest)
            size = bounded_count(m.get("size"))
            if size is not None:
                loaded_bytes[digest] = size
            loaded_models.append(
                LoadedModel(
                    name=_text(m.get("name")) or _text(m.get("model")) or digest[:12],
                    digest=digest,
                    size=size,
                    size_vram=bounded_count(m.get("size_vram")),
                    expires_at=_text(m.get("expires_at")),
                    context_length=bounded_count(m.get("context_length")),
                )
            )
        cards = {d: shown.card for d, shown in self._shown.items() if shown.card is not None}
        return Inventory(
            models=models,
            loaded=loaded,
            loaded_bytes=loaded_bytes,
            loaded_models=loaded_models,
            cards={m.digest: cards[m.digest] for m in models if m.digest in cards},
        )

    async def _with_show(self, models: list[ModelEntry]) -> list[ModelEntry]:
        """`models` with what /api/show says of each, asking it for each digest not asked yet (one
        request per digest in the worker's life, never per task). Its facts come before those of
        /api/tags, which says less."""
        first: dict[str, str] = {}
        for m in models:
            if m.digest and m.digest not in self._shown:
                first.setdefault(m.digest, m.name)
        if first:
            await asyncio.gather(*(self._learn(digest, name) for digest, name in first.items()))
        out = []
        for m in models:
            shown = self._shown.get(m.digest)
            out.append(m if shown is None else shown.onto(m))
        return out

    async def _learn(self, digest: str, name: str) -> None:
        """Ask /api/show what `name` is and can do. A backend that cannot say (an error answer, not
        an object) is remembered as not saying; one that did not answer is asked again later."""
        try:
            resp = await self.client.post("/api/show", json={"model": name}, timeout=10.0)
        except httpx.HTTPError:
            return
        if resp.status_code >= 500:
            return
        body: Any = None
        if resp.status_code < 400:
            try:
                body = resp.json()
            except ValueError:
                body = None
        self._shown[digest] = _Shown.read(body if isinstance(body, dict) else {})

    async def generate(
        self, task: TaskMessage, local_name: str
    ) -> AsyncIterator[str | Thought | list[ToolCall] | Generated]:
        if task.kind == EMBED:
            yield await self._embed(task, local_name)
            return
        body: dict[str, Any] = {"model": local_name, "stream": True, "options": _options(task)}
        if task.format is not None:
            body["format"] = task.format
        if task.think is not None:
            body["think"] = task.think
        if task.kind == "generate":
            path, key = "/api/generate", "response"
            body["prompt"] = task.prompt or ""
            if task.system:
                body["system"] = task.system
            if task.images:
                body["images"] = task.images
        else:
            path, key = "/api/chat", "message"
            body["messages"] = ollama_messages(task.messages)
            tools = _ollama_tools(task)
            if tools:
                body["tools"] = tools
        started = False
        called = 0
        final: Generated | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                batches = self.streams.batches(path, body, local_name)
                try:
                    async for batch in batches:
                        for line in batch:
                            data = _line_decoder.decode(line)
                            if "error" in data:
                                raise BackendError("http_5xx", str(data["error"]), retryable=True)
                            piece = data.get(key)
                            text = piece.get("content", "") if isinstance(piece, dict) else (piece or "")
                            # Chat thinks in `message.thinking`, generate in a top-level `thinking`.
                            thought = (
                                piece.get("thinking") if isinstance(piece, dict) else data.get("thinking")
                            )
                            if isinstance(thought, str) and thought:
                                started = True
                                yield Thought(thought)
                            if text:
                                started = True
                                yield text
                            if isinstance(piece, dict) and piece.get("tool_calls"):
                                started = True
                                calls = _ollama_calls(piece["tool_calls"])
                                if task.parallel_tool_calls is False:
                                    # Ollama reads no `parallel_tool_calls`: one call is all the client takes.
                                    calls = calls[: max(0, 1 - called)]
                                called += len(calls)
                                if calls:
                                    yield calls
                            if data.get("done"):
                                final = Generated(
                                    timings=_ollama_timings(data), done_reason=data.get("done_reason")
                                )
                finally:
                    await batches.aclose()
                # The body was read to its end, so the connection went back to the pool.
                if final is not None:
                    yield final
                    return
            raise BackendError("disconnect", "the stream ended without its final chunk", retryable=True)
        except BackendError:
            raise
        except Exception as exc:
            raise _classify(exc, started) from None

    async def _embed(self, task: TaskMessage, local_name: str) -> Generated:
        """Ollama's /api/embed: every input in one request; the vectors and Ollama's counts."""
        body: dict[str, Any] = {"model": local_name, "input": list(task.inputs or [])}
        if task.options:
            body["options"] = dict(task.options)
        if task.truncate is not None:
            body["truncate"] = task.truncate
        if task.dimensions is not None:
            body["dimensions"] = task.dimensions
        if task.keep_alive is not None:
            body["keep_alive"] = task.keep_alive
        data = await _post_json(self.client, "/api/embed", body, local_name, self.timeout_s)
        vectors = _vectors(data.get("embeddings"), len(body["input"]))
        total = _ns_or_none(data.get("total_duration"))
        load = _ns_or_none(data.get("load_duration"))
        reading = None if total is None else total - (load or 0)
        return Generated(
            timings=Timings(
                prompt_eval_count=_int_or_none(data.get("prompt_eval_count")),
                prompt_eval_duration=reading if reading is not None and reading > 0 else None,
                load_duration=load,
                total_duration=total,
            ),
            done_reason="stop",
            embeddings=vectors,
        )

    async def pull(self, model: str, *, insecure: bool = False) -> AsyncGenerator[dict[str, Any], None]:
        """Ollama's POST /api/pull: each progress line as it comes (`{"status": …}`, byte counts
        while a layer downloads), through `{"status": "success"}`; BackendError for an error line."""
        body = {"model": model, "insecure": insecure, "stream": True}
        started = False
        try:
            # Ollama prints nothing while it verifies a large download: as long as the API waits.
            lines = self.streams.lines("/api/pull", body, model, _timeout(PULL_IDLE_S))
            try:
                async for raw in lines:
                    started = True
                    line = msgspec.json.decode(raw)
                    if not isinstance(line, dict):
                        raise BackendError(
                            "protocol",
                            f"a pull progress line that is not an object: {raw!r}",
                            retryable=False,
                        )
                    if "error" in line:
                        raise BackendError("bad_request", str(line["error"]), retryable=False)
                    yield line
            finally:
                await lines.aclose()
        except BackendError:
            raise
        except Exception as exc:
            raise _classify(exc, started) from None

    async def delete(self, model: str) -> None:
        """Ollama's DELETE /api/delete: the model is gone from the machine (BackendError
        `model_missing` when the server does not hold it)."""
        try:
            answer = await self.client.request(
                "DELETE", "/api/delete", content=msgspec.json.encode({"model": model}), timeout=60.0
            )
        except Exception as exc:
            raise _classify(exc, started=False) from None
        await _raise_for_status(answer, model)

    async def aclose(self) -> None:
        await self.client.aclose()


def _vectors(raw: Any, inputs: int) -> list[bytes]:
    """A backend's vectors, packed; BackendError unless there is one list of numbers per input."""
    if not isinstance(raw, list) or len(raw) != inputs:
        got = len(raw) if isinstance(raw, list) else type(raw).__name__
        raise BackendError("protocol", f"expected {inputs} embeddings, got {got}", retryable=True)
    out = []
    for vector in raw:
        if not isinstance(vector, list) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in vector
        ):
            raise BackendError("protocol", "an embedding is not a list of numbers", retryable=True)
        out.append(pack_vector(vector))
    return out


def _ollama_tools(task: TaskMessage) -> list[dict[str, Any]] | None:
    """The tools to offer an Ollama backend, which reads no `tool_choice`: none for "none", only
    the named one for a named function (the nearest it comes to being made to call it)."""
    choice = task.tool_choice
    if not task.tools or choice == "none":
        return None
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        return [t for t in task.tools if (t.get("function") or {}).get("name") == wanted] or task.tools
    return task.tools


def _int_or_none(value: Any) -> int | None:
    # A count out of the ledger's range is a broken report: unknown, so that the event stays valid.
    return bounded_count(value)


def _ns_or_none(value: Any) -> int | None:
    return bounded_count(value, MAX_NS)


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`, where the server reports it."""
    details = usage.get("prompt_tokens_details")
    return _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None


def _decode_ns(first: int | None, last: int | None, tokens: int | None) -> int | None:
    """Decode time of `tokens` tokens streamed from `first` to `last` (ns, the worker's clock): the
    first token came at `first`, so `last - first` spans tokens - 1 of them; scaled to all."""
    if first is None or last is None or last <= first or tokens is None or tokens < 2:
        return None
    return min(round((last - first) * tokens / (tokens - 1)), MAX_NS)


def _with_server_timings(timings: Timings, server: dict[str, Any]) -> Timings:
    """`timings` with what the server measured itself, where it said (llama-server's `timings`:
    `prompt_n` tokens evaluated in `prompt_ms`, `cache_n` more its cache held, `predicted_n`
    generated in `predicted_ms`): its clock, not the worker's, which also counts the network and
    the wait for a busy slot."""
    prompt_n = _int_or_none(server.get("prompt_n"))
    cache_n = _int_or_none(server.get("cache_n"))
    predicted_n = _int_or_none(server.get("predicted_n"))
    prompt_ns = _ms_as_ns(server.get("prompt_ms"))
    predicted_ns = _ms_as_ns(server.get("predicted_ms"))
    changes: dict[str, Any] = {}
    if prompt_n is not None and prompt_ns is not None:
        cached = cache_n or 0
        changes.update(
            prompt_eval_count=prompt_n + cached,
            prompt_eval_cached_count=cached,
            prompt_eval_duration=prompt_ns,
        )
    if predicted_n is not None and predicted_ns is not None:
        changes.update(eval_count=predicted_n, eval_duration=predicted_ns, counted=None)
    return msgspec.structs.replace(timings, **changes) if changes else timings


def _ms_as_ns(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        return None
    return _ns_or_none(round(value * 1e6))


def _ollama_timings(data: dict[str, Any]) -> Timings:
    return Timings(
        prompt_eval_count=_int_or_none(data.get("prompt_eval_count")),
        prompt_eval_cached_count=_int_or_none(data.get("prompt_eval_cached_count")),
        prompt_eval_duration=_ns_or_none(data.get("prompt_eval_duration")),
        eval_count=_int_or_none(data.get("eval_count")),
        eval_duration=_ns_or_none(data.get("eval_duration")),
        load_duration=_ns_or_none(data.get("load_duration")),
        total_duration=_ns_or_none(data.get("total_duration")),
    )


def openai_digest(model_id: str) -> str:
    """The identity of a model an OpenAI-compatible server names but says nothing else of: its name's."""
    return hashlib.sha256(f"openai-compatible:{model_id}".encode()).hexdigest()


def weights_digest(file_name: str, meta: dict[str, Any]) -> str | None:
    """The identity of a GGUF a server describes (llama-server's /v1/models `meta`): its file name
    and what the weights are (parameters, bytes, vocabulary, training context, width), not the path
    it was started from, so the same file on two machines is one model. None when `meta` lacks
    the parameter count or the size."""
    facts = {k: meta.get(k) for k in ("n_params", "size", "n_vocab", "n_ctx_train", "n_embd")}
    if not isinstance(facts["n_params"], int) or not isinstance(facts["size"], int):
        return None
    key = msgspec.json.encode({"file": file_name, **facts})
    return hashlib.sha256(b"gguf:" + key).hexdigest()


def short_name(model_id: str) -> str:
    """The name a model is shown and asked for by: a GGUF file's base name without `.gguf`
    (llama-server names a model by the path it was started with), any other id as it is (an
    alias, or `org/model` on vLLM)."""
    if not model_id.lower().endswith(".gguf"):
        return model_id
    base = model_id.replace("\\", "/").rsplit("/", 1)[-1][: -len(".gguf")]
    return base or model_id


def _parameter_size(n: Any) -> str | None:
    """A parameter count as Ollama writes it (`135M`, `8.2B`)."""
    if not isinstance(n, int) or n <= 0:
        return None
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


class OpenAIBackend:
    """An OpenAI-compatible server: /v1/models and streaming /v1/chat/completions (SSE).

    A server that reports its own timings (llama-server's `timings`: prompt and predicted tokens
    and milliseconds, and the prompt tokens its cache held) is taken at its word. Others report
    token counts (`usage`) but no durations, so the worker measures them: prompt time until the
    first token, decode time from the first token to the last.

    A server that sends no `usage` (or no `completion_tokens` in it) still streams its output:
    the output tokens are then counted as the streamed pieces that carry text, and the timings say
    so (`counted="stream"`). llama.cpp, vLLM and Ollama send one token per chunk, so the count is
    exact there; a server that batches several tokens into a chunk is undercounted (its speed
    looks lower than it is, never higher), and a token that decodes to no text (a lone special or
    partial character) is not counted.

    Identity: where the server describes the weights (llama-server's `meta`), the digest comes from
    them (`weights_digest`) and the name is the alias or the file's base name (`short_name`); the
    server's own id is kept to send back to it.
    """

    kind = "openai"

    def __init__(
        self, url: str, *, api_key: str | None = None, timeout_s: float = 300.0, idle_timeout_s: float = 120.0
    ) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.client = backend_client(self.url, idle_timeout_s, headers)
        # Our name for a model -> the server's id for it.
        self._ids: dict[str, str] = {}
        # Our name -> capability -> when the server refused it (monotonic), learned from its
        # answers and forgotten after REFUSAL_KEPT_S (its server may be restarted with it).
        self._refused: dict[str, dict[str, float]] = {}
        # The server's id -> the file its /props names (asked once, where the id is an alias).
        self._files: dict[str, str | None] = {}

    async def inventory(self) -> Inventory:
        try:
            resp = await self.client.get("/v1/models", timeout=10.0)
            await _raise_for_status(resp, "*")
            listed: Any = resp.json().get("data", [])
        except Exception as exc:
            raise _classify(exc, started=False) from None
        models: list[ModelEntry] = []
        ids: dict[str, str] = {}
        given = [
            (m["id"], m.get("meta"))
            for m in (listed if isinstance(listed, list) else [])
            if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]
        ]
        # Two files of one base name (from two folders) keep their paths as their names.
        shorts = [short_name(ident) for ident, _ in given]
        for ident, meta in given:
            name = short_name(ident) if shorts.count(short_name(ident)) == 1 else ident
            entry = await self._entry(ident, name, meta)
            ids[entry.name] = ident
            models.append(entry)
        self._ids = ids
        # The protocol cannot say what is loaded: unknown, not "nothing is loaded".
        return Inventory(models=models, loaded=[], loaded_known=False)

    async def _entry(self, ident: str, name: str, meta: Any) -> ModelEntry:
        refused = self._lacks(name)
        if not isinstance(meta, dict):
            return ModelEntry(name=name, digest=openai_digest(ident), lacks=refused)
        if ident.lower().endswith(".gguf"):
            file_name = ident.replace("\\", "/").rsplit("/", 1)[-1]
        else:
            # An alias (`--alias`): the file is named by /props, if the server says.
            file_name = await self._file_of(ident) or ident
        digest = weights_digest(file_name, meta) or openai_digest(ident)
        return ModelEntry(
            name=name,
            digest=digest,
            size=bounded_count(meta.get("size")),
            parameter_size=_parameter_size(meta.get("n_params")),
            quantization=_text(meta.get("ftype")),
            format="gguf",
            context_length=bounded_count(meta.get("n_ctx_train")),
            lacks=refused,
        )

    async def _file_of(self, ident: str) -> str | None:
        """The file an alias names, asked of /props once: whatever the answer (a failure
        included), it stands for the worker's life, so that the model's digest never changes
        under it."""
        if ident not in self._files:
            path = None
            try:
                resp = await self.client.get("/props", timeout=10.0)
                if resp.status_code == 200:
                    raw: Any = resp.json()
                    found = raw.get("model_path") if isinstance(raw, dict) else None
                    path = found.replace("\\", "/").rsplit("/", 1)[-1] if isinstance(found, str) else None
            except (httpx.HTTPError, ValueError) as exc:
                log.warning(
                    "%s: /props did not say which file %s is (%s); naming it by its alias",
                    self.url,
                    ident,
                    exc,
                )
            self._files[ident] = path or None
        return self._files[ident]

    def refused(self, local_name: str, capability: str) -> None:
        """The server refused `capability` for the model: the inventories of the next
        REFUSAL_KEPT_S say it lacks it."""
        self._refused.setdefault(local_name, {})[capability] = time.monotonic()

    def _lacks(self, name: str) -> list[str] | None:
        now = time.monotonic()
        return sorted(c for c, at in self._refused.get(name, {}).items() if now - at < REFUSAL_KEPT_S) or None

    def _server_id(self, local_name: str) -> str:
        return self._ids.get(local_name, local_name)

    async def generate(
        self, task: TaskMessage, local_name: str
    ) -> AsyncIterator[str | Thought | list[ToolCall] | Generated]:
        if task.kind == EMBED:
            yield await self._embed(task, local_name)
            return
        if task.kind == "generate":
            messages: list[dict[str, Any]] = (
                [{"role": "system", "content": task.system}] if task.system else []
            )
            messages.append({"role": "user", "content": image_content(task.prompt or "", task.images)})
        else:
            messages = openai_messages(task.messages)
        body: dict[str, Any] = {
            "model": self._server_id(local_name),
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if task.tools:
            body["tools"] = task.tools
            if task.tool_choice is not None:
                body["tool_choice"] = task.tool_choice
            if task.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = task.parallel_tool_calls
        response_format = _openai_format(task)
        if response_format is not None:
            body["response_format"] = response_format
        effort = _effort(task.think)
        if effort is not None:
            body["reasoning_effort"] = effort
        if task.max_tokens is not None:
            body["max_tokens"] = task.max_tokens
        for key in ("temperature", "top_p", "seed", "stop"):
            if key in task.options:
                body[key] = task.options[key]
        started = False
        t0 = time.perf_counter_ns()
        first: int | None = None
        last: int | None = None
        usage: dict[str, Any] = {}
        server: dict[str, Any] = {}
        reason: str | None = None
        done_at: int | None = None
        pieces = 0
        streamed_calls = _CallsBeingStreamed()
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await open_stream(self.client, "/v1/chat/completions", body, "text/event-stream")
                try:
                    await _raise_for_status(resp, local_name)
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            done_at = time.perf_counter_ns()
                            continue
                        data = _line_decoder.decode(payload)
                        if data.get("usage"):
                            usage = data["usage"]
                        if isinstance(data.get("timings"), dict):
                            # llama-server's own figures, on its last chunk.
                            server = data["timings"]
                        for choice in data.get("choices") or []:
                            delta = choice.get("delta") or {}
                            text = delta.get("content") or ""
                            # Not OpenAI's own: vLLM says `reasoning_content`, others `reasoning`.
                            thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
                            reason = choice.get("finish_reason") or reason
                            calling = streamed_calls.add(delta.get("tool_calls"))
                            if not isinstance(thought, str):
                                thought = ""
                            if text or calling or thought:
                                now = time.perf_counter_ns()
                                first = first or now
                                last = now
                                started = True
                                pieces += 1
                            if thought:
                                yield Thought(thought)
                            if text:
                                yield text
                    # The body was read to its end, so the connection goes back to the pool.
                    if done_at is not None:
                        calls = streamed_calls.calls()
                        if calls:
                            yield calls
                        if reason == "tool_calls":
                            # In Ollama's terms (the ledger's): the model stopped of itself.
                            reason = "stop"
                        eval_count = _int_or_none(usage.get("completion_tokens"))
                        counted = None
                        if eval_count is None and pieces > 0:
                            eval_count, counted = pieces, "stream"
                        timings = Timings(
                            prompt_eval_count=_int_or_none(usage.get("prompt_tokens")),
                            prompt_eval_cached_count=_cached_tokens(usage),
                            prompt_eval_duration=(first - t0) if first else None,
                            eval_count=eval_count,
                            eval_duration=_decode_ns(first, last, eval_count),
                            total_duration=done_at - t0,
                            counted=counted,
                        )
                        yield Generated(timings=_with_server_timings(timings, server), done_reason=reason)
                        return
                finally:
                    await resp.aclose()
            raise BackendError("disconnect", "the stream ended without [DONE]", retryable=True)
        except BackendError:
            raise
        except Exception as exc:
            raise _classify(exc, started) from None

    async def _embed(self, task: TaskMessage, local_name: str) -> Generated:
        """/v1/embeddings: every input in one request, as floats; `truncate` and `keep_alive` are
        Ollama's and not sent. The duration is the request's wall time (the server reports none)."""
        body: dict[str, Any] = {
            "model": self._server_id(local_name),
            "input": list(task.inputs or []),
            "encoding_format": "float",
        }
        if task.dimensions is not None:
            body["dimensions"] = task.dimensions
        t0 = time.perf_counter_ns()
        try:
            data = await _post_json(self.client, "/v1/embeddings", body, local_name, self.timeout_s)
        except BackendError as exc:
            if exc.kind == "unsupported":
                self.refused(local_name, "embedding")
            raise
        wall = time.perf_counter_ns() - t0
        items = data.get("data")
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise BackendError("protocol", "the answer has no list of embeddings in `data`", retryable=True)
        ordered = sorted(items, key=lambda i: i.get("index") if isinstance(i.get("index"), int) else 0)
        vectors = _vectors([i.get("embedding") for i in ordered], len(body["input"]))
        usage: Any = data.get("usage")
        if not isinstance(usage, dict):
            usage = {}
        return Generated(
            timings=Timings(
                prompt_eval_count=_int_or_none(usage.get("prompt_tokens")),
                prompt_eval_duration=_ns_or_none(wall),
                total_duration=_ns_or_none(wall),
            ),
            done_reason="stop",
            embeddings=vectors,
        )

    async def aclose(self) -> None:
        await self.client.aclose()


def make_backend(url: str, kind: str, *, timeout_s: float, idle_timeout_s: float) -> Backend:
    """The adapter for `kind` (ollama or openai)."""
    if kind == "ollama":
        return OllamaBackend(url, timeout_s=timeout_s, idle_timeout_s=idle_timeout_s)
    if kind == "openai":
        return OpenAIBackend(url, timeout_s=timeout_s, idle_timeout_s=idle_timeout_s)
    raise BackendError("bad_request", f"unknown backend kind {kind!r}; use ollama or openai", retryable=False)
