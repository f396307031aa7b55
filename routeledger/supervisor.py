"""Starts, watches and stops the child processes of `routeledger up`.

A child that dies unexpectedly is restarted with a growing delay; Ctrl-C or SIGTERM stops every
child, newest first, with SIGTERM and then SIGKILL. On Linux every child also gets SIGTERM if the
supervisor itself dies, so that nothing is left running after a crash of `up`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("routeledger.supervisor")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux); runs in a child between fork and exec."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def python_argv(*args: str) -> list[str]:
    """argv that runs `routeledger ARGS` with this interpreter."""
    return [sys.executable, "-m", "routeledger", *args]


@dataclass
class ChildProcess:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    restart: bool = True
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    on_exit: Callable[[ChildProcess, int], None] | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """A small process supervisor for one machine's routeledger processes."""

    def __init__(self, max_backoff_s: float = 30.0) -> None:
        self.children: list[ChildProcess] = []
        self.max_backoff_s = max_backoff_s
        self._stopping = False

    def spawn(
        self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None, restart: bool = True
    ) -> ChildProcess:
        child = ChildProcess(name=name, argv=list(argv), env=env, restart=restart)
        self.children.append(child)
        self._start(child)
        return child

    def _start(self, child: ChildProcess) -> None:
        env = dict(os.environ)
        if child.env:
            env.update(child.env)
        kwargs: dict[str, object] = {}
        if sys.platform.startswith("linux"):
            kwargs["preexec_fn"] = die_with_parent
        child.proc = subprocess.Popen(child.argv, env=env, stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]
        child.started_at = time.monotonic()
        log.debug("started %s (pid %s)", child.name, child.proc.pid)

    def poll(self) -> list[tuple[ChildProcess, int]]:
        """Check every child once; restart the ones that died. Returns (child, exit code) of those."""
        died: list[tuple[ChildProcess, int]] = []
        now = time.monotonic()
        for child in self.children:
            if child.proc is None:
                if child.restart and not self._stopping and now >= child.next_start:
                    self._start(child)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            died.append((child, code))
            child.proc = None
            if child.restart and not self._stopping:
                # A child that ran for a while gets a fresh backoff; one that keeps dying waits longer.
                if now - child.started_at > 60:
                    child.restarts = 0
                delay = min(self.max_backoff_s, 0.5 * 2**child.restarts)
                child.restarts += 1
                child.next_start = now + delay
                log.warning("%s exited with %s; restarting in %.1fs", child.name, code, delay)
        return died

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every child, newest first; SIGKILL what is still alive after `timeout`."""
        self._stopping = True
        for child in reversed(self.children):
            if child.alive:
                assert child.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in reversed(self.children):
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", child.name, timeout)
                child.proc.kill()
                child.proc.wait()
            child.proc = None
