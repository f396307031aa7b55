"""What each of the backend's slots holds in its KV cache, as far as this worker can tell.

The backend does not say. The worker knows what it sent and what came back, and the rule the
backend follows (Ollama's runner and llama.cpp's server alike): a request gets the idle slot whose
cache shares the longest prefix with its prompt, else the least recently used idle slot, and when
it is done that slot holds its prompt and the answer it generated. The worker applies the same
rule to the same requests, per model (each model's runner has slots of its own), and reports the
result in its lease (router.prefix.SlotCache) for the plan to price.

It can be wrong (the backend restarted, another client used it, its slot count differs from the
worker's); where it knows the cache is gone (the model unloaded, a run failed) it forgets, and a
wrong guess costs only a worse estimate, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Iterable

from events.event import now_ms
from router.prefix import PromptChain, SlotCache, best_slot, marks_of


class _Slot:
    __slots__ = ("busy", "digest", "hashes", "hit", "used_ms")

    def __init__(self) -> None:
        self.hashes: tuple[int, ...] = ()
        self.busy = False
        self.used_ms = 0
        self.digest = ""
        # Blocks of the prompt it runs now that it held before (0: none, or it runs nothing).
        self.hit = 0


class Slots:
    """The worker's picture of its backend's slots, per model."""

    def __init__(self, slots: int) -> None:
        self._count = max(1, slots)
        self._by_digest: dict[str, list[_Slot]] = {}

    def _of(self, digest: str) -> list[_Slot]:
        found = self._by_digest.get(digest)
        if found is None:
            found = self._by_digest[digest] = [_Slot() for _ in range(self._count)]
        return found

    def start(self, digest: str, chain: PromptChain | None) -> int | None:
        """A run of `digest` starts with prompt `chain`: the slot the backend gives it (marked busy),
        by the backend's rule. None when every slot is busy (more runs than slots: the backend
        queues it; nothing is known of where it lands)."""
        slots = self._of(digest)
        hashes = chain.hashes if chain is not None else ()
        reported = [SlotCache(marks=marks_of(s.hashes) if s.hashes else (), busy=s.busy) for s in slots]
        k, hit = best_slot(hashes, reported)
        if k is None:
            idle = [i for i, s in enumerate(slots) if not s.busy]
            if not idle:
                return None
            k = min(idle, key=lambda i: slots[i].used_ms)
        slot = slots[k]
        slot.busy, slot.used_ms, slot.digest, slot.hit = True, now_ms(), digest, hit
        # While it runs, the slot holds this prompt (and then some): what it held before is gone.
        slot.hashes = hashes
        return k

    def hit(self, digest: str, k: int | None) -> int:
        """Blocks of its prompt the run on slot `k` should find in the cache (0: none expected)."""
        return 0 if k is None else self._of(digest)[k].hit

    def finish(self, digest: str, k: int | None, held: PromptChain | None) -> None:
        """The run on slot `k` ended; the slot holds `held` (its prompt and answer; None: unknown)."""
        if k is None:
            return
        slot = self._of(digest)[k]
        slot.busy, slot.hit = False, 0
        slot.hashes = held.hashes if held is not None else ()

    def forget(self, digests: Iterable[str]) -> None:
        """The backend no longer has these models loaded: their slots hold nothing."""
        for digest in digests:
            for slot in self._by_digest.get(digest, ()):
                if not slot.busy:
                    slot.hashes = ()

    def report(self) -> list[SlotCache]:
        """What the lease says: every slot that holds something or is busy."""
        out: list[SlotCache] = []
        for digest, slots in self._by_digest.items():
            for s in slots:
                if s.hashes or s.busy:
                    out.append(
                        SlotCache(
                            marks=marks_of(s.hashes) if s.hashes else (),
                            busy=s.busy,
                            used_ms=s.used_ms,
                            digest=digest,
                        )
                    )
        return out

    def digests(self) -> list[str]:
        """The models it has slots for."""
        return list(self._by_digest)
