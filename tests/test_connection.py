"""The asyncio Redis client routeledger opens: against a Redis that is killed and restarted, and over TLS."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest
import redis

from events.connection import redis_client as open_redis
from events.connection import send_all, with_tls_files
from events.errors import RedisUrlError
from routeledger.certs import ensure_server_tls
from routeledger.embedded import EmbeddedCluster, EmbeddedRedis, find_redis_server

POOLED = 5


@contextlib.contextmanager
def stopped(server: EmbeddedRedis) -> Iterator[None]:
    """`server` frozen (SIGSTOP) for the block, as a machine that stopped answering is; then resumed."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


async def test_after_a_redis_restart_no_command_fails_on_a_connection_the_dead_server_closed(
    fresh_server: EmbeddedRedis,
) -> None:
    client = open_redis(fresh_server.url)
    try:
        # As many connections in the pool as commands ran at once.
        await asyncio.gather(*(client.ping() for _ in range(POOLED)))
        fresh_server.kill()
        # Down for a moment, as after any crash: the pooled connections see the server close them.
        await asyncio.sleep(0.2)
        fresh_server.restart()
        # Each of them is checked out once more, and each must be replaced, not used as it is.
        replies = await asyncio.gather(
            *(client.set(f"k{i}", i) for i in range(POOLED)), return_exceptions=True
        )
    finally:
        await client.aclose()
    assert replies == [True] * POOLED


def _with_query(url: str, **params: str) -> str:
    """`url` with these query parameters set (replacing any of the same name)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.update(params)
    return urlunsplit(parts._replace(query=urlencode(query)))


async def test_over_tls_a_client_works_with_the_ca_that_signed_the_servers_certificate(
    tls_redis_url: str,
) -> None:
    client = open_redis(tls_redis_url)
    try:
        assert await client.set("k", "v")
        assert await client.get("k") == b"v"
    finally:
        await client.aclose()


async def test_a_client_refuses_a_server_whose_certificate_another_ca_signed(
    tls_redis_url: str, tmp_path: Path
) -> None:
    stranger = ensure_server_tls(tmp_path, ["localhost"])
    client = open_redis(_with_query(tls_redis_url, ssl_ca_certs=str(stranger.ca)))
    try:
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await client.ping()
    finally:
        await client.aclose()


def test_tls_files_on_a_plain_redis_url_are_refused_in_words(tmp_path: Path) -> None:
    ca = ensure_server_tls(tmp_path, ["localhost"]).ca
    with pytest.raises(RedisUrlError, match="write rediss://"):
        open_redis(with_tls_files("redis://127.0.0.1:6379/0", ca=str(ca)))


def test_a_missing_ca_file_is_named_before_any_connection(tmp_path: Path) -> None:
    missing = tmp_path / "nope.crt"
    with pytest.raises(RedisUrlError, match=f"CA file .*{missing}"):
        open_redis(with_tls_files("rediss://127.0.0.1:6379/0", ca=str(missing)))


def test_tls_settings_join_the_url_as_absolute_paths_and_the_urls_own_files_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = with_tls_files("rediss://:p@h:1/0", ca="ca.crt", cert="c.crt", key="c.key")
    assert dict(parse_qsl(urlsplit(url).query)) == {
        "ssl_ca_certs": str(tmp_path / "ca.crt"),
        "ssl_certfile": str(tmp_path / "c.crt"),
        "ssl_keyfile": str(tmp_path / "c.key"),
    }
    own = with_tls_files("rediss://:p@h:1/0?ssl_ca_certs=/etc/theirs.crt", ca="ca.crt")
    assert dict(parse_qsl(urlsplit(own).query)) == {"ssl_ca_certs": "/etc/theirs.crt"}
    assert with_tls_files("redis://:p@h:1/0") == "redis://:p@h:1/0"


async def test_fields_of_every_type_and_a_command_named_with_its_subcommand_reach_redis_whole(
    fresh_server: EmbeddedRedis,
) -> None:
    client = open_redis(fresh_server.url)
    try:
        fields = {"text": "héllo wörld", "n": 7, "x": 0.25, "raw": b"\x00\xff"}
        entry = await client.xadd("s", fields)  # type: ignore[arg-type]
        rows = await client.xrange("s")
        await client.execute_command("CLIENT SETNAME", "packed")  # type: ignore[no-untyped-call]
        name = await client.client_getname()
        with pytest.raises(redis.DataError):
            await client.set("k", True)
    finally:
        await client.aclose()
    assert rows == [
        (entry, {b"text": "héllo wörld".encode(), b"n": b"7", b"x": b"0.25", b"raw": b"\x00\xff"})
    ]
    assert name in ("packed", b"packed")


async def test_a_cluster_client_sends_scripts_and_stream_reads_to_the_node_of_their_keys(
    redis_cluster: EmbeddedCluster,
) -> None:
    redis_cluster.flush()
    client = open_redis(redis_cluster.url)
    try:
        await client.function_load(
            "#!lua name=rl_keys_test\n"
            "redis.register_function('rl_keys_test_get',"
            " function(keys, args) return redis.call('GET', keys[1]) end)",
            replace=True,
        )
        await client.set("{t}a", "1")
        await client.xadd("{t}s1", {"f": "v"}, id="1-1")
        await client.xadd("{t}s2", {"f": "v"}, id="1-1")
        await client.xgroup_create("{t}s1", "g", id="0")
        assert await client.fcall("rl_keys_test_get", 1, "{t}a") == b"1"
        read: Any = await client.xread({"{t}s1": "0", "{t}s2": "0"}, count=1)
        taken: Any = await client.xreadgroup("g", "c", {"{t}s1": ">"}, count=1, block=10)
        assert len(read) == 2 and len(taken) == 1
        # Keys in two slots are still refused, as redis-py refuses them, before anything is sent.
        with pytest.raises(redis.RedisClusterException, match="same key slot"):
            await client.xread({"{t}s1": "0", "{u}s2": "0"})
    finally:
        await client.function_delete("rl_keys_test")
        await client.aclose()


@pytest.mark.parametrize("kind", ["single", "cluster"])
async def test_commands_sent_together_each_get_their_reply_and_a_refused_one_stops_none_of_the_others(
    kind: str, fresh_server: EmbeddedRedis, redis_cluster: EmbeddedCluster
) -> None:
    if kind == "cluster":
        redis_cluster.flush()
    client = open_redis(fresh_server.url if kind == "single" else redis_cluster.url)
    try:
        await client.set("{t}text", "not a number")
        replies = await send_all(
            client,
            [
                ("XADD", "{t}s", "*", "f", b"\x00v"),
                ("INCR", "{t}text"),
                ("HSET", "{t}h", "logged", "1"),
                ("PEXPIRE", "{t}h", 60_000),
            ],
        )
        rows: Any = await client.xrange("{t}s")
        logged = await client.hget("{t}h", "logged")
        # The connection is left in step: the next command reads its own reply.
        pong = await client.ping()
    finally:
        await client.aclose()
    assert isinstance(replies[0], bytes) and rows[0][0] == replies[0]
    assert isinstance(replies[1], redis.ResponseError) and "not an integer" in str(replies[1])
    assert replies[2:] == [1, 1]
    assert rows[0][1] == {b"f": b"\x00v"} and logged == b"1" and pong is True


async def test_commands_sent_together_raise_the_first_refusal_when_asked_once_every_reply_is_in(
    fresh_server: EmbeddedRedis,
) -> None:
    client = open_redis(fresh_server.url)
    try:
        await client.set("text", "x")
        with pytest.raises(redis.ResponseError, match="not an integer"):
            await send_all(client, [("INCR", "text"), ("SET", "after", "1")], raise_on_error=True)
        after = await client.get("after")
    finally:
        await client.aclose()
    assert after == b"1"


async def test_a_write_a_stalled_redis_cannot_take_fails_at_its_deadline_and_closes_its_connection(
    fresh_server: EmbeddedRedis,
) -> None:
    client = open_redis(fresh_server.url, socket_timeout=0.5)
    try:
        await client.ping()
        with stopped(fresh_server):
            started = time.monotonic()
            # Far more than the socket buffers on both sides take: the write has to wait.
            with pytest.raises(redis.TimeoutError, match="writing"):
                await client.set("big", b"x" * 64_000_000)
            waited = time.monotonic() - started
        # The half-sent command's connection was closed, not handed out again: the next one works.
        assert await client.ping() is True
    finally:
        await client.aclose()
    assert 0.4 < waited < 5


async def test_a_read_past_its_deadline_fails_naming_the_server_and_the_next_command_works(
    fresh_server: EmbeddedRedis,
) -> None:
    client = open_redis(fresh_server.url, socket_timeout=0.5)
    try:
        await client.set("k", "v")
        with stopped(fresh_server):
            started = time.monotonic()
            with pytest.raises(redis.TimeoutError, match=f"reading from 127.0.0.1:{fresh_server.port}"):
                await client.get("k")
            waited = time.monotonic() - started
        # The connection whose reply never came was closed: the next command does not read it.
        assert await client.get("k") == b"v"
    finally:
        await client.aclose()
    assert 0.4 < waited < 5


async def test_a_refused_command_raises_its_error_and_its_connection_stays_in_step(
    fresh_server: EmbeddedRedis,
) -> None:
    client = open_redis(fresh_server.url)
    try:
        await client.set("text", "x")
        before = await client.client_id()
        with pytest.raises(redis.ResponseError, match="not an integer"):
            await client.incr("text")
        after = await client.client_id()
        value = await client.get("text")
    finally:
        await client.aclose()
    # The same connection answered before and after the refusal, and read its own replies.
    assert before == after and value == b"x"


async def test_a_connection_the_server_closes_during_a_read_fails_as_a_connection_error(
    fresh_server: EmbeddedRedis,
) -> None:
    client = open_redis(fresh_server.url)
    killer = open_redis(fresh_server.url)
    try:
        waiting = asyncio.ensure_future(client.blpop(["nothing"], timeout=5))
        for _ in range(100):
            if any(c.get("cmd") == "blpop" for c in await killer.client_list()):
                break
            await asyncio.sleep(0.02)
        await killer.client_kill_filter(_type="normal", skipme=True)
        with pytest.raises(redis.ConnectionError):
            await waiting
        # A fresh connection serves the next command.
        assert await client.ping() is True
    finally:
        await client.aclose()
        await killer.aclose()


async def test_replies_go_through_redis_pys_callbacks_and_per_command_options(
    fresh_server: EmbeddedRedis,
) -> None:
    client = open_redis(fresh_server.url, decode_responses=True)
    try:
        await client.xadd("s", {"f": "v"})
        await client.xgroup_create("s", "g", id="0")
        await client.hset("h", mapping={"a": "1"})
        await client.set("k", "v")
        groups = await client.xinfo_groups("s")
        fields = await client.hgetall("h")
        none = await client.mget([])  # no keys: redis-py answers [] for Redis's refusal
        dumped = await client.dump("k")  # never decoded, even on a decoding client
        exists = await client.exists("k", "missing")
    finally:
        await client.aclose()
    assert groups[0]["name"] == "g" and groups[0]["consumers"] == 0
    assert fields == {"a": "1"} and none == [] and exists == 1
    assert isinstance(dumped, bytes) and dumped.startswith(b"\x00")


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[Path]:
    """A redis-server of this test's own that listens on a unix socket only; the socket's path."""
    path = tmp_path / "redis.sock"
    server = subprocess.Popen(
        [find_redis_server(), "--port", "0", "--unixsocket", str(path), "--save", ""],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(250):
            if path.exists():
                break
            time.sleep(0.02)
        yield path
    finally:
        server.terminate()
        server.wait(10)


async def test_a_unix_socket_url_makes_a_client_that_works(unix_socket: Path) -> None:
    client = open_redis(f"unix://{unix_socket}")
    try:
        await client.set("k", "v")
        value = await client.get("k")
    finally:
        await client.aclose()
    assert value == b"v"


async def test_reads_with_different_deadlines_each_fail_at_their_own_and_not_at_anothers(
    fresh_server: EmbeddedRedis,
) -> None:
    patient = open_redis(fresh_server.url, socket_timeout=5.0)
    hasty = open_redis(fresh_server.url, socket_timeout=0.5)
    try:
        await patient.set("k", "v")
        await hasty.ping()
        with stopped(fresh_server):
            # The patient read starts first: the hasty one's nearer deadline must still be kept.
            slow = asyncio.ensure_future(patient.get("k"))
            await asyncio.sleep(0.05)
            started = time.monotonic()
            with pytest.raises(redis.TimeoutError, match="reading from"):
                await hasty.get("k")
            waited = time.monotonic() - started
            assert not slow.done()
        # Redis is back well within the patient read's deadline: it gets its reply.
        assert await slow == b"v"
        assert await hasty.get("k") == b"v"
    finally:
        await patient.aclose()
        await hasty.aclose()
    assert 0.4 < waited < 2.5


async def test_a_reply_that_comes_in_as_its_deadline_passes_leaves_the_next_command_in_step(
    fresh_server: EmbeddedRedis,
) -> None:
    client = open_redis(fresh_server.url, socket_timeout=0.2, max_connections=1)

    async def stall() -> None:
        await asyncio.sleep(0.02)
        time.sleep(0.4)  # noqa: ASYNC251  the loop stalls: the reply and the deadline are due together

    try:
        stalling = asyncio.ensure_future(stall())
        # Redis answers nil after 0.1 s, while the loop is stalled past the 0.2 s deadline.
        try:
            late: Any = await client.blpop(["nothing"], timeout=0.1)
        except redis.TimeoutError as exc:
            late = exc
        await stalling
        counted = await client.incr("counter")
        stored = await client.get("counter")
    finally:
        await client.aclose()
    assert late is None or isinstance(late, redis.TimeoutError)
    assert counted == 1 and stored == b"1"
