"""Pulling a model onto the fleet through routeledger, as Ollama's clients pull one: `ollama.Client.pull`
pulls elyza-jp-8b onto rtx3070ti (the one machine lacking it) and the next requests for it can run
there; `POST /api/pull` streams Ollama's progress lines, each naming its machine (`worker`, an
extension, which may also name the one machine to pull onto); `DELETE /api/delete` removes it.
Each test has a routeledger of its own, since each changes what a machine holds."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import ollama

from tests.clients.fleet import Routeledger, eventually, holders

MODEL = "elyza-jp-8b"


def holders_once(instance: Routeledger, wanted: list[str]) -> list[str] | None:
    """The model's holders when they are `wanted` (the worker reports its machine's models at its
    next heartbeat), else None."""
    found = sorted(holders(instance, MODEL))
    return found if found == wanted else None


def ran_on(instance: Routeledger, i: int) -> str:
    """The machine that ran one request for the model (X-Routeledger-Worker)."""
    answer = httpx.post(
        instance.url + "/api/generate",
        json={
            "model": MODEL,
            "prompt": f"日本の首都は? ({i})",
            "stream": False,
            "options": {"num_predict": 8},
        },
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["response"].strip()
    return answer.headers["x-routeledger-worker"]


def test_the_ollama_sdk_pulls_a_model_onto_the_only_machine_lacking_it_and_it_runs_there(
    fresh_routeledger: Routeledger,
) -> None:
    assert holders(fresh_routeledger, MODEL) == ["macbookair"]
    pulled = ollama.Client(host=fresh_routeledger.url).pull(MODEL)
    assert pulled.status == "success"
    both = eventually(
        lambda: holders_once(fresh_routeledger, ["macbookair", "rtx3070ti"]), what=f"{MODEL} on rtx3070ti"
    )

    def some_on_the_gpu_pc() -> set[str] | None:
        # Three at once, one slot a machine: the GPU PC runs some of them whichever it is ranked,
        # once the router's view of the leases (cached for a moment) has it holding the model.
        with ThreadPoolExecutor(3) as pool:
            machines = set(pool.map(lambda i: ran_on(fresh_routeledger, i), range(3)))
        return machines if "rtx3070ti" in machines else None

    machines = eventually(some_on_the_gpu_pc, timeout=5.0, what=f"a request for {MODEL} run on rtx3070ti")
    assert both == ["macbookair", "rtx3070ti"]
    assert machines <= {"macbookair", "rtx3070ti"}


def test_a_streamed_pull_naming_a_machine_answers_ollamas_progress_lines_each_naming_it(
    fresh_routeledger: Routeledger,
) -> None:
    with httpx.stream(
        "POST",
        fresh_routeledger.url + "/api/pull",
        json={"model": MODEL, "stream": True, "worker": "rtx3070ti"},
        timeout=60,
    ) as answer:
        status = answer.status_code
        kind = answer.headers.get("content-type", "")
        lines: list[dict[str, Any]] = [json.loads(line) for line in answer.iter_lines() if line.strip()]
    assert status == 200, lines
    assert kind.startswith("application/x-ndjson")
    statuses = [line.get("status") for line in lines]
    assert statuses[0] == "pulling manifest", lines
    assert statuses[-1] == "success", lines
    assert not any("error" in line for line in lines), lines
    # Every machine's own line names it; the closing success may speak for the whole pull.
    assert all(line.get("worker") == "rtx3070ti" for line in lines[:-1]), lines
    assert lines[-1].get("worker", "rtx3070ti") == "rtx3070ti", lines
    assert eventually(lambda: holders_once(fresh_routeledger, ["macbookair", "rtx3070ti"]), what="the pull")


def test_a_pull_without_streaming_answers_success_once_the_machine_has_it(
    fresh_routeledger: Routeledger,
) -> None:
    answer = httpx.post(
        fresh_routeledger.url + "/api/pull",
        json={"model": MODEL, "stream": False, "worker": "rtx3070ti"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "success"
    assert eventually(lambda: holders_once(fresh_routeledger, ["macbookair", "rtx3070ti"]), what="the pull")


def test_delete_naming_a_machine_removes_the_model_from_that_machine_only(
    fresh_routeledger: Routeledger,
) -> None:
    pulled = httpx.post(
        fresh_routeledger.url + "/api/pull",
        json={"model": MODEL, "stream": False, "worker": "rtx3070ti"},
        timeout=60,
    )
    assert pulled.status_code == 200, pulled.text
    eventually(lambda: holders_once(fresh_routeledger, ["macbookair", "rtx3070ti"]), what="the pull")
    deleted = httpx.request(
        "DELETE",
        fresh_routeledger.url + "/api/delete",
        json={"model": MODEL, "worker": "rtx3070ti"},
        timeout=60,
    )
    assert deleted.status_code == 200, deleted.text
    assert eventually(lambda: holders_once(fresh_routeledger, ["macbookair"]), what="the delete") == [
        "macbookair"
    ]
