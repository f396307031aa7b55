"""The API's own cost: the same chat requests straight to a zero-delay sim host and through routeledger.

    python bench/api.py [--requests N] [--seconds S] [--concurrency C] [--profile] [--json]

A demo-like set-up on this machine, each part its own process: an embedded Redis (AOF on), one
`routeledger sim hosts` process with --time-scale 0 (answers at once, reports simulated timings),
one `routeledger worker` process, and `routeledger api` (uvicorn). This process is the client: one
httpx client for both targets, non-streaming OpenAI chat completions, the same body.

- added latency: N requests one at a time, alternating direct and routed; p50 and p99 of each,
  and the difference (what routeledger adds: API, Redis round trips, the worker's pull and relay).
- requests/s: C concurrent clients for S seconds against each target.
- --profile runs the API under cProfile and prints its hottest functions.
- --gate: the worker's pull gate; `plain` (default) isolates the API's cost, `router` adds the
  speed-aware gate's own wake-up delay (a worker concern, measured by bench/dispatch.py).

The last line is JSON:
{"bench": "api", "added_p50_ms": ..., "added_p99_ms": ..., "rps": ..., "direct_rps": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from routeledger.embedded import EmbeddedRedis

FLEET = """
name = "api-bench"
[model."m"]
output = { dist = "fixed", mean = 16 }
[[worker]]
name = "w0"
slots = 8
[worker.models."m"]
decode_tps = 100.0
prompt_tps = 1000.0
load_s = 0.0
"""
BODY = {"model": "m", "messages": [{"role": "user", "content": "Say something short."}]}


def rl(*args: str) -> list[str]:
    return [sys.executable, "-m", "routeledger", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def wait_ready(http: httpx.AsyncClient, api: str, wait_s: float = 60) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            models = (await http.get(api + "/v1/models")).json()["data"]
            if any(m["id"] == "m:latest" for m in models):
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        await asyncio.sleep(0.2)
    raise SystemExit("the API or the worker did not come up")


async def one(http: httpx.AsyncClient, url: str) -> float:
    t0 = time.perf_counter()
    response = await http.post(url, json=BODY)
    elapsed = (time.perf_counter() - t0) * 1000
    if response.status_code != 200:
        raise SystemExit(f"{url} answered {response.status_code}: {response.text[:300]}")
    return elapsed


async def latency(
    http: httpx.AsyncClient, direct: str, routed: str, n: int
) -> tuple[list[float], list[float]]:
    d: list[float] = []
    r: list[float] = []
    for _ in range(n):
        d.append(await one(http, direct))
        r.append(await one(http, routed))
    return d, r


async def rate(http: httpx.AsyncClient, url: str, clients: int, seconds: float) -> float:
    stop = time.perf_counter() + seconds
    done = 0

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await one(http, url)
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--gate",
        choices=["plain", "router"],
        default="plain",
        help="the worker's pull gate (router: the speed-aware gate, whose wake-up delay is the worker's)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="rl-api-bench-")
    root = Path(tmp.name)
    server = EmbeddedRedis(root / "redis")
    url = server.start()
    fleet = root / "fleet.toml"
    fleet.write_text(FLEET)
    env = {**os.environ, "ROUTELEDGER_LOG_LEVEL": "warning"}
    procs: list[subprocess.Popen[bytes]] = []
    prof = root / "api.prof"
    port = free_port()
    try:
        sim = subprocess.Popen(
            rl("sim", "hosts", "--fleet-file", str(fleet), "--time-scale", "0", "--json"),
            stdout=subprocess.PIPE,
            env=env,
        )
        procs.append(sim)
        assert sim.stdout is not None
        backend = json.loads(sim.stdout.readline())["hosts"]["w0"]
        procs.append(
            subprocess.Popen(
                rl(
                    "worker",
                    "--backend",
                    backend,
                    "--id",
                    "w0",
                    "--slots",
                    "8",
                    "--gate",
                    args.gate,
                    "--redis-url",
                    url,
                ),
                env=env,
            )
        )
        api_argv = rl("api", "--port", str(port), "--redis-url", url)
        if args.profile:
            api_argv = [sys.executable, "-m", "cProfile", "-o", str(prof), *api_argv[1:]]
        procs.append(subprocess.Popen(api_argv, env=env))
        api = f"http://127.0.0.1:{port}"
        direct_url = backend.rstrip("/") + "/v1/chat/completions"
        routed_url = api + "/v1/chat/completions"

        async def run() -> tuple[list[float], list[float], float, float]:
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
            async with httpx.AsyncClient(timeout=30, limits=limits) as http:
                await wait_ready(http, api)
                await latency(http, direct_url, routed_url, 50)  # warm-up: connections, caches, model loaded
                d, r = await latency(http, direct_url, routed_url, args.requests)
                direct_rps = await rate(http, direct_url, args.concurrency, args.seconds)
                rps = await rate(http, routed_url, args.concurrency, args.seconds)
                return d, r, rps, direct_rps

        d, r, rps, direct_rps = asyncio.run(run())
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT if proc is procs[-1] else signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()
    added_p50 = statistics.median(r) - statistics.median(d)
    added_p99 = pct(r, 0.99) - pct(d, 0.99)
    if not args.json:
        print(
            "set-up: embedded Redis (AOF), 1 zero-delay sim host, 1 worker (8 slots), API (1 uvicorn process)"
        )
        print(
            f"direct   p50 {statistics.median(d):.2f} ms  p99 {pct(d, 0.99):.2f} ms"
            f"  ({len(d)} requests, one at a time)"
        )
        print(f"routed   p50 {statistics.median(r):.2f} ms  p99 {pct(r, 0.99):.2f} ms")
        print(f"added    p50 {added_p50:.2f} ms (goal 3)  p99 {added_p99:.2f} ms (goal 10)")
        print(
            f"rps at {args.concurrency} clients: routed {rps:,.0f}, direct {direct_rps:,.0f} "
            f"({rps / direct_rps:.2f}x; goal 0.4x)"
        )
        if args.profile and prof.exists():
            print("\nAPI profile, top functions by own time:")
            pstats.Stats(str(prof)).sort_stats("tottime").print_stats(25)
    tmp.cleanup()
    line = {
        "bench": "api",
        "added_p50_ms": round(added_p50, 2),
        "added_p99_ms": round(added_p99, 2),
        "rps": round(rps, 1),
        "direct_rps": round(direct_rps, 1),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
