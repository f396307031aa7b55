"""One simulated machine's HTTP API (sim/backends/hosts.py runs several, each on its own port).

Each machine serves Ollama's native API (`/api/tags`, `/api/ps`, `/api/version`, `/api/show`,
`/api/chat`, `/api/generate`, `/api/pull`, `/api/delete`), the OpenAI-compatible `/v1/models` and
`/v1/chat/completions`, and operator controls under `/sim/` (`GET /sim/state`, `POST /sim/faults`,
`POST /sim/offline`, and `POST /sim/speed {"factor": 0.06}`: every model's decode and prompt speed
times that factor from now on, the fleet TOML's `[[worker.slowdown]]` at run time; 1 restores it).

Time: every duration a response reports (load, prompt eval, eval, total) is simulated and unscaled,
so `eval_count / eval_duration` is the preset's decode speed at any `time_scale`; the machine really
waits that long times `time_scale` (0: no waiting at all, timings still reported as if real). Queue
waits enter `total_duration` as wall time divided by `time_scale`. Keep-alive expiry and online
windows run on the wall clock times `time_scale` (unscaled when it is 0). The OpenAI-compatible API
carries no timings; a client timing it sees scaled wall time.

JSON mode: a chat or generate request that sets Ollama's `format` is answered with a JSON array of
short pseudo-sentences (sim.backends.text.json_answer; schemas are not read), unless the model's preset says
`follows_format = false`, in which case it answers prose as usual.

Faults are drawn once per generation request from a seeded stream: an error answers HTTP 500 with
Ollama's `{"error": …}` at once; a hang answers nothing and holds no slot until the client leaves;
a disconnect sends some chunks (none, for a non-streaming request) and then closes the connection.

The HTTP server is a thin ASGI app on uvicorn's httptools protocol (sim/backends/listener.py), one
listener per machine on a shared event loop; a request in zero-delay mode costs a few hundred
microseconds of CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec
from starlette.types import Receive, Scope, Send

from dispatch.ollama import OLLAMA_VERSION
from sim.backends.formats import NDJSON, ChatFormat, Format, GenerateFormat, OpenAIFormat
from sim.backends.listener import Listener, read_body, respond, until_disconnect
from sim.backends.machine import SimMachine, keep_alive_seconds
from sim.backends.wire import (
    ChatRequest,
    FaultsRequest,
    GenerateRequest,
    ModelRequest,
    OpenAIChatRequest,
    SpeedRequest,
    content_text,
    decode_body,
    int_option,
)
from sim.errors import BadRequestError, SimHostError, UnknownModelError

if TYPE_CHECKING:
    from sim.backends.hosts import SimHosts

# What a runner crash looks like from the client's side (Ollama's own message).
RUNNER_CRASH: Final = "llama runner process has terminated: exit status 2"

_enc: Final = msgspec.json.Encoder()

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class MachineApp:
    """The ASGI app of one simulated machine."""

    def __init__(self, machine: SimMachine, hosts: SimHosts) -> None:
        self.machine = machine
        self.hosts = hosts
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

    # -- small endpoints ----------------------------------------------------------------------

    async def _root(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"Ollama is running", b"text/plain; charset=utf-8")

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, _enc.encode({"version": OLLAMA_VERSION}))

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
        await respond(send, 200, _enc.encode({"models": models}))

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
        await respond(send, 200, _enc.encode({"models": out}))

    async def _show(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), ModelRequest)
        try:
            model = self.machine.find(req.which)
        except UnknownModelError:
            await respond(send, 404, _enc.encode({"error": f"model '{req.which}' not found"}))
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
        lines = [
            {"status": "pulling manifest"},
            {"status": f"pulling {model.digest[:12]}", "digest": digest, "total": size},
            {"status": f"pulling {model.digest[:12]}", "digest": digest, "total": size, "completed": size},
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
        texts = [content_text(msg.content) for msg in messages]
        last_user = next(
            (t for msg, t in zip(reversed(messages), reversed(texts), strict=True) if msg.role == "user"), ""
        )
        await self._serve(
            scope,
            receive,
            send,
            ChatFormat(req.model),
            model=req.model,
            prompt="\n".join(texts),
            last_user=last_user,
            stream=req.stream is not False,
            seed=int_option(req.options, "seed"),
            max_tokens=int_option(req.options, "num_predict"),
            keep_alive=req.keep_alive,
            load_only=not messages,
            wants_json=bool(req.format),
        )

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), GenerateRequest)
        prompt = req.prompt or ""
        await self._serve(
            scope,
            receive,
            send,
            GenerateFormat(req.model),
            model=req.model,
            prompt=f"{req.system}\n{prompt}" if req.system else prompt,
            last_user=prompt,
            stream=req.stream is not False,
            seed=int_option(req.options, "seed"),
            max_tokens=int_option(req.options, "num_predict"),
            keep_alive=req.keep_alive,
            load_only=not prompt,
            wants_json=bool(req.format),
        )

    async def _v1_chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await read_body(receive), OpenAIChatRequest)
        texts = [content_text(msg.content) for msg in req.messages]
        last_user = next(
            (t for msg, t in zip(reversed(req.messages), reversed(texts), strict=True) if msg.role == "user"),
            "",
        )
        self._openai_seq += 1
        include_usage = self.machine.spec.openai_usage and bool(
            req.stream_options and req.stream_options.get("include_usage")
        )
        await self._serve(
            scope,
            receive,
            send,
            OpenAIFormat(req.model, include_usage, self._openai_seq),
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
        fmt: Format,
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
            await respond(send, 404, fmt.error(str(exc)))
            return
        except SimHostError as exc:
            await respond(send, 400, fmt.error(str(exc)))
            return
        if job.fault == "error":
            await respond(send, 500, fmt.error(RUNNER_CRASH))
            return
        if job.fault == "hang":
            # Never answers; the client gives up (or the machine powers off).
            await until_disconnect(receive)
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
                        await until_disconnect(receive)
            return
        if load_only and job.unload:
            timings = msgspec.structs.replace(timings, done_reason="unload")
        if not stream:
            text = "".join(job.tokens[: timings.eval_count])
            await respond(send, 200, fmt.whole(text, timings))
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
        await self.hosts.go_offline(self.machine.name, keep=me)
        await respond(send, 200, _enc.encode(self.machine.state()))
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
