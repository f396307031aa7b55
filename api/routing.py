"""What the fleet looks like to the API: every model name the live leases serve, with its holders.

The live leases are the source of truth for "who serves what now" (a projection may lag); they are
read through workers.view.LiveView's short cache.
"""

from __future__ import annotations

import msgspec

from events.event import ModelEntry
from events.lease import LeaseInfo


class ModelInfo(msgspec.Struct, kw_only=True):
    """One model name the live fleet serves, with its identity and who serves it."""

    name: str
    entry: ModelEntry
    holders: list[str]
    slots: int
    loaded_on: list[str]


def catalog(leases: dict[str, LeaseInfo]) -> list[ModelInfo]:
    """Every model name (and alias) a live, non-draining worker serves, with its live slots."""
    by_name: dict[str, ModelInfo] = {}
    for info in sorted(leases.values(), key=lambda i: i.worker):
        if info.draining:
            continue
        for entry in info.serving():
            m = by_name.get(entry.name)
            if m is None:
                m = by_name[entry.name] = ModelInfo(
                    name=entry.name, entry=entry, holders=[], slots=0, loaded_on=[]
                )
            if entry.digest != m.entry.digest:
                continue  # one name with two digests: the first holder's identity wins, as find_holders does
            m.holders.append(info.worker)
            m.slots += info.slots
            if entry.digest in info.loaded:
                m.loaded_on.append(info.worker)
    return [by_name[k] for k in sorted(by_name)]
