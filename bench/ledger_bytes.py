"""Ledger bytes: what one task and one worker-day of liveness cost the ledger in Redis memory.

    python -m bench.ledger_bytes [--tasks N] [--holders H] [--redis-url URL] [--json]

A task is what a routed request leaves in the ledger: TaskSubmitted, TaskRouted (a real decision
over H live holders, built as the submission path builds it), TaskClaimed and TaskCompleted, one
attempt. A worker-day is 24 h of one worker at the agent's heartbeat interval: what its beats
append. Both are Redis `used_memory` deltas of the ledger stream divided by the count.

Without --redis-url it starts an embedded redis-server in a temporary directory. The last line
printed is JSON:
{"bench": "ledger_bytes", "ledger_bytes_per_task": ..., "heartbeat_bytes_per_worker_day": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from dispatch.submit import routed_event
from events.event import Event, ModelEntry, TaskClaimed, TaskCompleted, TaskSubmitted, Timings
from events.keys import Keys
from events.ledger import Ledger
from projections.snapshot import DEFAULT_HALF_LIFE_S, LengthRow, QualityRow, Snapshot, SpeedRow, Stat, fold
from routeledger.embedded import EmbeddedRedis
from router.choose import Decision, RouteQuery, decide
from router.estimate import build_estimator
from router.plan import BacklogEntry, FleetView, WorkerView
from workers.config import WorkerConfig
from workers.liveness import Liveness

NOW = 1_764_000_000_000
DAY_MS = 86_400_000
QWEN = "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41"
ELYZA = "3c1d4b0f6e7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c"
HOLDER_NAMES = ["rtx3070ti", "macbookair", "homeserver", "minipc", "studio", "nas", "tower", "laptop2"]


def _stat(values: list[float]) -> Stat:
    s = Stat()
    for x in values:
        s = fold(s, x, NOW - 3_600_000, DEFAULT_HALF_LIFE_S)
    return s


def holders(count: int) -> list[str]:
    return [HOLDER_NAMES[i] if i < len(HOLDER_NAMES) else f"worker{i}" for i in range(count)]


def a_decision(count: int, backlog: int = 2) -> Decision:
    """A decision over `count` holders of qwen3:8b with measured speeds and a short backlog."""
    names = holders(count)
    snap = Snapshot(half_life_s=DEFAULT_HALF_LIFE_S, taken_at=NOW)
    for i, name in enumerate(names):
        if i % 3 == 2:
            continue  # a holder never measured: its fields come from priors
        snap.speed[(name, QWEN)] = SpeedRow(
            worker=name,
            digest=QWEN,
            decode_tps=_stat([83.0 / (i + 1)] * (3 + i)),
            prompt_tps=_stat([900.0 / (i + 1)] * (3 + i)),
            load_s=_stat([4.0] * 2),
        )
    snap.length[(QWEN, "general")] = LengthRow(
        digest=QWEN, domain="general", output_tokens=_stat([300.0] * 40)
    )
    snap.quality[(QWEN, "general")] = QualityRow(digest=QWEN, domain="general", score=_stat([0.7] * 12))
    view = FleetView(
        workers=[
            WorkerView(name=n, slots=1, holds={QWEN}, loaded={QWEN} if i == 0 else set())
            for i, n in enumerate(names)
        ],
        backlog={
            QWEN: [
                BacklogEntry(task_id=f"b{k}", digest=QWEN, enqueued_at_ms=NOW - 1000 * k)
                for k in range(backlog)
            ]
        },
    )
    query = RouteQuery(model="qwen3:8b", domain="general", prompt_tokens=120, max_tokens=None)
    return decide(query, {"qwen3:8b": QWEN}, view, build_estimator(snap, NOW), NOW)


def task_events(count: int, decision: Decision) -> list[Event]:
    """`count` tasks, each as the ledger records one: submitted, routed, claimed, completed."""
    queue = f"rl:q:{QWEN[:12]}"
    out: list[Event] = []
    for i in range(count):
        task = f"{i:032x}"
        at = NOW + i * 1000
        out.append(
            TaskSubmitted(
                at=at,
                task_id=task,
                model="qwen3:8b",
                digest=QWEN,
                queue=queue,
                prompt_tokens=120,
                max_tokens=512,
                prompt_bytes=480,
                prompt_sha256="9f" * 32,
                client="bench",
            )
        )
        out.append(routed_event(task, queue, decision))
        out.append(
            TaskClaimed(
                at=at + 5,
                task_id=task,
                worker="rtx3070ti",
                digest=QWEN,
                attempt=1,
                queue=queue,
                entry_id=f"{at}-0",
                in_flight=1,
            )
        )
        out.append(
            TaskCompleted(
                at=at + 4000,
                task_id=task,
                worker="rtx3070ti",
                digest=QWEN,
                attempt=1,
                timings=Timings(
                    prompt_eval_count=120,
                    prompt_eval_duration=130_000_000,
                    eval_count=300,
                    eval_duration=3_610_000_000,
                    load_duration=12_000_000,
                    total_duration=3_800_000_000,
                ),
                ttft_ms=181.25,
                wall_ms=3912.5,
                in_flight=1,
                output_bytes=1200,
                output_sha256="ab" * 32,
                done_reason="stop",
            )
        )
    return out


def day_of_liveness(heartbeat_ms: int, changes_per_day: int) -> list[Event]:
    """What one worker's agent appends in 24 h of beats, its loaded model switching
    `changes_per_day` times (the agent's own rule, workers.agent.Liveness, decides)."""
    inventory = [
        ModelEntry(name="qwen3:8b", digest=QWEN, size=5_225_376_047, family="qwen3", quantization="Q4_K_M"),
        ModelEntry(
            name="elyza-jp-8b", digest=ELYZA, size=4_920_000_000, family="llama", quantization="Q4_K_M"
        ),
    ]
    config = WorkerConfig(name="rtx3070ti", heartbeat_ms=heartbeat_ms)
    live = Liveness(config.name, config.slots, config.serves)
    beats = DAY_MS // heartbeat_ms
    every = beats // changes_per_day if changes_per_day else beats + 1
    out: list[Event] = []
    for beat in range(beats):
        loaded = [QWEN] if (beat // every) % 2 == 0 else [ELYZA]
        event = live.beat(NOW + beat * heartbeat_ms, inventory, loaded)
        if event is not None:
            out.append(event)
            live.said(event)
    return out


async def bytes_per(url: str, events: list[Event], per: int) -> tuple[float, float]:
    """used_memory growth when `events` are appended to the ledger, divided by `per`, and the
    stream's own MEMORY USAGE divided by `per` (a cross-check that the growth is the ledger's)."""
    client = aioredis.Redis.from_url(url)
    keys = Keys()
    try:
        await client.flushall()
        ledger = Ledger(client, keys)
        # The first append loads the append script and grows client buffers: not the ledger's bytes.
        await ledger.append_many(events[:1000])
        await client.delete(keys.events)
        info: dict[str, Any] = await client.info("memory")
        before = int(info["used_memory"])
        for i in range(0, len(events), 1000):
            await ledger.append_many(events[i : i + 1000])
        info = await client.info("memory")
        grown = int(info["used_memory"]) - before
        usage: Any = await client.memory_usage(keys.events, samples=0)
        await client.flushall()
        return grown / per, int(usage) / per
    finally:
        await client.aclose()


def with_redis(url: str | None, job: Callable[[str], dict[str, float]]) -> dict[str, float]:
    if url:
        return job(url)
    with tempfile.TemporaryDirectory(prefix="rl-bench-") as tmp:
        server = EmbeddedRedis(Path(tmp))
        try:
            return job(server.start())
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--holders", type=int, default=3)
    parser.add_argument("--heartbeat-ms", type=int, default=WorkerConfig(name="w").heartbeat_ms)
    parser.add_argument(
        "--changes-per-day", type=int, default=48, help="loaded-model switches per worker-day"
    )
    parser.add_argument("--redis-url")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()

    decision = a_decision(args.holders)
    tasks = task_events(args.tasks, decision)
    day = day_of_liveness(args.heartbeat_ms, args.changes_per_day)

    def job(url: str) -> dict[str, float]:
        task, task_usage = asyncio.run(bytes_per(url, tasks, args.tasks))
        day_bytes, day_usage = asyncio.run(bytes_per(url, day, 1))
        return {"task": task, "task_usage": task_usage, "day": day_bytes, "day_usage": day_usage}

    got = with_redis(args.redis_url, job)
    if not args.json:
        kinds: dict[str, int] = {}
        for e in day:
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
        print(
            f"tasks: {args.tasks}, {args.holders} holders each: {got['task']:,.0f} ledger bytes per task "
            f"(MEMORY USAGE of the stream: {got['task_usage']:,.0f})"
        )
        print(
            f"one worker-day at a {args.heartbeat_ms} ms heartbeat, {args.changes_per_day} loaded-model "
            f"switches: {kinds or 'nothing'} appended, {got['day']:,.0f} ledger bytes "
            f"(MEMORY USAGE: {got['day_usage']:,.0f})"
        )
    print(
        json.dumps(
            {
                "bench": "ledger_bytes",
                "holders": args.holders,
                "ledger_bytes_per_task": round(got["task"]),
                "heartbeat_bytes_per_worker_day": round(got["day"]),
            }
        )
    )


if __name__ == "__main__":
    main()
