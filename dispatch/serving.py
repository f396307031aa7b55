"""Who serves a model: the one rule, read from the live workers' leases.

A live worker serves the held models its lease lists as served (all it holds unless `--models`
narrowed them), and nothing while it drains: a draining worker finishes what it runs and takes
nothing new. Submission, the model lists of the API, benchmarks, the router's view of the fleet
and the dashboard all ask here, so that they never disagree about a worker.

A model is named by its name, by an alias without `:latest` (as Ollama reads it), by the name or
path of the GGUF file it was served from (`….gguf`), or by a digest prefix of at least 12
characters. Workers are looked at in name order, so that one name held under
two digests resolves the same way everywhere: to the digest of the first holder by name.
"""

from __future__ import annotations

import msgspec

from dispatch.errors import ModelNotServedError
from events.event import ModelEntry
from tasks.lease import LeaseInfo


def served(info: LeaseInfo) -> list[ModelEntry]:
    """The held models a live worker takes new tasks for: none while it drains."""
    if info.draining:
        return []
    if info.serves is None:
        return list(info.inventory)
    wanted = set(info.serves)
    return [m for m in info.inventory if m.name in wanted or m.digest in wanted]


def names_model(entry: ModelEntry, model: str) -> bool:
    """Whether `model` (a name, an alias without `:latest`, a GGUF file's name or path, or a 12+
    digit digest prefix) names `entry`."""
    if entry.name == model:
        return True
    # `qwen3` means `qwen3:latest`, as Ollama reads it.
    if ":" not in model and entry.name == f"{model}:latest":
        return True
    # A model served from a GGUF file is named by the file's base name without `.gguf`
    # (workers.backend.short_name): its file name or path, as its server was started, names it too.
    # Only a `.gguf` name: `org/model` is another model than `model`.
    if model.lower().endswith(".gguf"):
        stem = model.replace("\\", "/").rsplit("/", 1)[-1][: -len(".gguf")]
        if stem and entry.name == stem:
            return True
    return len(model) >= 12 and entry.digest.startswith(model)


def _by_name(leases: dict[str, LeaseInfo]) -> list[LeaseInfo]:
    return sorted(leases.values(), key=lambda i: i.worker)


def holdings(leases: dict[str, LeaseInfo], model: str | None = None) -> list[tuple[str, str, str]]:
    """(worker, its name for the model, digest) for every live worker and every distinct digest it
    serves that `model` names (every served model when None), by worker name."""
    out: list[tuple[str, str, str]] = []
    for info in _by_name(leases):
        seen: set[str] = set()
        for entry in served(info):
            if entry.digest not in seen and (model is None or names_model(entry, model)):
                seen.add(entry.digest)
                out.append((info.worker, entry.name, entry.digest))
    return out


def find_holders(model: str, leases: dict[str, LeaseInfo]) -> tuple[str | None, list[str]]:
    """The digest `model` names among live workers that serve it, and those workers (by name)."""
    found = holdings(leases, model)
    if not found:
        return None, []
    digest = found[0][2]
    return digest, sorted({worker for worker, _, d in found if d == digest})


def require_model(model: str, leases: dict[str, LeaseInfo]) -> str:
    """The digest `model` names among live workers that serve it; ModelNotServedError if none does."""
    digest, holders = find_holders(model, leases)
    if digest is None or not holders:
        raise ModelNotServedError(
            f"no live worker serves model {model!r} ({describe_fleet(leases)})", model=model, fleet=leases
        )
    return digest


def capabilities(digest: str, leases: dict[str, LeaseInfo]) -> list[str]:
    """Every capability a live holder of `digest` reports, in the order first reported."""
    out: list[str] = []
    for info in _by_name(leases):
        for entry in served(info):
            if entry.digest == digest:
                out += [c for c in entry.capabilities or [] if c not in out]
    return out


def lacks(digest: str, capability: str, leases: dict[str, LeaseInfo]) -> bool:
    """Whether every live holder of `digest` reports capabilities without `capability`, or was seen
    to refuse it (`ModelEntry.lacks`). A holder that reports none (its backend cannot say) and
    refused nothing may have it: then the model does not lack it."""
    held = [entry for info in leases.values() for entry in served(info) if entry.digest == digest]
    return bool(held) and all(entry_lacks(entry, capability) for entry in held)


def entry_lacks(entry: ModelEntry, capability: str) -> bool:
    """Whether one holder's entry says the model cannot do `capability`."""
    if entry.lacks and capability in entry.lacks:
        return True
    return entry.capabilities is not None and capability not in entry.capabilities


def describe_fleet(leases: dict[str, LeaseInfo]) -> str:
    """What the live workers serve, for error messages."""
    if not leases:
        return "no live workers"
    parts = []
    for info in _by_name(leases):
        names = ", ".join(sorted(m.name for m in served(info)))
        parts.append(f"{info.worker} serves {names or 'nothing'}")
    return "; ".join(parts)


class ModelInfo(msgspec.Struct, kw_only=True):
    """One model name the live fleet serves, with its identity and who serves it."""

    name: str
    entry: ModelEntry
    holders: list[str]
    slots: int
    loaded_on: list[str]


def catalog(leases: dict[str, LeaseInfo]) -> list[ModelInfo]:
    """Every model name (and alias) a live worker serves, by name, with its holders and live slots."""
    by_name: dict[str, ModelInfo] = {}
    for info in _by_name(leases):
        for entry in served(info):
            m = by_name.get(entry.name)
            if m is None:
                m = by_name[entry.name] = ModelInfo(
                    name=entry.name, entry=entry, holders=[], slots=0, loaded_on=[]
                )
            if entry.digest != m.entry.digest:
                continue  # one name, two digests: the first holder's identity wins, as in find_holders
            m.holders.append(info.worker)
            m.slots += info.slots
            if entry.digest in info.loaded:
                m.loaded_on.append(info.worker)
    return [by_name[k] for k in sorted(by_name)]


def served_models(leases: dict[str, LeaseInfo]) -> dict[str, str]:
    """Every model name (and alias) live workers serve, with its digest."""
    return {m.name: m.entry.digest for m in catalog(leases)}


def resolve_models(model: str, leases: dict[str, LeaseInfo]) -> dict[str, str] | None:
    """The models a request for `model` may go to, name -> digest (every served model for `auto`);
    None when the live fleet serves none of them."""
    if model == "auto":
        return served_models(leases) or None
    digest, holders = find_holders(model, leases)
    return {model: digest} if digest is not None and holders else None


def embedding_only(leases: dict[str, LeaseInfo]) -> frozenset[str]:
    """The digests whose live holders report `embedding` and not `completion`: an embedding
    model, whose every task is an embedding (the estimates cost its tasks by its embedding rate)."""
    return frozenset(entry.digest for info in leases.values() for entry in served(info) if embeds_only(entry))


def embeds_only(entry: ModelEntry) -> bool:
    """Whether the backend says the model embeds and does not complete (an embedding model)."""
    caps = entry.capabilities
    return caps is not None and "embedding" in caps and "completion" not in caps
