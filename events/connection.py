"""The Redis client every routeledger process uses, with the settings that keep writes exact.

With RESP3, its default, redis-py 8.1.0 turns on maintenance notifications ("auto"), and while they
are on its pool skips the check, at checkout, of whether the server closed a pooled connection.
After a Redis restart every connection that sat idle in the pool through the outage is then handed
out again, and its next command fails with "Connection closed by server." (redis-py issue 4252; the
clients from from_url do not retry). A worker that draws one for a task's claim leaves the task
pending until the reaper takes it back. routeledger talks to a Redis that sends no maintenance
notifications, so it turns them off and gets the check back: a closed connection is replaced.

TLS: a `rediss://` URL makes a TLS connection, and the files it trusts and presents travel in the
URL's query, under the names redis-py reads there (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`).
So one string carries everything a process needs to reach Redis: `up` hands it to its children in
the environment, and a remote worker gets it in one `--redis-url`.

Redis Cluster: a `redis+cluster://` (or `rediss+cluster://`) URL names one or more seed nodes,
comma-separated (`redis+cluster://:secret@10.0.0.5:7000,10.0.0.6:7000`); the client learns the
rest of the cluster from them and follows its slots through resharding and failover. The client is
redis-py's RedisCluster, with the same rules as the plain one (no command sent twice, deadlines,
keepalive). Its key layout is `Keys(cluster=True)` (events/keys.py): `Keys.for_client` picks it.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import hiredis
import redis.asyncio as aioredis
from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
from redis._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.client import EMPTY_RESPONSE, NEVER_DECODE
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from events.errors import RedisUrlError

# TCP keepalive: a peer that vanished (Wi-Fi, VPN, a machine switched off) is noticed in about
# 10 + 3 x 3 seconds even on a connection that waits for nothing.
_KEEPALIVE: Final = {
    opt: value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 3))
    if (opt := getattr(socket, name, None)) is not None
}


# The query parameters of a Redis URL that name TLS files, and what each file is.
TLS_FILE_PARAMS: Final = {
    "ssl_ca_certs": "CA file (the certificate that signed the server's)",
    "ssl_certfile": "client certificate file",
    "ssl_keyfile": "client key file",
}


def with_tls_files(url: str, *, ca: str = "", cert: str = "", key: str = "") -> str:
    """`url` with the CA, client certificate and key files added to its query, as absolute paths
    (a process started elsewhere finds them too). A file the URL names already is kept: the URL
    was written for this Redis, a setting may be for any."""
    given = {"ssl_ca_certs": ca, "ssl_certfile": cert, "ssl_keyfile": key}
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    present = {name for name, _ in query}
    added = [
        (name, str(Path(path).expanduser().resolve()))
        for name, path in given.items()
        if path and name not in present
    ]
    if not added:
        return url
    query += added
    return urlunsplit(parts._replace(query=urlencode(query)))


# URL schemes of a Redis Cluster (plain and TLS), and the plain scheme each stands for.
CLUSTER_SCHEMES: Final = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    """Whether `url` names a Redis Cluster (redis+cluster:// or rediss+cluster://)."""
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """The seed nodes, user name and password of a cluster URL; RedisUrlError, in words, for a
    URL that names no node or a port that is not a number."""
    netloc = urlsplit(url).netloc
    userinfo, _, hosts = netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    nodes: list[tuple[str, int]] = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":") if not item.endswith("]") else (item, "", "")
        if not host or not port.isdigit():
            raise RedisUrlError(
                f"the cluster URL's node {item!r} is not host:port: write "
                "redis+cluster://[:password@]host:port[,host:port...]"
            )
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise RedisUrlError(
            "the cluster URL names no node: write redis+cluster://[:password@]host:port[,host:port...]"
        )
    return nodes, unquote(user) or None, unquote(password) if userinfo else None


def check_tls(url: str) -> None:
    """Refuse, in words, a URL whose TLS settings cannot work, before any connection is tried."""
    parts = urlsplit(url)
    files = [(name, value) for name, value in parse_qsl(parts.query) if name in TLS_FILE_PARAMS]
    if files and CLUSTER_SCHEMES.get(parts.scheme, parts.scheme) != "rediss":
        names = ", ".join(name for name, _ in files)
        raise RedisUrlError(
            f"the Redis URL names TLS files ({names}) but its scheme is {parts.scheme}://, which does "
            "not use TLS: write rediss:// (or unset redis_ca, redis_cert and redis_key)"
        )
    for name, value in files:
        if not os.access(value, os.R_OK) or not Path(value).is_file():
            raise RedisUrlError(
                f"the Redis {TLS_FILE_PARAMS[name]} {value} ({name}) does not exist or cannot be read"
            )


class _DeadlineError(Exception):
    """Raised when a Redis read waited past its connection's deadline (set on the read's stream)."""


class _ReadDeadlines:
    """The deadlines of one event loop's Redis reads, kept by one timer at the nearest of them
    rather than a timer of each read's own. `asyncio.timeout` per read (a Timeout object, a timer
    pushed onto the loop's heap and cancelled, the task's cancellation bookkeeping) cost about 8 us
    of a round trip's 41 on a bare protocol (bench/roundtrip.py, "floor" against "floor, no
    deadline"); here a read costs a dict entry. A read past its deadline has `_DeadlineError` set
    on its stream, which wakes it with the error; its connection is then closed, as after any
    failed read, so the stream is not read again."""

    __slots__ = ("_at", "_loop", "_reads", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reads: dict[asyncio.StreamReader, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._at = float("inf")

    def start(self, stream: asyncio.StreamReader, timeout: float) -> None:
        deadline = self._loop.time() + timeout
        self._reads[stream] = deadline
        if deadline < self._at:
            if self._timer is not None:
                self._timer.cancel()
            self._at = deadline
            self._timer = self._loop.call_at(deadline, self._check)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def stop(self, stream: asyncio.StreamReader) -> None:
        self._reads.pop(stream, None)

    def _check(self) -> None:
        self._timer, self._at = None, float("inf")
        # uvloop's clock and timers move in whole milliseconds: a timer may fire just short of the
        # deadline it was set for, and set again for what is left it would fire at once, over and
        # over, until the clock ticks. A deadline less than a millisecond away counts as passed.
        now = self._loop.time() + _DEADLINE_SLACK_S
        nearest = float("inf")
        for stream, deadline in list(self._reads.items()):
            if deadline <= now:
                del self._reads[stream]
                stream.set_exception(_DeadlineError())
            elif deadline < nearest:
                nearest = deadline
        if nearest < float("inf"):
            self._at = nearest
            self._timer = self._loop.call_at(nearest, self._check)


_DEADLINE_SLACK_S: Final = 0.001

# Each thread's running loop's read deadlines: one entry per thread, since a thread runs one loop
# at a time (a test suite runs one after another: a new loop gets a new one).
_DEADLINES = threading.local()


def _read_deadlines() -> _ReadDeadlines:
    loop = asyncio.get_running_loop()
    deadlines: _ReadDeadlines | None = getattr(_DEADLINES, "current", None)
    if deadlines is None or deadlines.loop is not loop:
        deadlines = _DEADLINES.current = _ReadDeadlines(loop)
    return deadlines


class _HiredisPacking:
    """Commands packed into the Redis protocol by hiredis (C) instead of redis-py's Python loop,
    which the asyncio client uses even where hiredis is installed: for an event's XADD of 40
    fields, about 5 us instead of 40 us, on every command the request path sends. Arguments
    hiredis does not take (a bool, None) go to redis-py's packing, which refuses them as before."""

    def pack_command(self, *args: Any) -> list[bytes]:
        head = args[0]
        if isinstance(head, str):
            head = head.encode()
        if b" " in head:
            # A command written with its subcommand ("CLIENT SETNAME"): sent as separate words.
            args = (*head.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except (TypeError, UnicodeError):
            return super().pack_command(*args)  # type: ignore[misc,no-any-return]

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        """redis-py's, with the write's deadline only where the write can wait. redis-py wraps every
        write in `asyncio.wait_for`, which makes a task and a timer per command and sends the
        command one turn of the event loop later; but a write waits only when the socket's buffer
        is over its high-water mark, and the bytes are handed to the socket before any wait. So the
        deadline (`socket_timeout`) is set only when something is left in the buffer; otherwise
        `drain` returns at once (it still raises for a connection that was lost). What follows a
        failed or timed-out write is redis-py's: the connection is closed, and the error says why."""
        if not self.is_connected:  # type: ignore[attr-defined]
            await self.connect_check_health(check_health=False)  # type: ignore[attr-defined]
        if (
            check_health
            and self.health_check_interval  # type: ignore[attr-defined]
            and asyncio.get_running_loop().time() > self.next_health_check
        ):
            # check_health's own test, made here: the coroutine it makes costs more than the test.
            await self.check_health()  # type: ignore[attr-defined]
        try:
            if isinstance(command, str):
                command = command.encode()
            if isinstance(command, bytes):
                command = [command]
            # A cluster client that learns the layout again (after a node failed) closes the
            # connections of the nodes it had, including one another task is still setting up;
            # redis-py then writes to a writer that is gone and an AttributeError reaches the caller.
            # It is a connection that closed: say so, so that callers treat it as Redis being away.
            writer: Any = getattr(self, "_writer", None)
            if writer is None:
                raise RedisConnectionError("the connection was closed while a command was being sent")
            writer.writelines(command)
            if writer.transport.get_write_buffer_size():
                await asyncio.wait_for(writer.drain(), self.socket_timeout)  # type: ignore[attr-defined]
            else:
                await writer.drain()
        except TimeoutError:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as e:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            err_no, errmsg = ("UNKNOWN", e.args[0]) if len(e.args) == 1 else (e.args[0], e.args[1])
            raise RedisConnectionError(f"Error {err_no} while writing to socket. {errmsg}.") from e
        except BaseException:
            # Part of the command may have been sent: the connection cannot be used again.
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise

    async def read_reply(self, disable_decoding: bool = False) -> Any:
        """One reply, as redis-py's `read_response` reads it with the connection's own deadline
        (`socket_timeout`, kept by _ReadDeadlines), without its layers: the reply is taken from
        hiredis's reader and the socket read only while the reader lacks data. Those layers (the
        parser's and the connection's read_response, the client's parse_response) and the
        checkout's retry wrapper were about half of what a round trip cost the client above a bare
        protocol's floor (bench/roundtrip.py: 55-59 us against a floor of 41, 48-51 us without
        them). What it does on failure is redis-py's: a read that timed out or failed closes the
        connection and raises redis-py's TimeoutError or ConnectionError; an error reply is
        raised, and one that says the server cannot serve (a ConnectionError, such as LOADING)
        closes the connection first. A connection with another parser, and a push message, take
        redis-py's own path."""
        parser: Any = self._parser  # type: ignore[attr-defined]
        reader: Any = getattr(parser, "_reader", None)
        if type(parser) is not _AsyncHiredisParser or reader is None or not parser._connected:
            return await self.read_response(disable_decoding=disable_decoding)  # type: ignore[attr-defined]
        reply = reader.gets(False) if disable_decoding else reader.gets()
        if reply is NOT_ENOUGH_DATA:
            stream: asyncio.StreamReader = self._reader  # type: ignore[attr-defined]
            size: int = parser._read_size
            timeout: float | None = self.socket_timeout  # type: ignore[attr-defined]
            deadlines = None if timeout is None else _read_deadlines()
            if deadlines is not None:
                deadlines.start(stream, timeout)  # type: ignore[arg-type]
            try:
                while reply is NOT_ENOUGH_DATA:
                    data = await stream.read(size)
                    if not data:
                        raise RedisConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
                    reader.feed(data)
                    reply = reader.gets(False) if disable_decoding else reader.gets()
            except _DeadlineError:
                await self.disconnect(nowait=True)  # type: ignore[attr-defined]
                raise RedisTimeoutError(f"Timeout reading from {self._host_error()}") from None  # type: ignore[attr-defined]
            except OSError as e:
                await self.disconnect(nowait=True)  # type: ignore[attr-defined]
                raise RedisConnectionError(
                    f"Error while reading from {self._host_error()} : {e.args}"  # type: ignore[attr-defined]
                ) from None
            except BaseException:
                await self.disconnect(nowait=True)  # type: ignore[attr-defined]
                raise
            finally:
                if deadlines is not None:
                    deadlines.stop(stream)
            if stream.exception() is not None:
                # The deadline passed in the turn the reply's last bytes came in: the reply stands,
                # but the stream keeps the error for every later read, so the connection goes.
                await self.disconnect(nowait=True)  # type: ignore[attr-defined]
        if self.health_check_interval:  # type: ignore[attr-defined]
            self.next_health_check = asyncio.get_running_loop().time() + self.health_check_interval  # type: ignore[attr-defined]
        if isinstance(reply, ResponseError):
            raise reply
        if isinstance(reply, RedisConnectionError):
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise reply
        if isinstance(reply, list) and reply and isinstance(reply[0], RedisConnectionError):
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise reply[0]
        # Typed None by redis-py; hiredis's PushNotification class where it has one.
        push: Any = getattr(parser, "_hiredis_PushNotificationType", None)
        if push is not None and isinstance(reply, push):
            await parser.handle_push_response(reply)  # type: ignore[no-untyped-call]
            return await self.read_reply(disable_decoding)
        return reply


class _Tcp(_HiredisPacking, Connection):
    pass


class _Tls(_HiredisPacking, SSLConnection):
    pass


class _Unix(_HiredisPacking, UnixDomainSocketConnection):
    pass


class _Pool(ConnectionPool):
    """redis-py's pool without what routeledger never uses on every checkout: the OpenTelemetry
    connection counts (four awaited recorder calls per command, with no meter configured) and the
    release event (it serves streaming credential providers' re-authentication). About a sixth of
    a worker's CPU per task went there (bench/api.py --profile). The checkout is the same: a pooled
    connection is checked for a server that closed it (ensure_connection), and a connection that
    asked to reconnect is closed at release. Nothing awaits between taking a connection off the
    list and marking it used, so the asyncio lock is not needed for that."""

    async def get_connection(
        self, command_name: Any = None, *keys: Any, **options: Any
    ) -> AbstractConnection:
        connection: AbstractConnection = self.get_available_connection()  # type: ignore[no-untyped-call]
        try:
            # ensure_connection's checks, called only when one fails: its connect() of a connected
            # connection still goes through the retry object.
            try:
                stale = not connection.is_connected or await connection.can_read()
            except (RedisConnectionError, RedisTimeoutError, OSError):
                stale = True
            if stale:
                await self.ensure_connection(connection)
        except BaseException:
            await self.release(connection)
            raise
        return connection

    async def release(self, connection: AbstractConnection) -> None:
        self._in_use_connections.remove(connection)
        if connection.should_reconnect():  # type: ignore[no-untyped-call]
            await connection.disconnect()
        self._available_connections.append(connection)


class _Client(aioredis.Redis):
    """redis-py's client with a command path for a client that never retries (`_settings`): the
    same steps (a pooled connection, send, parse, a connection that failed is closed before the
    error reaches the caller) without the retry loop's closures and the OpenTelemetry timing of
    every command, which routeledger does not configure."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if self.single_connection_client:
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        pool = self.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            if not isinstance(conn, _HiredisPacking) or _is_himport(args[0]):
                return await self._send_command_parse_response(conn, args[0], *args, **options)  # type: ignore[no-untyped-call]
            # redis-py's parse_response, on the lean read (_HiredisPacking.read_reply).
            await conn.send_packed_command(conn.pack_command(*args))
            try:
                reply = await conn.read_reply(NEVER_DECODE in options)
            except ResponseError:
                if EMPTY_RESPONSE in options:
                    return options[EMPTY_RESPONSE]
                raise
            callback = self.response_callbacks.get(args[0])
            if callback is None:
                return reply
            for option in (NEVER_DECODE, EMPTY_RESPONSE, "keys"):
                options.pop(option, None)
            value = callback(reply, **options)
            return await value if inspect.isawaitable(value) else value
        except _CLOSES_CONNECTION as error:
            await conn.disconnect(error=error, failure_count=1)
            raise
        finally:
            await pool.release(conn)


_HIMPORT: Final = ("HIMPORT", b"HIMPORT")


def _is_himport(name: str | bytes) -> bool:
    """Whether a command is HIMPORT, whose sending depends on the connection (redis-py's own path)."""
    return name[:7].upper() in _HIMPORT


# The errors after which redis-py's retry closes the connection (Retry's supported errors).
_CLOSES_CONNECTION: Final = (RedisConnectionError, RedisTimeoutError, socket.timeout)


_PACKED: Final[dict[type[AbstractConnection], type[AbstractConnection]]] = {
    Connection: _Tcp,
    SSLConnection: _Tls,
    UnixDomainSocketConnection: _Unix,
}


def _settings(socket_timeout: float) -> dict[str, Any]:
    """What every client routeledger makes is built with, plain or cluster (see `redis_client`)."""
    return {
        "socket_connect_timeout": 3,
        "socket_timeout": socket_timeout,
        "socket_keepalive": True,
        "socket_keepalive_options": _KEEPALIVE,
        "health_check_interval": 15,
        "retry": Retry(NoBackoff(), 0),
        "maint_notifications_config": MaintNotificationsConfig(enabled=False),
    }


def redis_client(url: str, *, socket_timeout: float = 10.0, **options: Any) -> aioredis.Redis:
    """The one way routeledger's processes make a Redis client.

    - No command is sent twice by the client: redis-py would retry (and re-send a whole pipeline)
      after a connection error or timeout, and a write whose first sending was applied would be
      applied twice. Retries are explicit, and only of what is safe to repeat
      (`dispatch.queues.resend`, the gateway's submission keyed by task id).
    - Every read has a deadline (`socket_timeout`, longer than any blocking read routeledger
      makes), and TCP keepalive is on, so that a half-open connection fails instead of hanging.
    - Maintenance notifications are off, so that a pooled connection the server closed is replaced
      at checkout (see the module's docstring).
    - A `rediss://` URL is TLS, with the files in its query (see the module's docstring); they are
      checked here, so that a missing one is named rather than failing the first command.
    - Commands are packed by hiredis (_HiredisPacking), and the pool skips redis-py's
      per-checkout telemetry (_Pool).
    """
    check_tls(url)
    if is_cluster_url(url):
        return _cluster_client(url, socket_timeout=socket_timeout, **options)
    settings = _settings(socket_timeout)
    if urlsplit(url).scheme == "unix":
        # A local socket has no TCP keepalive (redis-py refuses the options for one).
        del settings["socket_keepalive"], settings["socket_keepalive_options"]
    pool = _Pool.from_url(url, **settings, **options)
    pool.connection_class = _PACKED.get(pool.connection_class, pool.connection_class)
    client = _Client(connection_pool=pool)
    # The client owns the pool it was given here, as from_url's would: closing one closes both.
    client.auto_close_connection_pool = True
    return client


def _cluster_client(url: str, *, socket_timeout: float, **options: Any) -> aioredis.Redis:
    """A RedisCluster made by the rules of `redis_client`. MOVED and ASK redirections are followed
    (the command was not run where it was refused); a connection error is not retried, but it
    makes the client learn the cluster's layout again before its next command, so that a process
    follows a failover without a restart. The cluster client serves every command routeledger
    sends, with the same signatures, so it is typed as the plain client it stands in for: the
    cluster tier of the tests runs the code base on it."""
    nodes, username, password = cluster_nodes(url)
    parts = urlsplit(url)
    tls = dict(parse_qsl(parts.query))
    ssl: dict[str, Any] = {}
    if CLUSTER_SCHEMES[parts.scheme] == "rediss":
        ssl = {"ssl": True, **{name: tls[name] for name in TLS_FILE_PARAMS if name in tls}}
    client = _Cluster(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        username=username,
        password=password,
        **_settings(socket_timeout),
        **ssl,
        **options,
    )
    kwargs = client.nodes_manager.connection_kwargs
    kwargs["connection_class"] = _PACKED.get(kwargs["connection_class"], kwargs["connection_class"])
    return client  # type: ignore[return-value]


# Options that may come before STREAMS in XREAD/XREADGROUP, and how many values each takes.
_STREAM_READ_OPTIONS: Final[dict[str, int]] = {"COUNT": 1, "BLOCK": 1, "NOACK": 0}


def _word(arg: Any) -> str:
    """An argument as an upper-case word, for matching a command's option names."""
    if isinstance(arg, bytes):
        return arg.decode("latin-1").upper()
    return arg.upper() if isinstance(arg, str) else ""


def _streams_keys(args: tuple[Any, ...], start: int) -> tuple[Any, ...] | None:
    """The stream names of an XREAD (`start` 0) or XREADGROUP (`start` 3, after GROUP g c): the
    first half of what follows STREAMS. None for a form this does not know, which is then left to
    redis-py."""
    i = start
    while i < len(args):
        word = _word(args[i])
        if word == "STREAMS":
            rest = args[i + 1 :]
            return rest[: len(rest) // 2] if rest and len(rest) % 2 == 0 else None
        if word not in _STREAM_READ_OPTIONS:
            return None
        i += 1 + _STREAM_READ_OPTIONS[word]
    return None


class _Pipeline(ClusterPipeline):
    """redis-py's cluster pipeline, which makes its client learn the cluster's layout again after a
    node failed under it, as a single command does. redis-py does so only before a retry, and
    routeledger's clients never retry: a process whose commands to a failed master's slots went
    through pipelines (multi-key EXISTS, DEL and MGET are pipelines on a cluster) kept sending them
    to the dead node after a replica had taken its place."""

    __slots__ = ()

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except RedisCluster.ERRORS_ALLOW_RETRY:
            relearn_layout(self.cluster_client)
            raise


class _Cluster(RedisCluster):
    """redis-py's cluster client, which finds the keys of the commands routeledger sends most
    without asking a node, and whose pipelines follow a failover (_Pipeline).

    redis-py knows the keys of most commands from their position, but for those whose keys move
    (FCALL, FCALL_RO, XREAD, XREADGROUP) it sends COMMAND GETKEYS to a node before every call: a
    second round trip for each script, each claim and each ledger read."""

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        # Made by redis-py's own method (whatever wraps it), then given _Pipeline's execute.
        pipe = super().pipeline(transaction, shard_hint)
        pipe.__class__ = _Pipeline  # type: ignore[type-abstract]
        return pipe

    async def _determine_slot(self, command: str, *args: Any) -> int:
        name = _word(command)
        keys: tuple[Any, ...] | None = None
        if name in ("FCALL", "FCALL_RO") and len(args) >= 2:
            keys = tuple(args[2 : 2 + int(args[1])])
        elif name == "XREADGROUP":
            keys = _streams_keys(args, 3)
        elif name == "XREAD":
            keys = _streams_keys(args, 0)
        if not keys:
            # A function with no keys may run anywhere; redis-py picks a slot, as it does for any
            # form this does not read.
            return await super()._determine_slot(command, *args)
        slots = {self.keyslot(key) for key in keys}
        if len(slots) != 1:
            raise RedisClusterException(f"{command} - all keys must map to the same key slot")
        return slots.pop()


class _RawName(str):
    """A command name whose reply skips redis-py's response callbacks, for a cluster client (see
    `raw_name`). Callbacks are looked up by name in a dict; this name hashes apart from the plain
    one and equals only itself, so no callback is found, while everything that routes the command
    (slot, node) reads it through str methods (lower, upper, split), which return plain strings."""

    __slots__ = ()

    def __hash__(self) -> int:
        return hash((_RawName, str(self)))

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other


async def send_all(
    redis: aioredis.Redis, commands: Sequence[Sequence[Any]], *, raise_on_error: bool = False
) -> list[Any]:
    """`commands` sent in one write on one connection and their replies read in order, as a
    non-transactional pipeline does: a command Redis refused has its error in its place, and the
    others still ran; with `raise_on_error` the first such error is raised once every reply is in.
    Replies are raw (no response callbacks).

    On routeledger's own client this skips redis-py's pipeline object (its command stack, its
    Python packing, the retry loop and the telemetry): the hot path's closing writes cost three
    times the CPU through it (bench/api.py --profile). A cluster client, whose commands may go to
    several nodes, sends them through its pipeline (so command names are str: it refuses bytes)."""
    if type(redis) is not _Client or redis.single_connection_client:
        pipe = redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return await pipe.execute(raise_on_error=raise_on_error)
    pool = redis.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        await conn.send_packed_command([part for command in commands for part in conn.pack_command(*command)])
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_reply())
            except ResponseError as refused:
                replies.append(refused)
    except _CLOSES_CONNECTION as error:
        await conn.disconnect(error=error, failure_count=1)
        raise
    finally:
        await pool.release(conn)
    first = next((r for r in replies if isinstance(r, ResponseError)), None)
    if raise_on_error and first is not None:
        raise first
    return replies


def raw_name(redis: aioredis.Redis, name: str) -> str | bytes:
    """The name to send command `name` under so that its reply comes back raw (no response
    callback): bytes on a plain client, whose callbacks are keyed by str; a `_RawName` on a cluster
    client, which routes by the name and needs a str. The hot reads (XRANGE, XREAD of the ledger
    and of outputs) use it: a callback that builds a dict per entry costs more than decoding it."""
    return _RawName(name) if is_cluster(redis) else name.encode()


def relearn_layout(redis: object) -> None:
    """Make a cluster client learn the cluster's layout again before its next command: for a
    command sent to a node directly (not through the client's routing), which failed or was
    redirected because the node no longer serves the slot. Nothing on a plain client."""
    if isinstance(redis, RedisCluster):
        redis._initialize = True


def is_cluster(redis: object) -> bool:
    """Whether `redis` is a cluster client (typed as the plain client it stands in for)."""
    return isinstance(redis, RedisCluster)


async def redis_clock_ms(redis: aioredis.Redis, key: str) -> int:
    """Redis's clock (TIME) in ms, read on the server that holds `key`: on a cluster, that node's,
    so that it compares with the ids of the stream `key` names."""
    if is_cluster(redis):
        cluster: Any = redis
        reply: Any = await cluster.time(target_nodes=cluster.get_node_from_key(key))
    else:
        reply = await redis.time()
    secs, micros = reply
    return int(secs) * 1000 + int(micros) // 1000
