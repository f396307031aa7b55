"""A TCP proxy in front of Redis that can make a network misbehave on command.

Connections through it forward both ways until told otherwise:
- `hang_existing()`: the connections open now stop forwarding in both directions, as a half-open
  TCP connection does (Wi-Fi gone, a VPN that dropped its state); new ones work.
- `hang_all()`: every connection, and every new one, stops forwarding (a black hole), until `heal()`.
- `mute_reply_after(trigger)`: the next connection whose client sends `trigger` gets its request
  through, and then hears nothing back: a write applied by Redis whose reply was lost.
- `drop_on(trigger)`: the next connection whose client sends `trigger` is closed at once, its
  request never forwarded: what a client sees when Redis dies while the command is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class _Link:
    """One client connection and its connection to Redis."""

    def __init__(self) -> None:
        self.frozen = False
        self.muted = False
        # The end of what the client sent before, for a trigger split between two reads.
        self.seen = b""
        self.tasks: list[asyncio.Task[None]] = []
        self.writers: list[asyncio.StreamWriter] = []


class RedisProxy:
    """Listens on a free local port and forwards to `target_host:target_port`."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: list[_Link] = []
        self._black_hole = False
        self._trigger: bytes | None = None
        self._drop: bytes | None = None
        self.muted_replies = 0
        self.dropped = asyncio.Event()

    def url(self, password: str | None = None, db: int = 0) -> str:
        auth = f":{password}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for link in self._links:
            for task in link.tasks:
                task.cancel()
            for writer in link.writers:
                writer.close()

    def hang_existing(self) -> None:
        for link in self._links:
            link.frozen = True

    def hang_all(self) -> None:
        self._black_hole = True
        self.hang_existing()

    def heal(self) -> None:
        """New connections forward again (frozen ones stay frozen, as a dead TCP connection does)."""
        self._black_hole = False

    def mute_reply_after(self, trigger: bytes) -> None:
        self._trigger = trigger

    def drop_on(self, trigger: bytes) -> None:
        self._drop = trigger

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link()
        link.frozen = self._black_hole
        self._links.append(link)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        link.writers = [writer, up_writer]
        link.tasks = [
            asyncio.create_task(self._pump(reader, up_writer, link, upstream=True)),
            asyncio.create_task(self._pump(up_reader, writer, link, upstream=False)),
        ]

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link, *, upstream: bool
    ) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError, ConnectionError):
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if link.frozen:
                    continue  # swallowed: the other side never hears of it
                if upstream:
                    window, link.seen = link.seen + data, data[-64:]
                    if self._drop is not None and self._drop in window:
                        self._drop = None
                        self.dropped.set()
                        for other in link.writers:
                            other.transport.abort()
                        return
                    if self._trigger is not None and self._trigger in window:
                        self._trigger = None
                        link.muted = True
                        self.muted_replies += 1
                if not upstream and link.muted:
                    continue
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


@contextlib.asynccontextmanager
async def redis_proxy(host: str, port: int) -> AsyncIterator[RedisProxy]:
    proxy = RedisProxy(host, port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
