"""A run's request to its backend (workers.backend: httpx, `open_stream`, `LineStreams`), against a
small server whose every byte the test writes: kept-alive reuse, a connection the server closed
while idle, one it closes as the next request arrives (the stale-connection race), chunked and
unframed answers, cuts, error statuses, no server, no answer in time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from tasks.payload import Message, TaskMessage
from workers.backend import Generated, LineStreams, OllamaBackend, backend_client
from workers.errors import BackendError

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
    """One request's head and body (by its Content-Length, none without one); b"" when the client
    closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return b""
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    return head + await reader.readexactly(length)


def chunked(*parts: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"


@contextlib.asynccontextmanager
async def streams_to(url: str, idle_timeout_s: float = 5.0) -> AsyncIterator[LineStreams]:
    client = backend_client(url, idle_timeout_s)
    try:
        yield LineStreams(client)
    finally:
        await client.aclose()


def _task() -> TaskMessage:
    return TaskMessage(task_id="t", model="m", digest="d" * 64, messages=[Message(role="user", content="hi")])


async def test_answers_on_one_connection_are_read_whole_and_the_connection_is_kept() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await read_request(reader):
            seen.append(request)
            # A line split across two chunks, as a backend's writes may fall.
            writer.write(chunked(b'{"a": 1}\n{"b"', b": 2}\n", b'{"c": 3}'))
            await writer.drain()

    async with serving(handler) as (url, accepted), streams_to(url + "/") as streams:
        first = [line async for line in streams.lines("/api/chat", {"x": 1}, "m")]
        second = [line async for line in streams.lines("/api/chat", {"x": 2}, "m")]
    assert first == second == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}']
    assert len(accepted) == 1
    assert seen[0].startswith(b"POST /api/chat HTTP/1.1\r\n")
    assert seen[0].endswith(b'\r\n\r\n{"x":1}') and seen[1].endswith(b'{"x":2}')


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
        await writer.drain()
        # and closes, though it did not say so

    async with serving(handler) as (url, accepted), streams_to(url) as streams:
        for _ in range(3):
            assert [line async for line in streams.lines("/p", {}, "m")] == [b"ok"]
            await asyncio.sleep(0.05)  # the close reaches the client
    assert len(accepted) == 3


async def test_a_request_that_meets_a_connection_the_server_is_closing_is_sent_again_on_a_fresh_one() -> None:
    # The race the first request after an idle gap loses against a server whose keep-alive timeout
    # ends just then: the request goes out on the old connection, which closes without an answer.
    answered: list[bytes] = []
    dropped: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        while request := await read_request(reader):
            if not first:
                dropped.append(request)
                return  # read it, and close without a word
            first = False
            answered.append(request)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
            await writer.drain()

    async with serving(handler) as (url, accepted), streams_to(url) as streams:
        for _ in range(3):
            assert [line async for line in streams.lines("/p", {}, "m")] == [b"ok"]
    # Each connection answers once: the second and third requests each met a closing one first.
    assert len(answered) == 3 and len(dropped) == 2
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

    async with serving(handler) as (url, accepted), streams_to(url) as streams:
        lines = streams.lines("/p", {}, "m")
        assert await anext(lines) == b"line one"
        await lines.aclose()
        assert [line async for line in streams.lines("/p", {}, "m")] == [b"line one", b"line two"]
    assert len(accepted) == 2


async def test_a_stream_cut_mid_answer_is_a_disconnect_and_an_error_status_says_its_kind() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        line = b'{"message": {"role": "assistant", "content": "Hel"}}\n'
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(line), line))
        await writer.drain()

    async with serving(cut) as (url, _):
        backend = OllamaBackend(url)
        pieces: list[object] = []

        async def read() -> None:
            async for item in backend.generate(_task(), "m"):
                pieces.append(item)

        with pytest.raises(BackendError) as info:
            await read()
        await backend.aclose()
    assert pieces == ["Hel"]
    assert info.value.kind == "disconnect" and info.value.retryable

    for status, kind, retryable in ((404, "model_missing", True), (501, "unsupported", False)):

        async def refuse(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int = status
        ) -> None:
            await read_request(reader)
            body = b'{"error": "not here"}'
            writer.write(b"HTTP/1.1 %d No\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
            await writer.drain()

        async with serving(refuse) as (url, _), streams_to(url) as streams:
            with pytest.raises(BackendError) as refused:
                [line async for line in streams.lines("/p", {}, "m")]
        assert (refused.value.kind, refused.value.retryable) == (kind, retryable)
        assert "not here" in str(refused.value)


async def test_no_server_is_unreachable_and_no_answer_in_time_a_timeout() -> None:
    async with serving(lambda r, w: asyncio.sleep(0)) as (url, _):
        pass  # the port is free again
    backend = OllamaBackend(url)
    with pytest.raises(BackendError) as refused:
        [item async for item in backend.generate(_task(), "m")]
    await backend.aclose()
    assert refused.value.kind == "unreachable"

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with serving(silent) as (url, _):
        backend = OllamaBackend(url, idle_timeout_s=0.2)
        with pytest.raises(BackendError) as slow:
            [item async for item in backend.generate(_task(), "m")]
        await backend.aclose()
    assert slow.value.kind == "timeout"


async def test_an_answer_without_length_or_chunks_ends_where_its_connection_does() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        for line in (b'{"a": 1}\n', b'{"b": 2}\n'):
            writer.write(line)
            await writer.drain()
            await asyncio.sleep(0.01)

    async with serving(handler) as (url, accepted), streams_to(url) as streams:
        twice = [[line async for line in streams.lines("/p", {}, "m")] for _ in range(2)]
    assert twice == [[b'{"a": 1}', b'{"b": 2}']] * 2
    assert len(accepted) == 2


async def test_lines_split_across_chunks_are_joined_and_later_ones_follow_in_order() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        # Three chunks (a line each, the last split across two) in one write, then the rest later.
        writer.write(head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"a\n", b"b\n", b"c", b"c\n")))
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"2\r\nd\n\r\n0\r\n\r\n")
        await writer.drain()

    async with serving(handler) as (url, _), streams_to(url) as streams:
        batches = [batch async for batch in streams.batches("/p", {}, "m")]
    assert [line for batch in batches for line in batch] == [b"a", b"b", b"cc", b"d"]


async def test_a_finished_ollama_run_ends_with_the_backends_timings() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            chunked(
                b'{"message": {"role": "assistant", "content": "ok"}}\n',
                b'{"message": {"content": ""}, "done": true, "eval_count": 1, "eval_duration": 5}\n',
            )
        )
        await writer.drain()

    async with serving(handler) as (url, _):
        backend = OllamaBackend(url)
        items = [item async for item in backend.generate(_task(), "m")]
        await backend.aclose()
    assert items[0] == "ok"
    assert isinstance(items[1], Generated) and items[1].timings.eval_count == 1
