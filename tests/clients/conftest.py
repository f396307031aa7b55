"""The client tier: real third-party clients, unchanged, against a running routeledger.

Every test here is marked `clients` (part of `make test`; `make test-clients` runs the tier alone).
Each module gets one routeledger (tests/clients/fleet.py: the demo fleet's macbookair and rtx3070ti
simulated, a worker agent in front of each, the API), started in a fraction of a second; a test that
changes the fleet (pulling a model) asks for `fresh_routeledger`, an instance of its own.

Two clients read their environment the way their users set it up offline, as this machine and CI
are (no network but the package registries):
- tiktoken (OpenAIEmbeddings, and the API when it decodes token arrays) downloads cl100k_base on first
  use unless TIKTOKEN_CACHE_DIR holds it; litellm ships that file, so the cache is litellm's copy.
- litellm fetches its model price list from GitHub at import unless told to use its bundled copy.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.clients.fleet import Routeledger, running_routeledger


def _litellm_tokenizers() -> str:
    """The folder of `litellm.litellm_core_utils.tokenizers`, found without importing litellm."""
    spec = importlib.util.find_spec("litellm")
    assert spec is not None and spec.origin is not None, (
        "the client tier needs litellm (pip install -e '.[dev]')"
    )
    folder = Path(spec.origin).parent / "litellm_core_utils" / "tokenizers"
    assert folder.is_dir(), f"litellm no longer ships its tokenizers in {folder}"
    return str(folder)


os.environ.setdefault("TIKTOKEN_CACHE_DIR", _litellm_tokenizers())
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.clients)


@pytest.fixture(scope="module")
def routeledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routeledger]:
    """One running routeledger for the module's tests, which leave its fleet as they found it."""
    with running_routeledger(tmp_path_factory.mktemp("routeledger")) as instance:
        yield instance


@pytest.fixture
def fresh_routeledger(tmp_path: Path) -> Iterator[Routeledger]:
    """A routeledger of this test's own, for a test that changes what the fleet holds."""
    with running_routeledger(tmp_path) as instance:
        yield instance
