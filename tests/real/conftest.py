"""The real-server tier: routeledger in front of real llama.cpp servers (`make test-real`).

Every test here is marked `real`, which `make test` leaves out (it needs a llama-server built
once per machine, about 15 minutes on two cores, and runs for several minutes itself). Two
machines of unequal speed are two `llama-server` processes with one thread each, the slow one held
to a quarter of a core by `cpulimit`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real.fleet import Machine, RealFleet
from tests.real.llama import OTHER_CPUS, fast_server, model_path, slow_server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real)


@pytest.fixture(scope="session")
def gguf() -> Path:
    """The real model's file (built and downloaded once per machine)."""
    return model_path()


@pytest.fixture
def fleet(gguf: Path, tmp_path: Path) -> Iterator[RealFleet]:
    """routeledger up, a fast and a slow llama-server, a worker beside each; online, nothing measured."""
    f = RealFleet(
        tmp_path / "data",
        [Machine("fast", fast_server(gguf, tmp_path)), Machine("slow", slow_server(gguf, tmp_path))],
    )
    # The test's own clients keep off the fast server's core too (tests.real.llama.FAST_CPUS).
    before = os.sched_getaffinity(0)
    if OTHER_CPUS is not None:
        os.sched_setaffinity(0, {int(c) for c in OTHER_CPUS.split(",")})
    try:
        with f:
            yield f
    finally:
        os.sched_setaffinity(0, before)
