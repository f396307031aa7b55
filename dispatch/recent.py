"""Recent activity read back from the ledger: the newest tasks (who ran each and why), recent
reclaims, stalls and dead letters, and the decode-speed samples. What the dashboard and
`routeledger status` show beside the fleet (dispatch/overview.py).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from events.codec import decode_rows
from events.event import (
    BenchmarkResult,
    Event,
    TaskCancelled,
    TaskClaimed,
    TaskCompleted,
    TaskDeadLettered,
    TaskExpired,
    TaskFailed,
    TaskReclaimed,
    TaskRouted,
    TaskStalled,
    TaskSubmitted,
    WorkerOffline,
    WorkerOnline,
)
from events.keys import Keys
from events.ledger import Ledger, RawEntry, wire_rows
from projections.folder import decode_tps
from projections.status import TERMINAL_RANK, TaskStatus, fold_status

SAMPLE_TYPES: Final = frozenset({b"TaskCompleted", b"BenchmarkResult"})
_INCIDENT_TYPES: Final = frozenset({b"TaskReclaimed", b"TaskStalled", b"TaskDeadLettered"})
# A worker's comings and goings: whether the expected worker was there when another took its task.
_WORKER_TYPES: Final = frozenset({b"WorkerOnline", b"WorkerOffline"})
TASK_TYPES: Final = frozenset(
    {
        b"TaskSubmitted",
        b"TaskRouted",
        b"TaskClaimed",
        b"TaskCompleted",
        b"TaskFailed",
        b"TaskCancelled",
        b"TaskExpired",
    }
    | _INCIDENT_TYPES
    | _WORKER_TYPES
)
# The events after which a claimed task no longer holds its worker's slot.
_RUN_ENDS: Final = (TaskCompleted, TaskFailed, TaskReclaimed, TaskDeadLettered, TaskCancelled, TaskExpired)
# How far back the recent tasks and incidents are looked for (ledger entries, newest first).
RECENT_WINDOW: Final = 5000
MAX_SAMPLES: Final = 5000


def wanted(rows: Iterable[RawEntry], types: frozenset[bytes]) -> list[RawEntry]:
    """The entries of `types`: the envelope's type is an entry's second value, so entries are
    filtered before paying for a decode."""
    return [(i, flat) for i, flat in rows if len(flat) > 1 and flat[1] in types]


class Sample(msgspec.Struct, array_like=True, frozen=True):
    """One decode-speed sample: [at ms, worker, digest, tok/s, from a benchmark]."""

    at: int
    worker: str
    digest: str
    tps: float
    bench: bool


def sample_of(event: Event) -> Sample | None:
    """The speed sample an event carries, counted as the projector counts it (once per run)."""
    if isinstance(event, BenchmarkResult):
        tps = decode_tps(event.timings)
        return None if tps is None else Sample(event.at, event.worker, event.digest, round(tps, 2), True)
    # A benchmark's TaskCompleted repeats its BenchmarkResult; a duplicate changes no statistic.
    if isinstance(event, TaskCompleted) and event.bench_id is None and not event.duplicate:
        tps = decode_tps(event.timings)
        return None if tps is None else Sample(event.at, event.worker, event.digest, round(tps, 2), False)
    return None


async def read_samples(
    redis: aioredis.Redis, keys: Keys, since_ms: int, limit: int = MAX_SAMPLES
) -> tuple[list[Sample], str]:
    """Decode-speed samples appended since `since_ms`, oldest first (the newest `limit` of them),
    and the id of the last ledger entry read (where a live stream picks up)."""
    ledger = Ledger(redis, keys)
    last = await ledger.last_id() or "0-0"
    kept: deque[Sample] = deque(maxlen=limit)
    async for batch in ledger.read_raw(f"{max(0, since_ms)}-0", last, chunk=5000):
        for _, event in decode_rows(wanted(batch, SAMPLE_TYPES), lambda exc: None):
            s = sample_of(event)
            if s is not None:
                kept.append(s)
    return list(kept), last


class TaskView(msgspec.Struct, kw_only=True):
    """One recent task as the dashboard shows it: who ran it, and why it was routed so."""

    task_id: str
    model: str
    digest: str
    domain: str
    submitted_at: int
    entry_id: str
    status: TaskStatus = "submitted"
    worker: str | None = None
    attempts: int = 0
    expected_worker: str | None = None
    expected_finish_s: float | None = None
    # Each candidate's expected finish, best first: the short answer to "why this worker".
    ranking: list[tuple[str, float | None]] = msgspec.field(default_factory=list)
    # Candidates the ledger only counts (a compact TaskRouted keeps the top ones), and the best
    # expected finish among them; 0 and None for an entry that kept every candidate.
    others: int = 0
    others_best_finish_s: float | None = None
    auto: bool = False
    tps: float | None = None
    wall_ms: float | None = None
    finished_at: int | None = None
    # The queue the router put it on (a worker's pinned stream for a hand-off), and the last
    # attempt that ended before it finished: what changed the plan when another worker took it.
    routed_queue: str = ""
    setback: str | None = None
    # Why the worker that took it is not the expected one (None when it is, or before a claim).
    reason: str | None = None
    # The workers that took it, one per attempt, oldest first.
    claims: list[str] = msgspec.field(default_factory=list)

    def fold(self, event: Event) -> None:
        """One more event of this task (its status by projections.status, the one rule)."""
        self.status = fold_status(self.status, event)
        if isinstance(event, TaskRouted):
            self.routed_queue = event.queue
            self.expected_worker = event.expected_worker
            self.expected_finish_s = event.expected_finish_s
            self.ranking = _ranking(event.breakdown)
            self.others, self.others_best_finish_s = _others(event.breakdown)
            self.auto = "auto" in event.breakdown
        elif isinstance(event, TaskClaimed):
            self.attempts = max(self.attempts, event.attempt)
            self.claims.append(event.worker)
            if self.finished_at is None:
                self.worker = event.worker
        elif isinstance(event, TaskCompleted) and not event.duplicate and self.finished_at is None:
            self.worker = event.worker
            self.tps = None if (t := decode_tps(event.timings)) is None else round(t, 2)
            self.wall_ms, self.finished_at = event.wall_ms, event.at
        elif isinstance(event, TaskFailed) and self.finished_at is None:
            self.worker = event.worker
            if event.retryable:
                what = f"{event.kind}: {event.message}" if event.message else event.kind
                self.setback = f"attempt {event.attempt} failed on {event.worker} ({what[:80]})"
        elif isinstance(event, TaskReclaimed):
            self.setback = (
                f"{event.owner} stopped answering during attempt {event.attempt - 1} (lease expired)"
            )

    @property
    def taker(self) -> str | None:
        return self.claims[-1] if self.claims else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "model": self.model,
            "digest": self.digest,
            "domain": self.domain,
            "submitted_at": self.submitted_at,
            "status": self.status,
            "worker": self.worker,
            "attempts": self.attempts,
            "expected_worker": self.expected_worker,
            "expected_finish_s": self.expected_finish_s,
            # The worker that took it (its latest claim), beside the one the router expected.
            "taker": self.taker,
            "reason": self.reason,
            "ranking": [{"worker": w, "expected_finish_s": s} for w, s in self.ranking],
            "others": {"count": self.others, "best_finish_s": self.others_best_finish_s},
            "auto": self.auto,
            "decode_tps": self.tps,
            "wall_ms": self.wall_ms,
            "finished_at": self.finished_at,
        }


def _ranking(breakdown: dict[str, object]) -> list[tuple[str, float | None]]:
    out: list[tuple[str, float | None]] = []
    candidates = breakdown.get("candidates")
    if isinstance(candidates, list):
        for c in candidates:
            if isinstance(c, dict) and isinstance(c.get("worker"), str):
                finish = c.get("expected_finish_s")
                # An unknown finish stays unknown (None), never a sentinel.
                out.append(
                    (c["worker"], round(float(finish), 2) if isinstance(finish, int | float) else None)
                )
    return out


def _others(breakdown: dict[str, object]) -> tuple[int, float | None]:
    """(count, best expected finish) of the candidates a compact breakdown only counts."""
    others = breakdown.get("others")
    if not isinstance(others, dict):
        return 0, None  # an older entry: every candidate is in `candidates`
    count, best = others.get("count"), others.get("best_finish_s")
    return (
        count if isinstance(count, int) else 0,
        round(float(best), 2) if isinstance(best, int | float) else None,
    )


def digest_of_queue(queue: str, keys: Keys) -> str:
    """What a queue's name says of its model: a digest prefix (or `w:NAME` for a pinned queue,
    `bg:NAME` for a worker's background queue of benchmarks)."""
    name = queue.removeprefix(keys.prefix + "q:")
    if name.startswith("{") and "}" in name:
        # A band queue: its hash tag is its model's plain queue.
        name = name[1 : name.index("}")].removeprefix(keys.prefix + "q:")
    return name


class Recent:
    """The newest tasks and incidents, folded from ledger events (loaded from the tail, then fed live)."""

    def __init__(self, keys: Keys, tasks: int = 25, incidents: int = 25) -> None:
        self.keys = keys
        self.max_tasks = tasks
        self.tasks: OrderedDict[str, TaskView] = OrderedDict()
        self.incidents: deque[dict[str, Any]] = deque(maxlen=incidents)
        # What the window says of each worker: the reason of its last WorkerOffline (gone while
        # it is offline), and the tasks it claimed and has not finished.
        self.offline: dict[str, str] = {}
        self.running: dict[str, dict[str, None]] = {}

    def add(self, entry_id: str, event: Event) -> bool:
        """Fold one event; True when it changed what is shown."""
        if isinstance(event, WorkerOnline):
            self.offline.pop(event.worker, None)
            return False
        if isinstance(event, WorkerOffline):
            self.offline[event.worker] = event.reason
            self.running.pop(event.worker, None)
            return False
        if isinstance(event, TaskClaimed):
            # Judged before the claim is counted: what the taker saw of the expected worker.
            view = self.tasks.get(event.task_id)
            if view is not None:
                view.reason = self._why(view, event)
            self._forget_run(event.task_id)
            self.running.setdefault(event.worker, {})[event.task_id] = None
        elif isinstance(event, _RUN_ENDS):
            self._forget_run(event.task_id)
        incident = False
        if isinstance(event, TaskReclaimed | TaskStalled | TaskDeadLettered):
            self.incidents.append(self._incident(entry_id, event))
            incident = True
        if isinstance(event, TaskSubmitted) and event.task_id not in self.tasks:
            view = TaskView(
                task_id=event.task_id,
                model=event.model,
                digest=event.digest,
                domain=event.domain,
                submitted_at=event.at,
                entry_id=entry_id,
            )
            view.fold(event)
            self.tasks[event.task_id] = view
            while len(self.tasks) > self.max_tasks:
                self._evict()
            return True
        task_id = getattr(event, "task_id", None)
        found = self.tasks.get(task_id) if isinstance(task_id, str) else None
        if found is None:
            return incident
        found.fold(event)
        return True

    def _evict(self) -> None:
        """Drop the oldest finished task; the oldest of all when none has finished. A task still
        running stays while it can: a busy slot on the page names it, and so must a task row."""
        for task_id, view in self.tasks.items():
            if view.status in TERMINAL_RANK:
                del self.tasks[task_id]
                return
        self.tasks.popitem(last=False)

    def _forget_run(self, task_id: str) -> None:
        for runs in self.running.values():
            runs.pop(task_id, None)

    def _why(self, view: TaskView, claim: TaskClaimed) -> str | None:
        """Why `claim`'s worker took a task the router expected elsewhere, from what the ledger
        says had happened by then; None when the expected worker took it (or none was expected)."""
        expected, taker = view.expected_worker, claim.worker
        if expected is None or expected == taker:
            return None
        if view.setback is not None:
            return f"re-queued after {view.setback}; {taker} took attempt {claim.attempt}"
        handed = self.keys.pinned_worker(view.routed_queue)
        if handed is not None and claim.queue != view.routed_queue:
            return (
                f"handed off to {handed}, who did not take it in time; {taker} took it from the shared queue"
            )
        if self.keys.pinned_worker(claim.queue) == taker:
            return f"pinned to {taker}"
        if expected in self.offline:
            return f"{expected} was offline ({self.offline[expected]}); {taker} took it"
        busy = list(self.running.get(expected, {}))
        if busy:
            shown = ", ".join(t[:8] for t in busy[:3]) + (" …" if len(busy) > 3 else "")
            return f"{expected} was busy (running {shown}); {taker} had a free slot first"
        return f"{taker} took it from the shared queue before {expected} did"

    def _incident(
        self, entry_id: str, event: TaskReclaimed | TaskStalled | TaskDeadLettered
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": entry_id,
            "type": type(event).__name__,
            "at": event.at,
            "task_id": event.task_id,
            "digest": digest_of_queue(event.queue, self.keys),
        }
        if isinstance(event, TaskReclaimed):
            out["detail"] = (
                f"owner {event.owner} gone; attempt {event.attempt} (idle {event.idle_ms / 1000:.1f}s)"
            )
            out["worker"] = event.owner
        elif isinstance(event, TaskStalled):
            out["detail"] = f"nobody took it for {event.waited_ms / 1000:.1f}s"
        else:
            out["detail"] = f"{event.reason} after {event.attempts} attempt(s)"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "tasks": [t.to_dict() for t in reversed(self.tasks.values())],
            "incidents": list(reversed(self.incidents)),
        }


async def load_recent(redis: aioredis.Redis, keys: Keys, window: int = RECENT_WINDOW) -> tuple[Recent, str]:
    """Recent tasks and incidents from the newest `window` ledger entries, and the newest id read."""
    reply: Any = await redis.xrevrange(keys.events, "+", "-", count=window)
    rows: list[RawEntry] = [(row[0].decode(), row[1]) for row in wire_rows(reply)]
    last = rows[0][0] if rows else "0-0"
    rows.reverse()
    recent = Recent(keys)
    for entry_id, event in decode_rows(wanted(rows, TASK_TYPES), lambda exc: None):
        recent.add(entry_id, event)
    return recent, last
