"""The far side of a LAN, made on this machine: one Linux network namespace per remote machine,
joined to this one by a veth pair, so that a process started in it has an address of its own and
reaches this side only through the veth (traffic never leaves the machine).

Made with `ip netns` where the kernel and our rights allow it (root, `ip` on PATH); otherwise every
side is loopback, with the same addresses to listen on and no command prefix, so that a test written
for namespaces still runs. `ROUTELEDGER_TEST_NETNS=0` asks for loopback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Side:
    """One remote machine: `near` is this side's address on its link (where proxies for it
    listen), `far` its own address, `prefix` what starts a command on it."""

    name: str
    near: str
    far: str
    prefix: tuple[str, ...]

    @property
    def isolated(self) -> bool:
        """Whether it is a namespace of its own (else loopback)."""
        return bool(self.prefix)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _may_make_namespaces() -> bool:
    if os.environ.get("ROUTELEDGER_TEST_NETNS", "1") == "0":
        return False
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") is not None


def _make(name: str, index: int, tag: str) -> Side:
    ns, host_end, far_end = f"rl{tag}{name}", f"rl{tag}{name}h", f"rl{tag}{name}n"
    # A /30 per side out of 10.231.0.0/16, varied by process so that two runs do not collide.
    third, fourth = (os.getpid() // 64) % 250, (os.getpid() % 64) * 4
    base = f"10.{231 + index}.{third}."
    near, far = base + str(fourth + 1), base + str(fourth + 2)
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_end, "type", "veth", "peer", "name", far_end)
        _ip("link", "set", far_end, "netns", ns)
        _ip("addr", "add", f"{near}/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("-n", ns, "addr", "add", f"{far}/30", "dev", far_end)
        _ip("-n", ns, "link", "set", far_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.SubprocessError, OSError):
        _remove(ns)
        raise
    return Side(name=name, near=near, far=far, prefix=("ip", "netns", "exec", ns))


def _remove(ns: str) -> None:
    # Deleting the namespace deletes the veth pair with it (once no process is left inside).
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        _ip("netns", "del", ns)


@contextlib.contextmanager
def far_sides(names: Sequence[str]) -> Iterator[dict[str, Side]]:
    """One Side per name: a namespace each where possible, loopback otherwise; namespaces are
    removed when the block ends, however it ends (stop the processes in them first)."""
    tag = format(os.getpid() % 4096, "x")
    made: list[str] = []
    sides: dict[str, Side] = {}
    try:
        if _may_make_namespaces():
            try:
                for index, name in enumerate(names):
                    side = _make(name, index, tag)
                    made.append(side.prefix[-1])
                    sides[name] = side
            except (subprocess.SubprocessError, OSError):
                for ns in made:
                    _remove(ns)
                made.clear()
                sides.clear()
        for name in names:
            sides.setdefault(name, Side(name=name, near="127.0.0.1", far="127.0.0.1", prefix=()))
        yield sides
    finally:
        for ns in made:
            _remove(ns)
