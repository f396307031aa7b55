"""Change detection on speed: whether a field's recent samples left its long-run value.

Each speed field has two time scales: the long-run statistics (a week's half-life) and the window
of its newest samples (`SpeedRow.decode_recent`, `prompt_recent`). The detector is a run test on
log speed against the long run:

- A sample is *off* when |log(x / long-run mean)| exceeds both a practical floor (a factor of
  `MIN_RATIO`) and `Z` times the field's own noise (the long run's coefficient of variation, which
  is the spread of log speed by the delta method), so a machine whose timings are noisy needs a
  larger change to count.
- The state changes when `CONFIRM` consecutive samples are off on the same side (a shift), or
  `CONFIRM` consecutive samples are not off (back to the long run), walking the window oldest
  first. One odd sample (a long context, a moment of swapping) never switches it either way, and
  with independent noise a false switch needs `CONFIRM` samples past `Z` sigma in a row
  (about 1e-5 per pair at Z = 3), however long the history.

Samples taken while a field is shifted are kept out of its long run (`fold_sample`): the long run
stays the belief from before the shift and the window alone carries the shift. Folding them in
would pull a young row's long run down to the slow value until the shift cleared during the
slowdown, and the machine would then look slow for good, with nothing sent to it and no probe to
see it fast again. Held out, the shift lasts exactly as long as the samples say so, and the first
probes after the recovery clear it.

A shift that lasts is *adopted*: a machine that changed for good (a new driver, a slower disk,
dried thermal paste) would otherwise be probed every PROBE_AFTER_S forever with a long run that
never moves. Once `ADOPT_SAMPLES` samples in a row have been held out AND they span at least
`ADOPT_AFTER_S` of ledger time, the long run restarts from the recent window (its samples folded
at the newest one's time), so the field is no longer shifted and the router's long run is the new
speed. Both conditions are needed: a count alone is a duration in disguise, because a machine
that looks slow is probed at a fixed rate (PROBE_PROMPTS per PROBE_AFTER_S, one sample a minute),
so ten samples would adopt an evening's game after ten minutes; once adopted, nothing probes a
slow machine, and it would not be seen fast again when the game ends. A day's use (an evening's
slowdown, a night switched off) stays a shift; a change still there half a day later is the
machine. A machine adopted slow is seen fast again like any other row: by the work the plan gives
it when the fleet is busy, or by the week-old re-benchmark.

The state is a function of the row alone (the window and the long-run statistics), so the live
projector, replay's rebuild and the router all compute the same answer from the same row, and
nothing else needs to be stored or replayed. Counting in samples, not seconds, is what lets a
machine that looked slow stay slow in the router's eyes while nothing is sent to it; a probe
(dispatch.benchmark.needs_benchmark) brings the samples that can clear it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import msgspec

from projections.snapshot import SpeedRow, Stat, fold, push_recent

# A change smaller than this factor is not worth routing differently, whatever its significance.
MIN_RATIO: Final = 1.5
# Standard deviations of log speed a sample must be off by.
Z: Final = 3.0
# Consecutive samples that switch the state.
CONFIRM: Final = 2
# Long-run samples before anything counts as a shift: a younger row's mean is its window.
MIN_LONG_RUN: Final = 5
# The fields that keep a window, with the name of their window on SpeedRow.
WINDOWS: Final = {"decode_tps": "decode_recent", "prompt_tps": "prompt_recent"}
# Samples in a row held out of the long run, and the ledger time they must span, before a shift
# becomes the long run (see the module docstring for why both).
ADOPT_SAMPLES: Final = 10
ADOPT_AFTER_S: Final = 12 * 3600.0
# The fields' held-out run on SpeedRow: (samples held out in a row, ledger ms of the first).
HELD: Final = {
    "decode_tps": ("decode_held", "decode_held_since"),
    "prompt_tps": ("prompt_held", "prompt_held_since"),
}


class Shift(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A field whose recent samples disagree with its long run beyond noise."""

    field: str
    long_run: float
    recent: float  # geometric mean of the samples of the current run
    samples: int

    @property
    def slower(self) -> bool:
        return self.recent < self.long_run

    def source(self) -> str:
        """The field's source as a breakdown shows it."""
        return f"recent n={self.samples} (shift from long-run {self.long_run:.3g})"


def _noise(stat: Stat, mean: float) -> float:
    """Standard deviation of log speed, from the long run's decayed coefficient of variation."""
    if stat.dn <= 0 or mean <= 0:
        return 0.0
    var = max(0.0, stat.dsumsq / stat.dn - mean * mean)
    return math.sqrt(var) / mean


def detect(field: str, stat: Stat, window: Sequence[float]) -> Shift | None:
    """The shift of one field given its long-run `stat` and recent `window` (oldest first)."""
    mean = stat.decayed_mean
    if mean is None or mean <= 0 or stat.n < MIN_LONG_RUN or len(window) < CONFIRM:
        return None
    base = math.log(mean)
    threshold = max(math.log(MIN_RATIO), Z * _noise(stat, mean))
    side = 0  # the state: 0 agrees with the long run, -1 slower, +1 faster
    run_side, run = 0, 0  # the current streak of samples on one side (0: not off)
    logs: list[float] = []
    for x in window:
        if x <= 0 or not math.isfinite(x):
            continue
        d = math.log(x) - base
        s = 0 if abs(d) <= threshold else (1 if d > 0 else -1)
        if s == run_side:
            run += 1
            logs.append(d)
        else:
            run_side, run, logs = s, 1, [d]
        if run >= CONFIRM:
            side = run_side
    if side == 0:
        return None
    # The samples since the state last switched to this side: the current run when it still holds,
    # else the switching run is gone from view and the window's samples on that side stand for it.
    if run_side == side:
        recent = logs
    else:
        recent = [
            math.log(x) - base
            for x in window
            if x > 0 and math.isfinite(x) and (math.log(x) - base) * side > threshold
        ]
    value = math.exp(base + sum(recent) / len(recent))
    return Shift(field=field, long_run=mean, recent=value, samples=len(recent))


class Folded(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A field after one sample: its long run, window, held-out run and shift state."""

    stat: Stat
    window: list[float]
    held: int  # samples in a row kept out of the long run
    held_since: int | None  # ledger ms of the first of them
    shift: Shift | None
    # The shift this sample made the long run (the long run restarted from the window), if any.
    adopted: Shift | None = None


def fold_sample(
    field: str,
    stat: Stat,
    window: list[float],
    x: float,
    at_ms: int,
    half_life_s: float,
    held: int = 0,
    held_since: int | None = None,
) -> Folded:
    """One sample `x` of a field with a window, given its held-out run so far. The sample joins the
    window; it joins the long run only when the window with it is not shifted; a shift held long
    enough becomes the long run. The one rule for the projector, replay's rebuild and the
    simulator."""
    recent = push_recent(window, x)
    shift = detect(field, stat, recent)
    if shift is None:
        folded = fold(stat, x, at_ms, half_life_s)
        after = detect(field, folded, recent)
        return Folded(stat=folded, window=recent, held=0, held_since=None, shift=after)
    since = at_ms if held_since is None else held_since
    if held + 1 >= ADOPT_SAMPLES and at_ms - since >= ADOPT_AFTER_S * 1000:
        restart = Stat()
        for v in recent:
            restart = fold(restart, v, at_ms, half_life_s)
        return Folded(
            stat=restart,
            window=recent,
            held=0,
            held_since=None,
            shift=detect(field, restart, recent),
            adopted=shift,
        )
    return Folded(stat=stat, window=recent, held=held + 1, held_since=since, shift=shift)


def row_shifts(row: SpeedRow) -> dict[str, Shift]:
    """Every shifted field of a speed row."""
    out: dict[str, Shift] = {}
    for field, window in WINDOWS.items():
        shift = detect(field, getattr(row, field), getattr(row, window))
        if shift is not None:
            out[field] = shift
    return out
