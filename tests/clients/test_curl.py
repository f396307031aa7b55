"""Ollama's documented curl examples, run with the real `curl` binary as the docs show them: the
body given with `-d` and no Content-Type header (curl then sends
`application/x-www-form-urlencoded`, which Ollama reads as JSON all the same)."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest

from tests.clients.fleet import Routeledger

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl binary")


def curl(*args: str) -> str:
    """What `curl -sS ARGS` printed; it must have exited 0."""
    done = subprocess.run(["curl", "-sS", *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def curl_json(url: str, *args: str) -> tuple[int, Any]:
    """The HTTP status and the JSON body curl got."""
    out = curl("-w", "\n%{http_code}", url, *args)
    body, _, status = out.rpartition("\n")
    return int(status), json.loads(body)


def ndjson(out: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert lines and all(isinstance(line, dict) for line in lines), out
    return lines


def test_the_documented_generate_example_answers_200_with_a_response(routeledger: Routeledger) -> None:
    status, answer = curl_json(
        routeledger.url + "/api/generate", "-d", '{"model":"qwen3:8b","prompt":"hi","stream":false}'
    )
    assert status == 200, answer
    assert isinstance(answer["response"], str) and answer["response"].strip()
    assert answer["model"] == "qwen3:8b"
    assert answer["done"] is True
    assert answer["eval_count"] > 0


def test_a_streamed_generate_answers_ndjson_lines_the_last_one_done(routeledger: Routeledger) -> None:
    lines = ndjson(
        curl(
            routeledger.url + "/api/generate",
            "-d",
            '{"model":"qwen3:8b","prompt":"Why is the sky blue?","options":{"num_predict":12}}',
        )
    )
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(line["response"] for line in lines).strip()
    assert lines[-1]["done_reason"] == "length"
    assert lines[-1]["eval_count"] == 12


def test_a_streamed_chat_answers_ndjson_lines_the_last_one_done(routeledger: Routeledger) -> None:
    lines = ndjson(
        curl(
            routeledger.url + "/api/chat",
            "-d",
            '{"model":"qwen3:8b","messages":[{"role":"user","content":"why is the sky blue?"}],'
            '"options":{"num_predict":12}}',
        )
    )
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert all(line["message"]["role"] == "assistant" for line in lines)
    assert "".join(line["message"]["content"] for line in lines).strip()
    assert lines[-1]["eval_count"] == 12


def test_tags_lists_every_model_the_fleet_serves(routeledger: Routeledger) -> None:
    status, tags = curl_json(routeledger.url + "/api/tags")
    assert status == 200
    names = {m["name"] for m in tags["models"]}
    assert {"qwen3:8b", "gemma3:4b", "nomic-embed-text:latest", "elyza-jp-8b:latest"} <= names
    assert all(len(m["digest"]) == 64 and m["details"] for m in tags["models"])


def test_show_tells_a_models_capabilities_and_details(routeledger: Routeledger) -> None:
    status, shown = curl_json(routeledger.url + "/api/show", "-d", '{"model":"qwen3:8b"}')
    assert status == 200, shown
    assert shown["capabilities"] == ["completion", "tools", "thinking"]
    assert shown["details"]["family"] == "qwen3"
    assert shown["details"]["parameter_size"] == "8.2B"
    assert sorted(shown["model_info"]["routeledger.holders"]) == ["macbookair", "rtx3070ti"]


def test_embed_answers_one_vector_of_768_numbers_per_input(routeledger: Routeledger) -> None:
    status, embedded = curl_json(
        routeledger.url + "/api/embed",
        "-d",
        '{"model":"nomic-embed-text","input":["Why is the sky blue?","Why is the grass green?"]}',
    )
    assert status == 200, embedded
    vectors = embedded["embeddings"]
    assert [len(v) for v in vectors] == [768, 768]
    assert vectors[0] != vectors[1]
    assert all(isinstance(x, float) for x in vectors[0])


def test_options_on_a_task_answers_allow_with_get_and_delete(routeledger: Routeledger) -> None:
    # Its own task id: the methods a task's URL allows do not depend on the task existing.
    out = curl("-i", "-X", "OPTIONS", routeledger.url + "/v1/tasks/0123456789abcdef0123456789abcdef")
    head = out.split("\r\n\r\n", 1)[0].splitlines()
    allow = next((line.split(":", 1)[1] for line in head if line.lower().startswith("allow:")), "")
    assert {m.strip() for m in allow.split(",")} >= {"GET", "DELETE"}, head
