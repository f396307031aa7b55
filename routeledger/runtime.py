"""What every command needs at run time: the shared options, the settings, a Redis connection,
clean errors, and one decorator (`command`) that gives a command all of them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Annotated, Any, Concatenate, NoReturn, ParamSpec, TypeVar

import msgspec
import redis.asyncio as aioredis
import typer
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError
from rich.console import Console

from events.connection import is_cluster_url, redis_client
from events.errors import RouteledgerError
from events.keys import Keys
from routeledger import library  # noqa: F401  every script joins the library this process loads
from routeledger.config import Resolved, redis_url_for, resolve

console = Console()
err_console = Console(stderr=True)

# Exit status for bad input or a set-up problem the user can fix.
EXIT_USAGE = 2

DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Data directory (default: $XDG_DATA_HOME/routeledger).")
]
RedisUrlOpt = Annotated[
    str | None, typer.Option("--redis-url", help="Use this Redis instead of the one `routeledger up` runs.")
]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML configuration file.")]

P = ParamSpec("P")
T = TypeVar("T")


def settings_from(
    data_dir: Path | None = None,
    redis_url: str | None = None,
    config: Path | None = None,
    *,
    find_running: bool = True,
    **flags: Any,
) -> Resolved:
    """Resolve the configuration from the command's flags, the environment and the file."""
    merged: dict[str, Any] = {"data_dir": str(data_dir) if data_dir else None, "redis_url": redis_url}
    merged.update(flags)
    return resolve(merged, config_file=config, find_running=find_running)


def connect(resolved: Resolved) -> aioredis.Redis:
    """A Redis client for the running instance (see `redis_url_for`; settings in `redis_client`)."""
    return redis_client(redis_url_for(resolved.settings))


@contextlib.asynccontextmanager
async def redis_session(resolved: Resolved) -> AsyncIterator[aioredis.Redis]:
    """A Redis client for one command, closed when the command is done."""
    client = connect(resolved)
    try:
        yield client
    finally:
        await client.aclose()


def keys_for(resolved: Resolved) -> Keys:
    # `up` runs one server; a cluster is always named by the given URL.
    return Keys(resolved.settings.prefix, cluster=is_cluster_url(resolved.settings.redis_url or ""))


class Instance:
    """The routeledger a command works with: its resolved settings, its key names, its Redis."""

    def __init__(self, resolved: Resolved) -> None:
        self.resolved = resolved
        self.settings = resolved.settings
        self.keys = keys_for(resolved)

    def session(self) -> contextlib.AbstractAsyncContextManager[aioredis.Redis]:
        """A Redis client for the running instance, closed when the block ends."""
        return redis_session(self.resolved)

    def run(self, work: Callable[[aioredis.Redis], Awaitable[T]], *, fast: bool = False) -> T:
        """Run `work` with a Redis client of its own (see run_async for Ctrl-C and `fast`)."""

        async def go() -> T:
            async with self.session() as client:
                return await work(client)

        return run_async(go(), fast=fast)


_SHARED_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("data_dir", DataDirOpt),
    ("redis_url", RedisUrlOpt),
    ("config", ConfigOpt),
)


def command(
    *, settings: Sequence[str] = (), find_running: bool = True
) -> Callable[[Callable[Concatenate[Instance, P], T]], Callable[P, T]]:
    """A command that works with a running routeledger: it gets `--data-dir`, `--redis-url` and
    `--config`, its settings resolved once (with its own options named in `settings` as flags), the
    Instance as its first argument, and `guarded`'s clean errors. `find_running`: with no data dir
    given, it works with the instance running elsewhere (config.running_elsewhere)."""

    def wrap(fn: Callable[Concatenate[Instance, P], T]) -> Callable[P, T]:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]
        shared = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
            for name, kind in _SHARED_OPTIONS
        ]

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            shared_values = {name: kwargs.pop(name, None) for name, _ in _SHARED_OPTIONS}
            flags = {name: kwargs.get(name) for name in settings}
            resolved = settings_from(
                shared_values["data_dir"],  # type: ignore[arg-type]
                shared_values["redis_url"],  # type: ignore[arg-type]
                shared_values["config"],  # type: ignore[arg-type]
                find_running=find_running,
                **flags,
            )
            return fn(Instance(resolved), *args, **kwargs)

        # Typer reads the options from the signature: the command's own, then the shared three.
        wrapper.__signature__ = inspect.Signature([*own, *shared])  # type: ignore[attr-defined]
        return guarded(wrapper)

    return wrap


def print_json(data: Any) -> None:
    """One JSON document on stdout (what every `--json` prints)."""
    print(msgspec.json.encode(data).decode(), flush=True)  # noqa: T201


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print one clear line and exit; never a traceback."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Client libraries log every request at INFO; that is noise in a server's log.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def unreachable(exc: Exception) -> str:
    """What to say when Redis cannot be reached, naming the fix for the causes a user can mend."""
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return (
            f"Redis's TLS certificate is not one this client trusts ({exc}): its certificate must be "
            "signed by the CA file in redis_ca (ROUTELEDGER_REDIS_CA, or ssl_ca_certs= in the URL); "
            "for a Redis that `routeledger up --tls` runs, copy tls/ca.crt from its data dir"
        )
    return (
        f"cannot reach Redis: {exc}; is `routeledger up` running (same --data-dir), or is --redis-url right?"
    )


def guarded(fn: Callable[P, T]) -> Callable[P, T]:
    """Turn the errors a user can meet into one line and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except RouteledgerError as exc:
            fail(str(exc))
        except AuthenticationError as exc:
            fail(f"Redis refused the password ({exc}); check --redis-url or the data dir's redis.url")
        except NoPermissionError as exc:
            # Redis answered: its ACL refused this user a command or a key, which no retry mends.
            fail(f"Redis refused this user a permission it needs ({exc}); check the user in --redis-url")
        except (RedisError, ConnectionError) as exc:
            fail(unreachable(exc))
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:
            if os.environ.get("ROUTELEDGER_DEBUG"):
                raise
            fail(f"internal error: {type(exc).__name__}: {exc} (set ROUTELEDGER_DEBUG=1 for a traceback)", 1)

    return wrapper


# Seconds a cancelled command may take to unwind before the process exits anyway.
CANCEL_GRACE_S = 3.0


def _exit_now() -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(130)


def cancel_soon(task: asyncio.Task[Any]) -> None:
    """Cancel a command's task, and end the process CANCEL_GRACE_S later if it has not ended: a
    cancelled Redis read has been seen, rarely, to leave the task waiting for ever, and a user who
    pressed Ctrl-C is not made to wait for that."""
    task.cancel()
    asyncio.get_running_loop().call_later(CANCEL_GRACE_S, _exit_now)


def on_signals(callback: Callable[[], None], *, exit_after_s: float | None = None) -> None:
    """Call `callback` on SIGINT or SIGTERM, from the running loop; `exit_after_s`: end the process
    that long after the first signal whatever the callback's work is doing (a shutdown that hangs
    on a Redis read must not keep a process alive that was told to stop).

    The loop learns of a signal through its wake-up socket, and uvloop has been seen to miss one
    that way (a projector that took no notice of SIGTERM for minutes). The interpreter's own
    handler, run at the next bytecode in the main thread (a heartbeat away at most), tells it too;
    the callback runs once."""
    loop = asyncio.get_running_loop()
    signalled = False

    def once() -> None:
        nonlocal signalled
        if signalled:
            return
        signalled = True
        if exit_after_s is not None:
            loop.call_later(exit_after_s, _exit_now)
        callback()

    def interpreter_handler(signum: int, frame: object) -> None:
        loop.call_soon_threadsafe(once)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, once)
            signal.signal(sig, interpreter_handler)


def run_async(coro: Coroutine[Any, Any, T], *, fast: bool = False) -> T:
    """Run a command's coroutine. Ctrl-C or SIGTERM cancels it and surfaces as KeyboardInterrupt
    once the loop has closed.

    `fast` runs it on uvloop (about a quarter less CPU per request): for the long-running
    processes, which handle their own signals. A short command keeps asyncio's own loop, whose
    signal wake-up interrupts a blocking read reliably; uvloop's was seen to miss a Ctrl-C under load.
    """
    interrupted = False

    async def main() -> T | None:
        nonlocal interrupted
        task = asyncio.ensure_future(coro)

        on_signals(lambda: cancel_soon(task))
        try:
            return await task
        except asyncio.CancelledError:
            interrupted = True
            return None

    result: T | None
    if fast:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvicorn[standard] brings it on Linux and macOS
            result = asyncio.run(main())
        else:
            result = uvloop.run(main())
    else:
        result = asyncio.run(main())
    if interrupted:
        raise KeyboardInterrupt
    return result  # type: ignore[return-value]
