"""A TCP proxy that makes a link between two machines misbehave on command (asyncio, in the test's
own event loop, so that the test decides when the network fails).

Every connection accepted on `listen_host:port` is forwarded to `target`, each direction through
its own ordered pipe:
- `delay_s` is added to every piece of data in each direction, plus up to `jitter_s` more at
  random; the order of the bytes is kept, as TCP keeps it.
- `rate` caps each direction at that many bytes a second (None: no cap).
- `blackhole()` stops forwarding on every connection, live and new, both ways: what a half-open
  Wi-Fi link or a VPN that lost its route does. Connections stay open and the bytes sent meanwhile
  are held, as the sender's TCP keeps retransmitting them; `heal()` lets them through in order (a
  FIN sent meanwhile arrives after them), as they would arrive once the link is back.
- `drop()` resets every live connection at once (both of its ends), as a router that lost its
  state or a peer that rebooted does.

TLS passes through untouched: the proxy only moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

# Largest piece written at once under a rate cap, so that a big read is paced and not one burst.
_PACED_PIECE = 4096


class _Pipe:
    """One direction of one connection: read from `source`, hold each piece until its time, write
    it to `sink`. `None` in the queue is the end of the stream (the sender's FIN)."""

    def __init__(self, proxy: FaultProxy, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.source = source
        self.sink = sink
        self.queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        self.last_release = 0.0

    def _release_at(self) -> float:
        p = self.proxy
        at = time.monotonic() + p.delay_s + (p.rng.uniform(0.0, p.jitter_s) if p.jitter_s else 0.0)
        # Never before the piece ahead of it: jitter delays, it does not reorder.
        self.last_release = max(self.last_release, at)
        return self.last_release

    async def read(self) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await self.source.read(65536):
                self.queue.put_nowait((self._release_at(), data))
        self.queue.put_nowait((self._release_at(), None))

    async def write(self) -> None:
        with contextlib.suppress(OSError, ConnectionError, RuntimeError):
            while True:
                release, data = await self.queue.get()
                wait = release - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self.proxy.forwarding.wait()
                if data is None:
                    if self.sink.can_write_eof():
                        self.sink.write_eof()
                    return
                await self._send(data)

    async def _send(self, data: bytes) -> None:
        rate = self.proxy.rate
        if rate is None:
            self.sink.write(data)
            await self.sink.drain()
            self.proxy.forwarded += len(data)
            return
        for start in range(0, len(data), _PACED_PIECE):
            piece = data[start : start + _PACED_PIECE]
            self.sink.write(piece)
            await self.sink.drain()
            self.proxy.forwarded += len(piece)
            await asyncio.sleep(len(piece) / rate)
            await self.proxy.forwarding.wait()


class _Link:
    """One accepted connection and its connection to the target."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.writers = (client, upstream)
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self) -> None:
        for task in self.tasks:
            task.cancel()
        for writer in self.writers:
            writer.transport.abort()


class FaultProxy:
    """Listens on `listen_host` (a free port unless `port` is given) and forwards to `target`."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        port: int = 0,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        rate: float | None = None,
        seed: int = 0,
    ) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.port = port
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.rate = rate
        self.rng = random.Random(seed)
        # Set while the link forwards; cleared by blackhole().
        self.forwarding = asyncio.Event()
        self.forwarding.set()
        self.forwarded = 0  # bytes written on, both directions together
        self.accepted = 0
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        """`host:port` to connect to instead of the target."""
        return f"{self.listen_host}:{self.port}"

    @property
    def live(self) -> int:
        """Connections open now."""
        return len(self._links)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop()
        self.forwarding.set()
        if self._server is not None:
            await self._server.wait_closed()

    def blackhole(self) -> None:
        """Stop forwarding on every connection, both ways; hold what is sent meanwhile."""
        self.forwarding.clear()

    def heal(self) -> None:
        """Forward again, starting with what was held."""
        self.forwarding.set()

    def drop(self) -> int:
        """Reset every live connection; returns how many there were."""
        links = list(self._links)
        for link in links:
            link.abort()
        self._links.clear()
        return len(links)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        link = _Link(writer, up_writer)
        self._links.add(link)
        pipes = (_Pipe(self, reader, up_writer), _Pipe(self, up_reader, writer))
        link.tasks = [asyncio.create_task(step()) for pipe in pipes for step in (pipe.read, pipe.write)]
        try:
            await asyncio.gather(*link.tasks)
        except asyncio.CancelledError:
            pass
        finally:
            self._links.discard(link)
            for end in link.writers:
                end.close()


@contextlib.asynccontextmanager
async def fault_proxy(target_host: str, target_port: int, **options: object) -> AsyncIterator[FaultProxy]:
    """A started FaultProxy (options as FaultProxy takes them), closed when the block ends."""
    proxy = FaultProxy(target_host, target_port, **options)  # type: ignore[arg-type]
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
