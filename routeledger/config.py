"""The effective configuration, and where each value came from.

Precedence, highest first: a command-line flag, a `ROUTELEDGER_*` environment variable, the TOML
file (`--config`, `ROUTELEDGER_CONFIG`, else `$XDG_CONFIG_HOME/routeledger/config.toml`), the
default. `REDIS_URL` is read as well as `ROUTELEDGER_REDIS_URL`, as most tools do.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import msgspec

from dispatch.options import DEFAULT_DOMAINS, DEFAULT_MAX_NUM_CTX, DOMAIN_RULE, valid_domain
from events.connection import with_tls_files
from events.keys import DEAD_MAX_ENTRIES, DEFAULT_PREFIX
from events.singleton import DEFAULT_LEASE_MS
from projections.snapshot import DEFAULT_DEMAND_HALF_LIFE_S, DEFAULT_HALF_LIFE_S
from routeledger.errors import ConfigError, NotRunningError
from tasks.quota import ApiKey, named_keys

ENV_PREFIX: Final = "ROUTELEDGER_"
# The largest clock shift a test may ask a worker for: a day, far past any skew worth playing.
MAX_CLOCK_OFFSET_MS: Final = 86_400_000


def default_data_dir() -> Path:
    """`$XDG_DATA_HOME/routeledger`, else `~/.local/share/routeledger`."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "routeledger"


def default_config_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "routeledger" / "config.toml"


class Settings(msgspec.Struct, kw_only=True):
    """Every setting, with its default. See FIELDS for what each one means."""

    data_dir: str = ""
    redis_url: str | None = None
    redis_bind: str = "127.0.0.1"
    redis_port: int = 0
    redis_tls: bool = False
    redis_ca: str = ""
    redis_cert: str = ""
    redis_key: str = ""
    prefix: str = DEFAULT_PREFIX
    host: str = "127.0.0.1"
    port: int = 8600
    api_keys: list[str] = msgspec.field(default_factory=list)
    keys: list[ApiKey] = msgspec.field(default_factory=list)
    max_queue_depth: int = 10_000
    lease_ms: int = DEFAULT_LEASE_MS
    heartbeat_ms: int = 2_000
    delivery_limit: int = 3
    stall_after_s: float = 600.0
    half_life_s: float = DEFAULT_HALF_LIFE_S
    demand_half_life_s: float = DEFAULT_DEMAND_HALF_LIFE_S
    task_retention_days: int = 30
    backend_timeout_s: float = 300.0
    log_level: str = "info"
    pipeline_model: str = "auto"
    max_body_bytes: int = 4 * 1024 * 1024
    max_messages: int = 256
    archive_dir: str = ""
    hot_window_s: float = 7 * 86_400.0
    max_hot_entries: int = 2_000_000
    archive_every_s: float = 3_600.0
    redis_maxmemory: int | str = "25%"
    dead_max_entries: int = DEAD_MAX_ENTRIES
    max_queue_s: float = 3_600.0
    allowed_hosts: list[str] = msgspec.field(default_factory=list)
    allowed_origins: list[str] = msgspec.field(default_factory=list)
    domains: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_DOMAINS))
    allow_runtime_options: bool = False
    max_num_ctx: int = DEFAULT_MAX_NUM_CTX
    prefix_pricing: bool = True
    paced_streams: bool = False
    clock_offset_ms: int = 0


# What each setting means, for `config show` and the README's table.
FIELDS: Final[dict[str, str]] = {
    "data_dir": "where embedded Redis keeps its AOF, password and URL files",
    "redis_url": "use this Redis instead of starting an embedded one",
    "redis_bind": "address embedded Redis listens on (other than 127.0.0.1 lets remote workers in)",
    "redis_port": "port of embedded Redis (0: a free one)",
    "redis_tls": (
        "embedded Redis speaks only TLS (rediss://), with a CA and certificate  made in <data_dir>/tls"
    ),
    "redis_ca": "CA file a rediss:// connection trusts (the server's certificate must be signed by it)",
    "redis_cert": "client certificate a rediss:// connection presents (for a Redis that asks for one)",
    "redis_key": "key of redis_cert",
    "prefix": "prefix of every Redis key",
    "host": "address the HTTP API binds",
    "port": "port of the HTTP API",
    "api_keys": "Bearer keys the API accepts, without limits (comma-separated in the environment)",
    "keys": (
        "named API keys with optional limits: [[keys]] tables with name, key, rpm, tokens_per_day, "
        "max_queued, max_priority (in the environment: a JSON list of such objects)"
    ),
    "max_queue_depth": "most tasks one model's queue holds; a new one past it is refused (503)",
    "lease_ms": "a worker or running task is presumed dead this long after its last heartbeat",
    "heartbeat_ms": "how often a worker refreshes its lease and reports its inventory",
    "delivery_limit": "deliveries of one task before it is dead-lettered",
    "stall_after_s": "a queued task nobody took for this long is reported stalled",
    "half_life_s": "half-life of the time-decayed statistics",
    "demand_half_life_s": "half-life of the arrival rate per model (short: the gate needs recent demand)",
    "task_retention_days": "days of ledger time the projection keeps a task's row and benchmark marks",
    "backend_timeout_s": "longest a worker waits on its backend for one generation",
    "log_level": "log level of every process (debug, info, warning, error)",
    "pipeline_model": "model of a pipeline's decomposer, children and integration when a request names none",
    "max_body_bytes": "largest request body the API accepts (413 above it)",
    "max_messages": "most chat messages one API request may carry (413 above it)",
    "archive_dir": "the ledger's archive: Parquet segments and manifest.json (default: <data_dir>/archive)",
    "hot_window_s": "ledger entries younger than this stay in Redis; older ones are archived",
    "max_hot_entries": "most entries the stream keeps; older ones beyond it are archived, however young",
    "archive_every_s": "how often `up` runs the archiver",
    "redis_maxmemory": (
        "memory limit of embedded Redis: bytes, a size (512mb, 2gb) or a share of this machine's RAM "
        "(25%, the default: room for the API, workers and the OS beside it); never evicts"
    ),
    "dead_max_entries": "most entries rl:dead keeps; older ones are trimmed as new ones arrive",
    "max_queue_s": (
        "longest a task waits for a worker; later it expires unrun (TaskExpired). A waiting client's "
        "task expires sooner: when the client stops waiting"
    ),
    "allowed_hosts": (
        "host names the API answers to besides localhost, 127.0.0.1, [::1] and the bound address "
        "(comma-separated in the environment); '*' allows any, behind a proxy that checks them"
    ),
    "allowed_origins": (
        "web origins (https://app.example:3000) besides the API's own whose pages may call it; '*' allows any"
    ),
    "domains": "the domains a request may name (anything else is refused with 400)",
    "allow_runtime_options": (
        "accept options that change how a backend loads a model (num_gpu, num_ctx above "
        "max_num_ctx, num_thread…); such runs are marked and never counted in the speed statistics"
    ),
    "max_num_ctx": (
        "largest num_ctx a request may ask for without allow_runtime_options (the models' default)"
    ),
    "prefix_pricing": (
        "price what workers' slots hold of a prompt (a chat's earlier turns) and hand a turn straight "
        "to the worker that holds it when it wins by a margin; false plans every prompt as uncached"
    ),
    "paced_streams": (
        "place an answer streamed to its client where its reader finishes reading it first (first token, "
        "then no slower than 5.3 tok/s), never on a slower machine while a faster one is free; false "
        "(the default) places every task where it finishes"
    ),
    "clock_offset_ms": (
        "shift `routeledger worker`'s clock by this many ms (for tests playing a machine whose clock is "
        "off; /v1/fleet flags such a worker, and no table or age depends on its clock)"
    ),
}

_LIST_FIELDS: Final = {"api_keys", "allowed_hosts", "allowed_origins", "domains"}
_JSON_FIELDS: Final = {"keys"}


class Resolved(msgspec.Struct, kw_only=True):
    """Settings plus the source of every value: flag, env NAME, file PATH or default."""

    settings: Settings
    sources: dict[str, str]
    config_file: str | None


def _from_env(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    found: dict[str, tuple[Any, str]] = {}
    for name in FIELDS:
        var = ENV_PREFIX + name.upper()
        if var in environ:
            raw: Any = environ[var]
            if name in _LIST_FIELDS:
                raw = [part.strip() for part in raw.split(",") if part.strip()]
            elif name in _JSON_FIELDS:
                try:
                    raw = msgspec.json.decode(raw)
                except msgspec.DecodeError as exc:
                    raise ConfigError(f"{var} is not valid JSON: {exc}") from None
            found[name] = (raw, f"env {var}")
    if "redis_url" not in found and environ.get("REDIS_URL"):
        found["redis_url"] = (environ["REDIS_URL"], "env REDIS_URL")
    return found


def _from_file(path: Path) -> dict[str, tuple[Any, str]]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"config file {path} has unknown settings {unknown}; known: {sorted(FIELDS)}")
    return {k: (v, f"file {path}") for k, v in data.items()}


def resolve(
    flags: Mapping[str, Any] | None = None,
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    find_running: bool = True,
) -> Resolved:
    """Merge defaults, file, environment and flags (None flags are ignored). A data dir given
    nowhere is the default one, or, with `find_running`, that of the instance running elsewhere
    (`running_elsewhere`); `up` itself starts in the default one."""
    env = os.environ if environ is None else environ
    layered: dict[str, tuple[Any, str]] = {}
    path: Path | None = None
    if config_file is not None:
        path = Path(config_file)
    elif env.get(ENV_PREFIX + "CONFIG"):
        path = Path(env[ENV_PREFIX + "CONFIG"])
    elif default_config_file().is_file():
        path = default_config_file()
    if path is not None:
        layered.update(_from_file(path))
    layered.update(_from_env(env))
    for name, value in (flags or {}).items():
        if value is not None:
            if name not in FIELDS:
                raise ConfigError(f"unknown setting {name!r}")
            layered[name] = (value, "flag")
    values = {k: v for k, (v, _) in layered.items()}
    try:
        settings = msgspec.convert(values, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
    sources = {name: layered[name][1] if name in layered else "default" for name in FIELDS}
    if not settings.data_dir:
        settings.data_dir = str(default_data_dir())
        running = running_elsewhere() if find_running else None
        if running is not None:
            settings.data_dir = str(running)
            sources["data_dir"] = f"running instance ({pointer_file()})"
    if not settings.archive_dir:
        settings.archive_dir = str(Path(settings.data_dir) / "archive")
    _validate(settings)
    return Resolved(settings=settings, sources=sources, config_file=str(path) if path else None)


def _validate(s: Settings) -> None:
    checks = [
        (0 < s.port < 65536, f"port must be 1-65535, got {s.port}"),
        (0 <= s.redis_port < 65536, f"redis_port must be 0-65535, got {s.redis_port}"),
        (s.lease_ms >= 100, f"lease_ms must be at least 100, got {s.lease_ms}"),
        (0 < s.heartbeat_ms < s.lease_ms, "heartbeat_ms must be positive and shorter than lease_ms"),
        (s.delivery_limit >= 1, f"delivery_limit must be at least 1, got {s.delivery_limit}"),
        (s.stall_after_s > 0, "stall_after_s must be positive"),
        (s.half_life_s > 0, "half_life_s must be positive"),
        (s.demand_half_life_s > 0, "demand_half_life_s must be positive"),
        (s.max_queue_s > 0, f"max_queue_s must be positive, got {s.max_queue_s}"),
        (s.max_queue_depth >= 1, f"max_queue_depth must be at least 1, got {s.max_queue_depth}"),
        (s.task_retention_days >= 1, f"task_retention_days must be at least 1, got {s.task_retention_days}"),
        (bool(s.prefix), "prefix must not be empty"),
        (s.max_body_bytes >= 1024, f"max_body_bytes must be at least 1024, got {s.max_body_bytes}"),
        (s.max_messages >= 1, f"max_messages must be at least 1, got {s.max_messages}"),
        (s.hot_window_s >= 0, f"hot_window_s must not be negative, got {s.hot_window_s}"),
        (s.max_hot_entries >= 0, f"max_hot_entries must not be negative, got {s.max_hot_entries}"),
        (s.archive_every_s > 0, f"archive_every_s must be positive, got {s.archive_every_s}"),
        (s.dead_max_entries >= 1, f"dead_max_entries must be at least 1, got {s.dead_max_entries}"),
        (s.max_num_ctx >= 1, f"max_num_ctx must be at least 1, got {s.max_num_ctx}"),
        (bool(s.domains), "domains must name at least one domain"),
        (
            abs(s.clock_offset_ms) <= MAX_CLOCK_OFFSET_MS,
            f"clock_offset_ms must be within a day either way, got {s.clock_offset_ms}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    bad = [d for d in s.domains if not valid_domain(d)]
    if bad:
        raise ConfigError(f"domains {bad} are not domain names: {DOMAIN_RULE}")
    try:
        named_keys(s.api_keys, s.keys)
    except ValueError as exc:
        raise ConfigError(f"invalid API keys: {exc}") from None
    maxmemory_bytes(s)


# Multipliers of the size suffixes Redis itself accepts (redis.conf: 1k = 1000, 1kb = 1024).
_SIZE_UNITS: Final[dict[str, int]] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1024,
    "m": 1000**2,
    "mb": 1024**2,
    "g": 1000**3,
    "gb": 1024**3,
}
_SIZE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")
# Below this Redis cannot even hold its own bookkeeping and a few tasks.
MIN_MAXMEMORY: Final = 16 * 1024**2


def total_ram() -> int:
    """This machine's physical memory in bytes."""
    import psutil

    return int(psutil.virtual_memory().total)


def maxmemory_bytes(s: Settings) -> int:
    """`redis_maxmemory` in bytes: as given, a size with a unit, or a percentage of this machine's RAM."""
    raw = s.redis_maxmemory
    how = "bytes (1073741824), a size (512mb, 2gb) or a share of RAM (25%)"
    if isinstance(raw, int):
        value = raw
    else:
        text = raw.strip().lower()
        if text.endswith("%"):
            try:
                share = float(text[:-1])
            except ValueError:
                raise ConfigError(f"redis_maxmemory {raw!r} is not a percentage; give {how}") from None
            if not 0 < share <= 100:
                raise ConfigError(f"redis_maxmemory {raw!r} must be a share between 0% and 100%")
            value = int(total_ram() * share / 100)
        else:
            match = _SIZE.match(text)
            if match is None or match.group(2) not in _SIZE_UNITS:
                raise ConfigError(f"redis_maxmemory {raw!r} is not a size; give {how}")
            value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
    if value < MIN_MAXMEMORY:
        raise ConfigError(
            f"redis_maxmemory {raw!r} is {value} bytes, under the least that works ({MIN_MAXMEMORY}, 16mb)"
        )
    return value


def pointer_file() -> Path:
    """Where `up` records the data dir it runs in, when that is not the default one."""
    return default_data_dir() / "running"


def running_elsewhere() -> Path | None:
    """The data dir of an instance `up` runs outside the default data dir (`make demo` runs in
    ./.routeledger), when none runs in the default one: every command run with no data dir finds it.

    A pointer in the default data dir rather than a look in ./.routeledger: a command run from
    another directory (a second terminal, a cron job) finds the instance too, and what it finds
    does not change with the directory it runs in; a data dir given (flag, ROUTELEDGER_DATA_DIR,
    the config file) always wins."""
    if (default_data_dir() / "redis.url").is_file():
        return None
    try:
        named = Path(pointer_file().read_text().strip())
    except OSError:
        return None
    # A pointer left by an `up` that was killed names a dir whose URL file is gone (or stale: then
    # the command says it cannot reach Redis there, naming the dir).
    return named if named.is_absolute() and (named / "redis.url").is_file() else None


def url_file(settings: Settings) -> Path:
    """The 0600 file where `up` records the URL of the Redis it uses."""
    return Path(settings.data_dir) / "redis.url"


def redis_url_for(settings: Settings) -> str:
    """The Redis URL a command should use: the configured one, else the one `up` recorded; with
    the TLS files of `redis_ca`, `redis_cert` and `redis_key` in its query (see events/connection.py)."""
    url = settings.redis_url or _recorded_url(settings)
    return with_tls_files(url, ca=settings.redis_ca, cert=settings.redis_cert, key=settings.redis_key)


def _recorded_url(settings: Settings) -> str:
    path = url_file(settings)
    if path.is_file():
        url = path.read_text().strip()
        if url:
            return url
    raise NotRunningError(
        f"no running routeledger found in {settings.data_dir}: start one with `routeledger up` "
        "(with the same --data-dir), or pass --redis-url"
    )
