"""What a prompt cache is made of, as tasks and leases carry it: a task's prompt as a chain of block
hashes (`PromptChain`) and what one backend slot holds (`SlotCache`). The router's prefix rules
(router.prefix) read them; they live here because a queued task and a worker's lease carry them.
"""

from __future__ import annotations

import msgspec


class PromptChain(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """A task's prompt as the cache sees it: the chain hash of each full block, and its length."""

    hashes: tuple[int, ...] = ()
    chars: int = 0


class SlotCache(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """What one backend slot holds, as its worker reports it in the lease."""

    # (blocks, chain hash at that block) at 1, 2, 4, ... blocks and at the end, ascending.
    marks: tuple[tuple[int, int], ...] = ()
    # False: the slot is idle, and the next task the backend gives it may use what it holds.
    busy: bool = False
    # Epoch ms it was last given work (the backend reuses the least recently used slot first).
    used_ms: int = 0
    # The model whose KV cache it is (each model's runner has its own slots); '' : unknown.
    digest: str = ""

    @property
    def blocks(self) -> int:
        """How many blocks it holds."""
        return self.marks[-1][0] if self.marks else 0
