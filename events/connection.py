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

Everything here is redis-py's public API: `Redis.from_url`, `RedisCluster` and a thin public
subclass of it (arq's `ArqRedis` is the model), its pipelines and its parsed replies. An earlier
version packed and read replies on redis-py's private parser classes to save about 9 us a round
trip; a routed request makes about forty round trips and its answer takes seconds, and a renamed
private class in a redis-py release would have stopped every process.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError, ResponseError
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
      (`tasks.store.resend`, the gateway's submission keyed by task id).
    - Every read has a deadline (`socket_timeout`, longer than any blocking read routeledger
      makes), and TCP keepalive is on, so that a half-open connection fails instead of hanging.
    - Maintenance notifications are off, so that a pooled connection the server closed is replaced
      at checkout (see the module's docstring).
    - A `rediss://` URL is TLS, with the files in its query (see the module's docstring); they are
      checked here, so that a missing one is named rather than failing the first command.
    """
    check_tls(url)
    if is_cluster_url(url):
        return _cluster_client(url, socket_timeout=socket_timeout, **options)
    settings = _settings(socket_timeout)
    if urlsplit(url).scheme == "unix":
        # A local socket has no TCP keepalive (redis-py refuses the options for one).
        del settings["socket_keepalive"], settings["socket_keepalive_options"]
    client: aioredis.Redis = aioredis.Redis.from_url(url, **settings, **options)
    return client


def _cluster_client(url: str, *, socket_timeout: float, **options: Any) -> aioredis.Redis:
    """A RedisCluster made by the rules of `redis_client`. MOVED and ASK redirections are followed
    (the command was not run where it was refused); a connection error is not retried, but it
    makes the client learn the cluster's layout again before its next command (redis-py's own
    rule for a single command; `FailoverPipeline` for a pipeline), so that a process follows a
    failover without a restart. The cluster client serves every command routeledger sends, with
    the same signatures, so it is typed as the plain client it stands in for: the cluster tier of
    the tests runs the code base on it."""
    nodes, username, password = cluster_nodes(url)
    parts = urlsplit(url)
    tls = dict(parse_qsl(parts.query))
    ssl: dict[str, Any] = {}
    if CLUSTER_SCHEMES[parts.scheme] == "rediss":
        ssl = {"ssl": True, **{name: tls[name] for name in TLS_FILE_PARAMS if name in tls}}
    client = ClusterClient(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        username=username,
        password=password,
        **_settings(socket_timeout),
        **ssl,
        **options,
    )
    return client  # type: ignore[return-value]


class FailoverPipeline(ClusterPipeline):
    """redis-py's cluster pipeline, which makes its client learn the cluster's layout again after a
    node failed under it, as a single command does. redis-py does so only before a retry, and
    routeledger's clients never retry: a process whose commands to a failed master's slots went
    through pipelines (multi-key EXISTS, DEL and MGET are pipelines on a cluster) kept sending them
    to the dead node after a replica had taken its place."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except RedisCluster.ERRORS_ALLOW_RETRY:
            await relearn_layout(self.cluster_client)
            raise


class ClusterClient(RedisCluster):
    """redis-py's cluster client whose pipelines follow a failover (`FailoverPipeline`)."""

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        # As redis-py's own pipeline() makes one (its stubs call the class abstract).
        return FailoverPipeline(self, transaction)  # type: ignore[abstract]


async def send_all(
    redis: aioredis.Redis, commands: Sequence[Sequence[Any]], *, raise_on_error: bool = False
) -> list[Any]:
    """`commands` sent together and their replies in order, through a non-transactional pipeline:
    a command Redis refused has its error in its place, and the others still ran; with
    `raise_on_error` the first such error is raised once every reply is in. Replies go through
    redis-py's response callbacks, as any command's do. On a cluster the commands may go to
    several nodes (so command names are str: the cluster client refuses bytes)."""
    pipe = redis.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    replies: list[Any] = await pipe.execute(raise_on_error=raise_on_error)
    return replies


async def relearn_layout(redis: object) -> None:
    """Make a cluster client learn the cluster's layout now: after a command sent to a node
    directly (not through the client's routing), or a pipeline, failed or was redirected because
    the node no longer serves the slot. A layout that cannot be read now (the cluster is still
    electing) is read again at the next failure. Nothing on a plain client."""
    if isinstance(redis, RedisCluster):
        with contextlib.suppress(RedisError, OSError):
            await redis.nodes_manager.initialize()


def is_oom(exc: BaseException) -> bool:
    """Whether Redis refused a command because it is at maxmemory ("OOM command not allowed when used
    memory > 'maxmemory'"): redis-py's OutOfMemoryError, or the same refusal inside a script, which
    Redis 6.2 reports as a script error quoting it."""
    if isinstance(exc, OutOfMemoryError):
        return True
    return isinstance(exc, ResponseError) and "command not allowed when used memory" in str(exc)


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
