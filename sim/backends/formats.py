"""How the simulated machines spell a generation in each API: streamed chunks, the closing chunk,
the whole answer and errors, for Ollama's /api/chat and /api/generate and OpenAI's chat completions."""

from __future__ import annotations

import time
from typing import Final

import msgspec

from dispatch.ollama import final_fields, rfc3339
from sim.backends.machine import Timings

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


class ChatFormat(Format):
    def lines(self, tokens: list[str]) -> bytes:
        head = (
            b'{"model":'
            + self.model_json
            + b',"created_at":"'
            + rfc3339().encode()
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
                "created_at": rfc3339(),
                "message": {"role": "assistant", "content": text},
                **final_fields(timings.done_reason, timings),
            }
        )


class GenerateFormat(Format):
    def lines(self, tokens: list[str]) -> bytes:
        head = b'{"model":' + self.model_json + b',"created_at":"' + rfc3339().encode() + b'","response":'
        tail = b',"done":false}\n'
        return b"".join([head + _json_str(t) + tail for t in tokens])

    def final(self, timings: Timings) -> bytes:
        return self.whole("", timings) + b"\n"

    def whole(self, text: str, timings: Timings) -> bytes:
        return _enc.encode(
            {
                "model": self.model,
                "created_at": rfc3339(),
                "response": text,
                **final_fields(timings.done_reason, timings),
            }
        )


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
