"""One simulated machine's HTTP API (sim/backends/hosts.py runs several, each on its own port).

Each machine serves Ollama's native API (`/api/tags`, `/api/ps`, `/api/version`, `/api/show`,
`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/pull`, `/api/delete`), the
OpenAI-compatible `/v1/models`, `/v1/chat/completions` and `/v1/embeddings`, and operator controls
under `/sim/` (`GET /sim/state`, `POST /sim/faults`, `POST /sim/offline`, and `POST /sim/speed
{"factor": 0.06}`: every model's decode and prompt speed times that factor from now on, the fleet
TOML's `[[worker.slowdown]]` at run time; 1 restores it).

Time: every duration a response reports (load, prompt eval, eval, total) is simulated and unscaled,
so `eval_count / eval_duration` is the preset's decode speed at any `time_scale`; the machine really
waits that long times `time_scale` (0: no waiting at all, timings still reported as if real). Queue
waits enter `total_duration` as wall time divided by `time_scale`. Keep-alive expiry and online
windows run on the wall clock times `time_scale` (unscaled when it is 0). The OpenAI-compatible API
carries no timings; a client timing it sees scaled wall time.

Capabilities (the fleet's per-model `capabilities`, reported by `/api/show`): a request that asks a
model for what it lacks is refused as Ollama refuses it, HTTP 400 `{"error": "\"NAME\" does not
support tools"}` (OpenAI's API: the same message in `{"error": {"message", "type":
"invalid_request_error", …}}`): `tools` without `tools`, images without `vision`, a truthy `think`
(or `reasoning_effort` other than "none") without `thinking`, an embedding without `embedding`,
chat or generate without `completion` ("does not support chat" / "does not support generate").

Tools: the rule of sim.backends.tools (call the tools named in the last user message, else the
first; arguments drawn from each tool's schema; after tool results, prose quoting them).

Images: Ollama's base64 `images` (on chat messages or generate) and OpenAI's `image_url` parts with
`data:…;base64,` URLs (remote URLs are refused: the server fetches nothing); each image costs a
`vision` model sim.backends.ask.IMAGE_TOKENS (576) prompt tokens, in `prompt_eval_count` and in time.

Prompt cache: each parallel slot of a loaded model keeps its last prompt and what it generated
(sim.backends.machine.SlotCache); a request takes the free slot sharing the longest prefix with its
prompt (none: the least recently used) and evaluates only the rest. The prompt is the messages'
texts joined by "\n", so a chat that resends the answer it received, then a new question, extends
the cached text. `prompt_eval_count` and `usage.prompt_tokens` stay the whole prompt, as Ollama
reports them; `prompt_eval_cached_count` (`usage.prompt_tokens_details.cached_tokens`) is the cached
part, and `prompt_eval_duration` the time of the rest. Unloading the model loses every slot's cache;
`/sim/state` counts `cached_prompt_tokens` and `cache_hits`.

Structured output: Ollama's `format` ("json" or a JSON schema) and OpenAI's `response_format`
(`json_object`, or `json_schema` with its schema; read as a `format` by dispatch.response_format, as
the API reads it). A model that follows formats answers a schema
with a value valid against it (sim.backends.schema), and plain JSON mode with a JSON object, as real
models answer it (`{"answer": "<pseudo-sentence>", "details": [two more]}`: sim.backends.text.json_answer);
a model whose table says `follows_format = false` ignores the format and answers prose, as a model
without JSON mode would.

Thinking: `think: true` (or a level) on Ollama's chat and generate, and `reasoning_effort` (or
Ollama's `think` in the body) on OpenAI's, make a `thinking` model think first: pseudo-words, half
as many tokens as the answer and at least 8, sent as `message.thinking` (`thinking` on generate)
and, on the OpenAI side, `reasoning_content`. Thinking tokens count in `eval_count` and decode
time, and `num_predict` / `max_tokens` caps thinking and answer together, as Ollama counts them.
Without `think` a model does not think.

Embeddings: deterministic unit vectors (sim.backends.embedding); an embedding request takes a slot
and lasts load (if not loaded) plus prompt tokens / the machine's `embed_tps` (default: its
`prompt_tps`), times `time_scale`; its keep_alive works as for generation. No faults are drawn for
embeddings.

Metadata: `/api/show` answers the model's capabilities, template (the table's, or a ChatML one built
from the capabilities), parameters, details and model_info; `/api/tags` and `/api/ps` its details
and size; `/api/ps` `expires_at` comes from the machine's keep-alive timer and `size_vram` is the
size, or the worker's `vram_bytes` if smaller. A fact the fleet does not give (family, parameter
size, size, context length) is left out of every answer rather than reported as 0 or "".

Faults are drawn once per generation request from a seeded stream: an error answers HTTP 500 with
Ollama's `{"error": …}` at once; a hang answers nothing and holds no slot until the client leaves;
a disconnect sends some chunks (none, for a non-streaming request) and then closes the connection.

The HTTP server is a thin ASGI app on uvicorn's httptools protocol (sim/backends/listener.py), one
listener per machine on a shared event loop; a request in zero-delay mode costs a few hundred
microseconds of CPU.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
from starlette.types import Receive, Scope, Send

from dispatch.errors import ResponseFormatError
from dispatch.ollama import OLLAMA_VERSION
from dispatch.response_format import ollama_format
from sim.backends.ask import Ask
from sim.backends.formats import (
    NDJSON,
    ChatFormat,
    Format,
    GenerateFormat,
    OpenAIFormat,
    ollama_embed,
    ollama_embeddings,
    openai_embeddings,
    openai_error,
)
from sim.backends.listener import Listener, read_body, respond, until_disconnect
from sim.backends.machine import Embedded, SimMachine, keep_alive_seconds
from sim.backends.wire import (
    ChatMessageBody,
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    FaultsRequest,
    GenerateRequest,
    ModelRequest,
    OpenAIChatRequest,
    OpenAIEmbeddingsRequest,
    SpeedRequest,
    content_text,
    decode_body,
    image_parts,
    int_option,
)
from sim.errors import BadRequestError, SimHostError, UnknownModelError

# What a runner crash looks like from the client's side (Ollama's own message).
RUNNER_CRASH: Final = "llama runner process has terminated: exit status 2"

_enc: Final = msgspec.json.Encoder()

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class MachineApp:
    """The ASGI app of one simulated machine."""

    def __init__(self, machine: SimMachine) -> None:
        self.machine = machine
        self.listener: Listener | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._openai_seq = 0
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/"): self._root,
            ("HEAD", "/"): self._root,
            ("GET", "/api/version"): self._version,
            ("GET", "/api/tags"): self._tags,
            ("GET", "/api/ps"): self._ps,
            ("POST", "/api/show"): self._show,
            ("POST", "/api/chat"): self._chat,
            ("POST", "/api/generate"): self._generate,
            ("POST", "/api/pull"): self._pull,
            ("DELETE", "/api/delete"): self._delete,
            ("GET", "/v1/models"): self._v1_models,
            ("POST", "/v1/chat/completions"): self._v1_chat,
            ("POST", "/api/embed"): self._embed,
            ("POST", "/api/embeddings"): self._embeddings,
            ("POST", "/v1/embeddings"): self._v1_embeddings,
            ("GET", "/sim/state"): self._sim_state,
            ("POST", "/sim/faults"): self._sim_faults,
            ("POST", "/sim/offline"): self._sim_offline,
            ("POST", "/sim/speed"): self._sim_speed,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        handler = self._routes.get((scope["method"], scope["path"]))
        if handler is None:
            known = any(path == scope["path"] for _, path in self._routes)
            await respond(
                send, 405 if known else 404, b"404 page not found" if not known else b"", b"text/plain"
            )
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await handler(scope, receive, send)
        except BadRequestError as exc:
            await respond(send, 400, _enc.encode({"error": str(exc)}))
        except asyncio.CancelledError:
            # Cancelled by power-off: the connection is already cut, nothing is left to answer.
            if task is not None and not self.machine.online:
                task.uncancel()
                return
            raise
        finally:
            if task is not None:
                self._tasks.discard(task)

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def power_off(self, keep: asyncio.Transport | None = None) -> None:
        """Power the machine off: its port closes, open connections drop (but `keep`), loaded models
        are lost."""
        self.machine.power_off()
        if self.listener is not None:
            await self.listener.close(keep=keep)
        self.cancel_all()

    # -- small endpoints ----------------------------------------------------------------------

    async def _root(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"Ollama is running", b"text/plain; charset=utf-8")

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, _enc.encode({"version": OLLAMA_VERSION}))

    def _details(self, key: str) -> dict[str, Any]:
        """Ollama's `details` of a model: the facts its fleet table gives, and none it does not."""
        spec = self.machine.fleet.model_spec(key)
        details: dict[str, Any] = {"parent_model": "", "format": "gguf"}
        if spec.family:
            details["family"] = spec.family
            details["families"] = [spec.family]
        if spec.parameter_size:
            details["parameter_size"] = spec.parameter_size
        if spec.quantization:
            details["quantization_level"] = spec.quantization
        return details

    async def _tags(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.machine
        models = []
        for model in m.models.values():
            entry: dict[str, Any] = {
                "name": model.name,
                "model": model.name,
                "modified_at": m.modified_at[model.name],
                "digest": model.digest,
                "details": self._details(model.key),
            }
            if model.spec.size is not None:
                entry["size"] = model.spec.size
            models.append(entry)
        await respond(send, 200, _enc.encode({"models": models}))

    async def _ps(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.machine
        out = []
        for loaded in m.loaded():
            model = m.models[loaded.name]
            entry: dict[str, Any] = {
                "name": loaded.name,
                "model": loaded.name,
                "digest": loaded.digest,
                "details": self._details(model.key),
                # When the model unloads, from the machine's own keep-alive timer.
                "expires_at": loaded.expires_at,
                # The runner's context window: Ollama's default num_ctx, within the model's own.
                "context_length": min(4096, model.spec.context_length or 4096),
            }
            if loaded.size is not None:
                entry["size"] = loaded.size
            if loaded.size_vram is not None:
                entry["size_vram"] = loaded.size_vram
            out.append(entry)
        await respond(send, 200, _enc.encode({"models": out}))

    async def _show(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), ModelRequest)
        try:
            model = self.machine.find(req.which)
        except UnknownModelError:
            await respond(send, 404, _enc.encode({"error": f"model '{req.which}' not found"}))
            return
        spec = model.spec
        info: dict[str, Any] = {}
        if spec.family:
            info["general.architecture"] = spec.family
        count = _parameter_count(spec.parameter_size)
        if count is not None:
            info["general.parameter_count"] = count
        if spec.family and spec.context_length is not None:
            info[f"{spec.family}.context_length"] = spec.context_length
        if spec.family and "embedding" in spec.capabilities:
            info[f"{spec.family}.embedding_length"] = spec.embedding_dim
        body = {
            "license": "",
            "modelfile": f'# Modelfile generated by "ollama show"\nFROM {model.name}\n',
            "parameters": spec.parameters if spec.parameters is not None else _DEFAULT_PARAMETERS,
            "template": spec.template if spec.template is not None else default_template(spec.capabilities),
            "details": self._details(model.key),
            "model_info": info,
            "capabilities": list(spec.capabilities),
            "modified_at": self.machine.modified_at[model.name],
        }
        await respond(send, 200, _enc.encode(body))

    async def _pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), ModelRequest)
        m = self.machine
        try:
            name = m.give_model(req.which)
        except UnknownModelError:
            await respond(send, 500, _enc.encode({"error": "pull model manifest: file does not exist"}))
            return
        if req.stream is False:
            await respond(send, 200, _enc.encode({"status": "success"}))
            return
        model = m.models[name]
        digest = f"sha256:{model.digest}"
        size = model.spec.size
        # A model of unknown size reports its layer without byte counts.
        total: dict[str, int] = {} if size is None else {"total": size}
        done: dict[str, int] = {} if size is None else {"total": size, "completed": size}
        lines = [
            {"status": "pulling manifest"},
            {"status": f"pulling {model.digest[:12]}", "digest": digest, **total},
            {"status": f"pulling {model.digest[:12]}", "digest": digest, **done},
            {"status": "verifying sha256 digest"},
            {"status": "writing manifest"},
            {"status": "success"},
        ]
        body = b"".join(_enc.encode(line) + b"\n" for line in lines)
        await respond(send, 200, body, NDJSON)

    async def _delete(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), ModelRequest)
        try:
            self.machine.take_model(req.which)
        except UnknownModelError:
            await respond(send, 404, _enc.encode({"error": f"model '{req.which}' not found"}))
            return
        await respond(send, 200, b"")

    async def _v1_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        data = [
            {"id": name, "object": "model", "created": int(_START), "owned_by": "library"}
            for name in self.machine.models
        ]
        await respond(send, 200, _enc.encode({"object": "list", "data": data}))

    # -- generation ---------------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), ChatRequest)
        messages = req.messages or []
        images = [image for msg in messages for image in msg.images or []]
        await self._serve(
            scope,
            receive,
            send,
            ChatFormat(req.model),
            Ask(
                model=req.model,
                prompt="\n".join(content_text(msg.content) for msg in messages),
                last_user=_last_user(messages),
                seed=int_option(req.options, "seed"),
                max_tokens=int_option(req.options, "num_predict"),
                keep_alive=req.keep_alive,
                load_only=not messages,
                format=req.format or None,
                tools=req.tools or None,
                tool_results=_tool_results(messages),
                images=_count_base64_images(images),
                think=_thinks(req.think),
                surface="chat",
            ),
            stream=req.stream is not False,
        )

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), GenerateRequest)
        prompt = req.prompt or ""
        await self._serve(
            scope,
            receive,
            send,
            GenerateFormat(req.model),
            Ask(
                model=req.model,
                prompt=f"{req.system}\n{prompt}" if req.system else prompt,
                last_user=prompt,
                seed=int_option(req.options, "seed"),
                max_tokens=int_option(req.options, "num_predict"),
                keep_alive=req.keep_alive,
                load_only=not prompt,
                format=req.format or None,
                images=_count_base64_images(req.images or []),
                think=_thinks(req.think),
                surface="generate",
            ),
            stream=req.stream is not False,
        )

    async def _v1_chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), OpenAIChatRequest)
        self._openai_seq += 1
        include_usage = self.machine.spec.openai_usage and bool(
            req.stream_options and req.stream_options.get("include_usage")
        )
        fmt = OpenAIFormat(req.model, include_usage, self._openai_seq)
        try:
            images = sum(_count_data_urls(image_parts(msg.content)) for msg in req.messages)
            ask = Ask(
                model=req.model,
                prompt="\n".join(content_text(msg.content) for msg in req.messages),
                last_user=_last_user(req.messages),
                seed=req.seed,
                max_tokens=req.max_completion_tokens or req.max_tokens,
                format=ollama_format(req.response_format),
                tools=req.tools or None,
                tool_choice=req.tool_choice,
                parallel_tool_calls=req.parallel_tool_calls is not False,
                tool_results=_tool_results(req.messages),
                images=images,
                think=_openai_thinks(req.reasoning_effort, req.think),
            )
        except (BadRequestError, ResponseFormatError) as exc:
            await respond(send, 400, fmt.error(str(exc), 400))
            return
        await self._serve(scope, receive, send, fmt, ask, stream=req.stream is True)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, fmt: Format, ask: Ask, *, stream: bool
    ) -> None:
        m = self.machine
        try:
            job = m.plan(ask)
        except UnknownModelError as exc:
            await respond(send, 404, fmt.error(str(exc), 404))
            return
        except SimHostError as exc:
            await respond(send, 400, fmt.error(str(exc), 400))
            return
        if job.fault == "error":
            await respond(send, 500, fmt.error(RUNNER_CRASH))
            return
        if job.fault == "hang":
            # Never answers; the client gives up (or the machine powers off).
            await until_disconnect(receive)
            return
        fmt.bind(job.answer)
        load_only = ask.load_only
        transport = self.listener.transport_of(scope) if self.listener else None
        if transport is not None:
            job.gone = transport.is_closing
        if load_only:
            job.load_only = True
            job.unload = keep_alive_is_zero(ask.keep_alive)
        started = False

        async def emit(tokens: list[str]) -> None:
            nonlocal started
            if not started:
                started = True
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", fmt.stream_type)],
                    }
                )
            body = fmt.lines(tokens)
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})

        timings = await m.run(job, emit if stream and not load_only else None)
        if timings is None:
            if job.fault == "disconnect" and transport is not None:
                # Mid-stream: what was sent stays sent, then the connection drops.
                transport.close()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2.0):
                        await until_disconnect(receive)
            return
        if load_only and job.unload:
            timings = msgspec.structs.replace(timings, done_reason="unload")
        if not stream:
            await respond(send, 200, fmt.whole(job.tokens[: timings.eval_count], timings))
            return
        if not started:
            started = True
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", fmt.stream_type)],
                }
            )
        await send({"type": "http.response.body", "body": fmt.final(timings), "more_body": False})

    # -- embeddings -----------------------------------------------------------------------------

    async def _embed_with(
        self,
        send: Send,
        model: str,
        texts: list[str],
        *,
        truncate: bool = True,
        dimensions: int | None = None,
        keep_alive: object = None,
        error: Callable[[str, int], bytes],
    ) -> Embedded | None:
        """Embed on this machine; None when the error answer has been sent."""
        try:
            return await self.machine.embed(
                model, texts, truncate=truncate, dimensions=dimensions, keep_alive=keep_alive
            )
        except UnknownModelError as exc:
            await respond(send, 404, error(str(exc), 404))
        except SimHostError as exc:
            await respond(send, 400, error(str(exc), 400))
        return None

    async def _embed(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), EmbedRequest)
        texts = [req.input] if isinstance(req.input, str) else req.input
        done = await self._embed_with(
            send,
            req.model,
            [t for t in texts if t],
            truncate=req.truncate is not False,
            dimensions=req.dimensions,
            keep_alive=req.keep_alive,
            error=_ollama_error,
        )
        if done is not None:
            await respond(send, 200, ollama_embed(req.model, done))

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), EmbeddingsRequest)
        done = await self._embed_with(
            send,
            req.model,
            [req.prompt] if req.prompt else [],
            keep_alive=req.keep_alive,
            error=_ollama_error,
        )
        if done is not None:
            await respond(send, 200, ollama_embeddings(done))

    async def _v1_embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.machine.spec.openai_embeddings:
            # llama-server's own answer when it was started without --embeddings.
            message = "This server does not support embeddings. Start it with `--embeddings`"
            await respond(send, 501, openai_error(message, 501))
            return
        try:
            req = decode_body(await read_body(receive), OpenAIEmbeddingsRequest)
        except BadRequestError as exc:
            await respond(send, 400, openai_error(f"{exc}; input must be a string or a list of strings", 400))
            return
        texts = [req.input] if isinstance(req.input, str) else req.input
        encoding = req.encoding_format or "float"
        if encoding not in ("float", "base64"):
            await respond(
                send, 400, openai_error(f"encoding_format must be float or base64, got {encoding!r}", 400)
            )
            return
        if not texts or any(not t for t in texts):
            await respond(
                send, 400, openai_error("input must be a non-empty string or list of non-empty strings", 400)
            )
            return
        done = await self._embed_with(send, req.model, texts, dimensions=req.dimensions, error=openai_error)
        if done is not None:
            await respond(send, 200, openai_embeddings(req.model, done, encoding == "base64"))

    # -- operator controls --------------------------------------------------------------------

    async def _sim_state(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, _enc.encode(self.machine.state()))

    async def _sim_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), FaultsRequest)
        try:
            faults = self.machine.set_faults(
                error_rate=req.error_rate, hang_rate=req.hang_rate, disconnect_rate=req.disconnect_rate
            )
        except SimHostError as exc:
            await respond(send, 400, _enc.encode({"error": str(exc)}))
            return
        await respond(send, 200, _enc.encode(faults))

    async def _sim_speed(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), SpeedRequest)
        try:
            self.machine.set_speed(req.factor)
        except SimHostError as exc:
            await respond(send, 400, _enc.encode({"error": str(exc)}))
            return
        await respond(send, 200, _enc.encode(self.machine.state()))

    async def _sim_offline(self, scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        me = self.listener.transport_of(scope) if self.listener else None
        await self.power_off(keep=me)
        await respond(send, 200, _enc.encode(self.machine.state()))
        if me is not None:
            me.close()


def keep_alive_is_zero(value: object) -> bool:
    try:
        return keep_alive_seconds(value) == 0
    except SimHostError:
        return False


# Sampling parameters `/api/show` reports for a model whose table gives none (Qwen3's own).
_DEFAULT_PARAMETERS: Final = "temperature 0.6\ntop_k 20\ntop_p 0.95"


def default_template(capabilities: list[str]) -> str:
    """A ChatML prompt template with the parts the capabilities need (Ollama itself decides that a
    model takes tools or thinks from whether its template reads `.Tools` or `.Thinking`)."""
    if "completion" not in capabilities:
        return "{{ .Prompt }}"
    parts = []
    if "tools" in capabilities:
        parts.append(
            "{{- if .Tools }}<|im_start|>system\n# Tools\n"
            "{{ range .Tools }}{{ . }}\n{{ end }}<|im_end|>\n{{ end }}"
        )
    parts.append("{{- range .Messages }}<|im_start|>{{ .Role }}\n")
    if "thinking" in capabilities:
        parts.append("{{- if .Thinking }}<think>{{ .Thinking }}</think>{{ end }}")
    parts.append("{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n")
    return "".join(parts)


def _last_user(messages: list[ChatMessageBody]) -> str:
    return next((content_text(m.content) for m in reversed(messages) if m.role == "user"), "")


def _tool_results(messages: list[ChatMessageBody]) -> list[str]:
    """The contents of the `tool` messages that end the conversation, in order."""
    results: list[str] = []
    for msg in reversed(messages):
        if msg.role != "tool":
            break
        results.append(content_text(msg.content))
    return results[::-1]


def _count_base64_images(images: list[str]) -> int:
    """How many images, each checked to be base64 as Ollama takes them."""
    for i, image in enumerate(images):
        try:
            base64.b64decode(image, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequestError(
                f"image {i} is not valid base64: send each image's bytes base64-encoded, "
                "without a data: prefix"
            ) from None
    return len(images)


def _count_data_urls(urls: list[str]) -> int:
    """How many `image_url` parts, each checked to be an inline base64 data URL."""
    for url in urls:
        head, sep, data = url.partition(",")
        if not (head.startswith("data:") and head.endswith(";base64") and sep):
            raise BadRequestError(
                "image_url must be a data URL (data:image/png;base64,…): only inline images are "
                "accepted; the server fetches nothing"
            )
        _count_base64_images([data])
    return len(urls)


def _thinks(think: bool | str | None) -> bool:
    """Ollama's `think`: true, or a level ("low", "medium", "high"), asks for thinking."""
    if isinstance(think, str):
        if think not in ("low", "medium", "high"):
            raise BadRequestError(f"think must be true, false, or low, medium or high; got {think!r}")
        return True
    return bool(think)


def _openai_thinks(effort: str | None, think: bool | str | None) -> bool:
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high"):
            raise BadRequestError(
                f"reasoning_effort must be none, minimal, low, medium or high; got {effort!r}"
            )
        return effort != "none"
    return _thinks(think)


def _ollama_error(message: str, status: int) -> bytes:
    return _enc.encode({"error": message})


def _parameter_count(size: str) -> int | None:
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    if size and size[-1].upper() in units:
        with contextlib.suppress(ValueError):
            return round(float(size[:-1]) * units[size[-1].upper()])
    return None


_START = time.time()
