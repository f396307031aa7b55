"""Every Redis key and stream name routeledger uses; nothing else spells one.

Keys that must change together in one Lua script or MULTI share a hash tag, so that the
layout works on Redis Cluster as well as on a single server.

On a cluster, the ledger and everything a script changes together with it (task queues, task
records, the registries and leases the dispatch scripts read, the ingest's claims) is the *core*:
its keys carry one hash tag, the prefix in braces (`{rl:}events`), so that they live in one slot.
The ledger is one ordered stream, so it is on one node whatever its neighbours are; what spreads
over the other nodes is the bulk of the writes, which no script joins to the core: every task's
output and result (`rl:out:{task}`), the projection tables (`rl:p:{ns}:...`), API keys' quotas
and pipelines. On one server the core keeps its plain names, those of every earlier release.
"""

from __future__ import annotations

from typing import Final

DEFAULT_PREFIX: Final = "rl:"
# The consumer group that workers read every task queue through.
WORKERS_GROUP: Final = "workers"
# Most entries `Keys.dead` keeps by default (setting dead_max_entries); XADD trims older ones.
DEAD_MAX_ENTRIES: Final = 10_000
# Digests are sha256 hex; twelve characters name a queue (as `ollama list` shows them).
DIGEST_PREFIX_LEN: Final = 12
# The consumer that holds re-queued entries in a queue's pending list, in their original place
# (ahead of newer work), until a worker takes one; no worker name can be spelled like it.
REQUEUED_CONSUMER: Final = "(requeued)"
# Priorities are served in bands: every priority above BAND_HIGHEST shares its band, and so does
# every one below BAND_LOWEST.
BAND_HIGHEST: Final = 9
BAND_LOWEST: Final = -1


def band_order(priority: int, round_: int) -> int:
    """Where a band queue comes in its model's order (lowest first): higher priority first, then the
    earlier fair-share round."""
    band = max(BAND_LOWEST, min(BAND_HIGHEST, priority))
    return (BAND_HIGHEST - band) * 16 + round_


class Keys:
    """Names of every key under one configurable prefix."""

    __slots__ = ("cluster", "core", "prefix")

    def __init__(self, prefix: str = DEFAULT_PREFIX, *, cluster: bool = False) -> None:
        self.prefix = prefix
        self.cluster = cluster
        # Head of every core key (see the module's docstring): the prefix, in braces on a cluster.
        self.core = f"{{{prefix}}}" if cluster else prefix

    def __repr__(self) -> str:
        return f"Keys({self.prefix!r}, cluster={self.cluster})" if self.cluster else f"Keys({self.prefix!r})"

    @classmethod
    def for_client(cls, redis: object, prefix: str = DEFAULT_PREFIX) -> Keys:
        """The default layout for a client: the cluster layout for a cluster client."""
        from events.connection import is_cluster

        return cls(prefix, cluster=is_cluster(redis))

    # -- the ledger ---------------------------------------------------------------------------
    @property
    def events(self) -> str:
        # The ledger stream: every event, in order.
        return f"{self.core}events"

    def inbox(self, worker: str) -> str:
        # A worker's own event stream, the only one its ACL lets it append to; the projector's
        # ingest checks each entry against the worker it came from and moves it into the ledger.
        return f"{self.core}events:w:{worker}"

    @property
    def inboxes(self) -> str:
        # Set of the names of workers that write to an inbox, so that the ingest finds them without SCAN.
        return f"{self.core}inboxes"

    @property
    def claims(self) -> str:
        # Hash task id -> the runs of it the ingest accepted a claim for (attempt, worker, digest):
        # a completion, a failure or a grade counts only for a run claimed by the same worker.
        return f"{self.core}claims"

    @property
    def graded(self) -> str:
        # Set of "task grader" pairs the ingest let through: one grade per answer and grader.
        return f"{self.core}graded"

    @property
    def archive(self) -> str:
        # Hash: the archive's state (last archived id, segments, events, bytes, last run, last error).
        return f"{self.core}archive"

    @property
    def dead(self) -> str:
        # Dead-lettered tasks and poison ledger entries, each with its reason.
        return f"{self.core}dead"

    # -- task queues and payloads --------------------------------------------------------------
    def queue(self, digest: str) -> str:
        # Shared task queue of one model (group `workers`); only holders of the digest read it.
        return f"{self.core}q:{digest[:DIGEST_PREFIX_LEN]}"

    def band_queue(self, digest: str, priority: int, round_: int) -> str:
        # One model's queue for one priority band and fair-share round; band 0 round 0 is the
        # model's plain queue. The hash tag is the plain queue's name: one slot for all of them.
        band = max(BAND_LOWEST, min(BAND_HIGHEST, priority))
        if band == 0 and round_ == 0:
            return self.queue(digest)
        return f"{self.core}q:{{{self.queue(digest)}}}:p{band}r{round_}"

    def bands(self, digest: str) -> str:
        # Zset of one model's band queues that were ever used, scored in the order they are
        # served (band_order); same slot as the model's plain queue.
        return f"{self.core}qb:{{{self.queue(digest)}}}"

    def pinned(self, worker: str) -> str:
        # Tasks pinned to one worker: hand-offs and explicit pins (group `workers`); benchmarks
        # before they had a stream of their own (`background`).
        return f"{self.core}q:w:{worker}"

    def background(self, worker: str) -> str:
        # A worker's own benchmark and grading tasks (group `workers`): the lowest priority it has,
        # taken only while no user work waits for it, and given up when user work comes.
        return f"{self.core}q:bg:{worker}"

    def background_worker(self, queue: str) -> str | None:
        # The worker whose background stream `queue` is (None: not one).
        head = f"{self.core}q:bg:"
        return queue[len(head) :] if queue.startswith(head) else None

    def pinned_worker(self, queue: str) -> str | None:
        # The worker whose pinned stream `queue` is (None: not a pinned stream).
        head = f"{self.core}q:w:"
        return queue[len(head) :] if queue.startswith(head) else None

    @property
    def queue_pattern(self) -> str:
        # SCAN pattern that matches every task queue (only to seed `queues` from an older layout).
        return f"{self.core}q:*"

    @property
    def queues(self) -> str:
        # Set of every task queue name, shared and pinned, so that nothing SCANs for them.
        return f"{self.core}queues"

    def out(self, task_id: str) -> str:
        # Output chunks of one task, relayed to streaming clients; the hash tag puts it in its
        # result's slot (a run is closed in one script); expires.
        return f"{self.prefix}out:{{{task_id}}}"

    def result(self, task_id: str) -> str:
        # Final text and timings of one task (same slot as its output); expires.
        return f"{self.prefix}result:{{{task_id}}}"

    def run_out(self, worker: str, task_id: str) -> str:
        # Output chunks of one task as one worker wrote them: a worker's ACL lets it write only its
        # own, and the API reads only those of the workers that ran the task (`ran`, or the holder
        # of its queue entry). The hash tag keeps a task's keys in one slot; expires.
        return f"{self.prefix}out:w:{worker}:{{{task_id}}}"

    def run_result(self, worker: str, task_id: str) -> str:
        # Final text and timings of one task as one worker wrote them (see run_out); expires.
        return f"{self.prefix}result:w:{worker}:{{{task_id}}}"

    def ran(self, task_id: str) -> str:
        # Set of the workers whose claim of the task the ingest accepted: whose run_out and
        # run_result the API may serve for it; expires.
        return f"{self.core}ran:{{{task_id}}}"

    def cancel(self, task_id: str) -> str:
        # Set when a client asks a running task to stop; the worker polls it; expires.
        return f"{self.prefix}cancel:{task_id}"

    def task(self, task_id: str) -> str:
        # What the API recorded at submission (queue, model, routing breakdown), for lookups; expires.
        return f"{self.core}task:{task_id}"

    def pipeline(self, pipeline_id: str) -> str:
        # A pipeline's state (status, children, plan, outcome), so that any API process can answer
        # for it; the ledger keeps its history. Expires.
        return f"{self.prefix}pipeline:{pipeline_id}"

    @property
    def stalled(self) -> str:
        # Set of "queue entry-id" members already reported stalled, so each is reported once.
        return f"{self.core}stalled"

    # -- workers -------------------------------------------------------------------------------
    def live(self, worker: str) -> str:
        # A worker's lease: present while its heartbeats arrive (string with TTL).
        return f"{self.core}live:{worker}"

    def control(self, worker: str) -> str:
        # Operators' requests to one worker (pull or delete a model on its machine: dispatch.control),
        # a capped stream the API appends to and that worker alone reads; each request's progress
        # lines go to that worker's own output keys (`run_out`) under the request's id.
        return f"{self.prefix}ctl:{worker}"

    def card(self, worker: str) -> str:
        # Hash digest -> what the worker's backend says of that model too large for its lease
        # (template, parameters, model_info: dispatch.modelcard); written by that worker only.
        return f"{self.prefix}card:{worker}"

    @property
    def workers(self) -> str:
        # Set of workers holding a lease: a worker joins when it takes one; the reaper drops it
        # once its lease is gone.
        return f"{self.core}workers"

    @property
    def forgotten(self) -> str:
        # Set of worker names retired for good by `routeledger worker forget`.
        return f"{self.core}forgotten"

    @property
    def expired(self) -> str:
        # Hash worker -> status_since of the life the reaper ended (lease expired): one WorkerOffline each.
        return f"{self.core}expired"

    def sleeper(self, worker: str) -> str:
        # A machine that sleeps: how to wake it (MAC, broadcast, port), its slots and models and its
        # configured wake time (dispatch.wake.SleepRecord); persistent, written by that worker (or an
        # operator's `routeledger wake --mac`), read while its lease is absent.
        return f"{self.core}sleeper:{worker}"

    @property
    def sleepers(self) -> str:
        # Set of the names of workers with a sleeper record, so that the waker finds them without SCAN.
        return f"{self.core}sleepers"

    def woken(self, worker: str) -> str:
        # Set NX with a TTL when a magic packet goes to a machine: at most one per machine per window.
        return f"{self.core}woken:{worker}"

    @property
    def waking(self) -> str:
        # Hash worker -> epoch ms of the magic packet not yet answered: the waker records the wake
        # time when its lease appears, or WakeFailed once the record's bound has passed.
        return f"{self.core}waking"

    # -- API keys ------------------------------------------------------------------------------
    def quota(self, name: str) -> str:
        # Hash: one API key's use (requests, refusals, today's tokens and day, its rate's timestamp).
        return f"{self.prefix}quota:{{{name}}}"

    def quota_open(self, name: str) -> str:
        # Zset: one API key's open tasks (admitted, result not yet delivered) -> admitted at ms.
        return f"{self.prefix}quota:{{{name}}}:open"

    def quota_charged(self, name: str) -> str:
        # Zset: one API key's tasks charged in the last two days -> charged at ms (each charged once).
        return f"{self.prefix}quota:{{{name}}}:charged"

    # -- leases of singleton processes ----------------------------------------------------------
    def singleton(self, role: str) -> str:
        # Lease held by the one active projector or reaper (`role`); others wait for it.
        return f"{self.prefix}lease:{role}"

    # -- projections ---------------------------------------------------------------------------
    @property
    def current(self) -> str:
        # Names the live projection namespace; switched atomically by a rebuild.
        return f"{self.prefix}p:current"

    def table(self, ns: str, name: str) -> str:
        # One projection table (hash) of namespace `ns`, or one day shard of one (`tasks:20251124`,
        # `pipelines:20251124`: the entry index; named by projections/store.py shard_name); the hash
        # tag keeps a namespace in one slot.
        return f"{self.prefix}p:{{{ns}}}:{name}"

    def checkpoint(self, ns: str) -> str:
        # The last ledger id folded into namespace `ns`, written with every table update.
        return f"{self.prefix}p:{{{ns}}}:checkpoint"

    def owner(self, ns: str) -> str:
        # Token of the one projector allowed to write namespace `ns` (fencing a lost lease out).
        return f"{self.prefix}p:{{{ns}}}:owner"
