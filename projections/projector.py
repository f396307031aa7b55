"""The projector: tails the ledger from its checkpoint and folds each batch into the tables.

One instance is active at a time: it holds the lease `rl:lease:projector`, and it also writes its
token into the namespace it folds into, which every write checks, so that an instance that lost
its lease without noticing (a long pause) has its next write refused instead of counting twice.

The active instance keeps the tables in memory (loaded from Redis when it takes over) and writes
only the rows a batch changed, together with the checkpoint, in one atomic script. When a rebuild
switches `rl:p:current`, it adopts the new namespace and goes on from that namespace's checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Iterable
from typing import Any, Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from events.codec import decode_rows
from events.errors import UndecodableEntryError
from events.keys import Keys
from events.ledger import Ledger
from events.singleton import DEFAULT_LEASE_MS, RELEASE_LEASE, RENEW_LEASE
from projections import store
from projections.errors import LeaseLostError, ProjectionError
from projections.folder import Folder
from projections.tables import DEFAULT_DEMAND_HALF_LIFE_S, DEFAULT_HALF_LIFE_S, Tables, pair_key

log = logging.getLogger("routeledger.projector")

ROLE: Final = "projector"


class Projector:
    """The lease-elected projector over one Redis."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys | None = None,
        *,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        demand_half_life_s: float = DEFAULT_DEMAND_HALF_LIFE_S,
        lease_ms: int = DEFAULT_LEASE_MS,
        batch: int = 2000,
        block_ms: int | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self.ledger = Ledger(redis, self.keys)
        self.half_life_s = half_life_s
        self.demand_half_life_s = demand_half_life_s
        self.lease_ms = lease_ms
        self.batch = batch
        # Renewals happen between batches, so one blocking read must stay well inside the lease.
        self.block_ms = block_ms if block_ms is not None else max(10, min(1000, lease_ms // 4))
        self.token = secrets.token_hex(8)
        self.ns: str | None = None
        self.tables: Tables | None = None
        self._folder: Folder | None = None
        self._writer: store.NamespaceWriter | None = None
        self._renew = redis.register_script(RENEW_LEASE)
        self._release = redis.register_script(RELEASE_LEASE)
        self._renewed_at = 0.0
        # Entries folded by this instance (for the benchmark and the log).
        self.folded = 0
        self.dead_lettered = 0

    # -- the lease -----------------------------------------------------------------------------
    @property
    def lease_key(self) -> str:
        return self.keys.singleton(ROLE)

    async def acquire(self) -> bool:
        """Take the lease if it is free (or already ours); True when this instance is active."""
        got = await self.redis.set(self.lease_key, self.token, nx=True, px=self.lease_ms)
        if not got:
            got = bool(await self._renew(keys=[self.lease_key], args=[self.token, self.lease_ms]))
        if got:
            self._renewed_at = _now()
        return bool(got)

    async def keep_lease(self) -> None:
        """Renew the lease when a third of it has passed; LeaseLostError when another holds it."""
        if _now() - self._renewed_at < self.lease_ms / 3000:
            return
        if not await self._renew(keys=[self.lease_key], args=[self.token, self.lease_ms]):
            raise LeaseLostError("the projector lease expired and another instance may hold it")
        self._renewed_at = _now()

    async def release(self) -> None:
        """Give the lease up (if held) so that a waiting instance takes over at once."""
        with contextlib.suppress(RedisError):
            await self._release(keys=[self.lease_key], args=[self.token])

    # -- the namespace -------------------------------------------------------------------------
    async def start(self) -> None:
        """Adopt the live namespace (creating the first one if there is none) and load its tables."""
        ns = await store.current(self.redis, self.keys)
        if ns is None:
            empty = Tables(half_life_s=self.half_life_s, demand_half_life_s=self.demand_half_life_s)
            created = await store.create(self.redis, self.keys, empty, built_by=ROLE, owner=self.token)
            ns = await store.switch_if_unset(self.redis, self.keys, created)
            if ns != created:
                await store.retire(self.redis, self.keys, created, after_ms=1)
        await self._adopt(ns)

    async def _adopt(self, ns: str) -> None:
        self.tables = self._folder = self._writer = None
        writer = store.NamespaceWriter(self.redis, self.keys, ns, self.token)
        # Owner first, then read: a write the previous owner makes after this is refused, so what
        # is read below is final.
        await writer.adopt()
        tables = await store.load(self.redis, self.keys, ns)
        if (tables.half_life_s, tables.demand_half_life_s) != (self.half_life_s, self.demand_half_life_s):
            log.warning(
                "namespace %s was folded with half-lives %s s and %s s (configured: %s s and %s s); "
                "continuing with the namespace's; `routeledger replay rebuild` applies the configured ones",
                ns,
                tables.half_life_s,
                tables.demand_half_life_s,
                self.half_life_s,
                self.demand_half_life_s,
            )
        self.ns, self.tables, self._folder, self._writer = ns, tables, Folder(tables), writer
        log.info(
            "projector %s folds into namespace %s from %s", self.token, ns, tables.checkpoint or "the start"
        )

    # -- folding -------------------------------------------------------------------------------
    async def step(self, block_ms: int | None = None, count: int | None = None) -> int:
        """Fold the next batch (waiting up to `block_ms` for one); returns how many entries it took."""
        live = await store.current(self.redis, self.keys)
        if live is None:
            raise ProjectionError("rl:p:current was deleted under a running projector")
        if live != self.ns or self.tables is None:
            await self._adopt(live)
        tables, folder, writer = self.tables, self._folder, self._writer
        assert tables is not None and folder is not None and writer is not None
        rows = await self.ledger.read_after(tables.checkpoint or "0-0", count or self.batch, block_ms)
        if not rows:
            return 0
        try:
            poison: list[UndecodableEntryError] = []
            for _, event in decode_rows(rows, poison.append):
                folder.apply(event)
            if poison:
                await self._dead_letter(poison)
            folder.flush_fleet()
            checkpoint, folded = rows[-1][0], tables.folded + len(rows)
            result = await writer.apply(tables.checkpoint, checkpoint, folded, _changes(folder, tables))
        except BaseException:
            # The memory may now hold a batch Redis does not: read it all again before going on.
            self.tables = None
            raise
        if result == store.NOT_OWNER:
            self.tables = None
            raise LeaseLostError(f"namespace {self.ns} was adopted by another projector")
        if result == store.MOVED:
            log.warning("namespace %s moved under this projector; reloading it", self.ns)
            self.tables = None
            return 0
        tables.checkpoint, tables.folded = checkpoint, folded
        folder.clear_dirty()
        self.folded += len(rows)
        return len(rows)

    async def _dead_letter(self, poison: list[UndecodableEntryError]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for exc in poison:
            fields: dict[Any, Any] = {"source": "ledger", "entry_id": exc.entry_id, "reason": exc.reason}
            kind = exc.fields.get(b"type")
            if kind is not None:
                fields["type"] = kind
            pipe.xadd(self.keys.dead, fields)
            log.warning("dead-lettered ledger entry %s: %s", exc.entry_id, exc.reason)
        await pipe.execute()
        self.dead_lettered += len(poison)

    async def catch_up(self) -> int:
        """Fold until nothing is left to read (tests and the benchmark); returns entries folded."""
        total = 0
        while True:
            n = await self.step()
            if n == 0 and self.tables is not None:
                return total
            total += n

    # -- the loop ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Wait for the lease, then fold forever (until `stop` is set), taking over again after a loss."""
        stop = stop or asyncio.Event()
        idle_s = self.lease_ms / 4000
        try:
            while not stop.is_set():
                try:
                    if not await self.acquire():
                        await _wait(stop, idle_s)
                        continue
                    if self.tables is None:
                        await self.start()
                    while not stop.is_set():
                        await self.keep_lease()
                        await self.step(self.block_ms)
                except LeaseLostError as exc:
                    log.warning("%s; waiting to take over again", exc)
                    self.tables = None
                except (RedisError, OSError) as exc:
                    log.warning("Redis error in the projector (%s); retrying", exc)
                    self.tables = None
                    await _wait(stop, idle_s)
        finally:
            await self.release()


def _changes(folder: Folder, t: Tables) -> list[tuple[str, Iterable[tuple[str, bytes]]]]:
    enc = store.encode_row
    return [
        (store.SPEED, [(pair_key(*k), enc(t.speed[k])) for k in folder.dirty_speed]),
        (store.LENGTH, [(pair_key(*k), enc(t.length[k])) for k in folder.dirty_length]),
        (store.QUALITY, [(pair_key(*k), enc(t.quality[k])) for k in folder.dirty_quality]),
        (store.FLEET, [(k, enc(t.fleet[k])) for k in folder.dirty_fleet]),
        (store.TASKS, [(k, enc(t.tasks[k])) for k in folder.dirty_tasks]),
        (store.DEMAND, [(k, enc(t.demand[k])) for k in folder.dirty_demand]),
        (store.BENCHED, [(pair_key(*k), b"") for k in folder.new_benched]),
    ]


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
