"""A task's output as a reader follows it: the streams its runs write to, and who may write them.

A run's output goes to the task's shared stream (trusted writers, and workers that run with the
server's credentials) or to the worker's own stream (a worker under its own ACL, Keys.run_out); a
reader follows the shared one and the own one of each worker that runs or ran the task, never what
a worker that does not run it wrote. The task store hands them out (TaskStore.relay).
"""

from __future__ import annotations

import time
from typing import Any, Final

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from events.codec import as_str
from events.keys import REQUEUED_CONSUMER, WORKERS_GROUP, Keys
from events.ledger import read_streams
from tasks.payload import Chunk, Result, chunk_decoder, result_decoder

# How often a reader of a task's output looks again for the workers that run it (run_writers) and
# for the live workers that might (see Outputs).
LOOK_MS: Final = 500


async def run_writers(redis: aioredis.Redis, keys: Keys, task_id: str) -> list[str]:
    """The workers whose own output keys (Keys.run_out, Keys.run_result) may be served for a task:
    those whose claim of it the ingest accepted (Keys.ran), and the one that holds its queue entry
    now (before its claim reaches the ledger). A worker that neither holds nor held the task is
    never among them, whatever it wrote."""
    pipe = redis.pipeline(transaction=False)
    pipe.smembers(keys.ran(task_id))
    pipe.hmget(keys.task(task_id), ["queue", "entry"])
    ran, (queue, entry) = await pipe.execute()
    names = {as_str(n) for n in ran}
    if queue and entry:
        try:
            rows: Any = await redis.xpending_range(as_str(queue), WORKERS_GROUP, entry, entry, 1)
        except ResponseError:
            rows = []
        if rows and (holder := as_str(rows[0]["consumer"])) != REQUEUED_CONSUMER:
            names.add(holder)
    return sorted(names)


async def _registered(outputs: Outputs) -> set[str]:
    raw: Any = await outputs.redis.smembers(outputs.keys.workers)
    return {as_str(n) for n in raw}


class RegisteredWorkers:
    """The names of the registered workers, read at most once per LOOK_MS for every reader that
    starts in between (a reader's first look), instead of once for each."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._names: set[str] = set()
        self._read_at = -float("inf")

    async def names(self) -> set[str]:
        now = time.monotonic()
        if (now - self._read_at) * 1000 >= LOOK_MS:
            raw: Any = await self.redis.smembers(self.keys.workers)
            self._names, self._read_at = {as_str(n) for n in raw}, now
        return self._names


class Outputs:
    """The output streams of one task a reader follows: the task's shared stream (trusted writers,
    and workers that run with the server's credentials) and the own stream of each worker that
    runs or ran it; never what a worker that does not run it wrote.

    So that the first chunk waits for nobody's bookkeeping, the reader blocks on the own streams of
    every live worker as well; a stream that has something is read only once its worker is found
    to hold the task's entry (or to have had its claim accepted), and one whose worker does not is
    dropped from the reader with what it had written (it wrote for a task it does not run)."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, task_id: str, workers: RegisteredWorkers | None = None
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.task_id = task_id
        self._workers = workers
        self.cursors: dict[str, str] = {keys.out(task_id): "0-0"}
        self.writers: list[str] = []
        # Stream -> its worker, for every worker's own stream followed; dropped stream -> its cursor.
        self._names: dict[str, str] = {}
        self._dropped: dict[str, str] = {}
        self._looked = -float("inf")

    async def _look(self) -> None:
        first = self._looked == -float("inf")
        self._looked = time.monotonic()
        if first:
            # Nothing was read yet, so nothing waits on knowing the writers: a chunk on a worker's
            # own stream makes the reader look them up before it is used (read). The workers' names
            # may be a moment old (RegisteredWorkers): the reader's next look, within LOOK_MS, reads them
            # afresh, so a worker registered in between is followed at most that much later.
            names = await self._workers.names() if self._workers is not None else await _registered(self)
        else:
            self.writers = await run_writers(self.redis, self.keys, self.task_id)
            names = await _registered(self)
        for name in {*self.writers, *names}:
            stream = self.keys.run_out(name, self.task_id)
            self._names[stream] = name
            if stream in self._dropped and name in self.writers:
                # It took the task since: what it writes from now on is its run's.
                self.cursors[stream] = self._dropped.pop(stream)
            elif stream not in self._dropped:
                self.cursors.setdefault(stream, "0-0")

    async def read(self, block_ms: int) -> list[tuple[Chunk, Result | None]]:
        """Chunks after the cursors (waiting up to `block_ms`), each with the result a done chunk
        carries (the first outcome's)."""
        if (time.monotonic() - self._looked) * 1000 >= LOOK_MS:
            await self._look()
        streams: Any = dict(self.cursors)
        reply: Any = await self.redis.xread(streams, count=256, block=max(1, min(block_ms, LOOK_MS)))
        out: list[tuple[Chunk, Result | None]] = []
        for stream, rows in read_streams(reply):
            name = self._names.get(stream)
            if name is not None and name not in self.writers:
                await self._look()  # it may have just taken the task
                if name not in self.writers:
                    del self.cursors[stream]
                    self._dropped[stream] = as_str(rows[-1][0])
                    continue
            for entry_id, flat in rows:
                self.cursors[stream] = as_str(entry_id)
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
                raw = fields.get(b"c")
                if raw is not None:
                    carried = fields.get(b"r")
                    out.append(
                        (
                            chunk_decoder.decode(raw),
                            None if carried is None else result_decoder.decode(carried),
                        )
                    )
        return out
