"""The manual's pictures, made rather than drawn: `make pictures` (or `python -m docs.pictures` from
the project's root) writes them into docs/img/, where the pages link them.

- `sim-<fleet>.png`: mean response vs load on the seed, trio and quad fleets, from the runs the
  simulator page's table reports (`routeledger sim schedule ... --plot`, the simulator's own chart
  code, seed 1, so a rerun gives the same bytes).
- `dashboard.png`: `/dashboard` of `routeledger up --demo` after it has served a few chats, taken
  by Debian's headless `chromium` (its `--screenshot` mode: no browser-automation package needed).

The script lives beside the pages it illustrates; mkdocs.yml keeps it out of the built site.
`--quick` draws small plots (a few hundred tasks at two loads) and no dashboard: the test's mode.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from routeledger.embedded import free_port

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"

# The runs behind the simulator page's "Measured: load and a slowdown" table, so that its plots and
# its figures come from the same simulations.
FLEETS = ("seed", "trio", "quad")
LOADS = "0.3,0.5,0.6,0.7,0.8,0.9,0.95"
POLICIES = "routeledger,sticky,pair,herd,best-threshold"
TASKS = 10_000

# The page is laid out for a wide screen; this height shows every card down to the first recent tasks.
WINDOW = (1400, 1700)
# Chats sent before the shot, so that the speed chart and the recent tasks have rows of this run
# (the demo's own trickle, one request per 5 s, would take minutes to fill them).
CHATS = 8
DASHBOARD = "dashboard.png"


@dataclass(frozen=True)
class PlotRun:
    fleet: str
    loads: str
    tasks: int


def plot_runs(quick: bool) -> list[PlotRun]:
    if quick:
        return [PlotRun("seed", "0.3,0.9", 300)]
    return [PlotRun(fleet, LOADS, TASKS) for fleet in FLEETS]


def names(quick: bool) -> list[str]:
    """The files a run writes, so that the test can hold docs/img/ and the pages to them."""
    return [f"sim-{run.fleet}.png" for run in plot_runs(quick)] + ([] if quick else [DASHBOARD])


def draw_plots(out: Path, runs: Sequence[PlotRun]) -> list[Path]:
    """One `routeledger sim schedule --plot` per fleet: the command a reader would run, so the
    picture is exactly what it draws."""
    written = []
    for run in runs:
        path = out / f"sim-{run.fleet}.png"  # as names() says
        argv = [sys.executable, "-m", "routeledger", "sim", "schedule", "--fleet", run.fleet]
        argv += ["--load", run.loads, "--policies", POLICIES, "--tasks", str(run.tasks)]
        # --json: one line, no table and no progress lines to wade through in a failure's output.
        argv += ["--seed", "1", "--json", "--plot", str(path)]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[1:])} failed:\n{done.stderr}")
        written.append(path)
    return written


def _wait(url: str, until: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until GET `url` answers 200 with `until` in its body, or fail if `up` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"routeledger up exited with {proc.returncode} before {url} answered")
        try:
            reply = httpx.get(url, timeout=2)
            if reply.status_code == 200 and until in reply.text:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not show {until!r} within {timeout:.0f} s")
        time.sleep(0.3)


def _chat(base: str, n: int) -> None:
    httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": "qwen3:8b",
            "messages": [{"role": "user", "content": f"Say hello in one line ({n})."}],
            # Short answers: the slow simulated laptop writes ~11 tokens a second.
            "max_tokens": 40,
        },
        timeout=120,
    ).raise_for_status()


def shoot_dashboard(out: Path, chromium: str) -> Path:
    """`up --demo` in its own data dir and process group, a few chats, the shot, then Ctrl-C."""
    path = out / DASHBOARD
    # chromium exits 0 without a picture when the folder is missing.
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="routeledger-pictures-") as data_dir:
        argv = [sys.executable, "-m", "routeledger", "up", "--demo", "--port", str(port)]
        argv += ["--data-dir", data_dir]
        # Its own session, so that SIGINT reaches `up` and every child it started, as Ctrl-C would.
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            # Generous: on a busy 2-core machine the demo's seven processes take a while to start.
            _wait(f"{base}/healthz", "", proc, 120)
            _wait(f"{base}/v1/models", "qwen3:8b", proc, 60)
            with concurrent.futures.ThreadPoolExecutor(CHATS) as pool:
                list(pool.map(lambda n: _chat(base, n), range(CHATS)))
            # The dashboard's overview follows the ledger at most once a second; let it catch up.
            time.sleep(3)
            with tempfile.TemporaryDirectory(prefix="routeledger-chromium-") as profile:
                shot = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
                shot += [f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}"]
                # Virtual time runs the page's scripts until its first data has been fetched and drawn.
                shot += ["--virtual-time-budget=5000", f"--screenshot={path}", f"{base}/dashboard"]
                subprocess.run(shot, capture_output=True, timeout=120, check=True)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    if not path.exists():
        raise RuntimeError(f"chromium wrote no screenshot at {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.pictures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=IMG, help="where the pictures go (default docs/img)")
    parser.add_argument("--quick", action="store_true", help="small plots and no dashboard (the test's)")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    written = draw_plots(out, plot_runs(args.quick))
    if not args.quick:
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is None:
            sys.stderr.write("the dashboard's picture needs Debian's chromium: apt-get install -y chromium\n")
            return 2
        written.append(shoot_dashboard(out, chromium))
    for path in written:
        sys.stdout.write(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}\n")
    sys.stdout.write(f"in {time.monotonic() - started:.0f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
