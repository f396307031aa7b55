"""The worker agent against simulated backends and a real Redis."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
import redis.asyncio as aioredis

from dispatch.submit import submit_task
from events.event import TaskClaimed, TaskCompleted, TaskDeadLettered, TaskFailed, TaskReclaimed
from events.keys import Keys
from events.ledger import Ledger
from sim.backends.hosts import SimHosts
from sim.fleetspec import load_fleet
from tasks.payload import Message, Result, TaskMessage, chunk_decoder, result_decoder
from tasks.store import TaskStore, parse_entry
from tests.helpers import (
    MODEL_DIGEST,
    SteppedLedgerClock,
    events_of,
    fast_config,
    make_test_fleet,
    running_agent,
    running_reaper,
    wait_until,
    worker_process,
)
from workers.admission import Admission, Applicant, Gate, PlainPull, RouterGate
from workers.agent import WorkerAgent
from workers.backend import OllamaBackend
from workers.reaper import Reaper, ReaperConfig
from workers.runs import Running

pytestmark = pytest.mark.cluster_tier


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=1.0, seed=3) as sim:
        yield sim


async def submit(queues: TaskStore, model: str = "m", max_tokens: int | None = None, text: str = "hi") -> str:
    task = (
        await submit_task(
            queues,
            TaskMessage(model=model, messages=[Message(role="user", content=text)], max_tokens=max_tokens),
        )
    ).task
    return task.task_id


async def completed(ledger: Ledger, n: int) -> bool:
    done = [e for e in await events_of(ledger, TaskCompleted) if not e.duplicate]
    return len(done) >= n


async def test_a_worker_without_the_model_never_receives_its_task(
    redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts
) -> None:
    queues = TaskStore(redis_client, Keys.for_client(redis_client), ledger)
    async with (
        running_agent(redis_client, hosts.url("a"), fast_config("a")),
        running_agent(redis_client, hosts.url("c"), fast_config("c")),
    ):
        ids = [await submit(queues) for _ in range(6)]
        await wait_until(lambda: completed(ledger, 6))
    claims = await events_of(ledger, TaskClaimed)
    assert {c.task_id for c in claims} == set(ids)
    assert {c.worker for c in claims} == {"a"}
    consumers = await redis_client.xinfo_consumers(
        Keys.for_client(redis_client).queue(make_test_fleet().model["m"].digest), "workers"
    )
    assert [c["name"] for c in consumers] == [b"a"]


async def test_tasks_for_a_model_two_workers_hold_are_served_by_both_when_both_are_free(
    redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts
) -> None:
    queues = TaskStore(redis_client, Keys.for_client(redis_client), ledger)
    async with (
        running_agent(redis_client, hosts.url("a"), fast_config("a")),
        running_agent(redis_client, hosts.url("b"), fast_config("b")),
    ):
        for _ in range(8):
            await submit(queues, max_tokens=80)  # 0.4 s each: both workers are needed
        await wait_until(lambda: completed(ledger, 8))
    done = [e for e in await events_of(ledger, TaskCompleted) if not e.duplicate]
    assert len(done) == 8
    assert {e.worker for e in done} == {"a", "b"}
    timings = done[0].timings
    assert timings.eval_count is not None and timings.eval_duration is not None and timings.eval_duration > 0


async def test_submitting_a_model_no_live_worker_serves_fails_at_once_naming_what_is_served(
    redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts
) -> None:
    from dispatch.errors import ModelNotServedError

    queues = TaskStore(redis_client, Keys.for_client(redis_client), ledger)
    async with running_agent(redis_client, hosts.url("c"), fast_config("c")):
        with pytest.raises(ModelNotServedError) as info:
            await submit(queues, model="m")
    assert "'m'" in str(info.value) and "c serves other:latest" in str(info.value)
    assert await ledger.length() > 0  # c's own events, and nothing about the refused task
    assert not [e async for _, e in ledger.read() if type(e).__name__ == "TaskSubmitted"]


async def test_a_worker_killed_mid_generation_has_its_task_completed_by_the_other_once(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts
) -> None:
    queues = TaskStore(redis_client, Keys.for_client(redis_client), ledger)
    procs = {name: worker_process(redis_url, hosts.url(name), name) for name in ("a", "b")}
    try:
        await wait_until(lambda: _both_live(redis_client), timeout=30)
        async with running_reaper(redis_client, lease_ms=1500):
            task_id = await submit(queues, max_tokens=200)  # 1 s of generation
            await wait_until(lambda: _has_output(redis_client, task_id), timeout=15, every=0.01)
            claim = next(c for c in await events_of(ledger, TaskClaimed) if c.task_id == task_id)
            victim = procs[claim.worker]
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            await wait_until(lambda: _completed_task(ledger, task_id), timeout=20)
            took = time.monotonic() - killed_at
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.wait(30)
    done = [e for e in await events_of(ledger, TaskCompleted) if e.task_id == task_id]
    assert [e.duplicate for e in done] == [False]
    assert done[0].worker != claim.worker and done[0].attempt == 2
    reclaims = await events_of(ledger, TaskReclaimed)
    assert [(r.task_id, r.owner) for r in reclaims] == [(task_id, claim.worker)]
    # Lease (1.5 s) + 2 s, plus the 1 s re-run itself.
    assert took < 1.5 + 2.0 + 1.0 + 1.0, f"took {took:.1f}s"
    result = result_decoder.decode(
        await redis_client.hget(Keys.for_client(redis_client).result(task_id), "result")
    )
    assert result.status == "completed" and result.worker == done[0].worker


async def _completed_task(ledger: Ledger, task_id: str) -> bool:
    return any(e.task_id == task_id for e in await events_of(ledger, TaskCompleted))


async def _both_live(redis: aioredis.Redis) -> bool:
    return bool(await redis.exists(Keys.for_client(redis).live("a"))) and bool(
        await redis.exists(Keys.for_client(redis).live("b"))
    )


async def _has_output(redis: aioredis.Redis, task_id: str) -> bool:
    return bool(await redis.exists(Keys.for_client(redis).out(task_id)))


async def test_an_entry_no_worker_took_is_never_reclaimed_and_is_reported_stalled_once(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    from events.event import TaskStalled
    from tasks.payload import TaskMessage

    queues = TaskStore(redis_client, Keys.for_client(redis_client), ledger)
    queue = Keys.for_client(redis_client).queue("f" * 64)
    await queues.enqueue(queue, TaskMessage(task_id="orphan", model="x", digest="f" * 64))
    clock = await SteppedLedgerClock(redis_client).start()
    config = ReaperConfig(lease_ms=200, stall_after_s=1.0)
    reaper = Reaper(redis_client, Keys.for_client(redis_client), config, clock=clock)
    # More than ten lease periods, swept every 100 ms as `running_reaper` sweeps, on a clock the
    # test steps: the entry is stalled from the eleventh sweep on, and reported once.
    sweeps = [await reaper.sweep()]
    for _ in range(25):
        clock.advance(100)
        sweeps.append(await reaper.sweep())
    assert [s.stalled for s in sweeps].count(1) == 1 and sum(s.stalled for s in sweeps) == 1
    assert all(s.reclaimed == 0 and s.dead_lettered == 0 for s in sweeps)
    rows = await redis_client.xrange(queue)
    assert len(rows) == 1 and rows[0][1][b"attempt"] == b"1"
    assert await events_of(ledger, TaskReclaimed) == []
    stalls = await events_of(ledger, TaskStalled)
    assert [(s.task_id, s.queue) for s in stalls] == [("orphan", queue)]


async def test_a_live_worker_running_a_task_five_times_longer_than_its_lease_is_never_reaped(
    redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts
) -> None:
    queues = TaskStore(redis_client, Keys.for_client(redis_client), ledger)
    config = fast_config("a", lease_ms=600, heartbeat_ms=150)
    async with (
        running_reaper(redis_client, lease_ms=600),
        running_agent(redis_client, hosts.url("a"), config),
    ):
        await submit(queues, max_tokens=700)  # 3.5 s of generation: about 6 leases
        await wait_until(lambda: completed(ledger, 1), timeout=30)
    assert await events_of(ledger, TaskReclaimed) == []
    done = await events_of(ledger, TaskCompleted)
    assert [(e.worker, e.attempt, e.duplicate) for e in done] == [("a", 1, False)]


@pytest.mark.parametrize(
    ("fault", "kind"),
    [("error_rate", "http_5xx"), ("hang_rate", "timeout"), ("disconnect_rate", "disconnect")],
)
async def test_a_backend_fault_fails_the_run_with_its_kind_and_the_task_runs_elsewhere(
    redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts, fault: str, kind: str
) -> None:
    queues = TaskStore(redis_client, Keys.for_client(redis_client), ledger)
    hosts.set_faults("a", **{fault: 1.0})
    async with running_agent(redis_client, hosts.url("a"), fast_config("a"), idle_timeout_s=1.0):
        task_id = await submit(queues, max_tokens=60)
        await wait_until(lambda: _failed(ledger, task_id), timeout=20)
        async with running_agent(redis_client, hosts.url("b"), fast_config("b")):
            await wait_until(lambda: completed(ledger, 1), timeout=20)
    failures = [f for f in await events_of(ledger, TaskFailed) if f.task_id == task_id]
    assert failures and {f.kind for f in failures} == {kind} and {f.worker for f in failures} == {"a"}
    assert all(f.retryable for f in failures)
    done = [e for e in await events_of(ledger, TaskCompleted) if e.task_id == task_id]
    assert [(e.worker, e.duplicate) for e in done] == [("b", False)]


async def _failed(ledger: Ledger, task_id: str) -> bool:
    return any(f.task_id == task_id for f in await events_of(ledger, TaskFailed))


async def test_past_the_delivery_limit_a_failing_task_is_dead_lettered_with_the_reason(
    redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts
) -> None:
    queues = TaskStore(redis_client, Keys.for_client(redis_client), ledger)
    hosts.set_faults("a", error_rate=1.0)
    async with running_agent(
        redis_client, hosts.url("a"), fast_config("a", cooldown_s=0.05, delivery_limit=3)
    ):
        task_id = await submit(queues)
        await wait_until(lambda: _dead(ledger, task_id), timeout=30)
    dead = [d for d in await events_of(ledger, TaskDeadLettered) if d.task_id == task_id]
    assert len(dead) == 1 and dead[0].attempts == 3 and "delivery limit 3" in dead[0].reason
    assert "http_5xx" in dead[0].reason
    assert len([f for f in await events_of(ledger, TaskFailed) if f.task_id == task_id]) == 3
    letters = await redis_client.xrange(Keys.for_client(redis_client).dead)
    assert [(row[1][b"id"], b"delivery limit 3" in row[1][b"reason"]) for row in letters] == [
        (task_id.encode(), True)
    ]
    queue = Keys.for_client(redis_client).queue(make_test_fleet().model["m"].digest)
    assert await redis_client.xlen(queue) == 0
    result = result_decoder.decode(
        await redis_client.hget(Keys.for_client(redis_client).result(task_id), "result")
    )
    assert result.status == "dead"


async def _dead(ledger: Ledger, task_id: str) -> bool:
    return any(d.task_id == task_id for d in await events_of(ledger, TaskDeadLettered))


async def test_sigterm_drains_without_losing_or_repeating_a_task(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts
) -> None:
    queues = TaskStore(redis_client, Keys.for_client(redis_client), ledger)
    proc = worker_process(redis_url, hosts.url("a"), "a")
    try:
        await wait_until(
            lambda: redis_exists_key(redis_client, Keys.for_client(redis_client).live("a")), timeout=30
        )
        ids = [await submit(queues, max_tokens=120) for _ in range(4)]  # 0.6 s each
        await wait_until(lambda: _claimed(ledger, 1), timeout=15)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0
    async with running_agent(redis_client, hosts.url("b"), fast_config("b")):
        await wait_until(lambda: completed(ledger, 4), timeout=30)
    done = list(await events_of(ledger, TaskCompleted))
    assert sorted(e.task_id for e in done) == sorted(ids)
    assert not any(e.duplicate for e in done)
    assert "a" in {e.worker for e in done}


async def redis_exists_key(redis: aioredis.Redis, key: str) -> bool:
    return bool(await redis.exists(key))


async def _claimed(ledger: Ledger, n: int) -> bool:
    return len(await events_of(ledger, TaskClaimed)) >= n


async def test_the_seed_fleet_completes_three_qwen_tasks_and_the_ledger_says_who_ran_each(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    queues = TaskStore(redis_client, Keys.for_client(redis_client), ledger)
    async with SimHosts(load_fleet("seed"), time_scale=0.05, seed=11) as sim:
        async with (
            running_agent(redis_client, sim.url("macbookair"), fast_config("macbookair")),
            running_agent(redis_client, sim.url("rtx3070ti"), fast_config("rtx3070ti")),
            running_agent(redis_client, sim.url("ai-core"), fast_config("ai-core", serves=[])),
        ):
            ids = [await submit(queues, model="qwen3:8b", max_tokens=64) for _ in range(3)]
            await wait_until(lambda: completed(ledger, 3), timeout=60)
    done = {e.task_id: e for e in await events_of(ledger, TaskCompleted)}
    assert set(done) == set(ids)
    for event in done.values():
        assert event.worker in ("macbookair", "rtx3070ti")
        t = event.timings
        assert t.eval_count == 64 and t.eval_duration and t.prompt_eval_count and t.total_duration
        tps = t.eval_count / (t.eval_duration / 1e9)
        assert tps == pytest.approx(11.4 if event.worker == "macbookair" else 83.0, rel=0.05)
    assert not [c for c in await events_of(ledger, TaskClaimed) if c.worker == "ai-core"]


async def test_the_heartbeat_never_reports_lost_a_run_that_acknowledged_its_entry_meanwhile(
    redis_client: aioredis.Redis, ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """The false alarm: a run that finished (entry acknowledged and deleted) between the heartbeat's
    list of running entries and its XCLAIM is not "no longer ours"; an entry really taken back is."""
    keys = Keys.for_client(redis_client)
    queues = TaskStore(redis_client, keys, ledger)
    digest = "cd" * 32
    queue = keys.queue(digest)
    for n in (1, 2):
        await submit_task(
            queues, TaskMessage(model="m", messages=[Message(role="user", content=f"{n}")]), digest=digest
        )
    agent = WorkerAgent(redis_client, keys, OllamaBackend("http://127.0.0.1:9"), fast_config("w"))
    closing_entry = await queues.take(queue, "w")
    lost_entry = await queues.take(queue, "w")
    # Two runs as the agent keeps them (their generation is not what this test is about).
    for taken in (closing_entry, lost_entry):
        entry = parse_entry(queue, taken.entry_id, taken.fields, taken.attempt)
        agent.running[taken.entry_id] = Running(entry=entry, started=time.monotonic())
    closing, lost = agent.running[closing_entry.entry_id], agent.running[lost_entry.entry_id]
    # One run closes: its entry is acknowledged and deleted as the heartbeat looks.
    closing.closing = True
    assert await queues.finish(queue, closing_entry.entry_id, "w") == 1
    # The other's entry is taken back by the reaper.
    await queues.requeue(queue, lost_entry.entry_id, delivery_limit=3, owner="w", attempt=1)
    with caplog.at_level("WARNING", logger="routeledger.worker"):
        await agent.heartbeat.keep_entries_alive()
    warned = [r.getMessage() for r in caplog.records if "no longer ours" in r.getMessage()]
    assert (closing.lost, lost.lost) == (False, True)
    assert len(warned) == 1 and lost_entry.entry_id in warned[0]


async def test_a_task_cancelled_before_its_claim_returns_stops_at_its_first_token_with_nothing_written(
    redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts
) -> None:
    # The claim's round trip (with its cancel check) is on its way while the backend is asked:
    # a cancel already there when the worker takes the task must still keep every word of it out.
    keys = Keys.for_client(redis_client)
    queues = TaskStore(redis_client, keys, ledger)
    task_id = "cancelled-before-its-claim"
    await redis_client.set(keys.cancel(task_id), b"1")
    # Streamed: its first token would be written at once, were the claim not settled first.
    request = TaskMessage(
        model="m", messages=[Message(role="user", content="a long answer")], max_tokens=400, task_id=task_id
    )
    await submit_task(queues, request, digest=make_test_fleet().model["m"].digest)
    # At a hundredth of its speed the machine would take 200 s over the answer, and 0.2 s over
    # its first token: the cancel is seen well before the wait below gives up.
    async with httpx.AsyncClient() as http:
        await http.post(hosts.url("a") + "/sim/speed", json={"factor": 0.01})
    async with running_agent(redis_client, hosts.url("a"), fast_config("a")):

        async def failed() -> bool:
            return any(e.task_id == task_id for e in await events_of(ledger, TaskFailed))

        await wait_until(failed, timeout=20)
    [failure] = [e for e in await events_of(ledger, TaskFailed) if e.task_id == task_id]
    assert failure.kind == "cancelled"
    assert task_id in {e.task_id for e in await events_of(ledger, TaskClaimed)}
    assert task_id not in {e.task_id for e in await events_of(ledger, TaskCompleted)}
    raw = await redis_client.hget(keys.result(task_id), "result")
    assert raw is not None and result_decoder.decode(raw).status == "cancelled"
    # The output holds its closing chunk only: no text of the run reached it.
    chunks = [chunk_decoder.decode(f[b"c"]) for _, f in await redis_client.xrange(keys.out(task_id))]
    assert chunks and chunks[-1].done
    assert "".join(c.text for c in chunks) == ""


async def test_a_task_nobody_streams_writes_its_whole_text_in_its_done_chunk_alone(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    # Its reader then wakes once, for the chunk that also carries the result.
    keys = Keys.for_client(redis_client)
    queues = TaskStore(redis_client, keys, ledger)
    async with SimHosts(make_test_fleet(), time_scale=0.0, seed=3) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a")):
            request = TaskMessage(
                model="m", messages=[Message(role="user", content="hi")], max_tokens=8, stream=False
            )
            task_id = (await submit_task(queues, request)).task.task_id
            await wait_until(lambda: completed(ledger, 1), timeout=20)
    [(_, fields)] = await redis_client.xrange(keys.out(task_id))
    chunk = chunk_decoder.decode(fields[b"c"])
    result = result_decoder.decode(fields[b"r"])
    assert chunk.done and chunk.text and chunk.text == result.text


async def test_a_result_stored_by_a_run_that_died_before_counting_it_is_counted_once_by_the_next_run(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    keys = Keys.for_client(redis_client)
    queues = TaskStore(redis_client, keys, ledger)
    request = TaskMessage(model="m", messages=[Message(role="user", content="hi")], max_tokens=8)
    task_id = (await submit_task(queues, request, digest=MODEL_DIGEST)).task.task_id
    # A run stored the task's result and died before appending its TaskCompleted (the entry stays).
    first = Result(task_id=task_id, status="completed", worker="a", attempt=1, text="first", run="r0")
    assert await queues.close_run(first)
    async with SimHosts(make_test_fleet(), time_scale=0.0, seed=3) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a")):
            await wait_until(lambda: _completed_task(ledger, task_id), timeout=20)
    # The next run finds the result unlogged and takes the ledger record over: one counting
    # completion, and the first run's result stays the task's.
    done = [e for e in await events_of(ledger, TaskCompleted) if e.task_id == task_id]
    assert [e.duplicate for e in done] == [False]
    stored = await redis_client.hgetall(keys.result(task_id))
    assert (stored[b"taken"], stored[b"logged"]) == (b"1", b"1")
    assert result_decoder.decode(stored[b"result"]).text == "first"


class _CountingGate:
    """A gate that records when the worker asks it, and whether it admitted anything."""

    def __init__(self, gate: Gate) -> None:
        self.gate, self.asks = gate, list[tuple[float, bool]]()

    async def admit(self, agent: Applicant, queues: Sequence[str]) -> Admission:
        admission = await self.gate.admit(agent, queues)
        self.asks.append((time.monotonic(), admission.queue is not None))
        return admission

    def idle_asks_soon_after_a_take(self, within_s: float) -> int:
        """Asks that found nothing to take within `within_s` of one that did."""
        takes = [at for at, took in self.asks if took]
        return sum(1 for at, took in self.asks if not took and any(0 <= at - t < within_s for t in takes))


@pytest.mark.parametrize(("kind", "slots"), [("plain", 1), ("router", 4)])
async def test_a_worker_that_took_the_only_waiting_task_waits_without_asking_its_gate_again(
    redis_client: aioredis.Redis, ledger: Ledger, hosts: SimHosts, kind: str, slots: int
) -> None:
    keys = Keys.for_client(redis_client)
    queues = TaskStore(redis_client, keys, ledger)
    inner: Gate = PlainPull(redis_client, keys) if kind == "plain" else RouterGate(redis_client, keys)
    gate = _CountingGate(inner)
    # An idle worker asks again every block_ms; an ask that follows a take sooner than half of it
    # was made because of the take.
    config = fast_config("a", block_ms=3_000, slots=slots)
    async with running_agent(redis_client, hosts.url("a"), config, gate=gate):
        await wait_until(lambda: _asked(gate))
        for n in range(1, 4):
            await submit(queues, max_tokens=4)
            await wait_until(lambda n=n: completed(ledger, n), timeout=5)
        # Tasks queued while the worker takes another (after its gate looked) are taken at once,
        # not after a block_ms.
        for n in range(5, 15, 2):
            started = time.monotonic()
            await asyncio.gather(submit(queues, max_tokens=4), submit(queues, max_tokens=4))
            await wait_until(lambda n=n: completed(ledger, n), timeout=5)
            assert time.monotonic() - started < 2.5
    assert sum(took for _, took in gate.asks) == 13
    assert gate.idle_asks_soon_after_a_take(1.5) == 0


async def _asked(gate: _CountingGate) -> bool:
    return bool(gate.asks)
