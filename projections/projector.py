"""The projector: tails the ledger from its checkpoint and folds each batch into the tables.

One instance is active at a time: it holds the lease `rl:lease:projector`, and it also writes its
token into the namespace it folds into, which every write checks, so that an instance that lost
its lease without noticing (a long pause) has its next write refused instead of counting twice.

The lease is renewed by a background task every third of it, so that long work (a slow batch) does
not let it lapse; and before each write the projector checks that its last successful renewal is
recent enough that the lease cannot have expired meanwhile. If it is not, it writes nothing, drops
the batch and takes the lease again: a projector that may have lost its lease stops before the
fencing token would have to refuse it.

The active instance keeps the small tables in memory (loaded from Redis when it takes over). Task
rows and benchmark marks grow with history and are never loaded whole: before folding a batch it
reads only the rows that batch touches, and forgets them once the batch is written. It writes only
the rows a batch changed, together with the checkpoint, in one atomic script. When a rebuild
switches `rl:p:current`, it adopts the new namespace and goes on from that namespace's checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from events.cancellation import cancel_and_wait
from events.codec import DATA, TYPE, as_str, decode_rows
from events.errors import UndecodableEntryError
from events.event import EVENT_TYPES, BenchmarkResult, Event, TaskCompleted, TaskFailed, TaskSubmitted, now_ms
from events.keys import DEAD_MAX_ENTRIES, Keys
from events.ledger import Ledger
from events.scripts import load_library, read_lua
from events.singleton import DEFAULT_LEASE_MS, RELEASE_LEASE, RENEW_LEASE
from projections import store
from projections.errors import LeaseLostError, ProjectionError
from projections.folder import FOLDED_TYPES, TASK_EVENTS, Folder
from projections.ingest import Ingest
from projections.mention import Mention, read_mention
from projections.snapshot import DEFAULT_DEMAND_HALF_LIFE_S, DEFAULT_HALF_LIFE_S
from projections.store import TableChange
from projections.tables import DEFAULT_TASK_RETENTION_DAYS, Tables, pair_key, split_pair
from tasks.quota import Quotas

log = logging.getLogger("routeledger.projector")

ROLE: Final = "projector"
# A write needs a renewal younger than the lease less this share of it: room for the write itself
# to reach Redis while the lease still holds.
SAFETY_SHARE: Final = 0.25
# How often the ingest forgets claims no completion closed (projections.ingest.CLAIM_TTL_MS).
PRUNE_CLAIMS_EVERY_S: Final = 3600.0
# A completion is charged to its task's API key when the live projector folds it no later than this
# after it was written; an older one (a fold of old history into a new namespace) charges nothing,
# since its day's count is gone. Shorter than tasks.quota.CHARGED_TTL_MS, so never twice.
CHARGE_HORIZON_MS: Final = 86_400_000


class Projector:
    """The lease-elected projector over one Redis."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys | None = None,
        *,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        demand_half_life_s: float = DEFAULT_DEMAND_HALF_LIFE_S,
        task_retention_days: int = DEFAULT_TASK_RETENTION_DAYS,
        lease_ms: int = DEFAULT_LEASE_MS,
        batch: int = 2000,
        block_ms: int | None = None,
        dead_max_entries: int = DEAD_MAX_ENTRIES,
    ) -> None:
        self.redis = redis
        self.dead_max_entries = dead_max_entries
        self.keys = keys or Keys.for_client(redis)
        self.ledger = Ledger(redis, self.keys)
        self.half_life_s = half_life_s
        self.demand_half_life_s = demand_half_life_s
        self.task_retention_days = task_retention_days
        self.lease_ms = lease_ms
        self.batch = batch
        # A short blocking read lets the loop notice a lost lease (and a stop) soon.
        self.block_ms = block_ms if block_ms is not None else max(10, min(1000, lease_ms // 4))
        self.token = secrets.token_hex(8)
        self.ns: str | None = None
        self.tables: Tables | None = None
        self._folder: Folder | None = None
        self._writer: store.NamespaceWriter | None = None
        self._renew = redis.register_script(RENEW_LEASE)
        self._release = redis.register_script(RELEASE_LEASE)
        self._field_of = redis.register_script(_FIELD_OF)
        # Loop time at which the last successful renewal was sent: the lease holds until at least
        # that plus lease_ms.
        self._renewed_at = 0.0
        # Whether this instance took the lease (acquire); only then does a write wait on it.
        self._leased = False
        # Set by the renewal task when the lease turned out to be another's.
        self._lost = False
        self._renewer: asyncio.Task[None] | None = None
        # Workers' inboxes, moved into the ledger while this instance holds the lease.
        self.ingest = Ingest(redis, self.keys, dead_max_entries=dead_max_entries)
        # API keys' quotas: a completion folded live is charged to its task's key (`_charge`).
        self.quotas = Quotas(redis, self.keys, open_ttl_s=0)
        # Entries folded by this instance (for the benchmark and the log).
        self.folded = 0
        self.dead_lettered = 0

    # -- the lease -----------------------------------------------------------------------------
    @property
    def lease_key(self) -> str:
        return self.keys.singleton(ROLE)

    async def acquire(self) -> bool:
        """Take the lease if it is free (or already ours); True when this instance is active."""
        sent = _now()
        got = await self.redis.set(self.lease_key, self.token, nx=True, px=self.lease_ms)
        if not got:
            got = bool(await self._renew(keys=[self.lease_key], args=[self.token, self.lease_ms]))
        if got:
            self._renewed_at, self._leased, self._lost = sent, True, False
        return bool(got)

    async def keep_lease(self) -> None:
        """Renew the lease when a third of it has passed; LeaseLostError when another holds it."""
        if _now() - self._renewed_at < self.lease_ms / 3000:
            return
        await self._renew_once()
        if self._lost:
            raise LeaseLostError("the projector lease expired and another instance may hold it")

    async def _renew_once(self) -> None:
        sent = _now()
        if await self._renew(keys=[self.lease_key], args=[self.token, self.lease_ms]):
            self._renewed_at = sent
        else:
            self._lost = True

    async def _renewing(self) -> None:
        """Renew the lease every third of it until it is lost (or the task is cancelled)."""
        while not self._lost:
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                await self._renew_once()
            except (RedisError, OSError) as exc:
                # The renewal grows old meanwhile: writes stop on their own if this goes on.
                log.warning("could not renew the projector lease (%s); retrying", exc)

    def _start_renewing(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renewing())

    async def _stop_renewing(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            await cancel_and_wait((renewer,))
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        self._leased = False

    def _check_lease(self) -> None:
        """LeaseLostError unless the lease surely still holds (always true without `acquire`)."""
        if not self._leased:
            return
        if self._lost:
            raise LeaseLostError("the projector lease was taken by another instance")
        age_ms = (_now() - self._renewed_at) * 1000
        if age_ms >= self.lease_ms * (1 - SAFETY_SHARE):
            raise LeaseLostError(
                f"the projector lease was last renewed {age_ms:.0f} ms ago (lease {self.lease_ms} ms) "
                "and may have expired; not writing"
            )

    async def release(self) -> None:
        """Give the lease up (if held) so that a waiting instance takes over at once."""
        with contextlib.suppress(RedisError):
            await self._release(keys=[self.lease_key], args=[self.token])

    # -- the namespace -------------------------------------------------------------------------
    async def start(self) -> None:
        """Adopt the live namespace (creating the first one if there is none) and load its small
        tables; no task row is read. Loads the routeledger function library first (workers under
        their ACL call it and may not load it themselves)."""
        await load_library(self.redis)
        ns = await store.current(self.redis, self.keys)
        if ns is None:
            empty = Tables(
                half_life_s=self.half_life_s,
                demand_half_life_s=self.demand_half_life_s,
                task_retention_days=self.task_retention_days,
            )
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
        tables = await store.load(self.redis, self.keys, ns, with_tasks=False)
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
        if tables.task_retention_days != self.task_retention_days:
            log.warning(
                "namespace %s keeps task rows %s days (configured: %s); continuing with the namespace's; "
                "`routeledger replay rebuild` applies the configured one",
                ns,
                tables.task_retention_days,
                self.task_retention_days,
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
            batch = list(decode_rows([r for r in rows if not _ignored(r[1])], poison.append))
            # The entries that name a task or a pipeline, for the entry index: read apart, with a
            # decoder that takes the names only (routing decisions are otherwise never decoded).
            mentions = {entry_id: m for entry_id, flat in rows if (m := read_mention(flat)) is not None}
            checkpoint, folded = rows[-1][0], tables.folded + len(rows)
            # Ledger time, not a clock: which shards are kept is a function of the history.
            now = _entry_ms(checkpoint)
            await self._load_rows(tables, batch, mentions, now)
            events = dict(batch)
            for entry_id, _ in rows:
                event, m = events.get(entry_id), mentions.get(entry_id)
                if event is None and m is None:
                    continue
                ms, _, seq = entry_id.partition("-")
                if event is not None:
                    folder.apply(event, int(ms), int(seq))
                if m is not None:
                    folder.mention(m, int(ms), int(seq))
            folder.flush_fleet()
            changes = _changes(folder, tables, now)
            drop = [
                store.shard_name(table, day)
                for day in store.dropped_days(
                    tables.task_retention_days, store.ledger_ms(tables.checkpoint), now
                )
                for table in store.SHARDED_TABLES
            ]
            # Fold first, then look at the lease: the fold may have taken long.
            self._check_lease()
            if poison:
                await self._dead_letter(poison)
            # Charged before the checkpoint moves: a crash in between folds the batch again, and
            # the charge is once per task (tasks.quota._SETTLE), so it is never lost nor doubled.
            await self._charge(batch)
            result = await writer.apply(tables.checkpoint, checkpoint, folded, changes, drop)
        except BaseException:
            # The memory may now hold a batch Redis does not: read it all again before going on.
            self.tables = None
            raise
        finally:
            # Task rows and marks are kept for one batch only: they grow with history.
            tables.tasks.clear()
            tables.benched.clear()
            tables.pipelines.clear()
        if result == store.NOT_OWNER:
            self.tables = None
            raise LeaseLostError(f"namespace {self.ns} was adopted by another projector")
        if result == store.MOVED:
            log.warning("namespace %s moved under this projector; reloading it", self.ns)
            self.tables = None
            return 0
        tables.checkpoint, tables.folded = checkpoint, folded
        # Notices after the write, so that a batch folded again (a lost lease) does not repeat
        # them; one lost in a crash just here is not needed by anything (no table folds it).
        for notice in folder.shifts:
            await self.ledger.append(notice)
            log.info(
                "speed of %s on %s: %s %s (long-run %s, recent %s)",
                notice.digest[:12],
                notice.worker,
                notice.field,
                "back to its long run" if notice.cleared else "shifted",
                notice.long_run,
                notice.recent,
            )
        folder.clear_dirty()
        self.folded += len(rows)
        return len(rows)

    async def _load_rows(
        self,
        tables: Tables,
        batch: Sequence[tuple[str, Event]],
        mentions: Mapping[str, Mention],
        now: int,
    ) -> None:
        """Read into `tables` the task rows, benchmark marks and pipeline rows the batch touches
        (and nothing else), in one pipeline (and one more for rows older than the newest two day
        shards)."""
        wanted: dict[store.ShardedField, store.Wanted] = {}
        for entry_id, event in batch:
            if isinstance(event, TASK_EVENTS):
                field = (store.TASKS, event.task_id)
                # A submission is new or a prompt retry of one, so only the newest shards can hold
                # its row; any other first event may come long after the task was submitted.
                near = isinstance(event, TaskSubmitted)
            elif isinstance(event, BenchmarkResult):
                field, near = (store.BENCHED, pair_key(event.bench_id, event.task_id)), False
            else:
                continue
            if field not in wanted:
                wanted[field] = store.Wanted(store.shard_day(_entry_ms(entry_id)), near)
            if isinstance(event, TaskSubmitted) and event.pipeline_id:
                day = store.shard_day(_entry_ms(entry_id))
                wanted.setdefault((store.PIPELINES, event.pipeline_id), store.Wanted(day))
        for entry_id, m in mentions.items():
            # A mention (a routing decision, a grade, a pipeline's step) adds to a row that exists
            # or, for a pipeline's own event, makes one: any live shard may hold it.
            day = store.shard_day(_entry_ms(entry_id))
            if m.task_id:
                wanted.setdefault((store.TASKS, m.task_id), store.Wanted(day))
            if m.pipeline_event and m.pipeline_id:
                wanted.setdefault((store.PIPELINES, m.pipeline_id), store.Wanted(day))
        assert self.ns is not None
        found = await store.find_in_shards(
            self.redis,
            self.keys,
            self.ns,
            wanted,
            retention_days=tables.task_retention_days,
            now_ms=now,
        )
        for (table, name), raw in found.items():
            if table == store.TASKS:
                tables.tasks[name] = store.decode_task(raw)
            elif table == store.PIPELINES:
                tables.pipelines[name] = store.decode_pipeline(raw)
            else:
                tables.benched[split_pair(name)] = int(raw) if raw else 0

    async def _charge(self, batch: Sequence[tuple[str, Event]]) -> None:
        """Charge each task the batch completes to the API key it was submitted with (the task's
        lookup hash names it), whether or not a client ever collects its result: prompt and output
        tokens as the backend reported them; for a run cancelled while running, what its worker
        reported it had done (TaskFailed.timings). A completion older than CHARGE_HORIZON_MS is not
        charged. A rebuild (replay/) never comes here: only the live fold charges."""
        oldest = now_ms() - CHARGE_HORIZON_MS
        tokens: dict[str, int] = {}
        for entry_id, event in batch:
            if _entry_ms(entry_id) < oldest:
                continue
            match event:
                case TaskCompleted(duplicate=False) | TaskFailed(kind="cancelled"):
                    t = event.timings
                case _:
                    continue
            n = (t.prompt_eval_count or 0) + (t.eval_count or 0)
            if n > 0 and event.task_id not in tokens:
                tokens[event.task_id] = n
        if not tokens:
            return
        names: list[Any] = await self._field_of(keys=[self.keys.task(t) for t in tokens], args=["key"])
        named = zip(tokens.items(), names, strict=True)
        await self.quotas.settle_all([(as_str(name), task_id, n) for (task_id, n), name in named if name])

    async def _dead_letter(self, poison: list[UndecodableEntryError]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for exc in poison:
            fields: dict[Any, Any] = {"source": "ledger", "entry_id": exc.entry_id, "reason": exc.reason}
            kind = exc.fields.get(b"type")
            if kind is not None:
                fields["type"] = kind
            # Capped, like every writer of the stream: poison must not fill Redis either.
            pipe.xadd(self.keys.dead, fields, maxlen=self.dead_max_entries, approximate=True)
            log.warning("dead-lettered ledger entry %s: %s", exc.entry_id, exc.reason)
        await pipe.execute()
        self.dead_lettered += len(poison)

    async def catch_up(self) -> int:
        """Move what the workers' inboxes hold, then fold until nothing is left to read (tests and the
        benchmark); returns entries folded."""
        total = 0
        await self.ingest.catch_up()
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
        ingesting = asyncio.create_task(self._ingesting(stop), name="ingest")
        try:
            while not stop.is_set():
                try:
                    if not await self.acquire():
                        await _wait(stop, idle_s)
                        continue
                    self._start_renewing()
                    if self.tables is None:
                        await self.start()
                    while not stop.is_set():
                        self._check_lease()
                        await self.step(self.block_ms)
                except LeaseLostError as exc:
                    log.warning("%s; waiting to take over again", exc)
                    self.tables = None
                    await self._stop_renewing()
                except (RedisError, OSError) as exc:
                    log.warning("Redis error in the projector (%s); retrying", exc)
                    self.tables = None
                    await self._stop_renewing()
                    await _wait(stop, idle_s)
        finally:
            await cancel_and_wait((ingesting,))
            with contextlib.suppress(asyncio.CancelledError):
                await ingesting
            await self._stop_renewing()
            await self.release()

    async def _ingesting(self, stop: asyncio.Event) -> None:
        """Move the workers' inboxes into the ledger for as long as this instance holds the lease
        (projections/ingest.py), beside the fold, so that an inbox waits for no fold."""
        idle_s = self.lease_ms / 4000
        pruned_at = -math.inf
        while not stop.is_set():
            if not self._leased or self._lost:
                await _wait(stop, idle_s)
                continue
            try:
                if _now() - pruned_at >= PRUNE_CLAIMS_EVERY_S:
                    pruned_at = _now()
                    await self.ingest.prune(now_ms())
                moved = await self.ingest.step(self.block_ms, before_write=self._check_lease)
                if not moved and not await self.ingest.inboxes():
                    await _wait(stop, idle_s)
            except LeaseLostError:
                await _wait(stop, idle_s)
            except (RedisError, OSError) as exc:
                log.warning("Redis error in the ingest (%s); retrying", exc)
                await _wait(stop, idle_s)


def _changes(folder: Folder, t: Tables, now_ms: int) -> list[TableChange]:
    enc = store.encode_row
    keep = t.task_retention_days
    return [
        TableChange(store.SPEED, [(pair_key(*k), enc(t.speed[k])) for k in folder.dirty_speed]),
        TableChange(store.LENGTH, [(pair_key(*k), enc(t.length[k])) for k in folder.dirty_length]),
        TableChange(store.QUALITY, [(pair_key(*k), enc(t.quality[k])) for k in folder.dirty_quality]),
        TableChange(store.FLEET, [(k, enc(t.fleet[k])) for k in folder.dirty_fleet]),
        TableChange(store.DEMAND, [(k, enc(t.demand[k])) for k in folder.dirty_demand]),
        *store.task_changes([t.tasks[k] for k in folder.dirty_tasks], keep, now_ms),
        *store.bench_changes([(k, t.benched[k]) for k in folder.new_benched], keep, now_ms),
        *store.pipeline_changes([t.pipelines[k] for k in folder.dirty_pipelines], keep, now_ms),
    ]


def _entry_ms(entry_id: str) -> int:
    """The ms part of a stream entry id: the time its day shard is named by."""
    return int(entry_id.partition("-")[0])


# The Lua this module runs (projections/lua/field_of.lua), headed by the KEYS and ARGV it takes: one
# field of many task records in one call.
_LUA: Final = Path(__file__).parent / "lua"
_FIELD_OF: Final = read_lua(_LUA / "field_of.lua")

# Envelope tags of the standard entries the folder has no use for: skipped undecoded. An entry
# of any other layout is decoded, so that poison is still dead-lettered.
_IGNORED: Final = frozenset(t.__name__.encode() for t in EVENT_TYPES if t.__name__ not in FOLDED_TYPES)


def _ignored(flat: Sequence[bytes]) -> bool:
    return len(flat) == 6 and flat[0] == TYPE and flat[1] in _IGNORED and flat[4] == DATA


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
