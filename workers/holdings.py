"""What this worker's machine holds, and what the ledger and Redis hear of it.

The backend's inventory (which models it has, which are loaded) and whether it answers, the
machine's resources, which models are warm and what each slot caches; the models it serves of
those; and the reports: WorkerOnline at the start of a life, WorkerChanged when what it holds
changes (workers.liveness), and the model cards beside the lease (dispatch.modelcard).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, RedisError

from dispatch.modelcard import ModelCard, publish_cards
from events.event import ModelEntry, Resources, WorkerOnline, now_ms
from events.keys import Keys
from events.ledger import Ledger
from tasks.payload import EMBED, TaskMessage
from workers.backend import Backend, Inventory, Refusing
from workers.config import WorkerConfig
from workers.errors import BackendError
from workers.liveness import Liveness
from workers.slots import Slots
from workers.warmth import Warmth

log = logging.getLogger("routeledger.worker")


class Holdings:
    """One worker's view of its backend's models and its machine, and its reports of them."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, ledger: Ledger, backend: Backend, config: WorkerConfig
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.ledger = ledger
        self.backend = backend
        self.config = config
        self.name = config.name
        self.inventory = Inventory(models=[], loaded=[])
        # The model cards last written to Redis (None: none yet in this life).
        self._cards_published: dict[str, ModelCard] | None = None
        self.backend_ok = False
        # The models the backend lists changed (benchmarking looks again at once).
        self.changed = asyncio.Event()
        # The backend refused something (workers.backend.Refusing): read its inventory again now.
        self.stale = asyncio.Event()
        # What the ledger last heard of this worker's state; the machine's figures go only to the lease.
        self.liveness = Liveness(self.name, config.slots, config.serves)
        self.resources = Resources()
        # Which models are in memory, run by run: whether a run was cold (a load sample) or warm.
        self.warmth = Warmth()
        # What each backend slot holds of earlier prompts (for the plan's prefix pricing).
        self.slots = Slots(config.slots)

    def serving(self) -> list[ModelEntry]:
        """Held models this worker consumes tasks for."""
        if not self.backend_ok:
            return []
        if self.config.serves is None:
            return list(self.inventory.models)
        wanted = set(self.config.serves)
        return [m for m in self.inventory.models if m.name in wanted or m.digest in wanted]

    def local_name(self, digest: str) -> str | None:
        """This backend's name for a digest it serves, or None if it does not serve it."""
        for model in self.serving():
            if model.digest == digest:
                return model.name
        return None

    def shared_queues(self) -> list[str]:
        return sorted({self.keys.queue(m.digest) for m in self.serving()})

    async def announce(self) -> None:
        """WorkerOnline, then what is loaded (WorkerOnline does not say): the ledger's start of a life."""
        if self.config.inbox:
            # Listed before its first event, so that the ingest finds the inbox without a SCAN.
            await self.redis.sadd(self.keys.inboxes, self.name)
        online = WorkerOnline(
            worker=self.name,
            slots=self.config.slots,
            backend=self.backend.url,
            backend_kind=self.backend.kind,
            host=socket.gethostname(),
            inventory=list(self.inventory.models),
            serves=self.config.serves,
        )
        await self.ledger.append(online)
        self.liveness.online(online)
        await self.report_changes()
        self._cards_published = None  # a new life: written again (Redis may have lost them)
        await self.publish_cards()

    async def publish_cards(self) -> None:
        """Write what the backend says of its models beyond the lease (dispatch.modelcard) to this
        worker's own hash, when it differs from what was written last."""
        cards = self.inventory.cards
        if cards == self._cards_published:
            return
        try:
            await publish_cards(self.redis, self.keys, self.name, cards)
        except RedisError as exc:
            if not isinstance(exc, NoPermissionError):
                # /api/show lacks the template until a later heartbeat writes it: nothing else waits.
                log.warning("worker %s: could not write its model cards (%s); will retry", self.name, exc)
                return
            # An ACL made before this key existed: said once, not every beat.
            log.warning(
                "worker %s: its Redis user may not write %s (%s); /api/show will lack its templates "
                "until `routeledger acl worker %s` is applied again",
                self.name,
                self.keys.card(self.name),
                exc,
                self.name,
            )
        self._cards_published = cards

    async def report_changes(self) -> None:
        """Append WorkerChanged when what the worker holds, has loaded or serves differs from what
        it last appended; a beat with no news appends nothing (the lease says it is alive)."""
        changed = self.liveness.beat(now_ms(), self.inventory.models, self.inventory.loaded)
        if changed is not None:
            await self.ledger.append(changed)
            self.liveness.said(changed)

    async def refresh(self, first: bool = False) -> None:
        self.stale.clear()
        try:
            inventory = await self.backend.inventory()
        except BackendError as exc:
            if self.backend_ok or first:
                log.warning(
                    "backend %s unavailable (%s); not taking work until it answers", self.backend.url, exc
                )
            self.backend_ok = False
            return
        if not self.backend_ok and not first:
            log.info("backend %s is back", self.backend.url)
        if {m.digest for m in inventory.models} != {m.digest for m in self.inventory.models}:
            self.changed.set()
        self.backend_ok = True
        self.inventory = inventory
        self.warmth.listed()
        if inventory.loaded_known:
            # A model the backend unloaded took its slots' caches with it.
            self.slots.forget(d for d in self.slots.digests() if d not in inventory.loaded)

    def refused(self, task: TaskMessage) -> None:
        """Learn from the backend's refusal of `task`: its inventory (and the lease) now says the
        model lacks what was asked, at the next renewal, which is asked for now."""
        if task.kind == EMBED and isinstance(self.backend, Refusing):
            local = self.local_name(task.digest)
            if local is not None:
                self.backend.refused(local, "embedding")
                self.stale.set()
