"""Open WebUI, unchanged, with routeledger as its Ollama connection and the demo's embedding model as
its RAG engine: it lists the fleet's models, indexes an uploaded document (its embeddings come from
nomic-embed-text through routeledger) and answers a chat about it with the document as a source.

Open WebUI is a 7 GB install with its own database and vector store, so it is not a dependency and
this test runs only where `ROUTELEDGER_OPEN_WEBUI` names its `open-webui` executable (say, after
`python3 -m venv /tmp/owui && /tmp/owui/bin/pip install open-webui`); CI leaves it out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.clients.fleet import Routeledger

EXECUTABLE = os.environ.get("ROUTELEDGER_OPEN_WEBUI", "")
pytestmark = pytest.mark.skipif(
    not EXECUTABLE, reason="set ROUTELEDGER_OPEN_WEBUI to an open-webui executable to run it"
)
DOCUMENT = (
    "The router sent two months of work to a machine 7.3 times slower than the one beside it.\n"
    "The GPU PC answered qwen3:8b at 83 tokens per second; the laptop at 11.4.\n"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def open_webui(instance: Routeledger, data_dir: Path) -> Iterator[str]:
    """Open WebUI on a port of its own, offline, without sign-up, routeledger its Ollama."""
    port = _free_port()
    env = {
        **os.environ,
        "OLLAMA_BASE_URL": instance.url,
        "ENABLE_OPENAI_API": "false",
        "WEBUI_AUTH": "False",
        "RAG_EMBEDDING_ENGINE": "ollama",
        "RAG_EMBEDDING_MODEL": "nomic-embed-text:latest",
        "RAG_OLLAMA_BASE_URL": instance.url,
        "DATA_DIR": str(data_dir),
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
    }
    log = (data_dir / "open-webui.log").open("w")
    proc = subprocess.Popen(
        # In its data dir: it writes a secret key file where it starts.
        [EXECUTABLE, "serve", "--port", str(port)],
        env=env,
        cwd=data_dir,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, (data_dir / "open-webui.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        else:
            raise AssertionError("Open WebUI did not come up in 180 s")
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_open_webui_indexes_a_document_with_the_demos_embedding_model_and_answers_from_it(
    routeledger: Routeledger, tmp_path: Path
) -> None:
    with open_webui(routeledger, tmp_path) as base, httpx.Client(base_url=base, timeout=120) as ui:
        signed: Any = ui.post("/api/v1/auths/signin", json={"email": "admin@localhost", "password": ""})
        ui.headers["Authorization"] = f"Bearer {signed.json()['token']}"
        models = [m["id"] for m in ui.get("/api/models").json()["data"]]
        uploaded = ui.post("/api/v1/files/", files={"file": ("story.txt", DOCUMENT, "text/plain")}).json()
        deadline = time.monotonic() + 60
        status = "pending"
        while status == "pending" and time.monotonic() < deadline:
            time.sleep(0.5)
            status = ui.get(f"/api/v1/files/{uploaded['id']}/process/status").json()["status"]
        file = ui.get(f"/api/v1/files/{uploaded['id']}").json()
        answer = ui.post(
            "/api/chat/completions",
            json={
                "model": "qwen3:8b",
                "stream": False,
                "messages": [{"role": "user", "content": "How much slower was the laptop?"}],
                "files": [{"type": "file", "id": uploaded["id"]}],
            },
        ).json()
    assert {"qwen3:8b", "nomic-embed-text:latest", "auto"} <= set(models)
    # Indexed: its chunks were embedded (by nomic-embed-text through routeledger) without an error.
    assert status == "completed" and file["data"]["error"] is None, file
    # The chat retrieved the document (its query embedded the same way) and the model answered.
    assert answer["sources"][0]["source"]["id"] == uploaded["id"]
    assert "7.3 times slower" in answer["sources"][0]["document"][0]
    assert answer["choices"][0]["message"]["content"]
