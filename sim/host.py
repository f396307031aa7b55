"""Simulated machines that speak Ollama's HTTP API, several per process, each on its own port.

    async with SimHosts(load_fleet("seed"), time_scale=0.1, seed=7) as hosts:
        ollama.AsyncClient(hosts.url("rtx3070ti"))
        await hosts.go_offline("rtx3070ti")      # the port closes, as when the PC is shut down

Each machine serves Ollama's native API (`/api/tags`, `/api/ps`, `/api/version`, `/api/show`,
`/api/chat`, `/api/generate`, `/api/pull`, `/api/delete`), the OpenAI-compatible `/v1/models` and
`/v1/chat/completions`, and operator controls under `/sim/` (`GET /sim/state`, `POST /sim/faults`,
`POST /sim/offline`). A machine that is offline has no port to ask, so the host process also serves a
control port (`SimHosts.control_url`) with `/sim/{machine}/…` for every machine, `online` included.

Time: every duration a response reports (load, prompt eval, eval, total) is simulated and unscaled,
so `eval_count / eval_duration` is the preset's decode speed at any `time_scale`; the machine really
waits that long times `time_scale` (0: no waiting at all, timings still reported as if real). Queue
waits enter `total_duration` as wall time divided by `time_scale`. Keep-alive expiry and online
windows run on the wall clock times `time_scale` (unscaled when it is 0). The OpenAI-compatible API
carries no timings; a client timing it sees scaled wall time.

JSON mode: a chat or generate request that sets Ollama's `format` is answered with a JSON array of
short pseudo-sentences (sim.text.json_answer; schemas are not read), unless the model's preset says
`follows_format = false`, in which case it answers prose as usual.

Faults are drawn once per generation request from a seeded stream: an error answers HTTP 500 with
Ollama's `{"error": …}` at once; a hang answers nothing and holds no slot until the client leaves;
a disconnect sends some chunks (none, for a non-streaming request) and then closes the connection.

The HTTP server is a thin ASGI app on uvicorn's httptools protocol, one listener per machine on a
shared event loop; a request in zero-delay mode costs a few hundred microseconds of CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from sim.fleet import Fleet, WorkerSpec
from sim.machine import (
    Faults,
    MachineState,
    SimHostError,
    SimMachine,
    Timings,
    UnknownModelError,
    keep_alive_seconds,
)

log = logging.getLogger(__name__)

OLLAMA_VERSION = "0.12.3"
JSON = b"application/json; charset=utf-8"
NDJSON = b"application/x-ndjson"
SSE = b"text/event-stream"
# What a runner crash looks like from the client's side (Ollama's own message).
RUNNER_CRASH = "llama runner process has terminated: exit status 2"

_enc = msgspec.json.Encoder()


# -- requests -------------------------------------------------------------------------------------


class _Message(msgspec.Struct):
    role: str = "user"
    content: str | list[dict[str, Any]] | None = None


class _ChatRequest(msgspec.Struct):
    model: str
    messages: list[_Message] | None = None
    stream: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    format: str | dict[str, Any] | None = None


class _GenerateRequest(msgspec.Struct):
    model: str
    prompt: str | None = None
    system: str | None = None
    stream: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    format: str | dict[str, Any] | None = None


class _OpenAIChatRequest(msgspec.Struct):
    model: str
    messages: list[_Message]
    stream: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    stream_options: dict[str, Any] | None = None


class _ModelRequest(msgspec.Struct):
    model: str | None = None
    name: str | None = None
    stream: bool | None = None

    @property
    def which(self) -> str:
        return self.model or self.name or ""


class _FaultsRequest(msgspec.Struct):
    error_rate: float | None = None
    hang_rate: float | None = None
    disconnect_rate: float | None = None


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI's content parts: only the text parts count.
    return "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")


def _int_option(options: dict[str, Any] | None, key: str) -> int | None:
    if not options:
        return None
    value = options.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


_T = TypeVar("_T")


class _BadRequestError(SimHostError):
    """Raised when a request body is not what the endpoint takes."""


def _decode(body: bytes, kind: type[_T]) -> _T:
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.DecodeError as exc:
        raise _BadRequestError(str(exc)) from None


# -- response formats -----------------------------------------------------------------------------


def _now_rfc3339() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f"{now % 1:.6f}"[1:] + "Z"


_TOKEN_CACHE: dict[str, bytes] = {}


def _json_str(token: str) -> bytes:
    enc = _TOKEN_CACHE.get(token)
    if enc is None:
        enc = _enc.encode(token)
        if len(_TOKEN_CACHE) < 65536:
            _TOKEN_CACHE[token] = enc
    return enc


class _Format:
    """How one API spells a generation: streamed chunks, the final chunk, the whole answer, errors."""

    stream_type = NDJSON

    def __init__(self, model: str) -> None:
        self.model = model
        self.model_json = _enc.encode(model)

    def lines(self, tokens: list[str]) -> bytes:
        raise NotImplementedError

    def final(self, timings: Timings) -> bytes:
        raise NotImplementedError

    def whole(self, text: str, timings: Timings) -> bytes:
        raise NotImplementedError

    def error(self, message: str) -> bytes:
        return _enc.encode({"error": message})


def _metrics(t: Timings) -> dict[str, Any]:
    return {
        "done_reason": t.done_reason,
        "done": True,
        "total_duration": t.total_duration,
        "load_duration": t.load_duration,
        "prompt_eval_count": t.prompt_eval_count,
        "prompt_eval_duration": t.prompt_eval_duration,
        "eval_count": t.eval_count,
        "eval_duration": t.eval_duration,
    }


class _ChatFormat(_Format):
    def lines(self, tokens: list[str]) -> bytes:
        head = (
            b'{"model":'
            + self.model_json
            + b',"created_at":"'
            + _now_rfc3339().encode()
            + b'","message":{"role":"assistant","content":'
        )
        tail = b'},"done":false}\n'
        return b"".join([head + _json_str(t) + tail for t in tokens])

    def final(self, timings: Timings) -> bytes:
        return self.whole("", timings) + b"\n"

    def whole(self, text: str, timings: Timings) -> bytes:
        return _enc.encode(
            {
                "model": self.model,
                "created_at": _now_rfc3339(),
                "message": {"role": "assistant", "content": text},
                **_metrics(timings),
            }
        )


class _GenerateFormat(_Format):
    def lines(self, tokens: list[str]) -> bytes:
        head = (
            b'{"model":' + self.model_json + b',"created_at":"' + _now_rfc3339().encode() + b'","response":'
        )
        tail = b',"done":false}\n'
        return b"".join([head + _json_str(t) + tail for t in tokens])

    def final(self, timings: Timings) -> bytes:
        return self.whole("", timings) + b"\n"

    def whole(self, text: str, timings: Timings) -> bytes:
        return _enc.encode(
            {"model": self.model, "created_at": _now_rfc3339(), "response": text, **_metrics(timings)}
        )


class _OpenAIFormat(_Format):
    stream_type = SSE

    def __init__(self, model: str, include_usage: bool, seq: int) -> None:
        super().__init__(model)
        self.include_usage = include_usage
        self.created = int(time.time())
        self.id = f"chatcmpl-{seq}"

    def _chunk_head(self) -> bytes:
        return (
            b'data: {"id":"'
            + self.id.encode()
            + b'","object":"chat.completion.chunk","created":'
            + str(self.created).encode()
            + b',"model":'
            + self.model_json
            + b',"system_fingerprint":"fp_ollama","choices":[{"index":0,'
            + b'"delta":{"role":"assistant","content":'
        )

    def lines(self, tokens: list[str]) -> bytes:
        head = self._chunk_head()
        tail = b'},"finish_reason":null}]}\n\n'
        return b"".join([head + _json_str(t) + tail for t in tokens])

    def _usage(self, t: Timings) -> dict[str, int]:
        return {
            "prompt_tokens": t.prompt_eval_count,
            "completion_tokens": t.eval_count,
            "total_tokens": t.prompt_eval_count + t.eval_count,
        }

    def final(self, timings: Timings) -> bytes:
        reason = _enc.encode(timings.done_reason)
        out = self._chunk_head() + b'""},"finish_reason":' + reason + b"}]}\n\n"
        if self.include_usage:
            usage = {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": "fp_ollama",
                "choices": [],
                "usage": self._usage(timings),
            }
            out += b"data: " + _enc.encode(usage) + b"\n\n"
        return out + b"data: [DONE]\n\n"

    def whole(self, text: str, timings: Timings) -> bytes:
        return _enc.encode(
            {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": "fp_ollama",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": timings.done_reason,
                    }
                ],
                "usage": self._usage(timings),
            }
        )

    def error(self, message: str) -> bytes:
        return _enc.encode({"error": {"message": message, "type": "api_error", "param": None, "code": None}})


# -- HTTP plumbing --------------------------------------------------------------------------------


async def _read_body(receive: Receive) -> bytes:
    message = await receive()
    body: bytes = message.get("body", b"")
    while message.get("more_body", False):
        message = await receive()
        body += message.get("body", b"")
    return body


async def _respond(send: Send, status: int, body: bytes, content_type: bytes = JSON) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Listener:
    """One listening port serving one ASGI app, whose connections can be cut at once."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http="httptools",
            lifespan="off",
            access_log=False,
            log_config=None,
            proxy_headers=False,
            server_header=False,
            date_header=False,
            # Idle keep-alive connections stay open, as with Go's server; no close racing a reuse.
            timeout_keep_alive=120,
        )
        self.config.load()
        self.conns: dict[tuple[str, int], HttpToolsProtocol] = {}
        self._server: asyncio.Server | None = None

    @property
    def listening(self) -> bool:
        return self._server is not None

    async def open(self) -> int:
        if self._server is not None:
            return self.port
        state = ServerState()
        listener = self

        class Protocol(HttpToolsProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(transport)  # type: ignore[arg-type]
                if self.client is not None:
                    listener.conns[self.client] = self

            def connection_lost(self, exc: Exception | None) -> None:
                if self.client is not None and listener.conns.get(self.client) is self:
                    del listener.conns[self.client]
                super().connection_lost(exc)

        config = self.config

        def factory() -> asyncio.Protocol:
            return Protocol(config=config, server_state=state, app_state={})

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, self.host, self.port, backlog=2048)
        sockets = self._server.sockets
        self.port = sockets[0].getsockname()[1]
        return self.port

    def transport_of(self, scope: Scope) -> asyncio.Transport | None:
        client = scope.get("client")
        proto = self.conns.get(tuple(client)) if client else None
        return proto.transport if proto is not None else None

    async def close(self, keep: asyncio.Transport | None = None) -> None:
        """Stop listening and cut every connection (but `keep`), as a machine losing power does."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for proto in list(self.conns.values()):
            if proto.transport is not keep:
                proto.transport.abort()
        if server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await server.wait_closed()


# -- one machine's app ----------------------------------------------------------------------------


Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class MachineApp:
    """The ASGI app of one simulated machine."""

    def __init__(self, machine: SimMachine, hosts: SimHosts) -> None:
        self.machine = machine
        self.hosts = hosts
        self.listener: _Listener | None = None
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
            ("GET", "/sim/state"): self._sim_state,
            ("POST", "/sim/faults"): self._sim_faults,
            ("POST", "/sim/offline"): self._sim_offline,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        handler = self._routes.get((scope["method"], scope["path"]))
        if handler is None:
            known = any(path == scope["path"] for _, path in self._routes)
            await _respond(
                send, 405 if known else 404, b"404 page not found" if not known else b"", b"text/plain"
            )
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await handler(scope, receive, send)
        except _BadRequestError as exc:
            await _respond(send, 400, _enc.encode({"error": str(exc)}))
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

    # -- small endpoints ----------------------------------------------------------------------

    async def _root(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, b"Ollama is running", b"text/plain; charset=utf-8")

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, _enc.encode({"version": OLLAMA_VERSION}))

    def _details(self, key: str) -> dict[str, Any]:
        spec = self.machine.fleet.model_spec(key)
        return {
            "parent_model": "",
            "format": "gguf",
            "family": spec.family,
            "families": [spec.family] if spec.family else None,
            "parameter_size": spec.parameter_size,
            "quantization_level": spec.quantization,
        }

    async def _tags(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.machine
        models = [
            {
                "name": model.name,
                "model": model.name,
                "modified_at": m.modified_at[model.name],
                "size": model.spec.size,
                "digest": model.digest,
                "details": self._details(model.key),
            }
            for model in m.models.values()
        ]
        await _respond(send, 200, _enc.encode({"models": models}))

    async def _ps(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.machine
        out = []
        for loaded in m.loaded():
            key = m.models[loaded.name].key
            out.append(
                {
                    "name": loaded.name,
                    "model": loaded.name,
                    "size": loaded.size,
                    "digest": loaded.digest,
                    "details": self._details(key),
                    "expires_at": loaded.expires_at,
                    "size_vram": loaded.size,
                    "context_length": 4096,
                }
            )
        await _respond(send, 200, _enc.encode({"models": out}))

    async def _show(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = _decode(await _read_body(receive), _ModelRequest)
        try:
            model = self.machine.find(req.which)
        except UnknownModelError:
            await _respond(send, 404, _enc.encode({"error": f"model '{req.which}' not found"}))
            return
        spec = model.spec
        family = spec.family or "llama"
        body = {
            "license": "",
            "modelfile": f'# Modelfile generated by "ollama show"\nFROM {model.name}\n',
            "parameters": "temperature 0.6\ntop_k 20\ntop_p 0.95",
            "template": "{{ .Prompt }}",
            "details": self._details(model.key),
            "model_info": {
                "general.architecture": family,
                "general.parameter_count": _parameter_count(spec.parameter_size),
                f"{family}.context_length": 40960,
            },
            "capabilities": ["completion"],
            "modified_at": self.machine.modified_at[model.name],
        }
        await _respond(send, 200, _enc.encode(body))

    async def _pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = _decode(await _read_body(receive), _ModelRequest)
        m = self.machine
        try:
            name = m.give_model(req.which)
        except UnknownModelError:
            await _respond(send, 500, _enc.encode({"error": "pull model manifest: file does not exist"}))
            return
        if req.stream is False:
            await _respond(send, 200, _enc.encode({"status": "success"}))
            return
        model = m.models[name]
        digest = f"sha256:{model.digest}"
        size = model.spec.size
        lines = [
            {"status": "pulling manifest"},
            {"status": f"pulling {model.digest[:12]}", "digest": digest, "total": size},
            {"status": f"pulling {model.digest[:12]}", "digest": digest, "total": size, "completed": size},
            {"status": "verifying sha256 digest"},
            {"status": "writing manifest"},
            {"status": "success"},
        ]
        body = b"".join(_enc.encode(line) + b"\n" for line in lines)
        await _respond(send, 200, body, NDJSON)

    async def _delete(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = _decode(await _read_body(receive), _ModelRequest)
        try:
            self.machine.take_model(req.which)
        except UnknownModelError:
            await _respond(send, 404, _enc.encode({"error": f"model '{req.which}' not found"}))
            return
        await _respond(send, 200, b"")

    async def _v1_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        data = [
            {"id": name, "object": "model", "created": int(_START), "owned_by": "library"}
            for name in self.machine.models
        ]
        await _respond(send, 200, _enc.encode({"object": "list", "data": data}))

    # -- generation ---------------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = _decode(await _read_body(receive), _ChatRequest)
        messages = req.messages or []
        texts = [_text(msg.content) for msg in messages]
        last_user = next(
            (t for msg, t in zip(reversed(messages), reversed(texts), strict=True) if msg.role == "user"), ""
        )
        await self._serve(
            scope,
            receive,
            send,
            _ChatFormat(req.model),
            model=req.model,
            prompt="\n".join(texts),
            last_user=last_user,
            stream=req.stream is not False,
            seed=_int_option(req.options, "seed"),
            max_tokens=_int_option(req.options, "num_predict"),
            keep_alive=req.keep_alive,
            load_only=not messages,
            wants_json=bool(req.format),
        )

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = _decode(await _read_body(receive), _GenerateRequest)
        prompt = req.prompt or ""
        await self._serve(
            scope,
            receive,
            send,
            _GenerateFormat(req.model),
            model=req.model,
            prompt=f"{req.system}\n{prompt}" if req.system else prompt,
            last_user=prompt,
            stream=req.stream is not False,
            seed=_int_option(req.options, "seed"),
            max_tokens=_int_option(req.options, "num_predict"),
            keep_alive=req.keep_alive,
            load_only=not prompt,
            wants_json=bool(req.format),
        )

    async def _v1_chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = _decode(await _read_body(receive), _OpenAIChatRequest)
        texts = [_text(msg.content) for msg in req.messages]
        last_user = next(
            (t for msg, t in zip(reversed(req.messages), reversed(texts), strict=True) if msg.role == "user"),
            "",
        )
        self._openai_seq += 1
        include_usage = bool(req.stream_options and req.stream_options.get("include_usage"))
        await self._serve(
            scope,
            receive,
            send,
            _OpenAIFormat(req.model, include_usage, self._openai_seq),
            model=req.model,
            prompt="\n".join(texts),
            last_user=last_user,
            stream=req.stream is True,
            seed=req.seed,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            keep_alive=None,
            load_only=False,
        )

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        fmt: _Format,
        *,
        model: str,
        prompt: str,
        last_user: str,
        stream: bool,
        seed: int | None,
        max_tokens: int | None,
        keep_alive: object,
        load_only: bool,
        wants_json: bool = False,
    ) -> None:
        m = self.machine
        try:
            job = m.plan(
                model,
                prompt,
                last_user,
                request_seed=seed,
                max_tokens=max_tokens,
                keep_alive=keep_alive,
                wants_json=wants_json,
            )
        except UnknownModelError as exc:
            await _respond(send, 404, fmt.error(str(exc)))
            return
        except SimHostError as exc:
            await _respond(send, 400, fmt.error(str(exc)))
            return
        if job.fault == "error":
            await _respond(send, 500, fmt.error(RUNNER_CRASH))
            return
        if job.fault == "hang":
            # Never answers; the client gives up (or the machine powers off).
            await _until_disconnect(receive)
            return
        transport = self.listener.transport_of(scope) if self.listener else None
        if transport is not None:
            job.gone = transport.is_closing
        if load_only:
            job.load_only = True
            job.unload = keep_alive_is_zero(keep_alive)
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
            await send({"type": "http.response.body", "body": fmt.lines(tokens), "more_body": True})

        timings = await m.run(job, emit if stream and not load_only else None)
        if timings is None:
            if job.fault == "disconnect" and transport is not None:
                # Mid-stream: what was sent stays sent, then the connection drops.
                transport.close()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2.0):
                        await _until_disconnect(receive)
            return
        if load_only and job.unload:
            timings = msgspec.structs.replace(timings, done_reason="unload")
        if not stream:
            text = "".join(job.tokens[: timings.eval_count])
            await _respond(send, 200, fmt.whole(text, timings))
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

    # -- operator controls --------------------------------------------------------------------

    async def _sim_state(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, _enc.encode(self.machine.state()))

    async def _sim_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = _decode(await _read_body(receive), _FaultsRequest)
        try:
            faults = self.machine.set_faults(
                error_rate=req.error_rate, hang_rate=req.hang_rate, disconnect_rate=req.disconnect_rate
            )
        except SimHostError as exc:
            await _respond(send, 400, _enc.encode({"error": str(exc)}))
            return
        await _respond(send, 200, _enc.encode(faults))

    async def _sim_offline(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _read_body(receive)
        me = self.listener.transport_of(scope) if self.listener else None
        await self.hosts.go_offline(self.machine.name, keep=me)
        await _respond(send, 200, _enc.encode(self.machine.state()))
        if me is not None:
            me.close()


def keep_alive_is_zero(value: object) -> bool:
    try:
        return keep_alive_seconds(value) == 0
    except SimHostError:
        return False


def _parameter_count(size: str) -> int | None:
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    if size and size[-1].upper() in units:
        with contextlib.suppress(ValueError):
            return round(float(size[:-1]) * units[size[-1].upper()])
    return None


_START = time.time()


# -- the control port -----------------------------------------------------------------------------


class ControlApp:
    """`/sim/{machine}/…` for every machine of the process, reachable while a machine is offline."""

    def __init__(self, hosts: SimHosts) -> None:
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            await self._handle(scope, receive, send)
        except _BadRequestError as exc:
            await _respond(send, 400, _enc.encode({"error": str(exc)}))
        except SimHostError as exc:
            await _respond(send, 404, _enc.encode({"error": str(exc)}))

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        method: str = scope["method"]
        parts = [p for p in scope["path"].split("/") if p]
        hosts = self.hosts
        if parts in (["sim"], ["sim", "state"]) and method == "GET":
            body = {
                "hosts": hosts.urls,
                "control": hosts.control_url,
                "machines": [hosts.state(n) for n in hosts.names],
            }
            await _respond(send, 200, _enc.encode(body))
            return
        if len(parts) != 3 or parts[0] != "sim":
            await _respond(send, 404, b"404 page not found", b"text/plain")
            return
        name, action = parts[1], parts[2]
        hosts.machine(name)
        if (method, action) == ("GET", "state"):
            pass
        elif (method, action) == ("POST", "faults"):
            req = _decode(await _read_body(receive), _FaultsRequest)
            hosts.set_faults(
                name, error_rate=req.error_rate, hang_rate=req.hang_rate, disconnect_rate=req.disconnect_rate
            )
        elif (method, action) == ("POST", "offline"):
            await hosts.go_offline(name)
        elif (method, action) == ("POST", "online"):
            await hosts.go_online(name)
        elif (method, action) == ("POST", "pull"):
            hosts.give_model(name, _decode(await _read_body(receive), _ModelRequest).which)
        else:
            await _respond(send, 404, b"404 page not found", b"text/plain")
            return
        await _respond(send, 200, _enc.encode(hosts.state(name)))


# -- the process-level API ------------------------------------------------------------------------


class SimHosts:
    """Several simulated machines on loopback ports, served from the running event loop."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        time_scale: float = 1.0,
        seed: int = 0,
        host: str = "127.0.0.1",
        control_port: int = 0,
        windows: bool = True,
    ) -> None:
        self.fleet = fleet
        self.host = host
        self.time_scale = time_scale
        self.seed = seed
        self._apps: dict[str, MachineApp] = {}
        for spec in fleet.worker:
            machine = SimMachine(spec, fleet, time_scale=time_scale, seed=seed)
            self._apps[spec.name] = MachineApp(machine, self)
        self._control = _Listener(ControlApp(self), host, control_port)
        self._windows = windows
        self._window_tasks: list[asyncio.Task[None]] = []
        self._started = False

    async def __aenter__(self) -> SimHosts:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Open every machine's port (and the control port)."""
        if self._started:
            return
        try:
            for name, app in self._apps.items():
                app.listener = _Listener(app, self.host, app.machine.spec.port)
                await app.listener.open()
                if self._windows and app.machine.spec.online is not None:
                    self._window_tasks.append(
                        asyncio.create_task(self._follow_windows(name, app.machine.spec))
                    )
            await self._control.open()
        except OSError as exc:
            await self.stop()
            raise SimHostError(f"cannot listen on {self.host}: {exc.strerror or exc}") from None
        self._started = True

    async def stop(self) -> None:
        for task in self._window_tasks:
            task.cancel()
        for task in self._window_tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._window_tasks.clear()
        for app in self._apps.values():
            app.machine.power_off()
            if app.listener is not None:
                await app.listener.close()
            app.cancel_all()
        await self._control.close()
        # Let cancelled handlers unwind before the loop may close.
        await asyncio.sleep(0)
        self._started = False

    # -- lookups ------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._apps)

    def _app(self, name: str) -> MachineApp:
        app = self._apps.get(name)
        if app is None:
            raise SimHostError(f"no simulated machine {name!r}; machines: {', '.join(self._apps)}")
        return app

    def machine(self, name: str) -> SimMachine:
        return self._app(name).machine

    def url(self, name: str) -> str:
        """The machine's base URL (the same across offline/online)."""
        listener = self._app(name).listener
        if listener is None:
            raise SimHostError("the sim hosts are not started")
        return f"http://{_url_host(self.host)}:{listener.port}"

    @property
    def urls(self) -> dict[str, str]:
        return {name: self.url(name) for name in self._apps}

    @property
    def control_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self._control.port}"

    # -- controls -----------------------------------------------------------------------------

    def state(self, name: str) -> MachineState:
        return self.machine(name).state()

    def set_faults(
        self,
        name: str,
        *,
        error_rate: float | None = None,
        hang_rate: float | None = None,
        disconnect_rate: float | None = None,
    ) -> Faults:
        return self.machine(name).set_faults(
            error_rate=error_rate, hang_rate=hang_rate, disconnect_rate=disconnect_rate
        )

    def give_model(self, name: str, model: str) -> str:
        """Give machine `name` a model its preset lists (as `POST /api/pull` does); its full name."""
        return self.machine(name).give_model(model)

    def take_model(self, name: str, model: str) -> None:
        """Remove a model from machine `name` (as `DELETE /api/delete` does)."""
        self.machine(name).take_model(model)

    def is_online(self, name: str) -> bool:
        return self.machine(name).online

    async def go_offline(self, name: str, keep: asyncio.Transport | None = None) -> None:
        """Power the machine off: its port closes, open connections drop, loaded models are lost."""
        app = self._app(name)
        app.machine.power_off()
        if app.listener is not None:
            await app.listener.close(keep=keep)
        app.cancel_all()

    async def go_online(self, name: str) -> None:
        """Power the machine on again, on the same port; nothing is loaded."""
        app = self._app(name)
        if app.listener is None:
            raise SimHostError("the sim hosts are not started")
        try:
            await app.listener.open()
        except OSError as exc:
            raise SimHostError(
                f"{name} cannot listen on its port {app.listener.port} again: {exc.strerror or exc}"
            ) from None
        app.machine.power_on()

    async def _follow_windows(self, name: str, spec: WorkerSpec) -> None:
        windows = sorted(spec.online or [])
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        scale = self.machine(name).timer_scale

        def on_at(t: float) -> bool:
            return any(start <= t < end for start, end in windows)

        edges = sorted({e for w in windows for e in w if math.isfinite(e) and e > 0})
        if not on_at(0.0):
            await self.go_offline(name)
        for edge in edges:
            await asyncio.sleep(max(0.0, t0 + edge * scale - loop.time()))
            want = on_at(edge)
            if want and not self.is_online(name):
                await self.go_online(name)
            elif not want and self.is_online(name):
                await self.go_offline(name)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


__all__ = ["Faults", "MachineApp", "MachineState", "SimHosts", "SimMachine"]
