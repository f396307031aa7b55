"""The pinned hand-off: when a task goes straight to one worker's pinned stream instead of its
model's shared queue.

The shared queue and every worker's gate already give a turn to the worker whose slot holds its
conversation when the plan says that worker finishes it first. The hand-off skips the race of the
gates for it (the chosen worker takes it without deciding again; the others are not woken), but
it also takes the task away from later decisions: once pinned, no other worker can take it if the
chosen one stalls. So it is done only when the plan's lead is wide and certain enough:

- the chosen worker's idle slot holds part of the prompt (`cached_prompt_tokens` > 0): without a
  cache there is nothing a pin keeps that the shared queue would not;
- it has a free slot now (no wait in the plan): the task starts at once, not behind other work
  whose length is a guess;
- every other holder's expected finish is at least HANDOFF_RATIO times its own: estimates of
  speeds are noisy, and a narrow lead is not worth giving up the shared queue's second chances.
  For a paced task (router.plan.BacklogEntry.paced) the finishes compared are its reader's, and
  since every holder's includes the same reading time, the lead demanded is (HANDOFF_RATIO - 1)
  times the chosen worker's own time to the first token (plus any decoding past reading pace).

A handed-off task the worker has not taken within a bound, or whose worker's lease is gone, is
moved back to the shared queue by the reaper (workers.reaper), so a pin never strands a task.
"""

from __future__ import annotations

from typing import Final

from router.choose import Decision

# The lead (others' finish / the chosen one's) a hand-off needs; see the module docstring.
HANDOFF_RATIO: Final = 1.25


def handoff_worker(decision: Decision, ratio: float = HANDOFF_RATIO) -> str | None:
    """The worker to hand the decided task to directly, or None (the shared queue)."""
    ranking = decision.ranking
    best = ranking.best
    if best.terms.get("cached_prompt_tokens", 0.0) <= 0.0 or best.terms.get("wait_s", 0.0) > 0.0:
        return None
    rest = ranking.best_cost_after(1)
    if rest is None:
        # The only holder: the shared queue reaches it as surely, and is kept for a newcomer.
        return None
    reading = best.terms.get("reading_s")
    if reading is not None:
        # A paced task: its reader's finish on every holder shares the reading time, so the lead
        # is measured on the rest, the time to its first token and what decoding adds past reading.
        own = ranking.cost(0) - reading - best.terms["decode_s"]
        if rest - ranking.cost(0) < (ratio - 1.0) * max(own, 0.0):
            return None
        return best.worker
    if rest < ratio * best.expected_finish_s:
        return None
    return best.worker
