"""Who serves a model: one rule for submission, the model lists, benchmarks and the router's view."""

from __future__ import annotations

import pytest

from dispatch.errors import ModelNotServedError
from dispatch.serving import (
    capabilities,
    catalog,
    find_holders,
    holdings,
    lacks,
    require_model,
    resolve_models,
    served,
)
from events.event import ModelEntry
from tasks.lease import LeaseInfo

QWEN = ModelEntry(name="qwen3:8b", digest="a" * 64)
QWEN_LATEST = ModelEntry(name="qwen3:latest", digest="a" * 64)
ELYZA = ModelEntry(name="elyza-jp-8b", digest="b" * 64)


def lease(name: str, *models: ModelEntry, **fields: object) -> LeaseInfo:
    return LeaseInfo(worker=name, token="t", slots=2, inventory=list(models), **fields)  # type: ignore[arg-type]


def test_a_draining_worker_serves_nothing_anywhere() -> None:
    leases = {"gpu": lease("gpu", QWEN, draining=True), "mac": lease("mac", QWEN, ELYZA)}
    assert served(leases["gpu"]) == []
    assert find_holders("qwen3:8b", leases) == (QWEN.digest, ["mac"])
    assert [m.holders for m in catalog(leases)] == [["mac"], ["mac"]]
    assert [w for w, _, _ in holdings(leases)] == ["mac", "mac"]
    only_draining = {"gpu": leases["gpu"]}
    with pytest.raises(ModelNotServedError, match="gpu serves nothing"):
        require_model("qwen3:8b", only_draining)
    assert resolve_models("auto", only_draining) is None


def test_a_worker_serves_what_its_lease_names_and_an_empty_list_serves_nothing() -> None:
    leases = {
        "mac": lease("mac", QWEN, ELYZA, serves=["elyza-jp-8b"]),
        "nas": lease("nas", QWEN, serves=[]),
    }
    assert served(leases["mac"]) == [ELYZA]
    assert served(leases["nas"]) == []
    assert find_holders("qwen3:8b", leases) == (None, [])
    assert resolve_models("auto", leases) == {"elyza-jp-8b": ELYZA.digest}


def test_a_model_is_named_by_name_alias_or_digest_prefix_and_aliases_of_one_digest_count_once() -> None:
    leases = {"gpu": lease("gpu", QWEN, QWEN_LATEST), "mac": lease("mac", QWEN)}
    assert find_holders("qwen3", leases) == (QWEN.digest, ["gpu"])
    assert find_holders("a" * 12, leases) == (QWEN.digest, ["gpu", "mac"])
    assert find_holders("a" * 11, leases) == (None, [])
    # Two names of one digest on one worker: one benchmark target, one slot count per name.
    assert holdings(leases, "a" * 12) == [("gpu", "qwen3:8b", QWEN.digest), ("mac", "qwen3:8b", QWEN.digest)]
    by_name = {m.name: (m.holders, m.slots) for m in catalog(leases)}
    assert by_name == {"qwen3:8b": (["gpu", "mac"], 4), "qwen3:latest": (["gpu"], 2)}


def test_a_model_lacks_a_capability_only_when_every_live_holder_reports_capabilities_without_it() -> None:
    plain = ModelEntry(name="qwen3:8b", digest="a" * 64, capabilities=["completion"])
    tooled = ModelEntry(name="qwen3:8b", digest="a" * 64, capabilities=["completion", "tools"])
    unknown = QWEN
    both_plain = {"gpu": lease("gpu", plain), "mac": lease("mac", plain)}
    assert lacks(QWEN.digest, "tools", both_plain)
    assert capabilities(QWEN.digest, both_plain) == ["completion"]
    # A holder whose backend cannot say, or says otherwise, lets the request through.
    assert not lacks(QWEN.digest, "tools", {"gpu": lease("gpu", plain), "mac": lease("mac", unknown)})
    assert not lacks(QWEN.digest, "tools", {"gpu": lease("gpu", plain), "mac": lease("mac", tooled)})
    # A draining holder is no holder; a model nobody serves lacks nothing it could be asked for.
    assert not lacks(QWEN.digest, "tools", {"gpu": lease("gpu", plain, draining=True)})
