"""What a run's backend request costs the worker, and whether it survives a server's keep-alive
timeout: the worker's httpx client (workers.backend: `backend_client` with `open_stream`),
httpx with its default settings, and aiohttp (when installed), side by side.

    python -m bench.backend_client [--requests 200] [--rounds 3] [--gaps 20] [--real] [--json]

Each request is a streamed chat of a few output tokens, every line decoded. The target is one
machine of `routeledger sim hosts --time-scale 0` (Ollama's NDJSON, answers at once), or with
`--real` a real llama-server (OpenAI's SSE; tests/real/llama.py builds it once per machine).

- CPU: CPU time of this process per request (the worker's own cost), and wall time per request,
  medians over rounds, the clients taking turns.
- reliability: the requests that failed in the timed rounds (each client's kept-alive connections
  sit idle while the others take their turn), and (`--gaps N`, real server only) N requests per
  client, each after an idle pause drawn
  from 4.8-5.2 s, around the 5 s after which llama-server (cpp-httplib) closes an idle kept-alive
  connection: the requests that failed. The race the worker used to lose ("Server disconnected
  without sending a response").

The last line is JSON: {"bench": "backend_client", "<client>_cpu_ms": ..., "<client>_wall_ms": ...,
"<client>_failed": ..., "requests": ..., "gaps": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from workers.backend import backend_client, open_stream

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
Call = Callable[[], Awaitable[int]]


def _lines(data: bytes, sse: bool) -> list[bytes]:
    out = []
    for line in data.split(b"\n"):
        line = line.strip()
        if sse:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            line = line[5:]
        if line:
            out.append(line)
    return out


def _request(sse: bool, tokens: int) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "user", "content": "Say something."}]
    if sse:
        body = {"model": "m", "stream": True, "messages": messages, "max_tokens": tokens}
        return "/v1/chat/completions", body
    return "/api/chat", {"model": "m", "stream": True, "messages": messages}


def httpx_call(client: httpx.AsyncClient, path: str, body: dict[str, Any], sse: bool, worker: bool) -> Call:
    async def call() -> int:
        n, rest = 0, b""
        if worker:
            resp = await open_stream(
                client, path, body, "text/event-stream" if sse else "application/x-ndjson"
            )
        else:
            resp = await client.send(client.build_request("POST", path, json=body), stream=True)
        try:
            async for chunk in resp.aiter_bytes():
                *whole, rest = (rest + chunk).split(b"\n")
                for line in _lines(b"\n".join(whole), sse):
                    _decoder.decode(line)
                    n += 1
        finally:
            await resp.aclose()
        return n

    return call


def aiohttp_call(session: Any, url: str, body: dict[str, Any], sse: bool) -> Call:
    async def call() -> int:
        n, rest = 0, b""
        async with session.post(url, json=body) as resp:
            async for chunk in resp.content.iter_any():
                *whole, rest = (rest + chunk).split(b"\n")
                for line in _lines(b"\n".join(whole), sse):
                    _decoder.decode(line)
                    n += 1
        return n

    return call


async def timed(call: Call, requests: int) -> tuple[float, float, int]:
    """(CPU ms, wall ms) per request over `requests` requests, and how many failed."""
    cpu, wall = time.process_time(), time.perf_counter()
    failed = 0
    for _ in range(requests):
        try:
            await call()
        except Exception:  # every failure counts, whatever the client calls it
            failed += 1
    return (
        (time.process_time() - cpu) * 1000 / requests,
        (time.perf_counter() - wall) * 1000 / requests,
        failed,
    )


async def gapped(call: Call, count: int, rng: random.Random) -> int:
    """Requests each after an idle pause around a 5 s keep-alive timeout; how many failed."""
    failed = 0
    for _ in range(count):
        await asyncio.sleep(rng.uniform(4.8, 5.2))
        try:
            await call()
        except Exception:  # every failure counts, whatever the client calls it
            failed += 1
    return failed


async def measure(url: str, sse: bool, tokens: int, requests: int, rounds: int, gaps: int) -> dict[str, Any]:
    path, body = _request(sse, tokens)
    worker = backend_client(url, 60.0)
    default = httpx.AsyncClient(base_url=url, timeout=60.0)
    calls: dict[str, Call] = {
        "worker_httpx": httpx_call(worker, path, body, sse, worker=True),
        "default_httpx": httpx_call(default, path, body, sse, worker=False),
    }
    session = None
    try:
        import aiohttp

        session = aiohttp.ClientSession()
        calls["default_aiohttp"] = aiohttp_call(session, url + path, body, sse)
    except ImportError:
        pass
    figures: dict[str, Any] = {}
    try:
        counts = [await call() for call in calls.values()]
        if len(set(counts)) != 1 or counts[0] == 0:
            raise SystemExit(f"the clients read different answers: {counts} lines")
        spent: dict[str, list[tuple[float, float, int]]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                spent[name].append(await timed(call, requests))
        for name, turns in spent.items():
            figures[f"{name}_cpu_ms"] = round(statistics.median(c for c, _, _ in turns), 3)
            figures[f"{name}_wall_ms"] = round(statistics.median(w for _, w, _ in turns), 3)
            # Each client's kept-alive connections sat idle while the others took their turn.
            figures[f"{name}_failed_after_turns"] = sum(f for _, _, f in turns)
        if gaps:
            runs = await asyncio.gather(
                *(gapped(call, gaps, random.Random(i)) for i, call in enumerate(calls.values()))
            )
            for name, failed in zip(calls, runs, strict=True):
                figures[f"{name}_failed"] = failed
    finally:
        await worker.aclose()
        await default.aclose()
        if session is not None:
            await session.close()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per client per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per answer")
    ap.add_argument("--gaps", type=int, default=0, help="requests after an idle pause, per client (--real)")
    ap.add_argument("--real", action="store_true", help="a real llama-server instead of a sim host")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rl-client-") as tmp:
        if args.real:
            from tests.real.llama import fast_server, model_path

            server = fast_server(model_path(), Path(tmp))
            with server:
                figures = asyncio.run(
                    measure(server.url, True, args.tokens, args.requests, args.rounds, args.gaps)
                )
        else:
            fleet = Path(tmp) / "fleet.toml"
            fleet.write_text(FLEET.format(tokens=args.tokens))
            argv = [sys.executable, "-m", "routeledger", "sim", "hosts", "--fleet-file", str(fleet)]
            sim = subprocess.Popen([*argv, "--time-scale", "0", "--json"], stdout=subprocess.PIPE)
            try:
                assert sim.stdout is not None
                url = next(iter(json.loads(sim.stdout.readline())["hosts"].values()))
                figures = asyncio.run(measure(url, False, args.tokens, args.requests, args.rounds, 0))
            finally:
                sim.terminate()
                sim.wait(30)
    figures.update(requests=args.requests, rounds=args.rounds, gaps=args.gaps, real=args.real)
    if not args.json:
        for key, value in figures.items():
            print(f"{key}: {value}")
    print(json.dumps({"bench": "backend_client", **figures}))


if __name__ == "__main__":
    main()
