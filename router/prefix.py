"""Prompt prefixes: which part of a task's prompt a worker's backend already holds in a slot's KV
cache, and so need not evaluate again.

Chat clients resend the whole conversation every turn; Ollama and llama.cpp keep each slot's last
prompt (and what it generated) in its KV cache, so a turn that lands on the slot holding its
conversation evaluates only the new tokens. The router cannot see the backend's tokens, so both
sides describe a prompt the same way, by its text:

- A prompt's text (a canonical rendering of its messages: `dispatch.prefix`) is cut into blocks of
  `BLOCK_CHARS` characters; block i's hash covers block i and the hash of block i-1, so equal
  hashes at position i mean equal text up to the end of block i (a chain). A task carries every
  full block's hash (`PromptChain`).
- A worker reports, per slot, only checkpoints of the chain its slot holds (`SlotCache`): the hash
  at blocks 1, 2, 4, 8, ... and at its end. A task that extends the slot's whole content (the next
  turn of its conversation) matches at the end; one that diverges earlier (an edited message)
  matches at the largest power of two at or below the divergence, never beyond it. A slot's
  report stays a few dozen bytes whatever the conversation's length.

Characters, not tokens: no tokenizer is at hand where the prompt is submitted. A match of b blocks
is b * BLOCK_CHARS of the task's `chars`, and that share of its prompt tokens is cached. Blocks of
256 characters (about 64 tokens) lose at most one block per match: under a second of prompt
evaluation on the slowest machine the story has (90 tok/s), against 45 s for a 4,000-token
conversation that lands cold.

A slot that runs other work, or that other work takes first, loses its content: `cached_tokens`
counts only idle slots, and the plan (router.plan) counts a hit only while the tasks it gives the
worker before this one fit in its other idle slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from tasks.prefix import PromptChain as PromptChain
from tasks.prefix import SlotCache as SlotCache

# Characters per block of the chain (see the module docstring for the choice).
BLOCK_CHARS = 256
# At most this many blocks are hashed (about 64k tokens): longer prompts match on their first part.
MAX_BLOCKS = 1024
# Hashes are 48-bit: exact in every JSON reader (a dashboard's numbers are doubles).
_MASK = (1 << 48) - 1


def block_hashes(text: str, limit: int = MAX_BLOCKS) -> tuple[int, ...]:
    """The chain hash of each full block of `text` (at most `limit` blocks)."""
    out: list[int] = []
    prev = b""
    data = text.encode("utf-8", "surrogatepass")
    # Blocks are of characters, hashed as UTF-8: slicing the str keeps a character whole.
    n = min(len(text) // BLOCK_CHARS, limit)
    if len(data) == len(text):  # ASCII: byte offsets are character offsets
        for i in range(n):
            h = hashlib.blake2b(data[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS], digest_size=8, key=prev)
            prev = h.digest()
            out.append(int.from_bytes(prev, "big") & _MASK)
        return tuple(out)
    for i in range(n):
        block = text[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS].encode("utf-8", "surrogatepass")
        h = hashlib.blake2b(block, digest_size=8, key=prev)
        prev = h.digest()
        out.append(int.from_bytes(prev, "big") & _MASK)
    return tuple(out)


def chain_of(text: str) -> PromptChain:
    """`text` as a `PromptChain`."""
    return PromptChain(hashes=block_hashes(text), chars=len(text))


def marks_of(hashes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The checkpoints a slot holding the chain `hashes` reports: blocks 1, 2, 4, ... and its end."""
    n = len(hashes)
    out: list[tuple[int, int]] = []
    b = 1
    while b < n:
        out.append((b, hashes[b - 1]))
        b *= 2
    if n:
        out.append((n, hashes[n - 1]))
    return tuple(out)


def matched_blocks(hashes: Sequence[int], slot: SlotCache) -> int:
    """How many leading blocks of a task's chain `slot` is known to hold (0: none)."""
    n = len(hashes)
    for blocks, h in reversed(slot.marks):
        if blocks <= n and hashes[blocks - 1] == h:
            return blocks
    return 0


def best_slot(hashes: Sequence[int], slots: Sequence[SlotCache]) -> tuple[int | None, int]:
    """(slot index, matched blocks) of the idle slot holding the longest prefix of `hashes`;
    (None, 0) when no idle slot holds any of it."""
    best: int = 0
    where: int | None = None
    if not hashes:
        return where, best
    for k, slot in enumerate(slots):
        if slot.busy or not slot.marks:
            continue
        b = matched_blocks(hashes, slot)
        if b > best:
            best, where = b, k
    return where, best


def tokens_of_blocks(blocks: int, chars: int, prompt_tokens: int) -> int:
    """Prompt tokens that `blocks` matched blocks stand for, of a prompt of `chars` characters and
    `prompt_tokens` tokens (its share of the characters; never more than the prompt)."""
    if blocks <= 0 or chars <= 0 or prompt_tokens <= 0:
        return 0
    return min(prompt_tokens, (prompt_tokens * blocks * BLOCK_CHARS) // chars)


def cached_tokens(chain: PromptChain | None, prompt_tokens: int, slots: Sequence[SlotCache]) -> int:
    """Prompt tokens of a task with `chain` that an idle slot among `slots` holds."""
    if chain is None or not chain.hashes or not slots:
        return 0
    _, blocks = best_slot(chain.hashes, slots)
    return tokens_of_blocks(blocks, chain.chars, prompt_tokens)


def idle_slots(slots: Sequence[SlotCache]) -> int:
    """How many of `slots` run nothing."""
    return sum(1 for s in slots if not s.busy)
