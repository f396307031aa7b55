"""The worker's picture of its backend's slots: the slot the backend would pick, what it holds
after a run, and what is forgotten."""

from __future__ import annotations

from router.prefix import PromptChain, cached_tokens, chain_of
from workers.slots import Slots

DIGEST = "d" * 64


def _chat(n: int) -> str:
    return "".join(f"turn {i}: " + "words " * 200 for i in range(n))


def test_the_next_turn_finds_the_slot_its_conversation_left_and_others_use_the_rest() -> None:
    slots = Slots(2)
    first = chain_of(_chat(2))
    k = slots.start(DIGEST, first)
    slots.finish(DIGEST, k, chain_of(_chat(3)))
    # Another conversation meanwhile takes the other (least recently used) slot.
    other = chain_of("another conversation " * 100)
    j = slots.start(DIGEST, other)
    assert j != k
    slots.finish(DIGEST, j, other)
    nxt = chain_of(_chat(4))
    report = slots.report()
    assert cached_tokens(nxt, 4000, report) > 0
    assert slots.start(DIGEST, nxt) == k


def test_on_one_slot_a_different_prompt_evicts_the_conversation() -> None:
    slots = Slots(1)
    k = slots.start(DIGEST, chain_of(_chat(2)))
    slots.finish(DIGEST, k, chain_of(_chat(3)))
    k = slots.start(DIGEST, chain_of("something else " * 100))
    slots.finish(DIGEST, k, chain_of("something else " * 120))
    assert cached_tokens(chain_of(_chat(4)), 4000, slots.report()) == 0


def test_a_busy_slot_is_reported_busy_and_a_failed_run_leaves_its_slot_holding_nothing() -> None:
    slots = Slots(1)
    k = slots.start(DIGEST, chain_of(_chat(2)))
    assert [s.busy for s in slots.report()] == [True]
    assert slots.start(DIGEST, PromptChain()) is None  # more runs than slots: the backend queues it
    slots.finish(DIGEST, k, None)
    assert slots.report() == []


def test_a_model_the_backend_unloaded_forgets_what_its_slots_held() -> None:
    slots = Slots(2)
    k = slots.start(DIGEST, chain_of(_chat(2)))
    slots.finish(DIGEST, k, chain_of(_chat(3)))
    assert slots.report()
    slots.forget([DIGEST])
    assert slots.report() == []


def test_a_run_knows_how_much_of_its_prompt_its_slot_should_hold() -> None:
    slots = Slots(1)
    k = slots.start(DIGEST, chain_of(_chat(2)))
    assert slots.hit(DIGEST, k) == 0  # the first turn: nothing held
    slots.finish(DIGEST, k, chain_of(_chat(3)))
    k = slots.start(DIGEST, chain_of(_chat(4)))
    assert slots.hit(DIGEST, k) == len(chain_of(_chat(3)).hashes)
    slots.finish(DIGEST, k, None)
    assert slots.hit(DIGEST, k) == 0
