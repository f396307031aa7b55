"""Simon Willison's `llm` CLI with the `llm-ollama` plugin, run as its users run it: a subprocess
with OLLAMA_HOST naming routeledger and its own LLM_USER_PATH. The plugin reads /api/tags and
/api/show for every command (it failed on every one with KeyError 'digest' while a model listed by
/api/tags had no digest), and names each model `ollama/NAME` (llm-ollama 0.19)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clients.fleet import Routeledger

LLM = Path(sys.executable).with_name("llm")


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llm's own folder (its keys, logs and the plugin's capability cache), for this module only."""
    return tmp_path_factory.mktemp("llm-user")


def llm(instance: Routeledger, user_dir: Path, *args: str) -> str:
    """What `llm ARGS` printed; it must have exited 0 and said nothing on stderr."""
    env = {**os.environ, "OLLAMA_HOST": instance.url, "LLM_USER_PATH": str(user_dir)}
    done = subprocess.run(
        [str(LLM), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    return done.stdout


def test_llm_models_lists_the_fleets_models(routeledger: Routeledger, user_dir: Path) -> None:
    listed = llm(routeledger, user_dir, "models").splitlines()
    ollama = {line.removeprefix("Ollama: ").split(" ")[0] for line in listed if line.startswith("Ollama: ")}
    # Chat models only: the plugin lists a model that cannot complete among the embedding models.
    assert {"ollama/qwen3:8b", "ollama/gemma3:4b", "ollama/elyza-jp-8b:latest", "ollama/auto"} <= ollama
    assert not any("nomic-embed-text" in name for name in ollama)


def test_llm_answers_a_prompt_with_a_fleet_model(routeledger: Routeledger, user_dir: Path) -> None:
    answer = llm(
        routeledger, user_dir, "-m", "ollama/qwen3:8b", "-o", "num_predict", "8", "Why is the sky blue?"
    )
    assert answer.strip()
    assert len(answer.split()) <= 8


def test_llm_embeds_a_text_with_the_fleets_embedding_model(routeledger: Routeledger, user_dir: Path) -> None:
    models = llm(routeledger, user_dir, "embed-models")
    vector = json.loads(llm(routeledger, user_dir, "embed", "-m", "ollama/nomic-embed-text", "-c", "hello"))
    assert "Ollama: ollama/nomic-embed-text:latest" in models
    assert len(vector) == 768
    assert all(isinstance(x, float) for x in vector)
