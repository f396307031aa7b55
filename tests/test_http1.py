"""The worker's HTTP/1.1 client for run requests (workers.http1), against a small server whose every
byte the test writes: kept-alive reuse, chunked answers, a server that closes, one that is not there."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from workers.backend import LineStreams
from workers.errors import BackendError, HttpError
from workers.http1 import Http1Pool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free port; yields its URL and a list that counts its connections."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (by its Content-Length); b"" when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return b""
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


def chunked(*parts: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"


async def test_answers_on_one_connection_are_read_whole_and_the_connection_is_kept() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await read_request(reader):
            seen.append(request)
            # A line split across two chunks, as a backend's writes may fall.
            writer.write(chunked(b'{"a": 1}\n{"b"', b": 2}\n", b'{"c": 3}'))
            await writer.drain()

    async with serving(handler) as (url, accepted):
        streams = LineStreams(url + "/", 5.0)
        try:
            first = [line async for line in streams.lines("/api/chat", {"x": 1}, "m")]
            second = [line async for line in streams.lines("/api/chat", {"x": 2}, "m")]
        finally:
            await streams.aclose()
    assert first == second == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}']
    assert len(accepted) == 1
    assert seen[0].startswith(b"POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1:")
    assert seen[0].endswith(b'\r\n\r\n{"x":1}') and seen[1].endswith(b'{"x":2}')


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
        await writer.drain()
        # and closes, though it did not say so

    async with serving(handler) as (url, accepted):
        pool = Http1Pool(url)
        try:
            for _ in range(3):
                answer = await pool.post("/p", b"{}", [])
                assert await answer.read() == b"ok\n"
                await asyncio.sleep(0.05)  # the close reaches the client
        finally:
            await pool.aclose()
    assert len(accepted) == 3


async def test_an_answer_left_unread_closes_its_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            whole = chunked(b"line one\n", b"line two\n")
            writer.write(whole[:60])
            await writer.drain()
            await asyncio.sleep(0.1)  # the rest comes later: the client leaves before it
            writer.write(whole[60:])
            await writer.drain()

    async with serving(handler) as (url, accepted):
        streams = LineStreams(url, 5.0)
        try:
            lines = streams.lines("/p", {}, "m")
            assert await anext(lines) == b"line one"
            await lines.aclose()
            assert [line async for line in streams.lines("/p", {}, "m")] == [b"line one", b"line two"]
        finally:
            await streams.aclose()
    assert len(accepted) == 2


async def test_a_stream_cut_mid_answer_is_a_disconnect_and_an_error_status_its_kind() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nline\n\r\n")
        await writer.drain()

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        body = b'{"error": "no such model"}'
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    async with serving(cut) as (url, _):
        pool = Http1Pool(url)
        answer = await pool.post("/p", b"{}", [])
        with pytest.raises(HttpError) as info:
            await answer.read()
        await pool.aclose()
    assert info.value.kind == "closed"
    async with serving(refuse) as (url, _):
        streams = LineStreams(url, 5.0)
        with pytest.raises(BackendError) as refused:
            [line async for line in streams.lines("/p", {}, "m")]
        await streams.aclose()
    assert refused.value.kind == "model_missing"
    assert "no such model" in str(refused.value)


async def test_no_server_is_a_connect_failure_and_no_answer_in_time_a_timeout() -> None:
    async with serving(lambda r, w: asyncio.sleep(0)) as (url, _):
        pass  # the port is free again
    with pytest.raises(HttpError) as refused:
        await Http1Pool(url).post("/p", b"{}", [])
    assert refused.value.kind == "connect"

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with serving(silent) as (url, _):
        pool = Http1Pool(url, read_timeout_s=0.2)
        with pytest.raises(HttpError) as slow:
            await pool.post("/p", b"{}", [])
        await pool.aclose()
    assert slow.value.kind == "timeout"


async def test_an_answer_without_length_or_chunks_ends_where_its_connection_does() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        for line in (b'{"a": 1}\n', b'{"b": 2}\n'):
            writer.write(line)
            await writer.drain()
            await asyncio.sleep(0.01)

    async with serving(handler) as (url, accepted):
        streams = LineStreams(url, 5.0)
        try:
            twice = [[line async for line in streams.lines("/p", {}, "m")] for _ in range(2)]
        finally:
            await streams.aclose()
    assert twice == [[b'{"a": 1}', b'{"b": 2}']] * 2
    assert len(accepted) == 2


async def test_lines_that_arrive_in_one_read_come_as_one_batch_and_later_ones_in_the_next() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        # Three chunks (a line each, the last split across two) in one write, then the rest later.
        writer.write(head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"a\n", b"b\n", b"c", b"c\n")))
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"2\r\nd\n\r\n0\r\n\r\n")
        await writer.drain()

    async with serving(handler) as (url, _):
        streams = LineStreams(url, 5.0)
        try:
            batches = [batch async for batch in streams.batches("/p", {}, "m")]
        finally:
            await streams.aclose()
    assert batches == [[b"a", b"b", b"cc"], [b"d"]]
