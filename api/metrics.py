"""Prometheus metrics: requests and latency by route and model, and the fleet's state at scrape time.

Each app has its own registry (several apps in one process, as in the tests, must not collide).
The fleet gauges are read from Redis when /metrics is scraped; the ledger event counters count
the events this API process has seen appended since it started (a counter may reset on restart,
as Prometheus expects), read incrementally from where the previous scrape stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dispatch.memory import MemoryState, archive_info
from dispatch.overview import queue_depths
from dispatch.serving import catalog
from projections.errors import ProjectionError
from projections.reader import lag
from tasks.quota import Usage

log = logging.getLogger("routeledger.api")

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Ledger event types worth counting for operators.
_COUNTED: Final = frozenset(
    {b"TaskReclaimed", b"TaskStalled", b"TaskDeadLettered", b"TaskFailed", b"TaskCancelled", b"TaskExpired"}
)


class Metrics:
    """The registry of one app and the collectors in it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "routeledger_api_requests",
            "HTTP requests by route, model and status",
            ["route", "model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "routeledger_api_request_seconds",
            "time to serve a request (the whole stream, for streamed ones)",
            ["route", "model"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "routeledger_queue_depth", "tasks waiting, not yet taken, per model", ["model"], registry=r
        )
        self.queue_running = Gauge(
            "routeledger_queue_running", "tasks taken and not finished, per model", ["model"], registry=r
        )
        self.in_flight = Gauge(
            "routeledger_worker_in_flight", "tasks a live worker runs", ["worker"], registry=r
        )
        self.slots = Gauge(
            "routeledger_worker_slots", "parallel slots of a live worker", ["worker"], registry=r
        )
        self.capacity = Gauge(
            "routeledger_model_capacity", "live slots that can serve a model", ["model"], registry=r
        )
        self.lag_entries = Gauge(
            "routeledger_projector_lag_entries", "ledger entries not folded yet", registry=r
        )
        self.lag_seconds = Gauge(
            "routeledger_projector_lag_seconds", "age of the oldest unfolded entry", registry=r
        )
        self.dead = Gauge("routeledger_dead_letters", "entries in the dead-letter stream", registry=r)
        self.stalled = Gauge("routeledger_stalled_reported", "queue entries reported stalled", registry=r)
        self.memory_used = Gauge("routeledger_redis_used_memory_bytes", "Redis used_memory", registry=r)
        self.memory_max = Gauge(
            "routeledger_redis_maxmemory_bytes", "Redis maxmemory (0: no limit)", registry=r
        )
        self.memory_ratio = Gauge(
            "routeledger_redis_memory_ratio",
            "used over maxmemory (new tasks are refused from 0.95; absent without a limit)",
            registry=r,
        )
        self.ledger_length = Gauge(
            "routeledger_ledger_entries", "entries in the ledger stream (the hot part in Redis)", registry=r
        )
        self.archive_ran = Gauge(
            "routeledger_archive_last_run_timestamp_seconds",
            "when the archiver last ran (0: never)",
            registry=r,
        )
        self.archive_events = Gauge(
            "routeledger_archive_events", "ledger entries moved into the archive", registry=r
        )
        self.archive_bytes = Gauge("routeledger_archive_bytes", "bytes of archive segments", registry=r)
        self.archive_error = Gauge(
            "routeledger_archive_error", "1 when the archiver's last run failed", registry=r
        )
        self.tasks_lost = Counter(
            "routeledger_tasks_lost",
            "accepted tasks this API found gone from Redis with no outcome while a client waited"
            " (a failover lost them); each client was answered 503 task_lost",
            registry=r,
        )
        self.events = Counter(
            "routeledger_ledger_events",
            "ledger events seen by this API since it started",
            ["type"],
            registry=r,
        )
        # Per API key (by name): what the keys' limits are held against, read from Redis at scrape.
        self.key_requests = Gauge(
            "routeledger_key_requests", "requests admitted per API key", ["key"], registry=r
        )
        self.key_tokens = Gauge(
            "routeledger_key_tokens_today",
            "tokens (prompt and output) charged to an API key today (UTC)",
            ["key"],
            registry=r,
        )
        self.key_queued = Gauge(
            "routeledger_key_queued", "tasks of an API key queued or running", ["key"], registry=r
        )
        self.key_refused = Gauge(
            "routeledger_key_refused",
            "requests refused (429) per API key and limit",
            ["key", "limit"],
            registry=r,
        )
        self._cursor: str | None = None

    def observe(self, route: str, model: str, status: int, seconds: float) -> None:
        self.requests.labels(route, model, str(status)).inc()
        self.latency.labels(route, model).observe(seconds)

    async def scrape(
        self,
        redis: Any,
        keys: Any,
        leases: dict[str, Any],
        memory: MemoryState,
        usage: Sequence[Usage] = (),
    ) -> bytes:
        """Refresh the fleet gauges from Redis (and the memory gauges from `memory`, the process's
        cached reading, and the key gauges from `usage`), then render the registry."""
        for g in (self.queue_depth, self.queue_running, self.in_flight, self.slots, self.capacity):
            g.clear()
        for u in usage:
            self.key_requests.labels(u.name).set(u.requests)
            self.key_tokens.labels(u.name).set(u.tokens_today)
            self.key_queued.labels(u.name).set(u.queued)
            for limit, n in u.refused_by.items():
                self.key_refused.labels(u.name, limit).set(n)
        for name, info in leases.items():
            self.in_flight.labels(name).set(info.in_flight)
            self.slots.labels(name).set(info.slots)
        seen: set[str] = set()
        for model in catalog(leases):
            self.capacity.labels(model.name).set(model.slots)
            if model.entry.digest in seen:
                continue
            seen.add(model.entry.digest)
            depth = (await queue_depths(redis, keys, [model.entry.digest]))[model.entry.digest]
            if depth["running"] is not None:
                self.queue_running.labels(model.name).set(depth["running"])
            if depth["queued"] is not None:
                self.queue_depth.labels(model.name).set(depth["queued"])
        try:
            entries, ms = await lag(redis, keys)
            self.lag_entries.set(entries)
            self.lag_seconds.set(ms / 1000)
        except ProjectionError:
            pass
        self.dead.set(int(await redis.xlen(keys.dead)))
        self.stalled.set(int(await redis.scard(keys.stalled)))
        self.memory_used.set(memory.used_bytes)
        self.memory_max.set(memory.max_bytes)
        self.memory_ratio.set(memory.ratio if memory.ratio is not None else float("nan"))
        self.ledger_length.set(int(await redis.xlen(keys.events)))
        archive = await archive_info(redis, keys)
        self.archive_ran.set((archive.ran_at or 0) / 1000)
        self.archive_events.set(archive.events)
        self.archive_bytes.set(archive.bytes)
        self.archive_error.set(1 if archive.error else 0)
        await self._count_events(redis, keys)
        return generate_latest(self.registry)

    async def _count_events(self, redis: Any, keys: Any) -> None:
        if self._cursor is None:
            last: Any = await redis.xrevrange(keys.events, count=1)
            self._cursor = last[0][0].decode() if last else "0-0"
            return
        while True:
            rows: Any = await redis.xrange(keys.events, "(" + self._cursor, "+", count=5000)
            if not rows:
                return
            for _, fields in rows:
                kind = fields.get(b"type", b"")
                if kind in _COUNTED:
                    self.events.labels(kind.decode()).inc()
            self._cursor = rows[-1][0].decode()
            if len(rows) < 5000:
                return
