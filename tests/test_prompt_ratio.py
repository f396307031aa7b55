"""A model's prompt bytes per token, learned from its runs' `prompt_eval_count`, and the prompt
estimate a submission makes with it."""

from __future__ import annotations

import redis.asyncio as aioredis

from dispatch.submit import route_and_submit
from dispatch.view import LiveView
from events.event import TaskCompleted, TaskSubmitted, Timings, now_ms
from events.keys import Keys
from events.ledger import Ledger
from projections.reader import snapshot
from router.estimate import build_estimator
from sim.backends.hosts import SimHosts
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from tests.helpers import MODEL_DIGEST, events_of, fast_config, make_test_fleet, running_agent
from tests.test_projector import D1, fold_all
from tests.test_replay import _live_against_rebuild


def _run(
    task: str, prompt_bytes: int | None, tokens: int, at: int, digest: str = D1, **t: int
) -> TaskCompleted:
    """A counted run whose backend read `tokens` prompt tokens of a text of `prompt_bytes` bytes."""
    timings = Timings(prompt_eval_count=tokens, eval_count=20, eval_duration=10**9, **t)
    return TaskCompleted(
        at=at, task_id=task, worker="w1", digest=digest, attempt=1, timings=timings, prompt_bytes=prompt_bytes
    )


def _three_bytes_a_token(at: int, digest: str = D1) -> list[TaskCompleted]:
    """Five runs at 3 bytes a token (a code-heavy tokenizer, not the default 4), and three that
    are no sample: one with images or tools (no text bytes), one with a cached part, one whose
    count is absurd for its text."""
    runs = [_run(f"t{i}", 300 * (i + 1), 100 * (i + 1), at + i, digest) for i in range(5)]
    return [
        *runs,
        _run("img", None, 900, at, digest),
        _run("cached", 3000, 200, at, digest, prompt_eval_cached_count=800),
        _run("absurd", 3000, 1, at, digest),
    ]


async def test_a_models_bytes_per_token_is_learned_from_its_runs_prompt_eval_counts(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    now = now_ms()
    await fold_all(redis_client, keys, _three_bytes_a_token(now - 1000)[:4])
    # Four runs are too few: the default stands.
    assert build_estimator(await snapshot(redis_client, keys), now).bytes_per_token(D1) is None
    await fold_all(redis_client, keys, _three_bytes_a_token(now - 1000)[4:])
    learned = build_estimator(await snapshot(redis_client, keys), now).bytes_per_token(D1)
    assert learned is not None and learned.n == 5
    assert abs(learned.value - 3.0) < 1e-9
    assert learned.source == "learned: 3.00 chars/token from 5 runs"


async def test_a_learned_ratio_is_held_within_its_sane_range(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    now = now_ms()
    # 20 bytes a token is a possible sample (a run's text in a long-token script) but no mean.
    await fold_all(redis_client, keys, [_run(f"t{i}", 2000, 100, now - 1000) for i in range(5)])
    learned = build_estimator(await snapshot(redis_client, keys), now).bytes_per_token(D1)
    assert learned is not None and learned.value == 8.0


async def test_the_live_fold_and_the_rebuild_learn_the_same_bytes_per_token(redis_url: str) -> None:
    events = [*_three_bytes_a_token(1_764_000_000_000), *_three_bytes_a_token(1_764_000_500_000)]
    # Duplicated task ids: only each task's first counted completion is a sample, in both folds.
    await _live_against_rebuild(redis_url, list(events), [(5, "go"), (4, "restart")])


async def test_a_submission_after_learning_counts_its_prompt_at_the_learned_ratio(
    redis_client: aioredis.Redis, keys: Keys, ledger: Ledger
) -> None:
    await fold_all(redis_client, keys, _three_bytes_a_token(now_ms() - 1000, MODEL_DIGEST))
    queues = TaskStore(redis_client, keys, ledger)
    async with SimHosts(make_test_fleet(), time_scale=1.0) as sim:
        async with running_agent(redis_client, sim.url("a"), fast_config("a")):
            req = TaskMessage(model="m", messages=[Message(role="user", content="x" * 600)])
            sub = await route_and_submit(queues, LiveView(redis_client, keys), req)
    assert sub.decision is not None
    best = sub.decision.ranking.candidates[0]
    # 600 bytes at 3 a token (150 at the default 4).
    assert best.terms["prompt_tokens"] == 200.0 and sub.task.prompt_tokens == 200
    assert "learned: 3.00 chars/token from 5 runs" in best.fields["prompt_tokens"].source
    [submitted] = await events_of(ledger, TaskSubmitted)
    assert submitted.prompt_tokens == 200
