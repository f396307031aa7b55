"""Backend adapters: Ollama's HTTP API, and OpenAI-compatible servers.

A generation is an async iterator of text pieces that ends with one `Generated` carrying the
backend's own timings. Every failure becomes a BackendError with a kind:

| kind | retryable | when |
|---|---|---|
| unreachable | yes | the connection was refused or could not be made |
| timeout | yes | no byte for `idle_timeout_s`, or the whole run exceeded `timeout_s` |
| disconnect | yes | the stream broke before its final chunk |
| http_5xx | yes | the backend answered with a server error |
| model_missing | yes | the backend does not have the model (another worker may) |
| bad_request | no | the backend rejected the request itself (4xx) |
| protocol | yes | the backend sent something that is not its protocol |
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx
import msgspec

from dispatch.payload import TaskMessage
from events.event import MAX_NS, ModelEntry, Timings, bounded_count
from workers.errors import BackendError


class Generated(msgspec.Struct, frozen=True, kw_only=True):
    """The end of a generation: the backend's timings and why it stopped."""

    timings: Timings
    done_reason: str | None = None


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend holds (name → digest) and which digests are loaded now."""

    models: list[ModelEntry]
    loaded: list[str]
    # False: the backend cannot say what is loaded (`loaded` is then empty and means nothing).
    loaded_known: bool = True
    # Bytes each loaded digest takes in memory, as the backend reports it (/api/ps `size`).
    loaded_bytes: dict[str, int] = msgspec.field(default_factory=dict)


class Backend(Protocol):
    """The seam between the worker agent and a model server."""

    url: str
    kind: str

    async def inventory(self) -> Inventory: ...

    def generate(self, task: TaskMessage, local_name: str) -> AsyncIterator[str | Generated]: ...

    async def aclose(self) -> None: ...


def _timeout(idle_timeout_s: float) -> httpx.Timeout:
    return httpx.Timeout(connect=5.0, read=idle_timeout_s, write=30.0, pool=30.0)


def _classify(exc: Exception, started: bool) -> BackendError:
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return BackendError("unreachable", str(exc) or "connection refused", retryable=True)
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return BackendError("timeout", str(exc) or "no answer in time", retryable=True)
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        kind = "disconnect" if started else "unreachable"
        return BackendError(kind, str(exc) or "connection closed", retryable=True)
    if isinstance(exc, msgspec.DecodeError | ValueError):
        return BackendError("protocol", str(exc), retryable=True)
    return BackendError("protocol", f"{type(exc).__name__}: {exc}", retryable=True)


async def _raise_for_status(resp: httpx.Response, model: str) -> None:
    if resp.status_code < 400:
        return
    body = (await resp.aread()).decode(errors="replace")[:500]
    try:
        message = str(msgspec.json.decode(body).get("error", body))
    except (msgspec.DecodeError, AttributeError):
        message = body
    if resp.status_code == 404:
        raise BackendError("model_missing", f"{model}: {message}", retryable=True)
    if resp.status_code >= 500:
        raise BackendError("http_5xx", f"HTTP {resp.status_code}: {message}", retryable=True)
    raise BackendError("bad_request", f"HTTP {resp.status_code}: {message}", retryable=False)


def _options(task: TaskMessage) -> dict[str, Any]:
    options = dict(task.options)
    if task.max_tokens is not None:
        options["num_predict"] = task.max_tokens
    return options


_line_decoder = msgspec.json.Decoder(dict[str, Any])


class OllamaBackend:
    """Ollama's native API: /api/tags, /api/ps, /api/chat and /api/generate (NDJSON)."""

    kind = "ollama"

    def __init__(self, url: str, *, timeout_s: float = 300.0, idle_timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=_timeout(idle_timeout_s),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
        )

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
                    family=details.get("family") or None,
                    parameter_size=details.get("parameter_size") or None,
                    quantization=details.get("quantization_level") or None,
                )
            )
        loaded: list[str] = []
        loaded_bytes: dict[str, int] = {}
        for m in ps.json().get("models", []):
            digest = str(m.get("digest", "")).removeprefix("sha256:")
            if not digest:
                continue
            loaded.append(digest)
            size = bounded_count(m.get("size"))
            if size is not None:
                loaded_bytes[digest] = size
        return Inventory(models=models, loaded=loaded, loaded_bytes=loaded_bytes)

    async def generate(self, task: TaskMessage, local_name: str) -> AsyncIterator[str | Generated]:
        body: dict[str, Any] = {"model": local_name, "stream": True, "options": _options(task)}
        if task.format is not None:
            body["format"] = task.format
        if task.kind == "generate":
            path, key = "/api/generate", "response"
            body["prompt"] = task.prompt or ""
            if task.system:
                body["system"] = task.system
        else:
            path, key = "/api/chat", "message"
            body["messages"] = [msgspec.to_builtins(m) for m in task.messages]
        started = False
        final: Generated | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.client.stream("POST", path, json=body) as resp:
                    await _raise_for_status(resp, local_name)
                    async for line in resp.aiter_lines():
                        if not line.strip():
                            continue
                        data = _line_decoder.decode(line)
                        if "error" in data:
                            raise BackendError("http_5xx", str(data["error"]), retryable=True)
                        piece = data.get(key)
                        text = piece.get("content", "") if isinstance(piece, dict) else (piece or "")
                        if text:
                            started = True
                            yield text
                        if data.get("done"):
                            final = Generated(
                                timings=_ollama_timings(data), done_reason=data.get("done_reason")
                            )
                    # The body was read to its end, so the connection goes back to the pool.
                    if final is not None:
                        yield final
                        return
            raise BackendError("disconnect", "the stream ended without its final chunk", retryable=True)
        except BackendError:
            raise
        except Exception as exc:
            raise _classify(exc, started) from None

    async def aclose(self) -> None:
        await self.client.aclose()


def _int_or_none(value: Any) -> int | None:
    # A count out of the ledger's range is a broken report: unknown, so that the event stays valid.
    return bounded_count(value)


def _ns_or_none(value: Any) -> int | None:
    return bounded_count(value, MAX_NS)


def _ollama_timings(data: dict[str, Any]) -> Timings:
    return Timings(
        prompt_eval_count=_int_or_none(data.get("prompt_eval_count")),
        prompt_eval_duration=_ns_or_none(data.get("prompt_eval_duration")),
        eval_count=_int_or_none(data.get("eval_count")),
        eval_duration=_ns_or_none(data.get("eval_duration")),
        load_duration=_ns_or_none(data.get("load_duration")),
        total_duration=_ns_or_none(data.get("total_duration")),
    )


def openai_digest(model_id: str) -> str:
    """OpenAI-compatible servers name models but do not report digests: derive a stable one."""
    return hashlib.sha256(f"openai-compatible:{model_id}".encode()).hexdigest()


class OpenAIBackend:
    """An OpenAI-compatible server: /v1/models and streaming /v1/chat/completions (SSE).

    Such servers report token counts (`usage`) but not durations, so the worker measures them:
    prompt time until the first token, decode time from the first token to the last.

    A server that sends no `usage` (or no `completion_tokens` in it) still streams its output:
    the output tokens are then counted as the streamed pieces that carry text, and the timings say
    so (`counted="stream"`). llama.cpp, vLLM and Ollama send one token per chunk, so the count is
    exact there; a server that batches several tokens into a chunk is undercounted (its speed
    looks lower than it is, never higher), and a token that decodes to no text (a lone special or
    partial character) is not counted.
    """

    kind = "openai"

    def __init__(
        self, url: str, *, api_key: str | None = None, timeout_s: float = 300.0, idle_timeout_s: float = 120.0
    ) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.client = httpx.AsyncClient(base_url=self.url, timeout=_timeout(idle_timeout_s), headers=headers)

    async def inventory(self) -> Inventory:
        try:
            resp = await self.client.get("/v1/models", timeout=10.0)
            await _raise_for_status(resp, "*")
        except Exception as exc:
            raise _classify(exc, started=False) from None
        models = [
            ModelEntry(name=m["id"], digest=openai_digest(m["id"])) for m in resp.json().get("data", [])
        ]
        # The protocol cannot say what is loaded: unknown, not "nothing is loaded".
        return Inventory(models=models, loaded=[], loaded_known=False)

    async def generate(self, task: TaskMessage, local_name: str) -> AsyncIterator[str | Generated]:
        if task.kind == "generate":
            messages = [{"role": "system", "content": task.system}] if task.system else []
            messages.append({"role": "user", "content": task.prompt or ""})
        else:
            messages = [msgspec.to_builtins(m) for m in task.messages]
        body: dict[str, Any] = {
            "model": local_name,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
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
        reason: str | None = None
        done_at: int | None = None
        pieces = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.client.stream("POST", "/v1/chat/completions", json=body) as resp:
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
                        for choice in data.get("choices") or []:
                            text = (choice.get("delta") or {}).get("content") or ""
                            reason = choice.get("finish_reason") or reason
                            if text:
                                now = time.perf_counter_ns()
                                first = first or now
                                last = now
                                started = True
                                pieces += 1
                                yield text
                    # The body was read to its end, so the connection goes back to the pool.
                    if done_at is not None:
                        eval_count = _int_or_none(usage.get("completion_tokens"))
                        counted = None
                        if eval_count is None and pieces > 0:
                            eval_count, counted = pieces, "stream"
                        yield Generated(
                            timings=Timings(
                                prompt_eval_count=_int_or_none(usage.get("prompt_tokens")),
                                prompt_eval_duration=(first - t0) if first else None,
                                eval_count=eval_count,
                                eval_duration=(last - first) if first and last and last > first else None,
                                total_duration=done_at - t0,
                                counted=counted,
                            ),
                            done_reason=reason,
                        )
                        return
            raise BackendError("disconnect", "the stream ended without [DONE]", retryable=True)
        except BackendError:
            raise
        except Exception as exc:
            raise _classify(exc, started) from None

    async def aclose(self) -> None:
        await self.client.aclose()


def make_backend(url: str, kind: str, *, timeout_s: float, idle_timeout_s: float) -> Backend:
    """The adapter for `kind` (ollama or openai)."""
    if kind == "ollama":
        return OllamaBackend(url, timeout_s=timeout_s, idle_timeout_s=idle_timeout_s)
    if kind == "openai":
        return OpenAIBackend(url, timeout_s=timeout_s, idle_timeout_s=idle_timeout_s)
    raise BackendError("bad_request", f"unknown backend kind {kind!r}; use ollama or openai", retryable=False)
