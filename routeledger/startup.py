"""A long-running process's first contact with Redis: the failures that waiting can mend are waited
out, the ones only a changed setting can mend stop it at once, naming the setting.

A worker on another machine is started by hand with a URL, a password and a CA copied from the
central machine; any of them can be wrong, and a process that retries a wrong password for ever
(as one did, with tenacity's "Retrying <unknown> in 5 seconds") looks as if it were working. A
Redis that is down or restarting is another matter: the process waits for it, and says so.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Iterator
from typing import Final
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
    RedisError,
    ResponseError,
)
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)

from routeledger.errors import RedisSettingsError

log = logging.getLogger("routeledger.startup")

# Seconds a refused connection (or an unresolved name, or one the server closed) is retried at start
# before the address is called wrong: long enough for a Redis started beside the process (at boot,
# or by `up`'s restart of it), short enough that a wrong address is said within 10 s.
REFUSED_GRACE_S: Final = 6.0
# The pause between tries; a restarting Redis is back within about a second.
PAUSE_S: Final = 0.5
# Seconds one PING may take before the wait is said.
PING_TIMEOUT_S: Final = 3.0
# How often the wait for a Redis that does not answer is said again in the log.
SAY_AGAIN_S: Final = 30.0

# Where the settings live, for the messages.
URL_HINT: Final = "--redis-url (or ROUTELEDGER_REDIS_URL)"
CA_HINT: Final = "ssl_ca_certs= in --redis-url, or redis_ca (ROUTELEDGER_REDIS_CA)"


def where(url: str) -> str:
    """`host:port` of a Redis URL, for messages (never its password)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    host = parts.netloc.rpartition("@")[2]
    return host or "localhost:6379"


def user_of(url: str) -> str | None:
    """The Redis user a URL names, if any."""
    userinfo = urlsplit(url).netloc.rpartition("@")[0]
    user = userinfo.partition(":")[0]
    return user or None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what it was raised from or while handling: redis-py wraps the socket's OSError
    in its ConnectionError (raised in the OSError's handler, so it is the context)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def permission_problem(exc: NoPermissionError, url: str, *, inbox: bool | None = None) -> str:
    """What to say when Redis says the user may not send a command or touch a key."""
    user = user_of(url) or "default"
    hint = (
        "a worker under the ACL `routeledger acl worker NAME` prints must run with --inbox"
        if inbox is False
        else "make the user again with `routeledger acl worker NAME` on the central machine "
        "(its rules may be older than this routeledger)"
    )
    return f"Redis user {user!r} lacks a permission this process needs ({exc}): {hint}"


def settings_problem(exc: BaseException, url: str) -> str | None:
    """What a failed first contact says is wrong in the settings, naming the setting to fix; None
    when waiting may mend it (a timeout, or a refusal within the grace: see `wait_for_redis`)."""
    at = where(url)
    if isinstance(exc, AuthenticationError) or (
        isinstance(exc, ResponseError) and str(exc).startswith(("WRONGPASS", "NOAUTH"))
    ):
        user = user_of(url) or "default"
        return (
            f"Redis at {at} refused the password of user {user!r} ({exc}): fix the password in "
            f"{URL_HINT}, rediss://USER:PASSWORD@HOST:PORT/0; `routeledger acl worker NAME` on the "
            "central machine makes a worker's user and prints its whole command"
        )
    if isinstance(exc, NoPermissionError):
        return permission_problem(exc, url)
    for cause in _chain(exc):
        if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(cause):
            return (
                f"Redis at {at} presented a TLS certificate that the CA file does not vouch for ({cause}): "
                f"set the CA ({CA_HINT}) to a copy of the central machine's <data dir>/tls/ca.crt"
            )
        if isinstance(cause, ssl.SSLError):
            return (
                f"the TLS handshake with Redis at {at} failed ({cause}): a Redis that speaks TLS needs a "
                f"rediss:// URL and one that does not a redis:// URL ({URL_HINT}); check the TLS files too"
            )
        if isinstance(cause, socket.gaierror) and cause.errno == socket.EAI_NONAME:
            return (
                f"the host name in the Redis URL does not resolve ({at}: {cause.strerror}): "
                f"fix the host in {URL_HINT}"
            )
    return None


def _refused(exc: BaseException, url: str) -> str | None:
    """What to say of a failure that waiting mends only if Redis is on its way (see REFUSED_GRACE_S)."""
    at = where(url)
    for cause in _chain(exc):
        if isinstance(cause, ConnectionRefusedError) or "Connect call failed" in str(cause):
            return (
                f"nothing accepts connections at {at} (connection refused): fix the host and port in "
                f"{URL_HINT}, or start `routeledger up` there (a remote worker needs --redis-bind on it)"
            )
        if isinstance(cause, socket.gaierror):
            return f"the host name in the Redis URL does not resolve ({at}: {cause}): fix it in {URL_HINT}"
    if isinstance(exc, RedisConnectionError) and not isinstance(exc, RedisTimeoutError):
        return (
            f"Redis at {at} closed the connection at once ({exc}): a Redis that speaks TLS needs a "
            f"rediss:// URL ({URL_HINT}), and its CA file ({CA_HINT})"
        )
    return None


async def wait_for_redis(client: aioredis.Redis, url: str) -> None:
    """PING until Redis answers. A setting that is wrong raises RedisSettingsError at once (or,
    for a refused connection, after REFUSED_GRACE_S); a Redis that does not answer is waited for,
    said in the log, for as long as it takes (the caller's signals end the wait)."""
    started = time.monotonic()
    said = 0.0
    while True:
        try:
            # Its own deadline, shorter than the client's read timeout: a Redis that accepts and does
            # not answer is said in the log within seconds (the cancelled try drops its connection).
            await asyncio.wait_for(client.ping(), PING_TIMEOUT_S)
            if said:
                log.info("Redis at %s answers", where(url))
            return
        except (RedisError, OSError, TimeoutError) as exc:
            problem = settings_problem(exc, url)
            if problem is not None:
                raise RedisSettingsError(problem) from None
            refused = _refused(exc, url)
            if refused is not None and time.monotonic() - started > REFUSED_GRACE_S:
                raise RedisSettingsError(refused) from None
            now = time.monotonic()
            if not said or now - said > SAY_AGAIN_S:
                log.warning(
                    "waiting for Redis at %s (%s); Ctrl-C or SIGTERM stops",
                    where(url),
                    str(exc) or type(exc).__name__,
                )
                said = now
        await asyncio.sleep(PAUSE_S)
