"""The simulated machines' HTTP plumbing: a thin ASGI listener on uvicorn's httptools protocol, one
per port on a shared event loop, whose connections can all be cut at once (a machine losing power)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Final

import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

JSON: Final = b"application/json; charset=utf-8"


async def read_body(receive: Receive) -> bytes:
    message = await receive()
    body: bytes = message.get("body", b"")
    while message.get("more_body", False):
        message = await receive()
        body += message.get("body", b"")
    return body


async def respond(send: Send, status: int, body: bytes, content_type: bytes = JSON) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Listener:
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
