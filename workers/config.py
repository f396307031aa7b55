"""How one worker behaves: its name, slots, what it serves, and every interval it keeps."""

from __future__ import annotations

import re
import socket
from typing import Final

import msgspec

from dispatch.benchmark import BENCH_MIN_SAMPLES, BENCH_STALE_AFTER_S, GRADE_BATCH
from events.keys import DEAD_MAX_ENTRIES
from events.singleton import DEFAULT_LEASE_MS

# What a worker's name may be: it names its lease, its pinned queue and its consumer in every group
# (a host name fits; the consumer that holds re-queued entries, "(requeued)", never does).
WORKER_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class WorkerConfig(msgspec.Struct, kw_only=True):
    """How one worker behaves."""

    name: str = msgspec.field(default_factory=socket.gethostname)
    slots: int = 1
    # Names (or digests) of held models to serve; None: all held; []: registered, serving nothing.
    serves: list[str] | None = None
    lease_ms: int = DEFAULT_LEASE_MS
    heartbeat_ms: int = 2_000
    delivery_limit: int = 3
    # Most entries rl:dead keeps (this worker's dead letters trim it to about that).
    dead_max_entries: int = DEAD_MAX_ENTRIES
    # How long an idle worker blocks on its queues before it looks again (a new entry wakes it
    # at once; a re-queued one waits for the next look). Under the client's socket timeout.
    block_ms: int = 3_000
    # A worker that the gate held back asks again when the ledger records news (a claim, a
    # completion) or a queue gets an entry, no sooner than recheck_min_ms after it last asked and
    # no later than recheck_ms.
    recheck_ms: int = 1_000
    recheck_min_ms: int = 50
    drain_timeout_s: float = 30.0
    # After a backend failure the worker pauses taking shared work, so the task runs elsewhere.
    cooldown_s: float = 2.0
    max_cooldown_s: float = 30.0
    # Output is flushed to rl:out in small batches: the first piece at once, then this often.
    flush_ms: float = 25.0
    cancel_check_ms: float = 250.0
    # Benchmark itself on start, on gaining a model, and when its speed rows are thin or stale.
    auto_bench: bool = True
    bench_min_samples: int = BENCH_MIN_SAMPLES
    bench_stale_after_s: float = BENCH_STALE_AFTER_S
    bench_check_s: float = 30.0
    bench_domain: str = "general"
    # Prompts per scheduled grading request (auto_bench grades every domain, a batch at a time).
    grade_batch: int = GRADE_BATCH
    # Scheduled grading waits until the worker has taken no shared work for this long and runs
    # nothing: a grading answer on the pinned stream goes ahead of queued user work.
    grade_quiet_s: float = 30.0
    # Append events to its own inbox (`Keys.inbox`) instead of the ledger: a worker on another
    # machine, under the ACL `routeledger acl worker` prints, may append nowhere else; the
    # projector's ingest checks what it says against what it holds and moves it into the ledger.
    inbox: bool = False
