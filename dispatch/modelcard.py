"""What the holders' backends say of a model, for the Ollama surface's /api/show, /api/tags, /api/ps.

Two parts, kept apart by size. The small facts (capabilities, family, parameter size,
quantisation, format, context length, size) ride in each `ModelEntry` of the worker's lease, where
routing reads the capabilities. The large text (the prompt template, the Modelfile parameters,
`model_info`) is a `ModelCard` per digest in the worker's own hash `Keys.card(worker)`: a template
is one to a few KB, a lease is written every heartbeat and every routing decision reads every
lease, so carrying it there would multiply the lease by ten for a fact only /api/show reads. The
worker writes its hash whole whenever what its backend says changes (and when it comes online),
and only its own (its ACL allows no other), so that no worker can speak for another's model; the
API reads the hashes of a model's live holders only.

A fact no holder reported is None here and absent from every answer, never 0 or "".
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from dispatch.serving import served
from events.event import ModelEntry
from events.keys import Keys
from tasks.lease import LeaseInfo

# A card larger than this (a backend's model_info with whole tokenizer arrays) is kept without its
# model_info, so that one model cannot make the hash large.
MAX_CARD_BYTES: Final = 64 * 1024


class ModelCard(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The large part of what a backend's /api/show says of one model; None: it does not say."""

    template: str | None = None
    parameters: str | None = None
    model_info: dict[str, Any] | None = None

    def empty(self) -> bool:
        return self.template is None and self.parameters is None and self.model_info is None


_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(ModelCard)


def encode_card(card: ModelCard) -> bytes:
    """The card as its hash field holds it (without model_info when it is too large)."""
    raw = _encoder.encode(card)
    if len(raw) > MAX_CARD_BYTES:
        raw = _encoder.encode(msgspec.structs.replace(card, model_info=None))
    return raw


async def publish_cards(redis: aioredis.Redis, keys: Keys, worker: str, cards: dict[str, ModelCard]) -> None:
    """Replace `worker`'s hash of cards (digest -> card) with `cards`, in one transaction."""
    pipe = redis.pipeline(transaction=True)
    pipe.delete(keys.card(worker))
    kept = {digest: encode_card(card) for digest, card in cards.items() if not card.empty()}
    if kept:
        pipe.hset(keys.card(worker), mapping=kept)  # type: ignore[arg-type]
    await pipe.execute()


async def read_card(redis: aioredis.Redis, keys: Keys, digest: str, holders: list[str]) -> ModelCard:
    """The card of `digest` as its `holders` (in that order) report it: each field from the first
    holder that reports it; an empty card when none does."""
    if not holders:
        return ModelCard()
    pipe = redis.pipeline(transaction=False)
    for worker in holders:
        pipe.hget(keys.card(worker), digest)
    found: list[Any] = await pipe.execute()
    template: str | None = None
    parameters: str | None = None
    model_info: dict[str, Any] | None = None
    for raw in found:
        if raw is None:
            continue
        try:
            card = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        template = template if template is not None else card.template
        parameters = parameters if parameters is not None else card.parameters
        model_info = model_info if model_info is not None else card.model_info
    return ModelCard(template=template, parameters=parameters, model_info=model_info)


def facts(digest: str, leases: dict[str, LeaseInfo]) -> ModelEntry | None:
    """One entry for `digest` from what every live holder reports (by worker name): each fact from
    the first holder that reports it, the capabilities of all of them together (None when none
    reports any); None when no live worker serves the digest."""
    found: ModelEntry | None = None
    caps: list[str] | None = None
    for info in sorted(leases.values(), key=lambda i: i.worker):
        for entry in served(info):
            if entry.digest != digest:
                continue
            if entry.capabilities is not None:
                caps = [] if caps is None else caps
                caps += [c for c in entry.capabilities if c not in caps]
            if found is None:
                found = entry
                continue
            found = msgspec.structs.replace(
                found,
                size=found.size if found.size is not None else entry.size,
                family=found.family or entry.family,
                families=found.families or entry.families,
                parameter_size=found.parameter_size or entry.parameter_size,
                quantization=found.quantization or entry.quantization,
                format=found.format or entry.format,
                context_length=found.context_length or entry.context_length,
                modified_at=found.modified_at or entry.modified_at,
            )
    if found is None:
        return None
    return msgspec.structs.replace(found, capabilities=caps)


def details(entry: ModelEntry) -> dict[str, Any]:
    """Ollama's `details` object with the facts that were reported, and nothing made up."""
    out: dict[str, Any] = {}
    if entry.format:
        out["format"] = entry.format
    if entry.family:
        out["family"] = entry.family
    if entry.families:
        out["families"] = list(entry.families)
    if entry.parameter_size:
        out["parameter_size"] = entry.parameter_size
    if entry.quantization:
        out["quantization_level"] = entry.quantization
    return out
