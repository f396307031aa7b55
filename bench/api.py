"""The API's own cost: the same chat requests straight to a zero-delay sim host and through routeledger.

    python -m bench.api [--requests N] [--seconds S] [--concurrency C] [--profile] [--json]

A demo-like set-up on this machine, each part its own process: an embedded Redis (AOF on), one
`routeledger sim hosts` process with --time-scale 0 (answers at once, reports simulated timings),
one `routeledger worker` process, and `routeledger api` (uvicorn). This process is the client: one
httpx client for both targets, non-streaming OpenAI chat completions, the same body.

- added latency: N requests one at a time, alternating direct and routed; p50 and p99 of each,
  and the difference (what routeledger adds: API, Redis round trips, the worker's pull and relay).
- requests/s: C concurrent clients for S seconds against each target.
- streaming: N/4 streamed requests one at a time, alternating; the time to the first content chunk
  of each, and the difference.
- CPU per routed request: the user + system CPU time of each process (API, worker, Redis) over the
  sequential routed requests (direct ones cost those processes nothing), divided by their count;
  and the same over the C-client run. Wall-clock figures move with whatever else the machine
  runs; CPU time per request barely does, so it is the figure to compare changes by.
- Redis commands per routed request: from Redis's own counts over the sequential routed requests.
- --profile runs the API and the worker under cProfile and prints each one's top functions by
  cumulative and by own time (the profiler's own cost inflates every other figure of that run).
- --gate: the worker's pull gate; `plain` (default) isolates the API's cost, `router` adds the
  speed-aware gate's own wake-up delay (a worker concern, measured by bench/dispatch.py).

The last line is JSON:
{"bench": "api", "added_p50_ms": ..., "added_p99_ms": ..., "rps": ..., "direct_rps": ...,
 "cpu_ms_per_request": ..., "cpu_ms_per_request_api": ..., "cpu_ms_per_request_worker": ...,
 "cpu_ms_per_request_redis": ..., "cpu_ms_per_request_at_c": ...,
 "stream_first_chunk_added_p50_ms": ..., "redis_cmds_per_request": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pstats
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import redis

from routeledger.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent

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
STREAM_BODY = {**BODY, "stream": True}
PROFILE_TOP = 15
# Runs `python -m routeledger ...` with cProfile, timed by the process's CPU clock, not the wall
# clock (a wall-clock profile of an event loop charges its idle waits, and the moments other
# processes had the core, to whatever call was running). SIGUSR1 starts a fresh profile and SIGUSR2
# ends it and writes it out, so that it covers the measured requests only, not start-up or warm-up.
PROFILED = """
import cProfile, runpy, signal, sys, time
out = sys.argv.pop(1)
sys.argv[0] = "routeledger"
prof = None

def start(*_):
    global prof
    prof = cProfile.Profile(time.process_time)
    prof.enable()

def stop(*_):
    if prof is not None:
        prof.disable()
        prof.dump_stats(out)

signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
runpy.run_module("routeledger", run_name="__main__", alter_sys=True)
"""


def top_functions(path: Path, order: str, count: int) -> list[str]:
    """The `count` functions first by `order` ("cumulative" or "tottime"), leaving out the event
    loop's own frames that hold everything (their cumulative time is the whole profile)."""
    stats = pstats.Stats(str(path))
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]] = stats.stats  # type: ignore[attr-defined]
    total = max((v[3] for v in raw.values()), default=0.0) or 1.0
    rows = []
    for (file, line, func), (_, calls, own, cum, _) in raw.items():
        if order == "cumulative" and cum > 0.8 * total:
            continue
        rows.append((cum if order == "cumulative" else own, calls, own, cum, f"{file}:{line}({func})"))
    rows.sort(reverse=True)
    out = [f"  {'calls':>8} {'own s':>7} {'cum s':>7}  function   (profiled CPU {total:.2f} s)"]
    for _, calls, own, cum, where in rows[:count]:
        out.append(f"  {calls:>8} {own:>7.3f} {cum:>7.3f}  {where.replace(str(ROOT) + '/', '')}")
    return out


# The processes whose CPU a routed request costs (the sim host answers direct requests too).
MEASURED = ("api", "worker", "redis")


def cpu_ms(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU time each process (and its children) has used so far, in ms."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        proc = psutil.Process(pid)
        total = sum(proc.cpu_times()[:2])
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += sum(child.cpu_times()[:2])
        out[name] = total * 1000
    return out


def redis_calls(url: str) -> dict[str, int]:
    """How many times Redis has run each command so far (INFO commandstats)."""
    client = redis.Redis.from_url(url)
    try:
        stats: dict[str, dict[str, int]] = client.info("commandstats")
    finally:
        client.close()
    return {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}


def per_request(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    return {name: (after[name] - before[name]) / n for name in before}


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


async def first_chunk(http: httpx.AsyncClient, url: str) -> float:
    """Time to the first SSE chunk that carries content (the role-only opening chunk does not)."""
    t0 = time.perf_counter()
    first: float | None = None
    async with http.stream("POST", url, json=STREAM_BODY) as response:
        if response.status_code != 200:
            raise SystemExit(f"{url} answered {response.status_code} to a stream")
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = (time.perf_counter() - t0) * 1000
    if first is None:
        raise SystemExit(f"{url} streamed no content")
    return first


async def streaming(
    http: httpx.AsyncClient, direct: str, routed: str, n: int
) -> tuple[list[float], list[float]]:
    d: list[float] = []
    r: list[float] = []
    for _ in range(n):
        d.append(await first_chunk(http, direct))
        r.append(await first_chunk(http, routed))
    return d, r


async def latency(
    http: httpx.AsyncClient, direct: str, routed: str, n: int
) -> tuple[list[float], list[float]]:
    d: list[float] = []
    r: list[float] = []
    for _ in range(n):
        d.append(await one(http, direct))
        r.append(await one(http, routed))
    return d, r


async def rate(http: httpx.AsyncClient, url: str, clients: int, seconds: float) -> tuple[float, int]:
    """Requests per second from `clients` concurrent clients, and how many were answered."""
    stop = time.perf_counter() + seconds
    done = 0

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await one(http, url)
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done / (time.perf_counter() - t0), done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-dir", type=Path, help="with --profile: keep api.prof and worker.prof here")
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
    profs = {"api": root / "api.prof", "worker": root / "worker.prof"}
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
        worker_argv = rl(
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
        )
        api_argv = rl("api", "--port", str(port), "--redis-url", url)
        if args.profile:
            worker_argv = [sys.executable, "-c", PROFILED, str(profs["worker"]), *worker_argv[3:]]
            api_argv = [sys.executable, "-c", PROFILED, str(profs["api"]), *api_argv[3:]]
        worker = subprocess.Popen(worker_argv, env=env)
        procs.append(worker)
        api_proc = subprocess.Popen(api_argv, env=env)
        procs.append(api_proc)
        assert server.process is not None
        pids = {"api": api_proc.pid, "worker": worker.pid, "redis": server.process.pid, "sim": sim.pid}
        api = f"http://127.0.0.1:{port}"
        direct_url = backend.rstrip("/") + "/v1/chat/completions"
        routed_url = api + "/v1/chat/completions"

        def signal_profiled(sig: int) -> None:
            for proc in (worker, api_proc):
                proc.send_signal(sig)

        async def run() -> None:
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
            async with httpx.AsyncClient(timeout=30, limits=limits) as http:
                await wait_ready(http, api)
                await latency(http, direct_url, routed_url, 50)  # warm-up: connections, caches, model loaded
                await streaming(http, direct_url, routed_url, 10)
                if args.profile:
                    signal_profiled(signal.SIGUSR1)
                before, calls_before = cpu_ms(pids), redis_calls(url)
                got["d"], got["r"] = await latency(http, direct_url, routed_url, args.requests)
                cpu["seq"] = per_request(before, cpu_ms(pids), args.requests)
                calls_after = redis_calls(url)
                cmds.update(
                    {
                        name: (calls - calls_before.get(name, 0)) / args.requests
                        for name, calls in calls_after.items()
                        if calls > calls_before.get(name, 0) and name != "info"
                    }
                )
                n_stream = max(10, args.requests // 4)
                got["sd"], got["sr"] = await streaming(http, direct_url, routed_url, n_stream)
                rates["direct"], _ = await rate(http, direct_url, args.concurrency, args.seconds)
                before = cpu_ms(pids)
                rates["routed"], done = await rate(http, routed_url, args.concurrency, args.seconds)
                cpu["conc"] = per_request(before, cpu_ms(pids), done)
                if args.profile:
                    signal_profiled(signal.SIGUSR2)
                    await asyncio.sleep(1.0)  # time to write the profiles out

        got: dict[str, list[float]] = {}
        cpu: dict[str, dict[str, float]] = {}
        rates: dict[str, float] = {}
        cmds: dict[str, float] = {}
        asyncio.run(run())
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
    d, r, rps, direct_rps = got["d"], got["r"], rates["routed"], rates["direct"]
    seq, conc = cpu["seq"], cpu["conc"]
    cpu_total = sum(seq[name] for name in MEASURED)
    stream_added = statistics.median(got["sr"]) - statistics.median(got["sd"])
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
        print(f"added    p50 {added_p50:.2f} ms (goal 2.5)  p99 {added_p99:.2f} ms (goal 6)")
        print(
            f"rps at {args.concurrency} clients: routed {rps:,.0f}, direct {direct_rps:,.0f} "
            f"({rps / direct_rps:.2f}x; goal 0.4x)"
        )
        print(
            f"stream   first chunk p50 direct {statistics.median(got['sd']):.2f} ms, routed "
            f"{statistics.median(got['sr']):.2f} ms, added {stream_added:.2f} ms "
            f"(goal 3; {len(got['sr'])} each)"
        )
        parts = ", ".join(f"{name} {seq[name]:.2f}" for name in MEASURED)
        print(
            f"CPU per routed request, one at a time: {cpu_total:.2f} ms (goal 2.5; {parts}; "
            f"sim host {seq['sim']:.2f})"
        )
        parts = ", ".join(f"{name} {conc[name]:.2f}" for name in MEASURED)
        print(
            f"CPU per routed request at {args.concurrency} clients: "
            f"{sum(conc[name] for name in MEASURED):.2f} ms ({parts})"
        )
        top = sorted(cmds.items(), key=lambda kv: -kv[1])
        print(
            f"Redis commands per routed request: {sum(cmds.values()):.1f} ("
            + ", ".join(f"{name} {n:.2f}" for name, n in top)
            + ")"
        )
        if args.profile:
            for name, path in profs.items():
                if not path.exists():
                    print(f"\n{name}: no profile was written")
                    continue
                for order in ("cumulative", "tottime"):
                    print(f"\n{name}, top {PROFILE_TOP} by {order} (the measured requests; CPU time):")
                    print("\n".join(top_functions(path, order, PROFILE_TOP)))
                if args.profile_dir is not None:
                    args.profile_dir.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, args.profile_dir / path.name)
    tmp.cleanup()
    line = {
        "bench": "api",
        "added_p50_ms": round(added_p50, 2),
        "added_p99_ms": round(added_p99, 2),
        "rps": round(rps, 1),
        "direct_rps": round(direct_rps, 1),
        "cpu_ms_per_request": round(cpu_total, 3),
        **{f"cpu_ms_per_request_{name}": round(seq[name], 3) for name in MEASURED},
        "cpu_ms_per_request_at_c": round(sum(conc[name] for name in MEASURED), 3),
        "stream_first_chunk_added_p50_ms": round(stream_added, 2),
        "redis_cmds_per_request": round(sum(cmds.values()), 2),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
