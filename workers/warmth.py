"""Whether a run had to load its model first: the worker's own view, recorded on its completion.

Only a run that really loaded the model is a load sample. Ollama reports a `load_duration` on
every call, a few milliseconds when the model was already in memory, so the duration alone cannot
say; with mostly warm traffic those milliseconds would drag the load estimate to nothing. The
worker can say, in one of two ways:

- A backend that lists what is loaded (Ollama's /api/ps, read every heartbeat): a run is cold when
  its model was not in that list before the run started and this worker has not run the model
  since the list was read (a run it has just finished left the model loaded, whatever an older
  list says).
- A backend that cannot say what is loaded (OpenAI-compatible servers): the first-token time
  tells. A run that had to load shows its first token far later than its prompt needs: more than
  `LOAD_SEEN_S` after what the prompt takes at the fastest prompt speed this worker has seen for
  the model, and more than `LOAD_FACTOR` times that. Such a run is cold, the excess is its load,
  and the prompt time is what is left. Only runs that had the machine to themselves are judged
  (sharing slows a first token as much as a load), and nothing is judged before a first run has
  given the prompt speed: those stay unknown (None). An always-warm server therefore never shows
  a load, and the plan charges it none.
"""

from __future__ import annotations

from typing import Final

import msgspec

from events.event import MAX_NS, Timings
from workers.backend import Inventory

# A first token later than the prompt needs by more than this (seconds) may be a load...
LOAD_SEEN_S: Final = 1.0
# ...when it is also more than this many times what the prompt needs (a long prompt's jitter is not).
LOAD_FACTOR: Final = 3.0


class Warmth:
    """What one worker knows of which of its models are in memory, run after run."""

    def __init__(self) -> None:
        # Digests this worker ran since its backend's loaded list was last read.
        self._ran: set[str] = set()
        # Per digest, the fewest seconds per prompt token a run judged warm took to its first token.
        self._prompt_s: dict[str, float] = {}

    def listed(self) -> None:
        """The backend's loaded list was read again: it speaks for the runs before it."""
        self._ran.clear()

    def before(self, digest: str, inventory: Inventory) -> bool | None:
        """Whether a run of `digest` about to start must load it (None: the backend cannot say)."""
        if not inventory.loaded_known:
            return None
        return digest not in inventory.loaded and digest not in self._ran

    def after(
        self,
        digest: str,
        cold: bool | None,
        timings: Timings,
        *,
        alone: bool,
        prompt_tokens: int | None = None,
    ) -> tuple[bool | None, Timings]:
        """(cold, timings) to record for a finished run of `digest`; `cold` is `before`'s answer.

        For a backend that cannot say what is loaded, the run is judged from its first token, and a
        load it shows moves from the prompt time into `load_duration`.
        """
        self._ran.add(digest)
        if cold is not None:
            return cold, timings
        first_ns = timings.prompt_eval_duration
        # What the backend evaluated: a slot's cached tokens took no time, and counting them would
        # set a prompt speed no cold prompt ever reaches.
        evaluated = timings.evaluated_prompt_tokens()
        tokens = evaluated if evaluated is not None else prompt_tokens
        if first_ns is None or first_ns <= 0 or tokens is None or tokens <= 0 or not alone:
            return None, timings
        per_token = first_ns / 1e9 / tokens
        best = self._prompt_s.get(digest)
        if best is None:
            # The first judged run sets the prompt speed; whether it loaded stays unknown.
            self._prompt_s[digest] = per_token
            return None, timings
        needed = tokens * best
        excess = first_ns / 1e9 - needed
        if excess > LOAD_SEEN_S and excess > LOAD_FACTOR * needed:
            load_ns = min(round(excess * 1e9), MAX_NS)
            return True, msgspec.structs.replace(
                timings, load_duration=load_ns, prompt_eval_duration=first_ns - load_ns
            )
        self._prompt_s[digest] = min(best, per_token)
        return False, timings
