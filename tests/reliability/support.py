"""Helpers for the reliability suite: worker processes with a log, ledger counts, queue emptiness."""

from __future__ import annotations

import collections
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from events.event import TaskCompleted
from events.keys import WORKERS_GROUP, Keys
from events.ledger import Ledger
from tests.helpers import events_of


def spawn_worker(
    redis_url: str,
    backend: str,
    name: str,
    log: Path,
    *,
    crash: str | None = None,
    lease_ms: int = 1500,
    heartbeat_ms: int = 300,
    delivery_limit: int = 3,
    extra_env: dict[str, str] | None = None,
    slots: int = 1,
    bench: bool = False,
    inbox: bool = False,
    wrap: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """A `routeledger worker` process whose stderr goes to `log` (appended, one file per name),
    with the router's gate; `bench`: it benchmarks itself on joining, as a worker does by default.

    `inbox`: it appends to its own inbox (`--inbox`), as a worker under its ACL must.

    `wrap` goes before the command: `ip netns exec NS` starts it on another network's side.

    `crash` is the worker's test hook (ROUTELEDGER_TEST_CRASH, POINT@N): it kills itself with
    SIGKILL at that point of its N-th task.
    """
    env = {
        **os.environ,
        "ROUTELEDGER_LEASE_MS": str(lease_ms),
        "ROUTELEDGER_HEARTBEAT_MS": str(heartbeat_ms),
        "ROUTELEDGER_DELIVERY_LIMIT": str(delivery_limit),
        "ROUTELEDGER_LOG_LEVEL": "warning",
        **(extra_env or {}),
    }
    env.pop("ROUTELEDGER_TEST_CRASH", None)
    if crash is not None:
        env["ROUTELEDGER_TEST_CRASH"] = crash
    argv = [*wrap, sys.executable, "-m", "routeledger", "worker", "--backend", backend, "--id", name]
    argv += ["--slots", str(slots), "--redis-url", redis_url, "--bench" if bench else "--no-bench"]
    if inbox:
        argv.append("--inbox")
    with log.open("ab") as out:
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=out)


def acl_line(name: str, password: str) -> list[str]:
    """The `ACL SETUSER` command `routeledger acl worker NAME` prints, split into its arguments."""
    out = subprocess.run(
        [sys.executable, "-m", "routeledger", "acl", "worker", name, "--password", password],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("ACL SETUSER"))
    return shlex.split(line)


def reaper_process(redis_url: str, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "ROUTELEDGER_LEASE_MS": "1500",
        "ROUTELEDGER_HEARTBEAT_MS": "300",
        "ROUTELEDGER_LOG_LEVEL": "warning",
    }
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "routeledger", "reaper", "--redis-url", redis_url],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )


def stop_all(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """SIGTERM every process still running, wait for each, SIGKILL any that do not leave in time."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def counted_completions(ledger: Ledger) -> collections.Counter[str]:
    """How many TaskCompleted events per task the ledger counts (not flagged duplicate)."""
    return collections.Counter(e.task_id for e in await events_of(ledger, TaskCompleted) if not e.duplicate)


async def queues_settled(redis: aioredis.Redis, keys: Keys) -> bool:
    """No task queue holds an entry: everything submitted was acknowledged (or dead-lettered)."""
    async for raw in redis.scan_iter(match=keys.queue_pattern, _type="stream"):
        if await redis.xlen(raw):
            return False
        groups: Any = await redis.xinfo_groups(raw)
        if any(g["name"] in (WORKERS_GROUP, WORKERS_GROUP.encode()) and g["pending"] for g in groups):
            return False
    return True


async def describe_queues(redis: aioredis.Redis, keys: Keys) -> str:
    """Length and pending entries (owner, idle) of every task queue, for failure messages."""
    parts = []
    async for raw in redis.scan_iter(match=keys.queue_pattern, _type="stream"):
        pending: Any = await redis.xpending_range(raw, WORKERS_GROUP, "-", "+", 20)
        owners = [(p["consumer"], p["time_since_delivered"], p["times_delivered"]) for p in pending]
        parts.append(f"{raw!r}: len {await redis.xlen(raw)}, pending {owners}")
    return "; ".join(parts) or "no queues"
