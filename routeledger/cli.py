"""The `routeledger` command line."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import secrets
import shlex
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, Final

import httpx
import msgspec
import redis.asyncio as aioredis
import typer
from rich.panel import Panel
from rich.table import Table

import routeledger
from events.codec import event_fields
from events.connection import check_tls
from events.event import TYPE_NAMES, Event
from events.ledger import Ledger
from routeledger.certs import WILDCARD_BINDS, ensure_server_tls, interface_addresses, server_names
from routeledger.cli_acl import acl_app, worker_acl_rules, worker_command, worker_url
from routeledger.cli_bench import bench_app
from routeledger.cli_pipeline import pipeline_app
from routeledger.cli_replay import archive_cmd, projector_cmd, replay_app
from routeledger.cli_route import route_app
from routeledger.cli_sim import sim_app
from routeledger.cli_status import status_cmd
from routeledger.cli_traffic import traffic_cmd
from routeledger.cli_wake import wake_cmd
from routeledger.cli_worker import reaper_cmd, task_app, worker_app
from routeledger.config import (
    FIELDS,
    Settings,
    default_data_dir,
    maxmemory_bytes,
    pointer_file,
    redis_url_for,
    url_file,
)
from routeledger.embedded import EmbeddedRedis, free_port, is_loopback, port_is_free, write_private
from routeledger.errors import ConfigError, PortTakenError
from routeledger.runtime import Instance, command, console, err_console, fail, print_json, setup_logging
from routeledger.supervisor import Supervisor, python_argv
from sim.fleetspec import preset_data

app = typer.Typer(
    name="routeledger",
    help="Route LLM requests across a small fleet of unequal machines, learning from a ledger.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
events_app = typer.Typer(help="Read the ledger.", no_args_is_help=True)
config_app = typer.Typer(help="Show the configuration.", no_args_is_help=True)
app.add_typer(events_app, name="events")
app.add_typer(config_app, name="config")
app.add_typer(sim_app, name="sim")
app.add_typer(replay_app, name="replay")
app.command("projector")(projector_cmd)
app.command("archive")(archive_cmd)
app.add_typer(worker_app, name="worker")
app.add_typer(task_app, name="task")
app.command("reaper")(reaper_cmd)
app.command("wake")(wake_cmd)
app.add_typer(bench_app, name="bench")
app.add_typer(route_app, name="route")
app.add_typer(pipeline_app, name="pipeline")
app.command("status")(status_cmd)
sim_app.command("traffic")(traffic_cmd)
app.add_typer(acl_app, name="acl")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _version(value: bool) -> None:
    if value:
        console.print(f"routeledger {routeledger.__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    data_dir: Annotated[
        Path | None,
        typer.Option("--data-dir", help="Data directory for every command (as ROUTELEDGER_DATA_DIR)."),
    ] = None,
) -> None:
    """routeledger: a ledger-driven router for a home LLM fleet."""
    if data_dir is not None:
        # Given before the subcommand, it is what ROUTELEDGER_DATA_DIR would be: every command
        # resolves it (a --data-dir after the subcommand still wins), and so do the processes `up`
        # starts, which inherit this environment.
        os.environ["ROUTELEDGER_DATA_DIR"] = str(data_dir.expanduser().resolve())


def _mask(url: str) -> str:
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


def _wait_http(url: str, timeout: float, alive: Any) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return True
        time.sleep(0.1)
    return False


# A name the API answers to besides loopback's (Open WebUI in Docker sends `host.docker.internal`).
ALLOW_HOST: Final = typer.Option(
    "--allow-host",
    metavar="NAME",
    help="A host name the API answers to besides localhost (repeatable; adds to allowed_hosts), "
    "e.g. host.docker.internal for a container on this machine.",
)


@app.command()
# `up` starts an instance where it is told, or in the default data dir: never in one already running.
@command(settings=("host", "port", "redis_bind", "redis_port", "redis_tls"), find_running=False)
def up(
    inst: Instance,
    host: Annotated[str | None, typer.Option(help="Address the API binds.")] = None,
    port: Annotated[int | None, typer.Option(help="Port of the API.")] = None,
    redis_bind: Annotated[
        str | None, typer.Option("--redis-bind", help="Address embedded Redis binds (for remote workers).")
    ] = None,
    redis_port: Annotated[int | None, typer.Option("--redis-port", help="Port of embedded Redis.")] = None,
    redis_tls: Annotated[
        bool | None,
        typer.Option(
            "--tls", help="Embedded Redis speaks only TLS, with a CA and certificate made in the data dir."
        ),
    ] = None,
    demo: Annotated[bool, typer.Option("--demo", help="Also run a simulated fleet.")] = False,
    allow_host: Annotated[list[str] | None, ALLOW_HOST] = None,
    worker: Annotated[
        list[str] | None,
        typer.Option(
            "--worker",
            metavar="NAME",
            help="With --tls: make a Redis user for remote worker NAME and print the command its "
            "machine runs (repeatable).",
        ),
    ] = None,
) -> None:
    """Start everything one machine needs: Redis (embedded unless --redis-url), the API, and more."""
    s = inst.settings
    if allow_host:
        s = msgspec.structs.replace(s, allowed_hosts=[*s.allowed_hosts, *allow_host])
    setup_logging(s.log_level)
    if s.host not in LOOPBACK and not (s.api_keys or s.keys):
        raise ConfigError(
            f"refusing to serve the API on {s.host} without API keys: set ROUTELEDGER_API_KEYS "
            "(or api_keys in the config file), or bind 127.0.0.1"
        )
    if not port_is_free(s.host, s.port):
        raise PortTakenError(
            f"port {s.port} on {s.host} is taken (another routeledger?): stop it, or pass --port"
        )

    embedded: EmbeddedRedis | None = None
    if s.redis_url:
        if s.redis_tls:
            raise ConfigError(
                "--tls makes the Redis that `up` starts speak TLS; a Redis of your own (--redis-url) "
                "has its own: give its rediss:// URL, with redis_ca when its CA is not a public one"
            )
        url = redis_url_for(s)
        _check_external_memory(url)
    else:
        # Made before the certificates, so that a Redis too old to listen where asked is refused first.
        embedded = EmbeddedRedis(
            Path(s.data_dir), port=s.redis_port or None, bind=s.redis_bind, maxmemory=maxmemory_bytes(s)
        )
        if s.redis_tls:
            embedded.tls = ensure_server_tls(embedded.data_dir, server_names(s.redis_bind))
        url = embedded.start()
    Path(s.data_dir).mkdir(parents=True, exist_ok=True)
    write_private(url_file(s), url + "\n")
    here = Path(s.data_dir).resolve()
    pointed = here != default_data_dir().resolve()
    if pointed:
        # Commands run with no data dir find this instance (config.running_elsewhere).
        pointer_file().parent.mkdir(parents=True, exist_ok=True)
        write_private(pointer_file(), f"{here}\n")

    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    sup = Supervisor()
    env = {"ROUTELEDGER_REDIS_URL": url, "ROUTELEDGER_PREFIX": s.prefix}
    if s.allowed_hosts:
        env["ROUTELEDGER_ALLOWED_HOSTS"] = ",".join(s.allowed_hosts)
    try:
        api = sup.spawn("api", python_argv("api", "--host", s.host, "--port", str(s.port)), env=env)
        sup.spawn("reaper", python_argv("reaper"), env=env)
        sup.spawn("projector", python_argv("projector"), env=env)
        # The archive directory is resolved here: `--data-dir` given to `up` does not reach children.
        archiver = ("archive", "--every", str(s.archive_every_s), "--archive-dir", s.archive_dir)
        sup.spawn("archiver", python_argv(*archiver), env=env)
        demo_hosts = _spawn_demo_fleet(sup, Path(s.data_dir), env) if demo else {}
        base = f"http://{s.host}:{s.port}"
        if not _wait_http(base + "/healthz", 30, lambda: api.alive):
            fail(f"the API did not come up on {base}; see its log above")
        _print_banner(base, url, s.data_dir, embedded is not None, demo_hosts)
        if embedded is not None and embedded.tls is not None:
            _print_worker_lines(s, embedded, url, worker or [])
        elif worker:
            err_console.print("[yellow]--worker makes users on the Redis that `up --tls` starts; ignored[/]")
        while not stop:
            sup.poll()
            if embedded is not None and not embedded.running:
                err_console.print("[yellow]embedded Redis exited; restarting it on the same data dir[/]")
                embedded.restart()
            time.sleep(0.2)
    finally:
        console.print("stopping…")
        sup.stop_all()
        if embedded is not None:
            embedded.stop()
        with contextlib.suppress(OSError):
            url_file(s).unlink()
        with contextlib.suppress(OSError):
            if pointed and pointer_file().read_text().strip() == str(here):
                pointer_file().unlink()


def _check_external_memory(url: str) -> None:
    """Warn when a Redis routeledger does not start itself has no memory limit or evicts at it
    (its limit and policy are its operator's to set; routeledger only reads them)."""
    import redis as sync_redis

    from dispatch.memory import parse_info

    log = logging.getLogger("routeledger.up")
    check_tls(url)
    client = sync_redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        state = parse_info(client.info("memory"))
    except sync_redis.RedisError as exc:
        log.warning("could not read the memory limit of %s (%s)", _mask(url), exc)
        return
    finally:
        client.close()
    warning = state.warning()
    if warning is not None:
        log.warning("%s", warning)


def _spawn_demo_fleet(sup: Supervisor, data_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """The story's fleet, simulated (preset `demo`: seed's machines, with an embedding model on both
    and a vision model on the GPU PC, so that every surface has a model to answer it): one sim hosts
    process and one worker per machine.

    Ports are chosen now and written into the fleet file, so that a restarted sim process comes
    back on the same ports and the workers' backend URLs stay right.
    """
    data = preset_data("demo")
    hosts: dict[str, str] = {}
    for machine in data["worker"]:
        machine["port"] = free_port()
        hosts[machine["name"]] = f"http://127.0.0.1:{machine['port']}"
    fleet_file = data_dir / "demo-fleet.json"
    fleet_file.write_text(json.dumps(data, indent=1))
    sup.spawn("sim-hosts", python_argv("sim", "hosts", "--fleet-file", str(fleet_file)), env=env)
    for machine in data["worker"]:
        argv = python_argv(
            "worker",
            "--backend",
            hosts[machine["name"]],
            "--id",
            machine["name"],
            "--slots",
            str(machine["slots"]),
        )
        if machine.get("serves") == []:
            argv += ["--models", ""]  # the story's retired server: registered, serving nothing
        sup.spawn(f"worker {machine['name']}", argv, env=env)
    # A light trickle of requests, so that the dashboard is alive on first sight.
    sup.spawn("traffic", python_argv("sim", "traffic", "--rate", "0.2"), env=env)
    return hosts


def _print_banner(base: str, url: str, data_dir: str, embedded: bool, demo: dict[str, str]) -> None:
    lines = [
        f"dashboard  {base}/dashboard",
        f"API        {base}",
        f"health     {base}/healthz",
        # The query (the TLS files) is left out: the data dir's tls/ holds them.
        f"Redis      {_mask(url.split('?', 1)[0])}{'  (embedded, AOF)' if embedded else ''}",
        f"data dir   {data_dir}",
        "Open WebUI connections:",
        f"  OpenAI   {base}/v1   (any API key, or one of api_keys)",
        f"  Ollama   {base}",
    ]
    for name, host in demo.items():
        lines.append(f"sim        {name:<11} {host}  (simulated Ollama, with a worker)")
    console.print(Panel("\n".join(lines), title="routeledger is up", subtitle="Ctrl-C stops everything"))


def _advertised_host(bind: str) -> str:
    """The address a worker on another machine dials to reach Redis bound to `bind`."""
    first = bind.split()[0]
    if first not in WILDCARD_BINDS:
        return f"[{first}]" if ":" in first else first
    addresses = interface_addresses()
    ipv4 = [a for a in addresses if ":" not in a]
    return (ipv4 or [f"[{a}]" for a in addresses] or ["127.0.0.1"])[0]


def _print_worker_lines(s: Settings, embedded: EmbeddedRedis, url: str, names: list[str]) -> None:
    """How a worker on another machine connects: the CA file to copy and, for each worker named
    with --worker, its Redis user (made now) and the whole command its machine runs. The admin's
    password is never printed; a worker's own is, as part of its command."""
    assert embedded.tls is not None
    host = _advertised_host(s.redis_bind)
    lines = [f"remote workers: copy {embedded.tls.ca} to the same path on each worker's machine"]
    if not names:
        data = f" --data-dir {shlex.quote(s.data_dir)}"
        lines.append(
            f"  then make each one's Redis user here, which prints the command its machine runs: "
            f"routeledger acl worker NAME --apply{data} --host {host}"
        )
    for name in names:
        password = _worker_password(Path(s.data_dir), name)
        _make_worker_user(url, name, password)
        lines.append(f"  worker {name} (Redis user {name}, made now), on its machine:")
        lines.append("  " + worker_command(name, worker_url(url, name, password, host=host)))
    if is_loopback(s.redis_bind):
        lines.append(
            f"  (Redis listens on {s.redis_bind} only: start with --redis-bind ADDRESS to let others in)"
        )
    # One line each, never wrapped, so that the command can be copied as it is.
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _worker_password(data_dir: Path, name: str) -> str:
    """Worker `name`'s Redis password, made once and kept in the data dir: the worker's machine
    keeps the command it was given through every restart of `up` (embedded Redis forgets its
    users when it stops, so `up` makes them again each time)."""
    path = data_dir / "workers" / f"{name}.pass"
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(24)
    write_private(path, password + "\n")
    return password


def _make_worker_user(url: str, name: str, password: str) -> None:
    import redis as sync_redis

    client = sync_redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        # A synchronous client's execute_command is untyped (as routeledger.embedded's _command says).
        client.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", name, *worker_acl_rules(name, password)
        )
    finally:
        client.close()


@app.command("api")
@command(settings=("host", "port"))
def api_cmd(
    inst: Instance,
    host: Annotated[str | None, typer.Option(help="Address to bind.")] = None,
    port: Annotated[int | None, typer.Option(help="Port.")] = None,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Server processes sharing the port.")] = 1,
    allow_host: Annotated[list[str] | None, ALLOW_HOST] = None,
) -> None:
    """Serve the HTTP API in the foreground (`up` starts it for you)."""
    import os

    import uvicorn

    from routeledger.config import redis_url_for

    s = inst.settings
    if allow_host:
        s = msgspec.structs.replace(s, allowed_hosts=[*s.allowed_hosts, *allow_host])
    setup_logging(s.log_level)
    if s.host not in LOOPBACK and not (s.api_keys or s.keys):
        raise ConfigError(
            f"refusing to serve the API on {s.host} without API keys (set ROUTELEDGER_API_KEYS)"
        )
    if not port_is_free(s.host, s.port):
        raise PortTakenError(f"port {s.port} on {s.host} is taken: stop what uses it, or pass --port")
    # Each server process builds its app from the environment (api_from_env), so the resolved
    # settings travel there; a flag or file value wins over what the environment said.
    os.environ["ROUTELEDGER_REDIS_URL"] = redis_url_for(s)
    # A TLS file that cannot be read is said here, not in each server process's start-up traceback.
    check_tls(os.environ["ROUTELEDGER_REDIS_URL"])
    os.environ["ROUTELEDGER_PREFIX"] = s.prefix
    os.environ["ROUTELEDGER_LOG_LEVEL"] = s.log_level
    os.environ["ROUTELEDGER_MAX_BODY_BYTES"] = str(s.max_body_bytes)
    os.environ["ROUTELEDGER_MAX_MESSAGES"] = str(s.max_messages)
    os.environ["ROUTELEDGER_MAX_QUEUE_DEPTH"] = str(s.max_queue_depth)
    if s.api_keys:
        os.environ["ROUTELEDGER_API_KEYS"] = ",".join(s.api_keys)
    os.environ["ROUTELEDGER_HOST"] = s.host
    os.environ["ROUTELEDGER_ALLOWED_HOSTS"] = ",".join(s.allowed_hosts)
    os.environ["ROUTELEDGER_ALLOWED_ORIGINS"] = ",".join(s.allowed_origins)
    os.environ["ROUTELEDGER_DOMAINS"] = ",".join(s.domains)
    os.environ["ROUTELEDGER_ALLOW_RUNTIME_OPTIONS"] = str(s.allow_runtime_options).lower()
    os.environ["ROUTELEDGER_MAX_NUM_CTX"] = str(s.max_num_ctx)
    if s.keys:
        os.environ["ROUTELEDGER_KEYS"] = msgspec.json.encode(s.keys).decode()
    uvicorn.run(
        "routeledger.cli:api_from_env",
        factory=True,
        host=s.host,
        port=s.port,
        workers=workers,
        log_config=None,
        access_log=False,
        loop="uvloop",
        http="httptools",
        # Longer than a client keeps an idle connection (httpx 5 s, aiohttp 15 s): a server that
        # closes one first races the client reusing it, which reads a reset (httpx.ReadError) for
        # a request that never arrived. uvicorn's default is 5 s, httpx's very figure.
        timeout_keep_alive=KEEP_ALIVE_S,
    )


# Seconds the API keeps an idle client connection open (see api's uvicorn.run).
KEEP_ALIVE_S: Final = 65


def api_from_env() -> Any:
    """The API app from `ROUTELEDGER_*` settings: the factory each uvicorn worker process calls."""
    from api.app import AppConfig, create_app
    from api.logs import configure
    from routeledger.config import redis_url_for, resolve

    s = resolve().settings
    configure(s.log_level)
    return create_app(
        AppConfig(
            redis_url=redis_url_for(s),
            prefix=s.prefix,
            api_keys=s.api_keys,
            keys=s.keys,
            max_queue_depth=s.max_queue_depth,
            max_body_bytes=s.max_body_bytes,
            max_messages=s.max_messages,
            wait_timeout_s=s.backend_timeout_s * 2,
            max_queue_s=s.max_queue_s,
            pipeline_model=s.pipeline_model,
            allowed_hosts=s.allowed_hosts,
            allowed_origins=s.allowed_origins,
            bound_host=s.host,
            domains=s.domains,
            allow_runtime_options=s.allow_runtime_options,
            max_num_ctx=s.max_num_ctx,
            prefix_pricing=s.prefix_pricing,
            paced_streams=s.paced_streams,
        )
    )


# -- events ---------------------------------------------------------------------------------------


def _event_line(entry_id: str, event: Event) -> str:
    when = dt.datetime.fromtimestamp(event.at / 1000).strftime("%H:%M:%S.%f")[:-3]
    fields = msgspec.to_builtins(event)
    fields.pop("type", None)
    fields.pop("at", None)
    brief = " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, "", [], {}))
    return f"[dim]{entry_id}[/] {when} [bold]{type(event).__name__}[/] {brief}"


@events_app.command("tail")
@command()
def events_tail(
    inst: Instance,
    type_: Annotated[
        list[str] | None, typer.Option("--type", help="Only events of this type (repeatable).")
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    from_id: Annotated[
        str, typer.Option("--from", help="Start after this id; `0` replays everything, `$` only new events.")
    ] = "$",
) -> None:
    """Follow the ledger, printing each event as it is appended."""
    wanted = set(type_ or [])
    unknown = wanted - TYPE_NAMES
    if unknown:
        fail(f"unknown event type(s) {sorted(unknown)}; known: {', '.join(sorted(TYPE_NAMES))}")

    def poison(exc: Exception) -> None:
        err_console.print(f"[yellow]skipped[/] {exc}")

    async def follow(client: aioredis.Redis) -> None:
        from replay.history import History

        history = History(client, inst.keys, inst.settings.archive_dir)
        async for entry_id, event in history.tail(from_id, block_ms=1000, on_poison=poison):
            if wanted and type(event).__name__ not in wanted:
                continue
            if json_:
                print_json({"id": entry_id, **event_fields(event)})
            else:
                console.print(_event_line(entry_id, event), highlight=False)

    with contextlib.suppress(KeyboardInterrupt):
        inst.run(follow)


@events_app.command("count")
@command()
def events_count(
    inst: Instance, json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False
) -> None:
    """How many events the ledger holds."""
    n = inst.run(lambda client: Ledger(client, inst.keys).length())
    if json_:
        print_json({"events": n})
    else:
        console.print(n)


# -- config ---------------------------------------------------------------------------------------


@config_app.command("show")
@command()
def config_show(
    inst: Instance, json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False
) -> None:
    """Print the effective configuration and where each value came from."""
    resolved = inst.resolved
    values = msgspec.to_builtins(resolved.settings)
    if values.get("redis_url"):
        values["redis_url"] = _mask(values["redis_url"])
    if values.get("api_keys"):
        values["api_keys"] = [f"…{k[-4:]}" if len(k) > 8 else "***" for k in values["api_keys"]]
    for table in values.get("keys") or []:
        table["key"] = f"…{table['key'][-4:]}" if len(table["key"]) > 8 else "***"
    if json_:
        out = {k: {"value": values[k], "source": resolved.sources[k]} for k in FIELDS}
        print_json({"settings": out, "config_file": resolved.config_file})
        return
    table = Table(title="routeledger configuration")
    table.add_column("setting")
    table.add_column("value")
    table.add_column("source")
    table.add_column("meaning", style="dim")
    for name, meaning in FIELDS.items():
        table.add_row(name, repr(values[name]), resolved.sources[name], meaning)
    console.print(table)


def main() -> None:
    app()
