"""A tiny Ollama-speaking server on loopback whose network behaviour a test switches at will.

Modes: `ok` answers like Ollama; `hang` reads the request and never answers; `reset` sends a
couple of chunks and then resets the connection (TCP RST, not a clean close); `drip` streams one
token every `drip_s` seconds and never finishes, so that no gap is long enough for an idle
timeout and only the whole-run timeout can end it. The sim hosts fault by HTTP semantics; these
faults are at the socket, which is what a flaky network or a wedged server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from typing import Literal

Mode = Literal["ok", "hang", "reset", "drip"]
DIGEST = "fa" * 32


class FaultyBackend:
    def __init__(self, drip_s: float = 0.25, tokens: int = 8) -> None:
        self.mode: Mode = "ok"
        self.drip_s = drip_s
        self.tokens = tokens
        self.chats = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aenter__(self) -> FaultyBackend:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._open):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            if path == "/api/tags":
                model = {"name": "m:latest", "model": "m:latest", "digest": DIGEST, "size": 1, "details": {}}
                await self._json(writer, {"models": [model]})
            elif path == "/api/ps":
                await self._json(writer, {"models": []})
            elif method == "POST" and path == "/api/chat":
                self.chats += 1
                await self._chat(reader, writer)
            else:
                await self._json(writer, {"error": "not found"}, status="404 Not Found")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._open.discard(writer)
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()

    async def _json(self, writer: asyncio.StreamWriter, body: object, status: str = "200 OK") -> None:
        data = json.dumps(body).encode()
        writer.write(
            f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
            "connection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    async def _chat(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mode = self.mode
        if mode == "hang":
            await reader.read()  # until the client gives up
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\nconnection: close\r\n\r\n")
        sent = 0
        while mode == "drip" or sent < self.tokens:
            piece = {
                "model": "m:latest",
                "message": {"role": "assistant", "content": f"t{sent} "},
                "done": False,
            }
            writer.write(json.dumps(piece).encode() + b"\n")
            await writer.drain()
            sent += 1
            if mode == "reset" and sent == 2:
                sock = writer.get_extra_info("socket")
                # SO_LINGER 0: close() sends RST at once instead of FIN.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            if mode == "drip":
                await asyncio.sleep(self.drip_s)
        final = {
            "model": "m:latest",
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": "stop",
            "prompt_eval_count": 5,
            "prompt_eval_duration": 5_000_000,
            "eval_count": sent,
            "eval_duration": sent * 10_000_000,
            "load_duration": 0,
            "total_duration": 5_000_000 + sent * 10_000_000,
        }
        writer.write(json.dumps(final).encode() + b"\n")
        await writer.drain()
