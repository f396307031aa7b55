"""The ingest's cost: inbox entries checked and moved into the ledger per second.

    python -m bench.ingest [--tasks N] [--workers W] [--redis-url URL]

Each of W workers takes N/W real queue entries and appends, to its own inbox, the events a served
task leaves (TaskClaimed, then TaskCompleted); the ingest then moves all 2N entries. Prints entries
per second (wall time) and the Redis time (INFO commandstats usec) per entry, as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import redis.asyncio as aioredis

from events.codec import encode_fields
from events.event import TaskClaimed, TaskCompleted, Timings
from events.keys import Keys
from events.ledger import Ledger
from projections.ingest import Ingest
from routeledger.embedded import redis_or_embedded
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore

D1 = "a" * 64


async def _redis_usec(client: aioredis.Redis) -> int:
    stats: Any = await client.info("commandstats")
    return sum(int(v["usec"]) for k, v in stats.items() if k not in ("cmdstat_info",))


async def measure(url: str, tasks: int, workers: int) -> dict[str, float]:
    client = aioredis.Redis.from_url(url)
    keys = Keys()
    try:
        await client.flushall()
        queues = TaskStore(client, keys, Ledger(client, keys))
        queue = keys.queue(D1)
        names = [f"w{i}" for i in range(workers)]
        await client.sadd(keys.inboxes, *names)
        for i in range(tasks):
            worker = names[i % workers]
            task = TaskMessage(task_id=f"t{i}", model="m", digest=D1, messages=[Message(role="user")])
            await queues.enqueue(queue, task)
            taken = await queues.take(queue, worker)
            claim = TaskClaimed(
                task_id=task.task_id,
                worker=worker,
                digest=D1,
                attempt=taken.attempt,
                queue=queue,
                entry_id=taken.entry_id,
            )
            done = TaskCompleted(
                task_id=task.task_id,
                worker=worker,
                digest=D1,
                attempt=taken.attempt,
                timings=Timings(eval_count=200, eval_duration=2 * 10**9),
            )
            pipe = client.pipeline(transaction=False)
            pipe.xadd(keys.inbox(worker), encode_fields(claim))  # type: ignore[arg-type]
            pipe.xadd(keys.inbox(worker), encode_fields(done))  # type: ignore[arg-type]
            await pipe.execute()
        await client.config_resetstat()
        ingest = Ingest(client, keys)
        t0 = time.perf_counter()
        handled = await ingest.catch_up()
        wall = time.perf_counter() - t0
        usec = await _redis_usec(client)
        assert ingest.refused == 0, "the bench's events are all valid"
        return {
            "entries": handled,
            "workers": workers,
            "wall_s": round(wall, 3),
            "entries_per_s": round(handled / wall),
            "redis_usec_per_entry": round(usec / handled, 1),
        }
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    with redis_or_embedded(args.redis_url, prefix="rl-bench-ingest-") as url:
        print(json.dumps(asyncio.run(measure(url, args.tasks, args.workers))))


if __name__ == "__main__":
    main()
