"""Trains the ledger's zstd dictionary (events/compression.py) on synthetic events.

Every fleet in the training set is random: its model, digest, worker names, number of holders and
speeds, so that the dictionary learns the schema (field names, breakdown shapes, source templates)
and nothing of one fleet. A shipped dictionary is frozen; this writes a new file for a new id:

    python -m sim.dictionary events/ledger-2.zdict --dict-id 2
"""

from __future__ import annotations

import argparse
import random
import string
from collections.abc import Iterator

import msgspec
import zstandard

from events.event import Event, ModelEntry, WorkerChanged, WorkerOnline
from sim.synthetic import HistoryMaker

MODELS = (
    "qwen3:8b",
    "llama3.1:8b-instruct-q4_K_M",
    "gemma3:12b",
    "mistral-small:24b",
    "phi4:14b",
    "qwen3:30b",
)


def _name(rnd: random.Random) -> str:
    return "".join(
        rnd.choice(string.ascii_lowercase + string.digits + "-") for _ in range(rnd.randint(3, 14))
    )


def training_events(fleets: int, tasks_per_fleet: int, seed: int) -> Iterator[Event]:
    """Events of `fleets` random fleets, `tasks_per_fleet` tasks each, and their workers' reports."""
    rnd = random.Random(seed)
    for _ in range(fleets):
        model = rnd.choice(MODELS)
        digest = f"{rnd.getrandbits(256):064x}"
        names = [_name(rnd) for _ in range(8)]
        maker = HistoryMaker(
            tasks_per_fleet,
            holders=rnd.randint(1, 6),
            seed=rnd.getrandbits(32),
            model=model,
            digest=digest,
            workers=names,
            speed=rnd.uniform(5.0, 150.0),
        )
        for batch in maker.batches():
            yield from batch
        inventory = [
            ModelEntry(name=m, digest=f"{rnd.getrandbits(256):064x}", size=rnd.randint(10**9, 4 * 10**10))
            for m in rnd.sample(MODELS, rnd.randint(1, 4))
        ]
        at = maker.start_ms + maker.span_ms
        for name in names:
            yield WorkerOnline(
                at=at,
                worker=name,
                slots=rnd.randint(1, 4),
                backend=f"http://{name}:11434",
                inventory=inventory,
            )
            yield WorkerChanged(
                at=at, worker=name, slots=rnd.randint(1, 4), inventory=inventory, loaded=[inventory[0].digest]
            )


def train(size: int, dict_id: int, seed: int = 1) -> bytes:
    """A dictionary of `size` bytes trained on `training_events`."""
    samples: list[bytes | bytearray | memoryview[int]] = [
        msgspec.msgpack.encode(e) for e in training_events(40, 400, seed)
    ]
    trained = zstandard.train_dictionary(size, samples, dict_id=dict_id, level=3)
    data: bytes = trained.as_bytes()
    return data


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", help="where to write the dictionary")
    parser.add_argument("--dict-id", type=int, required=True, help="its id: the next unused one")
    parser.add_argument("--size", type=int, default=16_384, help="dictionary bytes (default 16384)")
    args = parser.parse_args()
    data = train(args.size, args.dict_id)
    with open(args.out, "wb") as f:
        f.write(data)


if __name__ == "__main__":
    main()
