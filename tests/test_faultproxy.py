"""The fault-injecting proxy of the LAN rehearsal does what it says: it adds delay, caps the rate,
black-holes and heals, and drops connections (against an echo server on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from tests.faultproxy import FaultProxy, fault_proxy


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # Cancelled too when a test ends with the connection open (its loop closes).
    with contextlib.suppress(OSError, ConnectionError, asyncio.CancelledError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def _echo_behind_proxy(**options: object) -> AsyncIterator[FaultProxy]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with fault_proxy("127.0.0.1", port, **options) as proxy:
            yield proxy
    finally:
        server.close()


async def _connect(proxy: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def _round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> float:
    began = time.monotonic()
    writer.write(data)
    await writer.drain()
    assert await reader.readexactly(len(data)) == data
    return time.monotonic() - began


async def test_the_delay_is_added_in_each_direction_so_a_round_trip_takes_at_least_twice_it() -> None:
    async with _echo_behind_proxy(delay_s=0.02, jitter_s=0.01, seed=3) as proxy:
        reader, writer = await _connect(proxy)
        trips = [await _round_trip(reader, writer, f"ping {i}".encode()) for i in range(5)]
        writer.close()
    assert min(trips) >= 0.04, trips


async def test_jitter_keeps_the_order_of_the_bytes() -> None:
    async with _echo_behind_proxy(delay_s=0.001, jitter_s=0.02, seed=5) as proxy:
        reader, writer = await _connect(proxy)
        for i in range(50):
            writer.write(b"%03d" % i)
            await writer.drain()
            await asyncio.sleep(0.001)
        got = await reader.readexactly(150)
        writer.close()
    assert got == b"".join(b"%03d" % i for i in range(50))


async def test_a_rate_cap_paces_a_large_write() -> None:
    size, rate = 64 * 1024, 256 * 1024.0
    async with _echo_behind_proxy(rate=rate) as proxy:
        reader, writer = await _connect(proxy)
        took = await _round_trip(reader, writer, bytes(size))
        writer.close()
    # The proxy pauses after each 4 KiB piece it writes on (the echo overlaps the two directions).
    assert took >= (size - 4096) / rate, took


async def test_a_black_hole_forwards_nothing_until_healed_and_then_delivers_what_was_held() -> None:
    async with _echo_behind_proxy() as proxy:
        reader, writer = await _connect(proxy)
        assert await _round_trip(reader, writer, b"before") >= 0
        proxy.blackhole()
        writer.write(b"during")
        await writer.drain()
        answer = asyncio.ensure_future(reader.readexactly(6))
        await asyncio.wait({answer}, timeout=0.5)
        assert not answer.done()  # nothing came back
        # A connection opened during the black hole is accepted and hears nothing either.
        reader2, writer2 = await _connect(proxy)
        writer2.write(b"new")
        answer2 = asyncio.ensure_future(reader2.readexactly(3))
        await asyncio.wait({answer2}, timeout=0.3)
        assert not answer2.done()
        proxy.heal()
        assert await answer == b"during"
        assert await answer2 == b"new"
        assert await _round_trip(reader, writer, b"after") >= 0
        writer.close()
        writer2.close()


async def test_drop_closes_every_live_connection_and_new_ones_work() -> None:
    async with _echo_behind_proxy() as proxy:
        reader, writer = await _connect(proxy)
        await _round_trip(reader, writer, b"hello")
        assert proxy.drop() == 1
        # The client sees its connection end (reset or end of stream), never an answer.
        try:
            data = await asyncio.wait_for(reader.read(100), 5)
        except ConnectionError:
            data = b""
        assert data == b""
        reader2, writer2 = await _connect(proxy)
        await _round_trip(reader2, writer2, b"again")
        writer2.close()
        writer.close()
