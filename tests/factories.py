"""One plausible instance of every event type, for round-trip tests."""

from __future__ import annotations

from events.event import (
    EVENT_TYPES,
    BenchmarkRequested,
    BenchmarkResult,
    Event,
    ModelEntry,
    PipelineChildAdded,
    PipelineCompleted,
    PipelineStarted,
    QualityScored,
    Resources,
    SpeedShiftDetected,
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
    Timings,
    WakeFailed,
    WakeRequested,
    WorkerChanged,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
)

DIGEST = "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41"
AT = 1_764_000_000_000


def one_of_each() -> list[Event]:
    timings = Timings(
        prompt_eval_count=26,
        prompt_eval_duration=130_000_000,
        eval_count=64,
        eval_duration=5_610_000_000,
        load_duration=None,
        total_duration=5_800_000_000,
    )
    inventory = [ModelEntry(name="qwen3:8b", digest=DIGEST, family="qwen3", quantization="Q4_K_M")]
    events: list[Event] = [
        TaskSubmitted(at=AT, task_id="t1", model="qwen3:8b", digest=DIGEST, queue="rl:q:500a1f067a9f"),
        TaskRouted(
            at=AT,
            task_id="t1",
            digest=DIGEST,
            queue="rl:q:500a1f067a9f",
            breakdown={"rtx3070ti": {"decode_tps": 83.0, "source": "worker n=3"}},
        ),
        TaskClaimed(at=AT, task_id="t1", worker="rtx3070ti", digest=DIGEST, attempt=1, in_flight=1),
        TaskCompleted(at=AT, task_id="t1", worker="rtx3070ti", digest=DIGEST, attempt=1, timings=timings),
        TaskFailed(
            at=AT, task_id="t2", worker="macbookair", digest=DIGEST, attempt=1, kind="timeout", retryable=True
        ),
        TaskReclaimed(
            at=AT, task_id="t2", queue="q", old_entry="1-0", new_entry="2-0", owner="macbookair", attempt=2
        ),
        TaskStalled(at=AT, task_id="t3", queue="q", entry_id="3-0", waited_ms=600_000),
        TaskDeadLettered(at=AT, task_id="t2", queue="q", reason="delivery limit 3 reached", attempts=3),
        TaskCancelled(at=AT, task_id="t4", queue="q", was_running=True),
        TaskExpired(
            at=AT, task_id="t6", queue="q", worker="macbookair", deadline=AT - 1000, waited_ms=3_600_000
        ),
        WorkerHeartbeat(
            at=AT,
            worker="macbookair",
            slots=1,
            inventory=inventory,
            loaded=[DIGEST],
            resources=Resources(cpu_percent=None, mem_used_bytes=8 << 30),
        ),
        WorkerOnline(at=AT, worker="rtx3070ti", slots=1, inventory=inventory),
        WorkerChanged(at=AT, worker="rtx3070ti", slots=1, inventory=inventory, loaded=[DIGEST]),
        WorkerOffline(at=AT, worker="ai-core", reason="forgotten"),
        BenchmarkRequested(at=AT, bench_id="b1", worker="rtx3070ti", digest=DIGEST, reason="joined"),
        BenchmarkResult(at=AT, bench_id="b1", worker="rtx3070ti", digest=DIGEST, timings=timings),
        QualityScored(at=AT, digest=DIGEST, domain="japanese", score=0.8, bench_id="b1"),
        PipelineStarted(at=AT, pipeline_id="p1", fan_out=4, capacity=2),
        PipelineChildAdded(at=AT, pipeline_id="p1", task_id="t5"),
        PipelineCompleted(at=AT, pipeline_id="p1", ok=True),
        SpeedShiftDetected(at=AT, worker="rtx3070ti", digest=DIGEST, long_run=83.0, recent=5.0, samples=2),
        WakeRequested(at=AT, worker="rtx3070ti", why="plan", gain_s=420.5, digest=DIGEST, wake_s=90.0),
        WakeFailed(at=AT, worker="rtx3070ti", waited_s=270.0),
    ]
    assert {type(e) for e in events} == set(EVENT_TYPES), "one_of_each must cover every event type"
    return events
