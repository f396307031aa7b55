"""A worker's start: settings that no wait can mend stop it at once (exit 2, naming the setting),
a Redis that does not answer is waited for, a signal stops it at any stage, and a start that fails
leaves no lease behind. Real worker processes against the suite's real Redis servers."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import pytest
import redis.asyncio as aioredis

from events.keys import Keys
from events.scripts import load_library
from routeledger.certs import ensure_server_tls
from routeledger.cli_acl import worker_acl_rules
from routeledger.embedded import free_port
from tests.reliability.support import spawn_worker

# Nothing listens there: the worker's backend is never reached before Redis turns it away.
NO_BACKEND = "http://127.0.0.1:9"


def _exits(proc: subprocess.Popen[bytes], log: Path, within_s: float) -> tuple[int, str, float]:
    """The worker's exit status, what it said on stderr and how long it ran."""
    started = time.monotonic()
    try:
        code = proc.wait(within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the worker still ran after {within_s}s: {log.read_text()}") from None
    return code, " ".join(log.read_text().split()), time.monotonic() - started


def _with_password(url: str, password: str, user: str = "") -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password)}@{host}"))


@contextlib.contextmanager
def _silent_listener() -> Iterator[int]:
    """A port that accepts connections and never answers (a Redis that hangs, a wrong service)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


def test_a_wrong_password_stops_the_worker_with_exit_2_naming_the_password(
    redis_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "w.log"
    proc = spawn_worker(_with_password(redis_url, "not-the-password"), NO_BACKEND, "w", log)
    code, said, ran = _exits(proc, log, 10)
    assert code == 2 and ran < 10
    assert "refused the password" in said and "--redis-url" in said
    assert "Traceback" not in said and "Retrying" not in said


@pytest.mark.tls
def test_a_wrong_ca_stops_the_worker_with_exit_2_naming_the_ca_setting(
    tls_redis_url: str, tmp_path: Path
) -> None:
    other_ca = ensure_server_tls(tmp_path / "other", ["127.0.0.1"]).ca
    parts = urlsplit(tls_redis_url)
    query = "&".join(
        f"ssl_ca_certs={quote(str(other_ca), safe='')}" if q.startswith("ssl_ca_certs=") else q
        for q in parts.query.split("&")
    )
    log = tmp_path / "w.log"
    proc = spawn_worker(urlunsplit(parts._replace(query=query)), NO_BACKEND, "w", log)
    code, said, _ = _exits(proc, log, 10)
    assert code == 2
    assert "TLS certificate" in said and "ssl_ca_certs" in said and "redis_ca" in said
    assert "tls/ca.crt" in said and "Traceback" not in said


def test_an_address_where_nothing_listens_stops_the_worker_within_10_s_naming_the_url(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    proc = spawn_worker(f"redis://127.0.0.1:{free_port()}/0", NO_BACKEND, "w", log)
    code, said, ran = _exits(proc, log, 10)
    assert code == 2 and ran < 10
    assert "connection refused" in said and "--redis-url" in said and "Traceback" not in said


def test_a_host_name_that_does_not_resolve_stops_the_worker_naming_the_url(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    proc = spawn_worker("redis://no-such-host.invalid:6379/0", NO_BACKEND, "w", log)
    code, said, _ = _exits(proc, log, 10)
    assert code == 2
    assert "does not resolve" in said and "--redis-url" in said and "Traceback" not in said


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_stops_a_worker_waiting_on_a_redis_that_never_answers_within_5_s(
    tmp_path: Path, sig: signal.Signals
) -> None:
    log = tmp_path / "w.log"
    with _silent_listener() as port:
        proc = spawn_worker(f"redis://127.0.0.1:{port}/0", NO_BACKEND, "w", log)
        try:
            # A Redis that does not answer may be restarting: the worker waits for it, and says so.
            deadline = time.monotonic() + 20
            while "waiting for Redis" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proc.poll() is None, log.read_text()
            proc.send_signal(sig)
            code, said, ran = _exits(proc, log, 5)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert ran < 5 and code != 0
    assert "waiting for Redis" in said and "Ctrl-C or SIGTERM stops" in said and "Traceback" not in said


async def _acl_worker(admin: aioredis.Redis, name: str, password: str) -> None:
    await admin.execute_command("ACL", "SETUSER", name, *worker_acl_rules(name, password))


async def test_a_user_without_a_permission_stops_the_worker_naming_it_and_leaves_no_lease(
    redis_url: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    version = (await redis_client.info("server"))["redis_version"]
    if int(str(version).split(".")[0]) < 7:
        pytest.skip("a worker's ACL needs Redis 7 (selectors)")
    await load_library(redis_client)  # as the projector does, with the admin's credentials
    await _acl_worker(redis_client, "w", "w-secret")
    url = _with_password(redis_url, "w-secret", user="w")
    log = tmp_path / "w.log"
    try:
        # Without --inbox the worker appends to the ledger itself, which its ACL forbids.
        proc = spawn_worker(url, NO_BACKEND, "w", log, lease_ms=20_000)
        code, said, _ = await asyncio.to_thread(_exits, proc, log, 10)
        assert code == 2
        assert "lacks a permission" in said and "--inbox" in said and "cannot reach Redis" not in said
        # The lease it took is given back, and the next start does not wait for it.
        assert not await redis_client.exists(Keys().live("w"))
        again = spawn_worker(url, NO_BACKEND, "w", log, lease_ms=20_000)
        code, _, ran = await asyncio.to_thread(_exits, again, log, 10)
        assert code == 2 and ran < 8  # waiting out the 20 s lease would take longer
    finally:
        await redis_client.execute_command("ACL", "DELUSER", "w")
