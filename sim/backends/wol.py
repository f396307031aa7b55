"""A sleeping simulated machine's network card: it listens on a loopback UDP port for its magic packet.

A real machine asleep keeps its network card powered and wakes when a frame carries six 0xFF bytes
followed by its MAC address sixteen times. The simulated one listens on a UDP port of its host
(loopback in tests: nothing is sent anywhere else), keeps every datagram it receives, and calls
`on_wake` for each one that is its magic packet; anything else is ignored, as a card ignores it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from sim.errors import SimHostError


def expected_packet(mac: str) -> bytes:
    """The payload that wakes the machine with `mac` (hex pairs, any of ':' or '-' between them)."""
    digits = mac.replace(":", "").replace("-", "")
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        raise SimHostError(f"{mac!r} is not a MAC address") from None
    if len(raw) != 6:
        raise SimHostError(f"{mac!r} is not a MAC address (six bytes)")
    return b"\xff" * 6 + raw * 16


class WakeListener(asyncio.DatagramProtocol):
    """The card: every datagram received is kept; a matching one calls `on_wake`."""

    def __init__(self, mac: str, on_wake: Callable[[], None]) -> None:
        self.packet = expected_packet(mac)
        self.on_wake = on_wake
        self.received: list[bytes] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's own datagram transports do not derive from DatagramTransport.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self.received.append(data)
        if data == self.packet:
            self.on_wake()

    @property
    def port(self) -> int:
        assert self.transport is not None
        return int(self.transport.get_extra_info("sockname")[1])

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


async def open_wake_listener(host: str, port: int, mac: str, on_wake: Callable[[], None]) -> WakeListener:
    """A WakeListener bound to `host`:`port` (0: a free port)."""
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_datagram_endpoint(
        lambda: WakeListener(mac, on_wake), local_addr=(host, port)
    )
    return protocol
