"""Conversations go where their cache is, when that pays: a 6-turn chat on the story's two machines,
real worker processes and simulated Ollama hosts that keep each slot's KV cache.

The fleet is the story's (sim/presets/seed.toml: the laptop and the GPU PC, one slot each) with
every speed twenty times higher, so the chat takes seconds: the ratios between the machines, which
decide where a turn goes, are the story's. The hosts run at time scale 1, since the plan reads the
wall clock (a running task's expected end), as in tests/test_one_dispatch.py.

The GPU PC starts busy with another client's long job (a 270,000-token prompt: 6.75 s there). The
chat's first turn cannot wait for it and goes to the laptop, cold. Then:

- priced (the default): turn 2 stays on the laptop, whose slot holds the conversation, because
  there only the new message is evaluated (0.45 s) while the GPU PC is still busy for longer; once
  the GPU PC is free, evaluating the whole conversation there is faster than the laptop's cached
  turn, and the chat moves there and stays (cached again);
- unpriced (`prefix_pricing` off): the plan sees the laptop as cold (4.4 s) and queues turn 2 on
  the busy GPU PC, which it waits for;
- sticky (Olla's rule: the conversation stays on the backend its first turn went to): every turn
  on the laptop, cached but slow to decode.

The total of the six turns' latencies (submission to result) is lowest when priced, and turns 2-6
show the cached tokens in their routing breakdown.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from dispatch.submit import Submitted, route_and_submit, submit_task
from dispatch.view import LiveView
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from projections.reader import snapshot
from sim.backends.hosts import SimHosts
from sim.fleetspec import parse_fleet
from tasks.payload import Message, Result, TaskMessage
from tasks.store import TaskStore
from tests.helpers import wait_until
from tests.reliability.support import spawn_worker, stop_all

QWEN = "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41"
LAPTOP, GPU = "macbookair", "rtx3070ti"
ANSWER_TOKENS = 60
FLEET = f"""
name = "seed-x10"
[model."qwen3:8b"]
digest = "{QWEN}"
output = {{ dist = "fixed", mean = {ANSWER_TOKENS} }}

[[worker]]
name = "{LAPTOP}"
slots = 1
[worker.models."qwen3:8b"]
decode_tps = 228.0
prompt_tps = 2400.0
load_s = 0.4

[[worker]]
name = "{GPU}"
slots = 1
[worker.models."qwen3:8b"]
decode_tps = 1660.0
prompt_tps = 40000.0
load_s = 0.15
"""
TURNS = 6
# The conversation: a 10,000-token document with the first question, then 400 tokens a turn.
DOCUMENT_TOKENS = 10_000
QUESTION_TOKENS = 400
THINK_S = 0.5
# The other client's job on the GPU PC: its prompt takes 6.75 s there, so that the first turn goes
# to the laptop (4.4 s there) and the second comes while the GPU PC is still busy for about 1.5 s:
# about half the laptop's cold estimate, so that the unpriced plan queues it there by a margin.
BACKGROUND_TOKENS = 270_000
# Runs each machine makes before the chats, so that their speeds are known from more than the
# three benchmark samples (which are shrunk toward the fleet's figures, the GPU PC's among them).
# Uncapped: a capped answer would count as a short one in the model's output length.
WARM_UP_RUNS = 8


def _text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of text (the simulator counts 4 bytes a token)."""
    words = ["ledger", "router", "slot", "prompt", "model", "fleet", "turn", "cache", "queue", "worker"]
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


async def _result(redis: aioredis.Redis, keys: Keys, task_id: str, timeout_s: float = 60.0) -> Result:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = await TaskStore(redis, keys).result(task_id)
        if found is not None:
            return found
        await asyncio.sleep(0.005)
    raise AssertionError(f"task {task_id} has no result after {timeout_s} s")


async def _measured(redis: aioredis.Redis) -> bool:
    snap = await snapshot(redis)
    rows = [snap.speed.get((n, QWEN)) for n in (LAPTOP, GPU)]
    return all(r is not None and r.decode_tps.n >= 3 and r.prompt_tps.n >= 3 for r in rows)


async def _idle(redis: aioredis.Redis, keys: Keys) -> bool:
    view = LiveView(redis, keys)
    leases = await view.leases(fresh=True)
    return len(leases) == 2 and all(not info.running for info in leases.values())


async def _chat(
    redis: aioredis.Redis, keys: Keys, queues: TaskStore, mode: str, seed: int
) -> tuple[list[float], list[str], list[Submitted]]:
    """One conversation in `mode` (priced, unpriced, sticky), after the GPU PC was given the long
    job: each turn's latency (s), the worker that answered it, and its submission."""
    rng = random.Random(seed)
    view = LiveView(redis, keys)
    background = TaskMessage(
        model="qwen3:8b", messages=[Message(role="user", content=_text(rng, BACKGROUND_TOKENS))], max_tokens=1
    )
    await submit_task(queues, background, pin=GPU, prefixes=False)
    await asyncio.sleep(0.3)  # the GPU PC has claimed it, and its lease says so
    messages = [Message(role="user", content=_text(rng, DOCUMENT_TOKENS))]
    latencies: list[float] = []
    workers: list[str] = []
    submitted: list[Submitted] = []
    for turn in range(TURNS):
        if turn:
            messages.append(Message(role="user", content=_text(rng, QUESTION_TOKENS)))
        req = TaskMessage(model="qwen3:8b", messages=list(messages), stream=False)
        t0 = time.monotonic()
        if mode == "sticky" and workers:
            sub = await submit_task(queues, req, pin=workers[0], prefixes=False)
        else:
            sub = await route_and_submit(queues, view, req, prefixes=mode == "priced")
        result = await _result(redis, keys, sub.task_id)
        latencies.append(time.monotonic() - t0)
        workers.append(result.worker)
        submitted.append(sub)
        messages.append(Message(role="assistant", content=result.text))
        await asyncio.sleep(THINK_S)
    return latencies, workers, submitted


@pytest.mark.slow
async def test_a_chat_priced_for_its_cache_beats_the_same_chat_unpriced_and_sticky_on_the_story_fleet(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, tmp_path: Path
) -> None:
    fleet = parse_fleet(FLEET, "seed-x10.toml")
    keys = Keys()
    stop = asyncio.Event()
    projector = asyncio.create_task(Projector(redis_client, keys, lease_ms=2000).run(stop))
    log = tmp_path / "workers.log"
    procs = []
    runs: dict[str, tuple[list[float], list[str], list[Submitted]]] = {}
    async with SimHosts(fleet, time_scale=1.0, seed=3) as hosts:
        try:
            for spec in fleet.worker:
                procs.append(spawn_worker(redis_url, hosts.url(spec.name), spec.name, log, bench=True))
            await wait_until(lambda: _measured(redis_client), timeout=60)
            queues = TaskStore(redis_client, keys, ledger)
            rng = random.Random(99)
            warm = [
                await submit_task(
                    queues,
                    TaskMessage(
                        model="qwen3:8b",
                        messages=[Message(role="user", content=_text(rng, 1000))],
                    ),
                    pin=name,
                    prefixes=False,
                )
                for name in (LAPTOP, GPU)
                for _ in range(WARM_UP_RUNS)
            ]
            for sub in warm:
                await _result(redis_client, keys, sub.task_id)
            await asyncio.sleep(2.5)  # the projector folds them, the API's snapshot follows
            # Each mode has a conversation of its own: no cache one leaves helps another.
            for seed, mode in enumerate(("unpriced", "sticky", "priced")):
                await wait_until(lambda: _idle(redis_client, keys), timeout=60)
                runs[mode] = await _chat(redis_client, keys, queues, mode, seed)
        finally:
            stop_all(procs)
            stop.set()
            await asyncio.wait_for(projector, 10)

    totals = {mode: sum(lat) for mode, (lat, _, _) in runs.items()}
    report = {mode: (round(totals[mode], 2), "".join(w[0] for w in runs[mode][1])) for mode in runs}
    print(f"total of turn latencies (s) and where each turn ran: {report}")
    assert runs["priced"][1][0] == LAPTOP, "the first turn should go to the laptop: the GPU PC is busy"
    assert totals["priced"] < totals["unpriced"], report
    assert totals["priced"] < totals["sticky"], report
    # Turns 2-6 were planned with what a slot held: some holder's breakdown counts cached tokens.
    for sub in runs["priced"][2][1:]:
        assert sub.decision is not None
        cached = [c.terms.get("cached_prompt_tokens", 0.0) for c in sub.decision.ranking.candidates]
        assert max(cached) > 0, sub.decision.ranking.candidates
    # Unpriced, no breakdown counts any.
    for sub in runs["unpriced"][2]:
        assert sub.decision is not None
        assert all("cached_prompt_tokens" not in c.terms for c in sub.decision.ranking.candidates)
