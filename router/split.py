"""Splitting one large embedding batch across a model's holders, by the plan's own estimates.

An embedding request's inputs are independent, so a batch can run as several tasks on several
machines at once. The rule is deliberately simple, and uses only what the ranking of the whole
batch already worked out for each holder: when it could start (`wait_s` + `load_s`) and how fast it
reads (the batch's prompt tokens over its `prompt_s`, i.e. its embedding rate).

Holder i started at s_i and reading at r_i tokens/s has read r_i·(T - s_i) tokens by time T. The
split picks the earliest T at which the holders together have read the whole batch (water
filling: a holder whose start is later than T gets nothing), and cuts the inputs, in order, into
consecutive parts of about each holder's share of the tokens (at input boundaries; a share smaller
than half an input rounds to nothing). It splits only when:

- the batch has at least `min_inputs` inputs (a few inputs are not worth several tasks), and
- the split's T is at least `min_gain` shorter than the best single holder's finish (the parts
  are separate tasks, each queued, claimed and ledgered: a marginal gain is not worth that).

The parts are queued as ordinary tasks; the plan then assigns each to whichever holder would
finish it earliest, which, with the estimates the sizes came from, is the holder each was sized
for. Nothing here reads a clock or Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

# Fewest inputs a batch needs before it is split at all.
SPLIT_MIN_INPUTS: Final = 8
# The least share of the single best finish a split must save.
SPLIT_MIN_GAIN: Final = 0.2


class Reader(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One holder as the split sees it: seconds from now until it could start, tokens per second."""

    worker: str
    start_s: float
    rate_tps: float


def finish_together(readers: Sequence[Reader], tokens: float) -> float:
    """The earliest time (s from now) at which `readers`, each from its start at its rate, have
    read `tokens` between them."""
    ordered = sorted(readers, key=lambda r: r.start_s)
    rate = 0.0
    read_by = 0.0  # tokens read by the time of the current reader's start
    t = ordered[0].start_s
    for i, r in enumerate(ordered):
        read_by += rate * (r.start_s - t)
        t = r.start_s
        if read_by >= tokens:
            break
        rate += r.rate_tps
        upcoming = ordered[i + 1].start_s if i + 1 < len(ordered) else None
        finish = t + (tokens - read_by) / rate
        if upcoming is None or finish <= upcoming:
            return finish
    # The batch was read before the next reader could start.
    return t - (read_by - tokens) / rate if rate > 0 else t


def split_sizes(
    readers: Sequence[Reader],
    tokens: Sequence[int],
    *,
    min_inputs: int = SPLIT_MIN_INPUTS,
    min_gain: float = SPLIT_MIN_GAIN,
) -> list[tuple[str, int]]:
    """(worker, number of inputs) of each part, in input order; one part (the best single holder)
    when the batch is not worth splitting by the rules of the module's docstring."""
    usable = [r for r in readers if r.rate_tps > 0 and r.start_s >= 0]
    total = float(sum(tokens))
    if not usable:
        return [(readers[0].worker if readers else "", len(tokens))]
    alone = min(usable, key=lambda r: r.start_s + total / r.rate_tps)
    whole = [(alone.worker, len(tokens))]
    if len(tokens) < min_inputs or len(usable) < 2 or total <= 0:
        return whole
    t = finish_together(usable, total)
    if t > (1.0 - min_gain) * (alone.start_s + total / alone.rate_tps):
        return whole
    shares = [(r.worker, r.rate_tps * (t - r.start_s)) for r in sorted(usable, key=lambda r: r.start_s)]
    parts: list[tuple[str, int]] = []
    i, goal = 0, 0.0
    read = 0.0
    for worker, share in shares:
        if share <= 0:
            continue
        goal += share
        start = i
        # Take inputs while the part's cumulative tokens stay nearer the goal than without them.
        while i < len(tokens) and read + tokens[i] / 2 < goal:
            read += tokens[i]
            i += 1
        if i > start:
            parts.append((worker, i - start))
    if i < len(tokens):
        # Rounding left the last inputs over: they join the last part.
        if parts:
            worker, n = parts[-1]
            parts[-1] = (worker, n + len(tokens) - i)
        else:
            return whole
    return parts if len(parts) >= 2 else whole
