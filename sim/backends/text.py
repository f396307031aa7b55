"""Deterministic text for the simulated backends: pseudo-words, token counts, benchmark answers.

Everything here is a pure function of its seeds, so that a test or a benchmark run twice sees the same
outputs. A token is one pseudo-word (with its leading space), one chunk on the wire, one unit of
`eval_count`.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from functools import cache

from projections.benchset import BenchPrompt, benchset, speed_prompts
from sim.fleetspec import OutputLength

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_KANA = (
    "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをん"
    "がぎぐげござじずぜぞだでどばびぶべぼ"
)


def _words(rng: random.Random, syllables: list[str], n: int, joiner: str) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        word = joiner.join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3, 3, 4))))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def _build_lexicons() -> tuple[tuple[str, ...], tuple[str, ...]]:
    # A fixed generator seed: the lexicon is part of the simulator, not of a run.
    rng = random.Random(20240611)
    latin = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = _words(rng, latin, 509, "")
    # A few sentence marks, so that long outputs read as prose rather than a word list.
    latin_tokens = (*(" " + w for w in words), ",", ".", ".")
    kana_tokens = (*_words(rng, list(_KANA), 509, ""), "、", "。", "。")
    return latin_tokens, kana_tokens


LATIN_TOKENS, KANA_TOKENS = _build_lexicons()


def seed_of(*parts: object) -> int:
    """A 64-bit seed from any parts (stable across processes, unlike hash())."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def count_tokens(text: str) -> int:
    """The simulator's tokenizer estimate: one token per 4 bytes of UTF-8, at least 1."""
    return max(1, (len(text.encode()) + 3) // 4)


_WIDE = re.compile("[\u3000-\uffff]")


def is_japanese(text: str) -> bool:
    return _WIDE.search(text) is not None


def sample_length(rng: random.Random, dist: OutputLength) -> int:
    """Output tokens drawn from the model's distribution (at least 1)."""
    if dist.dist == "fixed":
        value = dist.mean
    elif dist.dist == "exp":
        value = rng.expovariate(1.0 / dist.mean)
    else:
        # mu chosen so that the distribution's mean is `mean`, not its median.
        mu = math.log(dist.mean) - dist.sigma * dist.sigma / 2
        value = rng.lognormvariate(mu, dist.sigma)
    return max(1, round(value))


_POOL_SIZE = 1 << 16


@cache
def _pool(japanese: bool) -> list[str]:
    # Drawing every token costs ~0.5 us each; a slice of one long fixed sequence costs almost nothing,
    # and the zero-delay benchmark needs a request to cost well under a millisecond.
    rng = random.Random(7 if japanese else 11)
    tokens = rng.choices(KANA_TOKENS if japanese else LATIN_TOKENS, k=_POOL_SIZE)
    return tokens + tokens


def filler(rng: random.Random, n: int, japanese: bool) -> list[str]:
    """`n` pseudo-word tokens (a seeded slice of a fixed pseudo-random sequence)."""
    pool = _pool(japanese)
    start = rng.randrange(_POOL_SIZE)
    out = pool[start : start + min(n, _POOL_SIZE)]
    while len(out) < n:
        out += pool[: min(n - len(out), _POOL_SIZE)]
    if out:
        out[0] = out[0].lstrip()
    return out


def json_answer(rng: random.Random, japanese: bool) -> list[str]:
    """Tokens of a JSON answer, for a request that sets Ollama's `format: "json"` (OpenAI's
    `response_format: {"type": "json_object"}`) without a schema: an object, as real models answer
    in JSON mode (LangChain's json_mode parses the answer into a dict and rejects anything else),
    here `{"answer": "<a pseudo-sentence>", "details": ["<two>", "<more>"]}`, deterministic for its seed."""
    sentences = ["".join(filler(rng, 8, japanese)).strip() for _ in range(3)]
    text = json.dumps({"answer": sentences[0], "details": sentences[1:]}, ensure_ascii=False)
    return split_tokens(text)


# -- the benchmark set ----------------------------------------------------------------------------
# One definition of the shipped prompts (dispatch/benchmark.py); the simulator reads
# their `answer` to answer right or wrong.


class _BenchEntry:
    """A benchmark prompt with what the simulator needs to answer it, right or wrong."""

    __slots__ = ("filler", "prompt", "wrong")

    def __init__(self, prompt: BenchPrompt, wrong: list[str], filler: tuple[str, ...]) -> None:
        self.prompt = prompt
        self.wrong = wrong
        self.filler = filler


@cache
def _bench_index() -> dict[str, _BenchEntry]:
    prompts = benchset()
    index: dict[str, _BenchEntry] = {}
    for p in prompts:
        # A wrong answer is plausible when it answers another question of the same domain.
        wrong = sorted(
            {
                q.answer
                for q in prompts
                if q.domain == p.domain and q.answer != p.answer and not p.passes(q.answer)
            }
        )
        lexicon = KANA_TOKENS if is_japanese(p.prompt) else LATIN_TOKENS
        # Filler must never pass by accident.
        safe = tuple(tok for tok in lexicon if not p.passes(tok))
        index[p.prompt.strip()] = _BenchEntry(p, wrong or ["?"], safe)
    return index


@cache
def _speed_texts() -> frozenset[str]:
    return frozenset(p.prompt.strip() for p in speed_prompts())


def asks_at_length(text: str) -> bool:
    """Whether `text` is a shipped speed prompt, which real models answer at length (and the
    benchmark cuts at its max_tokens)."""
    return text.strip() in _speed_texts()


def bench_prompt(text: str) -> BenchPrompt | None:
    """The benchmark prompt whose text equals `text`, if any."""
    entry = _bench_index().get(text.strip())
    return entry.prompt if entry else None


def bench_answer(rng: random.Random, text: str, quality: float) -> list[str] | None:
    """Tokens answering benchmark prompt `text`: right with probability `quality`; None if not one."""
    entry = _bench_index().get(text.strip())
    if entry is None:
        return None
    right = rng.random() < quality
    answer = entry.prompt.answer if right else rng.choice(entry.wrong)
    words = answer.split(" ")
    tokens = [words[0]] + [" " + w for w in words[1:]]
    tail = rng.randint(0, 6)
    if tail:
        tokens.append("." if not is_japanese(entry.prompt.prompt) else "。")
        tokens.extend(rng.choices(entry.filler, k=tail))
    return tokens


def split_tokens(text: str) -> list[str]:
    """`text` as tokens of four characters (about four bytes a token, as count_tokens reads text)."""
    return [text[i : i + 4] for i in range(0, len(text), 4)] or [""]
