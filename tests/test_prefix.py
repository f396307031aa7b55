"""Prompt prefixes: chains and checkpoints that never claim more than a slot holds, and a plan that
prices what a worker's idle slot holds without pinning a conversation to it."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.prefix import render, render_messages, task_chain
from events.event import Timings
from projections.folder import prompt_tps
from router.choose import RouteQuery, rank_workers
from router.plan import BacklogEntry, FleetView, PlanParams, PlanState, WorkerView, plan_queue
from router.prefix import (
    BLOCK_CHARS,
    PromptChain,
    SlotCache,
    block_hashes,
    cached_tokens,
    chain_of,
    marks_of,
    matched_blocks,
)
from sim.random_fleet import NOW_MS, FleetShape, random_fleet
from tasks.payload import Message, TaskMessage
from tests.router_helpers import NOW, QWEN, busy, estimator, fleet_shapes, snapshot, speed_row, view

# The story's two machines, as far as prompts go: the laptop evaluates about 90 prompt tokens a
# second, the GPU PC about 1,500; the GPU PC also decodes faster.
STORY = {"laptop": (6.0, 90.0), "gpupc": (44.0, 1500.0)}


def _est(speeds: dict[str, tuple[float, float]] = STORY, out: float = 200.0):  # type: ignore[no-untyped-def]
    rows = [speed_row(w, QWEN, d, 30, prompt=p, load=3.0) for w, (d, p) in speeds.items()]
    return estimator(snapshot(rows, {(QWEN, "general"): out}))


def _conversation(turns: int, words: int = 400) -> list[Message]:
    msgs: list[Message] = []
    for t in range(turns):
        msgs.append(Message(role="user", content=f"question {t} " + "lorem ipsum " * words))
        msgs.append(Message(role="assistant", content=f"answer {t} " + "dolor sit " * words))
    return msgs


def _slot_holding(text: str, *, busy_slot: bool = False) -> SlotCache:
    return SlotCache(marks=marks_of(block_hashes(text)), busy=busy_slot, used_ms=NOW)


def _entry(task_id: str, chain: PromptChain, prompt_tokens: int) -> BacklogEntry:
    return BacklogEntry(
        task_id=task_id, digest=QWEN, enqueued_at_ms=NOW - 1000, prompt_tokens=prompt_tokens, prefix=chain
    )


def _holder(name: str, *, slots: int = 1, cache: list[SlotCache] | None = None) -> WorkerView:
    return WorkerView(name=name, slots=slots, holds={QWEN}, loaded={QWEN}, cache=cache or [])


# -- chains and checkpoints ----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    common=st.integers(0, 40 * BLOCK_CHARS),
    tail_a=st.integers(0, 10 * BLOCK_CHARS),
    tail_b=st.integers(1, 10 * BLOCK_CHARS),
)
def test_a_slot_is_never_credited_with_more_of_a_prompt_than_the_two_share(
    common: int, tail_a: int, tail_b: int
) -> None:
    base = ("abcdefghij" * (common // 10 + 1))[:common]
    held = base + "x" * tail_a
    asked = base + "y" * tail_b
    slot = _slot_holding(held)
    matched = matched_blocks(block_hashes(asked), slot)
    shared_blocks = min(common // BLOCK_CHARS, len(held) // BLOCK_CHARS)
    assert matched <= shared_blocks
    # It finds at least the largest checkpoint within what they share: half of it or more.
    assert matched * 2 >= shared_blocks
    # A prompt that extends the slot's whole content (the next turn) matches all of it.
    assert matched_blocks(block_hashes(held + "more text" * 50), slot) == len(held) // BLOCK_CHARS


def test_a_slot_reports_a_few_dozen_checkpoints_for_a_very_long_conversation() -> None:
    marks = marks_of(block_hashes("z" * 200 * BLOCK_CHARS))
    assert [b for b, _ in marks] == [1, 2, 4, 8, 16, 32, 64, 128, 200]


def test_the_next_turn_of_a_chat_extends_the_rendering_of_the_turn_before_with_its_answer() -> None:
    first = _conversation(2)
    reply = "the answer to the last question " * 30
    task = TaskMessage(task_id="t1", model="qwen3:8b", digest=QWEN, messages=first)
    held = render(task, reply)
    assert held is not None
    following = [*first, Message(role="assistant", content=reply), Message(role="user", content="and?")]
    assert render_messages(following).startswith(held)
    nxt = task_chain(TaskMessage(task_id="t2", model="qwen3:8b", digest=QWEN, messages=following))
    assert nxt is not None
    assert cached_tokens(nxt, 3000, [_slot_holding(held)]) > 0
    # A busy slot runs other work: what it held is not there for this task.
    assert cached_tokens(nxt, 3000, [_slot_holding(held, busy_slot=True)]) == 0


def test_embeddings_and_prompts_shorter_than_a_block_carry_no_chain() -> None:
    embed = TaskMessage(task_id="e", model="m", digest=QWEN, kind="embed", inputs=["x" * 5000])
    short = TaskMessage(task_id="s", model="m", digest=QWEN, messages=[Message(role="user", content="hi")])
    assert task_chain(embed) is None
    assert task_chain(short) is None


# -- the plan ------------------------------------------------------------------------------------


def test_a_long_conversation_cached_on_the_laptop_goes_to_the_idle_gpu_pc_that_finishes_it_sooner() -> None:
    text = render_messages(_conversation(6))
    chain = chain_of(text + "next question")
    prompt = 4000
    laptop = _holder("laptop", cache=[_slot_holding(text)])
    gpupc = _holder("gpupc")
    fleet = view([laptop, gpupc])
    est = _est()
    ranking = rank_workers(
        fleet, est, QWEN, NOW, RouteQuery(model="qwen3:8b", prompt_tokens=prompt, prefix=chain)
    )
    by_name = {c.worker: c for c in ranking.candidates}
    # The laptop's slot holds nearly all of it, and the breakdown says so and where from.
    held = by_name["laptop"].terms["cached_prompt_tokens"]
    assert 3500 < held < prompt
    assert "idle slot of laptop" in by_name["laptop"].fields["cached_prompt_tokens"].source
    assert by_name["gpupc"].terms["cached_prompt_tokens"] == 0.0
    assert by_name["laptop"].terms["prompt_s"] == pytest.approx(
        (prompt - held) / est.speed("laptop", QWEN).prompt_tps.value
    )
    # Priced, not pinned: the GPU PC evaluates the whole prompt and still finishes first.
    assert ranking.best.worker == "gpupc"


def test_between_machines_of_equal_speed_the_one_whose_slot_holds_the_conversation_wins() -> None:
    text = render_messages(_conversation(4))
    chain = chain_of(text + "next question")
    equal = {"a": (20.0, 300.0), "b": (20.0, 300.0)}
    a, b = _holder("a"), _holder("b", cache=[_slot_holding(text)])
    est = _est(equal)
    plan = plan_queue(view([a, b], {QWEN: [_entry("t", chain, 2000)]}), est, QWEN, NOW)
    assert [x.worker for x in plan.assignments] == ["b"]
    # Without the chain the first registered wins the tie, as before.
    bare = plan_queue(view([a, b], {QWEN: [_entry("t", PromptChain(), 2000)]}), est, QWEN, NOW)
    assert [x.worker for x in bare.assignments] == ["a"]


def test_a_task_planned_first_on_a_one_slot_worker_takes_the_slot_and_the_hit_is_gone() -> None:
    text = render_messages(_conversation(4))
    chain = chain_of(text + "next question")
    equal = {"a": (20.0, 300.0), "b": (20.0, 300.0)}
    # b's only slot holds the conversation, and b is the only holder: a task queued ahead of the
    # turn takes that slot first, and evicts what it held.
    b = _holder("b", cache=[_slot_holding(text)])
    state = PlanState([b], _est(equal), QWEN, NOW, PlanParams())
    assert state.cached(chain, 2000)
    other = _entry("other", chain_of("unrelated " * 100), 2000)
    state.walk([other])
    assert state.cached(chain, 2000) == {}
    # On two idle slots, the other task takes the other slot and the hit stays.
    b2 = _holder("b", slots=2, cache=[_slot_holding(text), SlotCache()])
    state2 = PlanState([b2], _est(equal), QWEN, NOW, PlanParams())
    state2.walk([other])
    assert state2.cached(chain, 2000)


def test_a_worker_whose_slots_all_run_other_work_is_credited_nothing() -> None:
    text = render_messages(_conversation(4))
    chain = chain_of(text + "next question")
    b = _holder("b", cache=[_slot_holding(text, busy_slot=True)])
    busy(b, QWEN, started_s_ago=1.0)
    state = PlanState([b], _est({"b": (20.0, 300.0)}), QWEN, NOW, PlanParams())
    assert state.cached(chain, 2000) == {}


def test_caches_that_hold_nothing_of_the_queue_leave_the_plan_as_it_was() -> None:
    est = _est({"a": (20.0, 300.0), "b": (11.0, 700.0), "c": (30.0, 150.0)})
    queue = [
        _entry(f"t{i}", chain_of(f"conversation {i} " * (40 + 30 * i)), 300 + 150 * i) for i in range(12)
    ]
    stranger = [_slot_holding("someone else entirely " * 60)]
    plain = [_holder("a", slots=2), _holder("b"), _holder("c", slots=3)]
    cached = [_holder("a", slots=2, cache=stranger), _holder("b", cache=stranger), _holder("c", slots=3)]
    before = plan_queue(view(plain, {QWEN: queue}), est, QWEN, NOW)
    after = plan_queue(view(cached, {QWEN: queue}), est, QWEN, NOW)
    assert before.assignments == after.assignments
    assert before.free_s == after.free_s


def test_a_cache_hit_is_a_prompt_speed_sample_of_the_tokens_evaluated_not_of_the_whole_prompt() -> None:
    hit = Timings(prompt_eval_count=4000, prompt_eval_cached_count=3900, prompt_eval_duration=1_000_000_000)
    assert prompt_tps(hit) == pytest.approx(100.0)
    cold = Timings(prompt_eval_count=4000, prompt_eval_duration=1_000_000_000)
    assert prompt_tps(cold) == pytest.approx(4000.0)


@settings(max_examples=40, deadline=None)
@given(shape=fleet_shapes(max_workers=30), seed=st.integers(0, 2**16))
def test_slots_that_hold_none_of_the_queue_leave_every_plan_of_a_random_fleet_as_it_was(
    shape: FleetShape, seed: int
) -> None:
    snap, fleet, _ = random_fleet(shape, seed)
    est = estimator(snap, NOW_MS)
    rng = random.Random(seed)

    def noise(n: int) -> tuple[int, ...]:
        return tuple(rng.getrandbits(48) for _ in range(n))

    # Every worker's slots hold other conversations; half the queued tasks carry chains of their own.
    cached_workers = [
        msgspec.structs.replace(
            w, cache=[SlotCache(marks=marks_of(noise(rng.randint(1, 40)))) for _ in range(w.slots)]
        )
        for w in fleet.workers
    ]
    chained = {
        d: [
            msgspec.structs.replace(e, prefix=PromptChain(hashes=noise(8), chars=2048)) if k % 2 else e
            for k, e in enumerate(q)
        ]
        for d, q in fleet.backlog.items()
    }
    with_caches = FleetView(workers=cached_workers, backlog=chained, arrival_rate=fleet.arrival_rate)
    for digest in {d for w in fleet.workers for d in w.holds}:
        before = plan_queue(fleet, est, digest, NOW_MS)
        after = plan_queue(with_caches, est, digest, NOW_MS)
        assert before.assignments == after.assignments
        assert before.free_s == after.free_s


@settings(max_examples=60, deadline=None)
@given(shape=fleet_shapes(max_workers=40), seed=st.integers(0, 2**16))
def test_with_slots_holding_queued_conversations_the_pruned_walk_still_equals_the_full_walk(
    shape: FleetShape, seed: int
) -> None:
    snap, fleet, _ = random_fleet(shape, seed)
    est = estimator(snap, NOW_MS)
    rng = random.Random(seed)
    chains = [
        PromptChain(hashes=tuple(rng.getrandbits(48) for _ in range(12)), chars=12 * 256) for _ in range(6)
    ]
    # Each worker's slots hold some of six conversations, matched in part or whole; queued tasks
    # continue them (or are strangers).
    workers = [
        msgspec.structs.replace(
            w,
            cache=[
                SlotCache(marks=marks_of(rng.choice(chains).hashes[: rng.randint(1, 12)]))
                for _ in range(rng.randint(0, w.slots))
            ],
        )
        for w in fleet.workers
    ]
    backlog = {
        d: [msgspec.structs.replace(e, prefix=rng.choice([*chains, None])) for e in q]
        for d, q in fleet.backlog.items()
    }
    view_ = FleetView(workers=workers, backlog=backlog, arrival_rate=fleet.arrival_rate)
    for digest in {d for w in workers for d in w.holds}:
        pruned = plan_queue(view_, est, digest, NOW_MS)
        full = plan_queue(view_, est, digest, NOW_MS, params=PlanParams(full_walk=True))
        assert pruned.assignments == full.assignments
        assert pruned.free_s == full.free_s


def test_one_cached_slot_counts_for_one_task_and_the_next_that_shares_its_prefix_runs_cold() -> None:
    text = render_messages(_conversation(4))
    # Two queued turns both extend what b's one idle slot holds; b has a second, empty slot.
    first, second = chain_of(text + "first question"), chain_of(text + "another question")
    b = _holder("b", slots=2, cache=[_slot_holding(text), SlotCache()])
    state = PlanState([b], _est({"b": (20.0, 300.0)}), QWEN, NOW, PlanParams())
    assert state.cached(second, 2000)
    state.walk([_entry("t1", first, 2000)])
    # The first took the slot that held it: the second gets the empty one, cold.
    assert state.cached(second, 2000) == {}


def test_the_same_messages_with_other_tools_or_schema_share_no_cache() -> None:
    msgs = _conversation(2)
    plain = TaskMessage(task_id="a", model="m", digest=QWEN, messages=msgs)
    tooled = TaskMessage(
        task_id="b",
        model="m",
        digest=QWEN,
        messages=msgs,
        tools=[{"type": "function", "function": {"name": "f"}}],
    )
    shaped = TaskMessage(task_id="c", model="m", digest=QWEN, messages=msgs, format="json")
    chains = [task_chain(t) for t in (plain, tooled, shaped)]
    assert all(c is not None for c in chains)
    firsts = {c.hashes[0] for c in chains if c is not None}
    assert len(firsts) == 3
    # The same tools again: the next turn still extends the slot's content.
    held = render(tooled, "an answer " * 50)
    assert held is not None
    nxt = TaskMessage(
        task_id="d",
        model="m",
        digest=QWEN,
        messages=[
            *msgs,
            Message(role="assistant", content="an answer " * 50),
            Message(role="user", content="?"),
        ],
        tools=tooled.tools,
    )
    assert (render(nxt) or "").startswith(held)
