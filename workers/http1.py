"""A run's backend request over HTTP/1.1 on kept-alive connections: an asyncio protocol whose
bytes httptools (the C parser uvicorn serves with) parses, and nothing else in between.

Every run POSTs one JSON body and reads a streamed answer line by line (Ollama's NDJSON). Through
httpcore, each request passes its connection pool, anyio's stream wrappers and h11's pure-Python
parser: the largest share of a worker's CPU per task on a fast backend (bench/backend_client.py
measures the clients side by side). Here a chunk of the answer goes from the socket to the parser
(de-chunked in C) to the reader's buffer in one callback.

What it does not do, as the worker needs none of it: redirects, proxies, HTTP/2, compression,
cookies, a request body that is not bytes. A connection goes back to the pool only when its
answer was read to the end and the server keeps it alive; one the server closed while idle is
dropped when the loop sees it close.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from typing import Final
from urllib.parse import urlsplit

import httptools

from workers.errors import HttpError

# Connections kept idle per backend; more are opened while all are busy and closed when returned.
_IDLE_MAX: Final = 32


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and the answer being read on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.error: Exception | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._body: deque[bytes] = deque()
        self._headers_done = False
        self._complete = False
        self._keep_alive = False
        self._until_close = True
        self._waiter: asyncio.Future[None] | None = None
        self.status = 0

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = HttpError("protocol", f"the backend's answer is not HTTP/1.1: {exc}")
            self._close()
        self._wake()

    def eof_received(self) -> bool | None:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._headers_done and not self._complete and self._until_close and exc is None:
            # An answer with neither a length nor chunks ends where its connection does.
            self._complete = True
        if not self._complete and self.error is None:
            self.error = HttpError("closed", str(exc) if exc else "the backend closed the connection")
        self._wake()

    # -- httptools callbacks -------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or (lowered == b"transfer-encoding" and b"chunked" in value.lower()):
            self._until_close = False

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        # Read here: the parser forgets it once the message is done.
        self._keep_alive = self._parser.should_keep_alive()
        self._complete = True

    # -- the request ---------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def _wait(self, timeout_s: float) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self._waiter
        except TimeoutError:
            raise HttpError("timeout", f"no answer within {timeout_s:g} s") from None
        finally:
            self._waiter = None

    def send(self, request: bytes) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._body.clear()
        self._headers_done = self._complete = self._keep_alive = False
        # Until a header says how the body ends (a length, or chunks), it ends with the connection.
        self._until_close = True
        self.status = 0
        assert self.transport is not None
        self.transport.write(request)

    async def head(self, timeout_s: float) -> int:
        """Wait for the answer's status line and headers; its status."""
        while not self._headers_done:
            if self.error is not None:
                raise self.error
            await self._wait(timeout_s)
        return self.status

    async def chunks(self, timeout_s: float) -> AsyncIterator[bytes]:
        """The answer's body as it arrives (de-chunked), until it is complete: what arrived since
        the last look in one piece (a backend that answers at once sends many HTTP chunks in one
        read, and each piece handed on costs a step through every generator above)."""
        while True:
            while self._body:
                piece = self._body.popleft() if len(self._body) == 1 else b"".join(self._body)
                self._body.clear()
                yield piece
            if self._complete:
                return
            if self.error is not None:
                raise self.error
            await self._wait(timeout_s)

    def reusable(self) -> bool:
        return (
            self._complete
            and not self.closed
            and self.error is None
            and self._keep_alive
            and self.transport is not None
            and not self.transport.is_closing()
        )


class Http1Pool:
    """Kept-alive HTTP/1.1 connections to one origin, for POSTs whose answers are streamed."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        default_port = self._port == (443 if self._tls else 80)
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._host_header = (host if default_port else f"{host}:{self._port}").encode()
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self._tls else None
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
            self._open.discard(conn)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    _Connection,
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._tls else None,
                )
        except TimeoutError:
            raise HttpError("connect", f"no connection to {self._host}:{self._port} in time") from None
        except OSError as exc:
            raise HttpError("connect", str(exc) or "connection refused") from None
        self._open.add(conn)
        return conn

    def _give_back(self, conn: _Connection) -> None:
        if conn.reusable() and len(self._idle) < _IDLE_MAX:
            self._idle.append(conn)
        else:
            conn._close()
            self._open.discard(conn)

    async def post(self, path: str, content: bytes, headers: list[tuple[bytes, bytes]]) -> _Answer:
        """Send a POST of `content` at `path`; the answer, its status read, its body to stream.
        The caller reads it to the end or closes it (Answer.aclose)."""
        head = [b"POST ", (self._prefix + path).encode(), b" HTTP/1.1\r\nHost: ", self._host_header]
        for name, value in headers:
            head += [b"\r\n", name, b": ", value]
        head += [b"\r\nContent-Length: ", str(len(content)).encode(), b"\r\n\r\n", content]
        request = b"".join(head)
        conn = await self._connection()
        try:
            conn.send(request)
            status = await conn.head(self.read_timeout_s)
        except BaseException:
            conn._close()
            self._open.discard(conn)
            raise
        return _Answer(self, conn, status)

    async def aclose(self) -> None:
        for conn in list(self._open):
            conn._close()
        self._open.clear()
        self._idle.clear()


class _Answer:
    """An answer whose status is known and whose body is still to read."""

    def __init__(self, pool: Http1Pool, conn: _Connection, status: int) -> None:
        self._pool = pool
        self._conn = conn
        self.status = status
        self._done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; the connection goes back to the pool once it is all read."""
        try:
            async for chunk in self._conn.chunks(self._pool.read_timeout_s):
                yield chunk
        finally:
            await self.aclose()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def aclose(self) -> None:
        """Give the connection back (an answer read to its end) or close it (one left unread)."""
        if not self._done:
            self._done = True
            self._pool._give_back(self._conn)
