"""The simulated embedding vectors.

A model with the `embedding` capability answers each input text with a unit-length vector of its
`embedding_dim` numbers, drawn (standard normal, then normalised) from a generator seeded by the
model's digest and the text alone: equal texts give equal vectors on every machine that holds the
same weights, different texts almost orthogonal ones. A request's `dimensions` keeps the first that
many numbers and normalises them again (as Matryoshka-trained models are shortened).
"""

from __future__ import annotations

import math
import random

from sim.backends.text import seed_of


def embedding_vector(digest: str, text: str, dim: int, dimensions: int | None = None) -> list[float]:
    """The unit vector of `text` under the model with `digest`, of `dimensions` (or `dim`) numbers."""
    rng = random.Random(seed_of("embedding", digest, text))
    full = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    kept = full[: dimensions or dim]
    norm = math.sqrt(sum(x * x for x in kept)) or 1.0
    return [x / norm for x in kept]
