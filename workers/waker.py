"""The waker: wakes a sleeping machine when the plan says its models' queued work finishes sooner with
it, and says in the ledger when a woken machine did not come online.

It runs inside the reaper (one active at a time, so one decision per machine at a time; the
`Keys.woken` window keeps a second packet out even if two ran). Every `interval_s` it reads the
sleepers' records, the live leases and the queues of the models the sleepers serve, and asks
router.wake.decide_wake of each model a sleeper serves; the first model that pays wakes it, once.

A packet sent (by the waker or `routeledger wake`) waits in `Keys.waking` until the machine's worker
takes its lease, or until the record's bound passes, which appends WakeFailed. The wake time the
next decision counts is the projector's: WakeRequested to the WorkerOnline that followed it, folded
into the machine's fleet row (its `--wake-s` until one is measured).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import redis.asyncio as aioredis

from dispatch.errors import WakeError
from dispatch.view import LiveView
from dispatch.wake import (
    DEFAULT_WINDOW_S,
    MIN_BOUND_S,
    SleepRecord,
    pending_wakes,
    read_records,
    sleeper_of,
    wake,
)
from events.codec import as_str
from events.event import MAX_SECONDS, WakeFailed, now_ms
from events.keys import Keys
from events.ledger import Ledger
from projections.snapshot import FleetRow
from router.wake import WakeDecision, WakeParams, decide_wake
from tasks.lease import LeaseInfo, live_workers

log = logging.getLogger("routeledger.waker")


class WakerConfig(msgspec.Struct, kw_only=True, frozen=True):
    # How often sleepers are looked at against the queues.
    interval_s: float = 2.0
    # At most one packet per machine per window.
    window_s: float = DEFAULT_WINDOW_S
    # The shortest bound a woken machine is given before WakeFailed (dispatch.wake.SleepRecord.bound_s).
    min_bound_s: float = MIN_BOUND_S
    params: WakeParams = WakeParams()


class Waker:
    """One look at a time at every sleeping machine."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, config: WakerConfig | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.config = config or WakerConfig()
        self.view = LiveView(redis, keys)
        self.ledger = Ledger(redis, keys)

    async def tick(self) -> list[WakeDecision]:
        """Settle answered and overdue wakes, then decide for every sleeper; the decisions that woke one."""
        records = await read_records(self.redis, self.keys)
        if not records:
            return []
        leases = await live_workers(self.redis, self.keys)
        snap, est = await self.view.estimates()
        now = now_ms()
        pending = await pending_wakes(self.redis, self.keys)
        await self._settle(pending, records, leases, snap.fleet, now)
        raw: Any = await self.redis.smembers(self.keys.forgotten)
        forgotten = {as_str(n) for n in raw}
        asleep = [
            r
            for name, r in sorted(records.items())
            if name not in leases and name not in forgotten and name not in pending and r.holds
        ]
        if not asleep:
            return []
        digests = {d for r in asleep for d in r.holds}
        fleet, est, now, _ = await self.view.fleet(digests, leases)
        woke: list[WakeDecision] = []
        for rec in asleep:
            sleeper = sleeper_of(rec, snap.fleet.get(rec.worker), now)
            best: WakeDecision | None = None
            for digest in sorted(rec.holds):
                d = decide_wake(fleet, est, digest, sleeper, now, params=self.config.params)
                if d.wake and (best is None or d.gain_s > best.gain_s):
                    best = d
            if best is None:
                continue
            try:
                sent = await wake(
                    self.redis,
                    self.keys,
                    rec,
                    why="plan",
                    gain_s=best.gain_s,
                    digest=best.digest,
                    window_s=self.config.window_s,
                    wake_time=rec.wake_time(snap.fleet.get(rec.worker), now),
                )
            except WakeError as exc:
                log.warning("cannot wake %s: %s", rec.worker, exc)
                continue
            if sent is not None:
                log.info("woke %s: %s", rec.worker, best.reason)
                woke.append(best)
        return woke

    async def _settle(
        self,
        pending: dict[str, int],
        records: dict[str, SleepRecord],
        leases: dict[str, LeaseInfo],
        fleet: dict[str, FleetRow],
        now: int,
    ) -> None:
        """A woken machine whose worker holds its lease is done waiting (the projector measures the
        wake from the ledger: WakeRequested to WorkerOnline); one past its bound gets WakeFailed."""
        floor = self.config.min_bound_s
        for name, at in sorted(pending.items()):
            if name in leases:
                await self.redis.hdel(self.keys.waking, name)
                continue
            rec = records.get(name)
            bound = rec.bound_s(rec.wake_time(fleet.get(name)).seconds, floor) if rec is not None else floor
            waited = (now - at) / 1000.0
            if waited > bound:
                await self.ledger.append(WakeFailed(at=now, worker=name, waited_s=min(waited, MAX_SECONDS)))
                await self.redis.hdel(self.keys.waking, name)
                log.warning("%s did not come online within %.1fs of its magic packet", name, bound)
