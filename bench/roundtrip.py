"""What one Redis round trip costs a routeledger process's CPU, beside what it must cost.

    python -m bench.roundtrip [--commands N] [--rounds R] [--json]

Every routed request makes about ten round trips to Redis (bench/api.py counts the commands), so
the client's own cost per round trip is a large part of each process's CPU per request. This
script sends the same command (an XADD to a capped stream, as an event write is) one at a time, N
times, through each of:

- routeledger: the client every routeledger process makes (events.connection.redis_client);
- redis-py: redis-py's own asyncio client, with hiredis, on the same URL;
- floor: a bare asyncio protocol that writes the packed command and reads the reply with hiredis,
  with a deadline per read as routeledger keeps (asyncio.timeout);
- floor, no deadline: the same without it.

and prints the client's CPU time (user + system, this process only) per round trip, the median of
R rounds, the rounds alternating between the clients, against an embedded Redis (AOF on, as
`routeledger up` runs it). The processes run on uvloop, as routeledger's do. With two CPUs or more,
Redis is pinned to one and this process to another, so that neither waits for the other's core.

The last line is JSON:
{"bench": "roundtrip", "routeledger_us": ..., "redis_py_us": ..., "floor_us": ...,
 "floor_no_deadline_us": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import hiredis
import psutil
import redis.asyncio as aioredis
import uvloop

from events.connection import redis_client
from routeledger.embedded import EmbeddedRedis

COMMAND = ("XADD", "bench:s", "MAXLEN", "~", "1000", "*", "type", "bench", "v", "x" * 64)
WARM_UP = 500


_PENDING: Any = object()


class _Floor(asyncio.Protocol):
    """One command at a time: the reply's future, resolved when hiredis has a whole reply."""

    def __init__(self) -> None:
        # hiredis's own sentinel for "no whole reply yet" (its public `notEnoughData`), not redis-py's.
        self.reader = hiredis.Reader(notEnoughData=_PENDING)
        self.waiting: asyncio.Future[Any] | None = None

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        reply = self.reader.gets()
        if reply is not _PENDING and self.waiting is not None:
            self.waiting.set_result(reply)


async def _cpu_us(call: Callable[[], Awaitable[Any]], n: int) -> float:
    for _ in range(WARM_UP):
        await call()
    started = time.process_time()
    for _ in range(n):
        await call()
    return (time.process_time() - started) / n * 1e6


async def measure(url: str, server: EmbeddedRedis, n: int, rounds: int) -> dict[str, list[float]]:
    ours = redis_client(url)
    theirs = aioredis.Redis.from_url(url)
    loop = asyncio.get_running_loop()
    transport, floor = await loop.create_connection(_Floor, "127.0.0.1", server.port)
    floor.waiting = loop.create_future()
    transport.write(hiredis.pack_command(("AUTH", server.password)))
    await floor.waiting
    packed = hiredis.pack_command(COMMAND)

    async def by_floor() -> Any:
        floor.waiting = loop.create_future()
        transport.write(packed)
        async with asyncio.timeout(10):
            return await floor.waiting

    async def by_floor_no_deadline() -> Any:
        floor.waiting = loop.create_future()
        transport.write(packed)
        return await floor.waiting

    async def by_ours() -> Any:
        return await ours.execute_command(*COMMAND)

    async def by_redis_py() -> Any:
        return await theirs.execute_command(*COMMAND)

    calls = {
        "routeledger": by_ours,
        "redis_py": by_redis_py,
        "floor": by_floor,
        "floor_no_deadline": by_floor_no_deadline,
    }
    got: dict[str, list[float]] = {name: [] for name in calls}
    try:
        for _ in range(rounds):
            for name, call in calls.items():
                got[name].append(await _cpu_us(call, n))
    finally:
        transport.close()
        await ours.aclose()
        await theirs.aclose()
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rl-roundtrip-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis")
        url = server.start()
        try:
            assert server.process is not None
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) >= 2:
                psutil.Process(server.process.pid).cpu_affinity([cpus[0]])
                os.sched_setaffinity(0, {cpus[1]})
            got = uvloop.run(measure(url, server, args.commands, args.rounds))
        finally:
            server.stop()
    medians = {name: statistics.median(values) for name, values in got.items()}
    if not args.json:
        print(
            "client CPU per round trip (XADD, one at a time; "
            f"median of {args.rounds} rounds of {args.commands}):"
        )
        for name, values in got.items():
            spread = ", ".join(f"{v:.1f}" for v in values)
            print(f"  {name:<18} {medians[name]:6.1f} us   ({spread})")
    print(json.dumps({"bench": "roundtrip", **{f"{k}_us": round(v, 1) for k, v in medians.items()}}))


if __name__ == "__main__":
    main()
