"""Builders of snapshots and fleet views for the router's pure tests."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import strategies as st

from events.event import QualityScored
from projections.folder import Folder
from projections.snapshot import LengthRow, QualityRow, Snapshot, SpeedRow, Stat, fold
from projections.tables import Tables
from router.estimate import Estimator, build_estimator
from router.plan import BacklogEntry, FleetView, RunningTask, WorkerView
from sim.random_fleet import FleetShape

HALF_LIFE_S = 7 * 86_400.0
NOW = 1_764_000_000_000
QWEN = "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41"
ELYZA = "3c1d8f2a6b4e7d9c0a5f1e3b8d6c2a4f9e7b5d3c1a8f6e4d2b0c9a7e5f3d1b8c"


def stat(values: Iterable[float], at_ms: int = NOW) -> Stat:
    """The fold of `values`, all taken at `at_ms`."""
    s = Stat()
    for x in values:
        s = fold(s, x, at_ms, HALF_LIFE_S)
    return s


def speed_row(
    worker: str,
    digest: str,
    decode: float,
    n: int,
    *,
    prompt: float = 1000.0,
    load: float = 4.0,
    at_ms: int = NOW,
) -> SpeedRow:
    return SpeedRow(
        worker=worker,
        digest=digest,
        decode_tps=stat([decode] * n, at_ms),
        prompt_tps=stat([prompt] * n, at_ms),
        load_s=stat([load] * n, at_ms),
    )


def snapshot(
    speeds: Iterable[SpeedRow] = (),
    lengths: dict[tuple[str, str], float] | None = None,
    qualities: dict[tuple[str, str], float] | None = None,
    n: int = 20,
) -> Snapshot:
    snap = Snapshot(half_life_s=HALF_LIFE_S, taken_at=NOW)
    for row in speeds:
        snap.speed[(row.worker, row.digest)] = row
    for (digest, domain), mean in (lengths or {}).items():
        snap.length[(digest, domain)] = LengthRow(
            digest=digest, domain=domain, output_tokens=stat([mean] * n)
        )
    for (digest, domain), q in (qualities or {}).items():
        snap.quality[(digest, domain)] = QualityRow(digest=digest, domain=domain, score=stat([q] * n))
    return snap


def graded(snap: Snapshot, digest: str, domain: str, scores: Iterable[float], at_ms: int = NOW) -> Snapshot:
    """`snap` with the quality row the projector folds from reference grades `scores` of `digest`
    in `domain` (one QualityScored per answer, each on its own prompt, all at `at_ms`)."""
    tables = Tables(half_life_s=snap.half_life_s, quality=snap.quality)
    folder = Folder(tables)
    for i, score in enumerate(scores):
        folder.apply(
            QualityScored(
                at=at_ms,
                digest=digest,
                domain=domain,
                score=score,
                task_id=f"bench-{digest[:8]}-{domain}-{i}",
                bench_id=f"{digest[:8]}-{domain}",
                worker="grader",
                prompt_id=f"{domain}-{i}",
            )
        )
    return snap


def estimator(snap: Snapshot, now_ms: int = NOW) -> Estimator:
    return build_estimator(snap, now_ms)


def worker(name: str, holds: Iterable[str], *, slots: int = 1, loaded: bool = True) -> WorkerView:
    held = set(holds)
    return WorkerView(name=name, slots=slots, holds=held, loaded=set(held) if loaded else set())


def busy(view_worker: WorkerView, digest: str, started_s_ago: float, expected_s: float | None = None) -> None:
    view_worker.running.append(
        RunningTask(
            task_id=f"run-{view_worker.name}-{len(view_worker.running)}",
            digest=digest,
            started_at_ms=NOW - int(started_s_ago * 1000),
            expected_s=expected_s,
        )
    )


def backlog(
    digest: str, n: int, *, prompt_tokens: int = 64, max_tokens: int | None = None
) -> list[BacklogEntry]:
    return [
        BacklogEntry(
            task_id=f"q{i}",
            digest=digest,
            enqueued_at_ms=NOW - (n - i) * 1000,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
        )
        for i in range(n)
    ]


def view(
    workers: list[WorkerView], queues: dict[str, list[BacklogEntry]] | None = None, rate: float = 0.0
) -> FleetView:
    queues = queues or {}
    digests = set(queues) | {d for w in workers for d in w.holds}
    return FleetView(workers=workers, backlog=queues, arrival_rate=dict.fromkeys(digests, rate))


def fleet_shapes(max_workers: int = 40) -> st.SearchStrategy[FleetShape]:
    """Random fleets of every kind the plan meets: one worker or many, one slot or several, models
    loaded or not, idle or running more tasks than slots, measured or on priors (equal speeds: the
    finishes tie), slots that slow each other down, unknown prompt sizes, output caps down to 0 or
    many different ones."""
    return st.builds(
        FleetShape,
        workers=st.integers(1, max_workers),
        models=st.integers(1, 6),
        backlog=st.integers(0, 120),
        held=st.integers(1, 4),
        loaded=st.integers(0, 4),
        slots=st.sampled_from([(1,), (1, 2), (2, 4), (1, 1, 3)]),
        running=st.sampled_from([0.0, 0.5, 1.0]),
        max_running=st.integers(1, 4),
        measured=st.sampled_from([0.0, 0.5, 1.0]),
        sharing=st.sampled_from([0.0, 0.0, 0.5]),
        speed_levels=st.sampled_from([0, 1, 3]),
        unknown_prompts=st.sampled_from([0.0, 0.3]),
        max_tokens=st.sampled_from(
            [(None,), (None, 256, 1024), (0, 1, 50, None), (None, *range(1, 900, 61))]
        ),
    )
