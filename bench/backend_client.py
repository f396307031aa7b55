"""What a run's backend request costs the worker: httpx's streaming client against the httpcore pool
the worker uses (workers.backend.LineStreams), side by side on one zero-delay sim host.

    python bench/backend_client.py [--requests 300] [--rounds 5] [--tokens 16] [--json]

Each request is what a run sends: a streamed /api/chat of `--tokens` output tokens (NDJSON, one line
per token), every line decoded. The two clients take turns, round by round, on one machine of
`routeledger sim hosts --time-scale 0` (answers at once): CPU time of this process per request
(the worker's own cost) and wall time per request, medians over rounds.

The last line is JSON:
{"bench": "backend_client", "httpx_cpu_ms": ..., "httpcore_cpu_ms": ..., "cpu_ratio": ...,
 "httpx_wall_ms": ..., "httpcore_wall_ms": ...}
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


async def with_httpcore(streams: LineStreams, body: dict[str, Any]) -> int:
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
    figures: dict[str, list[float]] = {k: [] for k in ("httpx_cpu", "httpx_wall", "core_cpu", "core_wall")}
    async with httpx.AsyncClient(base_url=url) as client:
        streams = LineStreams(url, 60.0)
        try:
            lines = (await with_httpx(client, body), await with_httpcore(streams, body))
            if lines[0] != lines[1] or lines[0] == 0:
                raise SystemExit(f"the clients read different answers: {lines[0]} and {lines[1]} lines")
            for _ in range(rounds):
                cpu, wall = await timed(lambda: with_httpx(client, body), requests)
                figures["httpx_cpu"].append(cpu)
                figures["httpx_wall"].append(wall)
                cpu, wall = await timed(lambda: with_httpcore(streams, body), requests)
                figures["core_cpu"].append(cpu)
                figures["core_wall"].append(wall)
        finally:
            await streams.aclose()
    med = {k: statistics.median(v) for k, v in figures.items()}
    ratios = [c / h for c, h in zip(figures["core_cpu"], figures["httpx_cpu"], strict=True)]
    return {
        "httpx_cpu_ms": round(med["httpx_cpu"], 3),
        "httpcore_cpu_ms": round(med["core_cpu"], 3),
        "cpu_ratio": round(statistics.median(ratios), 3),
        "httpx_wall_ms": round(med["httpx_wall"], 3),
        "httpcore_wall_ms": round(med["core_wall"], 3),
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
            f" wall; CPU ratio {f['cpu_ratio']:.2f} (medians of {args.rounds} rounds of"
            f" {args.requests} requests, {args.tokens} tokens each)"
        )
    print(json.dumps({"bench": "backend_client", **figures}))


if __name__ == "__main__":
    main()
