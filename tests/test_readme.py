"""The README, as a newcomer uses it: its first-request commands, taken from the README itself, run
against `routeledger up --demo`, and its links lead somewhere in the repository."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from routeledger.embedded import free_port
from tests.test_cli import _wait_healthy

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The port the README shows (the API's default); the test rewrites only this.
SHOWN = "localhost:8600"
# A block the test runs is marked in the README by this comment on the line before its fence.
MARKED = re.compile(r"<!-- readme-test: (\w+) -->\n```\w*\n(.*?)\n```", re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(kind: str) -> list[str]:
    return [body for k, body in MARKED.findall(README.read_text()) if k == kind]


def _commands(block: str) -> list[str]:
    """A shell block's commands, one each, with backslash-continued lines joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _on(port: int, text: str) -> str:
    assert SHOWN in text, f"a marked block does not show {SHOWN}, so the test cannot point it at the demo"
    return text.replace(SHOWN, f"localhost:{port}")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """`routeledger up --demo` on a free port and its own data dir, ready once its workers serve
    qwen3:8b (healthz answers before the simulated machines' workers have joined)."""
    port = free_port()
    data_dir = tmp_path_factory.mktemp("demo")
    argv = [sys.executable, "-m", "routeledger", "up", "--demo", "--port", str(port)]
    argv += ["--data-dir", str(data_dir)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        deadline = time.monotonic() + 30
        while "qwen3:8b" not in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).text:
            assert time.monotonic() < deadline, "the demo's workers never came online"
            time.sleep(0.2)
        yield port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)


def test_the_readme_marks_one_curl_block_and_two_python_snippets_to_run() -> None:
    assert len(_blocks("curl")) == 1
    assert len(_blocks("python")) == 2


@pytest.mark.clients
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl binary")
def test_the_readmes_curl_commands_each_get_an_answer_from_the_demo(demo: int) -> None:
    commands = _commands(_on(demo, _blocks("curl")[0]))
    assert len(commands) == 3
    for command in commands:
        done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{command}\n{done.stderr}"
        answer = json.loads(done.stdout)
        if "/v1/models" in command:
            assert "qwen3:8b" in {m["id"] for m in answer["data"]}
        elif "/v1/chat/completions" in command:
            assert answer["choices"][0]["message"]["content"], done.stdout
        else:
            assert answer["message"]["content"] and answer["done"], done.stdout


@pytest.mark.clients
@pytest.mark.parametrize("index", [0, 1], ids=["openai", "ollama"])
def test_each_python_snippet_of_the_readme_prints_an_answer_from_the_demo(demo: int, index: int) -> None:
    snippet = _on(demo, _blocks("python")[index])
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the snippet printed no answer"


def test_the_readme_is_a_guide_of_at_most_200_lines() -> None:
    assert len(README.read_text().splitlines()) <= 200


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs gives a page's headings (its toc extension's slugs)."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), re.M):
        text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        found.add(re.sub(r"[-\s]+", "-", text))
    return found


def test_every_relative_link_in_the_readme_leads_to_a_file_in_the_repository() -> None:
    links = [link for link in LINK.findall(README.read_text()) if not re.match(r"[a-z]+:", link)]
    assert links, "the README links into docs/"
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path).resolve()
        # ../shared/ exists beside a checkout on the development machine, not in the repository.
        assert target.is_relative_to(ROOT), f"{link} leaves the repository"
        assert target.exists(), f"{link}: no such file"
        if anchor:
            assert anchor in _anchors(target), f"{link}: {path} has no heading with that id"
