"""Whether a run loaded its model: the worker's judgement, and what the fold and the plan make of it."""

from __future__ import annotations

import msgspec
import redis.asyncio as aioredis

from dispatch.submit import submit_task
from dispatch.view import worker_views
from events.event import ModelEntry, TaskCompleted, Timings, now_ms
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from projections.reader import snapshot
from router.estimate import build_estimator
from router.plan import BacklogEntry, FleetView, plan_state
from sim.backends.hosts import SimHosts
from sim.fleetspec import parse_fleet
from tasks.lease import live_workers
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import MODEL_DIGEST, TEST_FLEET, events_of, fast_config, running_agent, wait_until
from workers.backend import Inventory
from workers.warmth import Warmth

# The test fleet's machine `a`, with a model that takes 2 simulated seconds to load and warm calls
# that report 4 ms of "load" as real Ollama does; `b` is a server that sends no `usage`.
FLEET = TEST_FLEET.replace(
    """name = "a"
slots = 1
[worker.models."m"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 0.0""",
    """name = "a"
slots = 1
warm_load_ms = 4.0
[worker.models."m"]
decode_tps = 200.0
prompt_tps = 5000.0
load_s = 2.0""",
).replace(
    """name = "b"
slots = 1""",
    """name = "b"
slots = 1
openai_usage = false""",
)

LISTED = Inventory(models=[ModelEntry(name="m", digest=MODEL_DIGEST)], loaded=[MODEL_DIGEST])
NOTHING_LOADED = Inventory(models=[ModelEntry(name="m", digest=MODEL_DIGEST)], loaded=[])
UNKNOWN = Inventory(models=[ModelEntry(name="m", digest=MODEL_DIGEST)], loaded=[], loaded_known=False)


def _first_token(prompt_tokens: int, seconds: float) -> Timings:
    return Timings(prompt_eval_count=prompt_tokens, prompt_eval_duration=round(seconds * 1e9))


def test_a_run_is_cold_only_when_the_model_was_neither_listed_nor_run_since_the_list() -> None:
    warmth = Warmth()
    assert warmth.before(MODEL_DIGEST, LISTED) is False
    assert warmth.before(MODEL_DIGEST, NOTHING_LOADED) is True
    warmth.after(MODEL_DIGEST, True, Timings(), alone=True)
    # The list predates the run that loaded it: the next run is warm all the same.
    assert warmth.before(MODEL_DIGEST, NOTHING_LOADED) is False
    warmth.listed()
    assert warmth.before(MODEL_DIGEST, NOTHING_LOADED) is True


def test_a_backend_that_cannot_list_is_judged_by_its_first_token_and_the_load_leaves_the_prompt_time() -> (
    None
):
    warmth = Warmth()
    assert warmth.before(MODEL_DIGEST, UNKNOWN) is None
    # The first run only gives the prompt speed: 100 tokens in 0.1 s.
    assert warmth.after(MODEL_DIGEST, None, _first_token(100, 0.1), alone=True)[0] is None
    cold, timings = warmth.after(MODEL_DIGEST, None, _first_token(100, 6.1), alone=True)
    assert cold is True
    assert timings.load_duration is not None and abs(timings.load_duration / 1e9 - 6.0) < 1e-6
    assert timings.prompt_eval_duration is not None and abs(timings.prompt_eval_duration / 1e9 - 0.1) < 1e-6
    assert warmth.after(MODEL_DIGEST, None, _first_token(100, 0.3), alone=True) == (
        False,
        _first_token(100, 0.3),
    )
    # Sharing the machine slows a first token as much as a load: such a run is not judged.
    assert warmth.after(MODEL_DIGEST, None, _first_token(100, 6.1), alone=False)[0] is None


async def _submit(queues: TaskStore, max_tokens: int = 40) -> None:
    # 40 tokens: the test fleet's whole answer, and long enough to be a speed sample
    # (projections.folder.MIN_DECODE_TOKENS).
    await submit_task(
        queues, TaskMessage(model="m", messages=[Message(role="user", content="hi")], max_tokens=max_tokens)
    )


async def _done(ledger: Ledger, n: int) -> list[TaskCompleted]:
    return [e for e in await events_of(ledger, TaskCompleted) if not e.duplicate][:n]


async def _run_tasks(redis: aioredis.Redis, ledger: Ledger, n: int) -> list[TaskCompleted]:
    """Submit `n` tasks one after another (each waits for the last), then fold the ledger."""
    queues = TaskStore(redis, Keys(), ledger)
    for i in range(n):
        await _submit(queues)

        async def finished(k: int = i + 1) -> bool:
            return len(await _done(ledger, k)) >= k

        await wait_until(finished)
    projector = Projector(redis, Keys())
    await projector.start()
    await projector.catch_up()
    return await _done(ledger, n)


async def test_warm_ollama_runs_never_move_the_load_estimate(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with (
        SimHosts(parse_fleet(FLEET, "warmth.toml"), time_scale=0.01, seed=1) as hosts,
        running_agent(redis_client, hosts.url("a"), fast_config("a")),
    ):
        done = await _run_tasks(redis_client, ledger, 5)
    # Every warm call reported its few milliseconds of load_duration, as Ollama does.
    assert [e.cold for e in done] == [True, False, False, False, False]
    assert all(e.timings.load_duration for e in done)
    snap = await snapshot(redis_client, Keys())
    load = snap.speed["a", MODEL_DIGEST].load_s
    assert load.n == 1 and load.mean is not None and abs(load.mean - 2.0) < 1e-6
    assert snap.speed["a", MODEL_DIGEST].decode_tps.n == 5


async def test_an_openai_compatible_backend_is_not_charged_a_load_it_never_showed(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with (
        SimHosts(parse_fleet(TEST_FLEET, "test.toml"), time_scale=1.0, seed=1) as hosts,
        running_agent(redis_client, hosts.url("a"), fast_config("a"), kind="openai") as agent,
    ):
        await _run_tasks(redis_client, ledger, 3)
        digest = agent.serving()[0].digest
        leases = await live_workers(redis_client, Keys())
    snap = await snapshot(redis_client, Keys())
    views = worker_views(leases)
    assert views[0].loaded_known is False and views[0].loaded == set()
    est = build_estimator(snap, now_ms())
    entry = BacklogEntry(task_id="x", digest=digest, enqueued_at_ms=now_ms())
    _, state = plan_state(FleetView(workers=views), est, digest, now_ms(), backlog=[entry])
    assert state is not None and state.load_left == [0.0]
    assert est.unknown_load("a", digest).source == "loaded state unknown, no load seen"
    # A backend that cannot list loads is still charged what its own runs have shown.
    row = snap.speed["a", digest]
    row.load_s = msgspec.structs.replace(row.load_s, n=1, sum=4.0, dn=1.0, dsum=4.0, updated_at=now_ms())
    shown = build_estimator(snap, now_ms()).unknown_load("a", digest)
    assert 0.0 < shown.value < 4.0 and "of runs loaded" in shown.source


async def test_a_server_sending_no_usage_yields_decode_samples_from_counted_tokens_marked_as_such(
    redis_client: aioredis.Redis, ledger: Ledger
) -> None:
    async with (
        SimHosts(parse_fleet(FLEET, "warmth.toml"), time_scale=1.0, seed=1) as hosts,
        running_agent(redis_client, hosts.url("b"), fast_config("b"), kind="openai") as agent,
    ):
        done = await _run_tasks(redis_client, ledger, 3)
        digest = agent.serving()[0].digest
    assert {e.timings.counted for e in done} == {"stream"}
    assert {e.timings.eval_count for e in done} == {40}
    snap = await snapshot(redis_client, Keys())
    row = snap.speed["b", digest]
    assert row.decode_tps.n == 3 and row.counted_n == 3
    decode = build_estimator(snap, now_ms()).speed("b", digest).decode_tps
    assert decode.n == 3 and "3 of n counted from the stream" in decode.source
