"""How the simulated machines spell a generation in each API: streamed chunks, the closing chunk,
the whole answer and errors, for Ollama's /api/chat and /api/generate and OpenAI's chat completions,
and the answers to embedding requests (Ollama's /api/embed and /api/embeddings, OpenAI's
/v1/embeddings).

A streamed answer goes out one token a chunk, in the answer's order (sim.backends.ask.Answer):
thinking first (Ollama: `message.thinking`, or `thinking` on /api/generate; OpenAI:
`reasoning_content` in the delta, the extension several OpenAI-compatible servers use), then content,
or tool calls. Ollama sends the tool calls whole in one chunk once the model has emitted them
(`message.tool_calls`, arguments as an object); OpenAI streams each call as a delta with its
`index`, `id`, type and name, then deltas with chunks of its arguments' JSON, and finishes with
`finish_reason: "tool_calls"`.

A prompt partly read from a slot's cache keeps its whole count, as Ollama and OpenAI-compatible
servers report it (`prompt_eval_count`, `usage.prompt_tokens`); the cached part is reported beside
it (`prompt_eval_cached_count`, `usage.prompt_tokens_details.cached_tokens`) when there is one."""

from __future__ import annotations

import base64
import struct
import time
from typing import Any, Final

import msgspec

from dispatch.ollama import final_fields, rfc3339
from sim.backends.ask import Answer, ToolCall
from sim.backends.machine import Embedded, Timings

NDJSON: Final = b"application/x-ndjson"
SSE: Final = b"text/event-stream"

_enc: Final = msgspec.json.Encoder()


_TOKEN_CACHE: dict[str, bytes] = {}


def _json_str(token: str) -> bytes:
    enc = _TOKEN_CACHE.get(token)
    if enc is None:
        enc = _enc.encode(token)
        if len(_TOKEN_CACHE) < 65536:
            _TOKEN_CACHE[token] = enc
    return enc


class Format:
    """How one API spells a generation: streamed chunks, the final chunk, the whole answer, errors.

    One instance serves one request: `bind` gives it the planned answer, and `lines` is then called
    with the answer's tokens in order (it counts them to know which part each one belongs to).
    """

    stream_type = NDJSON

    def __init__(self, model: str) -> None:
        self.model = model
        self.model_json = _enc.encode(model)
        self.answer = Answer(tokens=[])
        self.sent = 0
        # For each call token (after the thinking): which call it belongs to and where in it.
        self._call_at: list[tuple[int, int]] = []

    def bind(self, answer: Answer) -> None:
        self.answer = answer
        self._call_at = [(i, k) for i, call in enumerate(answer.calls) for k in range(len(call.pieces))]

    def lines(self, tokens: list[str]) -> bytes:
        answer = self.answer
        start = self.sent
        self.sent += len(tokens)
        if not answer.thinking and not answer.calls:
            return self.content_lines(tokens)
        out: list[bytes] = []
        for i, token in enumerate(tokens, start):
            if i < answer.thinking:
                out.append(self.thinking_line(token))
            elif answer.calls:
                call, k = self._call_at[i - answer.thinking]
                out.append(self.call_line(call, k, token))
            else:
                out.append(self.content_lines([token]))
        return b"".join(out)

    def parts(self, tokens: list[str]) -> tuple[str, str, list[ToolCall]]:
        """Thinking, content and the calls (only when all were emitted) of the emitted `tokens`."""
        answer = self.answer
        thinking = "".join(tokens[: answer.thinking])
        rest = tokens[answer.thinking :]
        if answer.calls:
            complete = len(tokens) == len(answer.tokens)
            return thinking, "", answer.calls if complete else []
        return thinking, "".join(rest), []

    def calls_done(self, timings: Timings) -> bool:
        return bool(self.answer.calls) and timings.eval_count == len(self.answer.tokens)

    def content_lines(self, tokens: list[str]) -> bytes:
        raise NotImplementedError

    def thinking_line(self, token: str) -> bytes:
        raise NotImplementedError

    def call_line(self, call: int, k: int, token: str) -> bytes:
        # Only chat answers carry calls; other formats never see one.
        return b""

    def final(self, timings: Timings) -> bytes:
        raise NotImplementedError

    def whole(self, tokens: list[str], timings: Timings) -> bytes:
        raise NotImplementedError

    def error(self, message: str, status: int = 500) -> bytes:
        return _enc.encode({"error": message})


def ollama_final(timings: Timings) -> dict[str, Any]:
    """Ollama's closing fields, with the cached part of the prompt when a slot's cache held some."""
    out = final_fields(timings.done_reason, timings)
    if timings.prompt_eval_cached_count:
        out["prompt_eval_cached_count"] = timings.prompt_eval_cached_count
    return out


def ollama_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
        for c in calls
    ]


class ChatFormat(Format):
    def content_lines(self, tokens: list[str]) -> bytes:
        head = (
            b'{"model":'
            + self.model_json
            + b',"created_at":"'
            + rfc3339().encode()
            + b'","message":{"role":"assistant","content":'
        )
        tail = b'},"done":false}\n'
        return b"".join([head + _json_str(t) + tail for t in tokens])

    def _chunk(self, message: dict[str, Any]) -> bytes:
        body = {"model": self.model, "created_at": rfc3339(), "message": message, "done": False}
        return _enc.encode(body) + b"\n"

    def thinking_line(self, token: str) -> bytes:
        return self._chunk({"role": "assistant", "content": "", "thinking": token})

    def call_line(self, call: int, k: int, token: str) -> bytes:
        if call < len(self.answer.calls) - 1 or k < len(self.answer.calls[call].pieces) - 1:
            return b""
        # The model has emitted every call: Ollama's parser hands them over at once.
        return self._chunk(
            {"role": "assistant", "content": "", "tool_calls": ollama_calls(self.answer.calls)}
        )

    def final(self, timings: Timings) -> bytes:
        return self._done({"role": "assistant", "content": ""}, timings) + b"\n"

    def whole(self, tokens: list[str], timings: Timings) -> bytes:
        thinking, content, calls = self.parts(tokens)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = ollama_calls(calls)
        return self._done(message, timings)

    def _done(self, message: dict[str, Any], timings: Timings) -> bytes:
        return _enc.encode(
            {
                "model": self.model,
                "created_at": rfc3339(),
                "message": message,
                **ollama_final(timings),
            }
        )


class GenerateFormat(Format):
    def content_lines(self, tokens: list[str]) -> bytes:
        head = b'{"model":' + self.model_json + b',"created_at":"' + rfc3339().encode() + b'","response":'
        tail = b',"done":false}\n'
        return b"".join([head + _json_str(t) + tail for t in tokens])

    def thinking_line(self, token: str) -> bytes:
        body = {
            "model": self.model,
            "created_at": rfc3339(),
            "response": "",
            "thinking": token,
            "done": False,
        }
        return _enc.encode(body) + b"\n"

    def final(self, timings: Timings) -> bytes:
        return self.whole([], timings) + b"\n"

    def whole(self, tokens: list[str], timings: Timings) -> bytes:
        thinking, content, _ = self.parts(tokens)
        body: dict[str, Any] = {"model": self.model, "created_at": rfc3339(), "response": content}
        if thinking:
            body["thinking"] = thinking
        return _enc.encode({**body, **ollama_final(timings)})


class OpenAIFormat(Format):
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

    def content_lines(self, tokens: list[str]) -> bytes:
        head = self._chunk_head()
        tail = b'},"finish_reason":null}]}\n\n'
        return b"".join([head + _json_str(t) + tail for t in tokens])

    def _delta(self, delta: dict[str, Any]) -> bytes:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "fp_ollama",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }
        return b"data: " + _enc.encode(chunk) + b"\n\n"

    def thinking_line(self, token: str) -> bytes:
        return self._delta({"role": "assistant", "content": "", "reasoning_content": token})

    def call_line(self, call: int, k: int, token: str) -> bytes:
        c = self.answer.calls[call]
        if k == 0:
            head = {
                "index": call,
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": ""},
            }
            return self._delta({"role": "assistant", "content": None, "tool_calls": [head]})
        return self._delta({"tool_calls": [{"index": call, "function": {"arguments": token}}]})

    def _usage(self, t: Timings) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": t.prompt_eval_count,
            "completion_tokens": t.eval_count,
            "total_tokens": t.prompt_eval_count + t.eval_count,
        }
        if t.prompt_eval_cached_count:
            usage["prompt_tokens_details"] = {"cached_tokens": t.prompt_eval_cached_count}
        return usage

    def final(self, timings: Timings) -> bytes:
        reason = _enc.encode("tool_calls" if self.calls_done(timings) else timings.done_reason)
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

    def whole(self, tokens: list[str], timings: Timings) -> bytes:
        thinking, content, calls = self.parts(tokens)
        message: dict[str, Any] = {"role": "assistant", "content": content if not calls else None}
        if thinking:
            message["reasoning_content"] = thinking
        if calls:
            message["tool_calls"] = openai_calls(calls)
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
                        "message": message,
                        "finish_reason": "tool_calls" if calls else timings.done_reason,
                    }
                ],
                "usage": self._usage(timings),
            }
        )

    def error(self, message: str, status: int = 500) -> bytes:
        return openai_error(message, status)


def openai_error(message: str, status: int = 500) -> bytes:
    """OpenAI's error body: a client's mistake (4xx) is an `invalid_request_error`."""
    kind = "invalid_request_error" if 400 <= status < 500 else "api_error"
    return _enc.encode({"error": {"message": message, "type": kind, "param": None, "code": None}})


# -- embeddings -------------------------------------------------------------------------------------


def ollama_embed(model: str, done: Embedded) -> bytes:
    """Ollama's /api/embed answer."""
    return _enc.encode(
        {
            "model": model,
            "embeddings": done.vectors,
            "total_duration": done.total_duration,
            "load_duration": done.load_duration,
            "prompt_eval_count": done.prompt_eval_count,
        }
    )


def ollama_embeddings(done: Embedded) -> bytes:
    """Ollama's older /api/embeddings answer: one vector."""
    return _enc.encode({"embedding": done.vectors[0] if done.vectors else []})


def openai_embeddings(model: str, done: Embedded, base64_floats: bool) -> bytes:
    """OpenAI's /v1/embeddings answer; `base64_floats`: each vector as base64 of little-endian float32s."""
    data = [
        {
            "object": "embedding",
            "embedding": (base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if base64_floats else v),
            "index": i,
        }
        for i, v in enumerate(done.vectors)
    ]
    usage = {"prompt_tokens": done.prompt_eval_count, "total_tokens": done.prompt_eval_count}
    return _enc.encode({"object": "list", "data": data, "model": model, "usage": usage})
