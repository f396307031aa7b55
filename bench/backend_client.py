"""What a run's backend request costs the worker: httpx's streaming client, an httpcore pool and the
worker's own HTTP/1.1 client (workers.backend.LineStreams over workers.http1), side by side on one
zero-delay sim host.

    python bench/backend_client.py [--requests 300] [--rounds 5] [--tokens 16] [--json]

Each request is what a run sends: a streamed /api/chat of `--tokens` output tokens (NDJSON, one line
per token), every line decoded. The two clients take turns, round by round, on one machine of
`routeledger sim hosts --time-scale 0` (answers at once): CPU time of this process per request
(the worker's own cost) and wall time per request, medians over rounds.

The last line is JSON (cpu_ratio: httpcore's CPU over httpx's; http1_cpu_ratio: the worker's
client's over httpcore's):
{"bench": "backend_client", "httpx_cpu_ms": ..., "httpcore_cpu_ms": ..., "cpu_ratio": ...,
 "httpx_wall_ms": ..., "httpcore_wall_ms": ..., "http1_cpu_ms": ..., "http1_wall_ms": ...,
 "http1_cpu_ratio": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

# The project this script sits in, ahead of any installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpcore
import httpx
import msgspec

from workers.backend import LineStreams

FLEET = """
name = "client-bench"
[model."m"]
output = {{ dist = "fixed", mean = {tokens} }}
[[worker]]
name = "host"
slots = 4
[worker.models."m"]
decode_tps = 100.0
"""

_decoder = msgspec.json.Decoder(dict[str, Any])


async def with_httpx(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    n = 0
    async with client.stream("POST", "/api/chat", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.strip():
                _decoder.decode(line)
                n += 1
    return n


async def with_httpcore(pool: httpcore.AsyncConnectionPool, url: str, body: dict[str, Any]) -> int:
    """What the worker sent its requests through before workers.http1: straight to httpcore."""
    content = msgspec.json.encode(body)
    headers = [
        (b"Content-Type", b"application/json"),
        (b"Accept", b"application/x-ndjson"),
        (b"Content-Length", str(len(content)).encode()),
    ]
    n = 0
    async with pool.stream("POST", url + "/api/chat", headers=headers, content=content) as resp:
        rest = b""
        async for chunk in resp.aiter_stream():
            *whole, rest = (rest + chunk).split(b"\n")
            for line in whole:
                if line.strip():
                    _decoder.decode(line)
                    n += 1
    return n


async def with_http1(streams: LineStreams, body: dict[str, Any]) -> int:
    n = 0
    async for line in streams.lines("/api/chat", body, "m"):
        _decoder.decode(line)
        n += 1
    return n


async def timed(call: Callable[[], Awaitable[int]], requests: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per request over `requests` requests."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(requests):
        await call()
    return (
        (time.process_time() - cpu) * 1000 / requests,
        (time.perf_counter() - wall) * 1000 / requests,
    )


async def measure(url: str, requests: int, rounds: int) -> dict[str, float]:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
    names = ("httpx", "core", "http1")
    figures: dict[str, list[float]] = {f"{n}_{k}": [] for n in names for k in ("cpu", "wall")}
    async with httpx.AsyncClient(base_url=url) as client:
        streams = LineStreams(url, 60.0)
        pool = httpcore.AsyncConnectionPool(max_connections=64, max_keepalive_connections=32)
        calls: dict[str, Callable[[], Awaitable[int]]] = {
            "httpx": lambda: with_httpx(client, body),
            "core": lambda: with_httpcore(pool, url, body),
            "http1": lambda: with_http1(streams, body),
        }
        try:
            lines = [await call() for call in calls.values()]
            if len(set(lines)) != 1 or lines[0] == 0:
                raise SystemExit(f"the clients read different answers: {lines} lines")
            for _ in range(rounds):
                for name, call in calls.items():
                    cpu, wall = await timed(call, requests)
                    figures[f"{name}_cpu"].append(cpu)
                    figures[f"{name}_wall"].append(wall)
        finally:
            await streams.aclose()
            await pool.aclose()
    med = {k: statistics.median(v) for k, v in figures.items()}
    ratios = [c / h for c, h in zip(figures["core_cpu"], figures["httpx_cpu"], strict=True)]
    own = [c / h for c, h in zip(figures["http1_cpu"], figures["core_cpu"], strict=True)]
    return {
        "httpx_cpu_ms": round(med["httpx_cpu"], 3),
        "httpcore_cpu_ms": round(med["core_cpu"], 3),
        "cpu_ratio": round(statistics.median(ratios), 3),
        "httpx_wall_ms": round(med["httpx_wall"], 3),
        "httpcore_wall_ms": round(med["core_wall"], 3),
        "http1_cpu_ms": round(med["http1_cpu"], 3),
        "http1_wall_ms": round(med["http1_wall"], 3),
        "http1_cpu_ratio": round(statistics.median(own), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per client per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16, help="output tokens (NDJSON lines) per answer")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rl-client-") as tmp:
        fleet = Path(tmp) / "fleet.toml"
        fleet.write_text(FLEET.format(tokens=args.tokens))
        argv = [sys.executable, "-m", "routeledger", "sim", "hosts", "--fleet-file", str(fleet)]
        sim = subprocess.Popen([*argv, "--time-scale", "0", "--json"], stdout=subprocess.PIPE)
        try:
            assert sim.stdout is not None
            url = next(iter(json.loads(sim.stdout.readline())["hosts"].values()))
            figures = asyncio.run(measure(url, args.requests, args.rounds))
        finally:
            sim.terminate()
            sim.wait(30)
    if not args.json:
        f = figures
        print(
            f"httpx: {f['httpx_cpu_ms']:.3f} ms CPU, {f['httpx_wall_ms']:.3f} ms wall per request;"
            f" httpcore pool: {f['httpcore_cpu_ms']:.3f} ms CPU, {f['httpcore_wall_ms']:.3f} ms"
            f" wall; CPU ratio {f['cpu_ratio']:.2f}; the worker's client (workers.http1):"
            f" {f['http1_cpu_ms']:.3f} ms CPU, {f['http1_wall_ms']:.3f} ms wall, CPU ratio to httpcore"
            f" {f['http1_cpu_ratio']:.2f} (medians of {args.rounds} rounds of"
            f" {args.requests} requests, {args.tokens} tokens each)"
        )
    print(json.dumps({"bench": "backend_client", **figures}))


if __name__ == "__main__":
    main()
