"""What a real llama-server says about its model and what it refuses: one GGUF started from two
paths is one model, named by its file; an embedding it cannot make is the client's error at once."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from events.event import TaskClaimed, TaskFailed, TaskReclaimed, TaskSubmitted
from tests.real.fleet import Machine, RealFleet
from tests.real.llama import PORTABLE, LlamaServer


@pytest.fixture(scope="module")
def twin(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    """Two chat-only servers of the same GGUF, one started from another path (a link elsewhere)."""
    tmp = tmp_path_factory.mktemp("twin")
    elsewhere = tmp / "models" / "copy"
    elsewhere.mkdir(parents=True)
    os.symlink(gguf, elsewhere / gguf.name)
    fleet = RealFleet(
        tmp / "data",
        [
            Machine("one", LlamaServer(gguf, threads=1, name="one", extra=PORTABLE, log_dir=tmp)),
            Machine(
                "two", LlamaServer(elsewhere / gguf.name, threads=1, name="two", extra=PORTABLE, log_dir=tmp)
            ),
        ],
    )
    with fleet:
        yield fleet


def test_the_same_gguf_started_from_two_paths_is_one_model_with_two_holders(
    twin: RealFleet, gguf: Path
) -> None:
    name = gguf.name.removesuffix(".gguf")
    assert twin.model() == name
    fleet = httpx.get(twin.base + "/v1/fleet", timeout=10).json()
    assert fleet["capacity"] == {name: 2}
    tags = httpx.get(twin.base + "/api/tags", timeout=10).json()["models"]
    assert [m["name"] for m in tags if m["name"] == name] == [name]
    # Asked for by its name, its file's name or the path one server was started with.
    for asked in (name, gguf.name, str(gguf)):
        answer = twin.chat("Say hello.", model=asked, max_tokens=8)
        assert answer.status == 200, (asked, answer.text)


def test_an_embedding_request_to_a_chat_only_server_is_the_clients_error_at_once(twin: RealFleet) -> None:
    name = twin.model()
    answers = []
    for i in range(6):
        path = "/api/embed" if i % 2 else "/v1/embeddings"
        t0 = time.monotonic()
        resp = httpx.post(twin.base + path, json={"model": name, "input": f"hello {i}"}, timeout=30)
        took = time.monotonic() - t0
        assert resp.status_code == 400, (path, resp.status_code, resp.text)
        assert took <= 2.0, (path, took)
        error = resp.json()["error"]
        answers.append(error["message"] if path.startswith("/v1/") else error)
        time.sleep(0.6)  # the API reads leases at most 0.5 s old
    # Each holder's server said 501 once: after that, the model is known to lack embeddings and
    # a request is refused before any worker, naming the fix.
    reached = [a for a in answers if "does not support embeddings" in a]
    assert 1 <= len(reached) <= 2, answers
    assert all("cannot embed" in a and "--embeddings" in a for a in answers[len(reached) :]), answers
    # Nothing was retried: every embedding task was claimed once, failed as not retryable, and
    # never reclaimed.
    embeds = {
        e.task_id for e in twin.events(TaskSubmitted) if isinstance(e, TaskSubmitted) and e.kind == "embed"
    }
    assert len(embeds) == len(reached)
    claims = [e for e in twin.events(TaskClaimed) if isinstance(e, TaskClaimed) and e.task_id in embeds]
    assert len(claims) == len(embeds)
    failed = [e for e in twin.events(TaskFailed) if isinstance(e, TaskFailed) and e.task_id in embeds]
    assert [(e.kind, e.retryable) for e in failed] == [("unsupported", False)] * len(embeds), failed
    assert not [e for e in twin.events(TaskReclaimed) if isinstance(e, TaskReclaimed) and e.task_id in embeds]
    # Chat still works there.
    assert twin.chat("Say hi.", max_tokens=8).status == 200
