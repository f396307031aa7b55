"""`routeledger acl worker NAME`: Redis ACL lines for a worker that runs on another machine.

A worker's Redis user may touch only what a worker touches (read from workers/ and events/), and
speaks only for itself: the projector's ingest checks what it appends to its inbox against what it
holds before moving it into the ledger (projections/ingest.py).

| keys | access | why |
|---|---|---|
| `rl:events:w:NAME` | XADD only | its inbox (`--inbox`), the only stream it appends events to |
| `rl:inboxes` | SADD only | it lists its inbox there (the ingest finds it without SCAN), no other off |
| `rl:q:{12 hex}` | read; take, keep, re-queue | shared queues of models (never XACK, XDEL, DEL, XADD) |
| `rl:q:{rl:q:{12 hex}}:*` | the same | the same models' priority band queues |
| `rl:qb:{rl:q:{12 hex}}` | read | which band queues a model has (the backlog function reads it) |
| `rl:q:w:NAME` | the same | its own pinned queue (not another's): tasks handed straight to it |
| `rl:q:bg:NAME` | the same, and XADD | its own background queue (not another's): its benchmark requests |
| `rl:out:w:NAME:{*}`, `rl:result:w:NAME:{*}` | read, write | its own output chunks and results |
| `rl:live:NAME` | read, write | its own lease |
| `rl:card:NAME` | read, write | what its backend says of its models beyond the lease (template, parameters) |
| `rl:forgotten` | read, write | it takes itself off the retired list when it comes back |
| `rl:sleeper:NAME` | read, write | how its machine is woken (`--wake-mac`), read while it sleeps |
| `rl:sleepers` | SADD only | it lists its sleeper record (the waker finds it without SCAN), no other off |
| `rl:ctl:NAME` | read | operators' pulls and deletes for its machine (progress: its own output keys) |
| `rl:live:*`, `rl:p:*`, `rl:cancel:*` | read | other leases and the snapshot (the gate), cancel flags |
| `rl:events` | read | ledger news wakes a worker the gate held back |
| `rl:dead` | XADD only | it dead-letters a malformed or spent task, never rewrites the stream |

Scripts: FCALL of the `routeledger` function library only (events/scripts.py; the projector loads it
with the admin's credentials). No EVAL, EVALSHA or SCRIPT LOAD: a worker runs no Lua of its own. No
SCAN, KEYS or any admin command.

Redis runs a function with its caller's ACL, so the commands the functions send are the worker's
own too: its user can send them directly, on the keys above. So the task queues are in a selector
of their own that allows only what taking, keeping and re-queuing an entry needs (XREADGROUP,
XCLAIM, XGROUP CREATE, and reads): no XACK, XDEL, XTRIM, DEL, PEXPIRE or XADD, so that a worker
cannot make a queued task vanish. The worker never acknowledges an entry: the ingest finishes it
as it moves the event that closes the run (projections/ingest.py), and the reaper re-queues an
entry that a consumer read with NOACK or skipped with XCLAIM LASTID (workers/reaper.py). What the
ledger says cannot be forged (the ingest checks it); what a worker does with the tasks it takes
(its answers, or holding them unanswered while its lease lives) is trusted. Its answers go to keys
of its own (`Keys.run_out`, `Keys.run_result`), which the API serves only for a task the worker
holds or held (tasks/outputs.py `run_writers`): what it writes for another task is never read.

Read-only keys use Redis 7's `%R~` and the last line is a Redis 7 *selector*: Redis 6.2 rejects
both, and has no functions, so these lines need Redis 7 to mean what they say.
"""

from __future__ import annotations

import secrets
import shlex
from typing import Annotated, Final
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
import typer

from events.connection import send_all
from events.errors import RouteledgerError
from events.keys import Keys
from routeledger.config import redis_url_for
from routeledger.runtime import Instance, command, fail

acl_app = typer.Typer(help="Redis ACLs for processes on other machines.", no_args_is_help=True)

# Every command the worker agent, its gate and its benchmarks send. Not CLIENT SETINFO: redis-py
# sends it on connect and ignores a refusal, and Redis 7.0 does not know it.
WORKER_COMMANDS: tuple[str, ...] = (
    "ping",
    "select",
    "time",
    "get",
    "set",
    "del",
    "exists",
    "mget",
    "pexpire",
    "srem",
    "sadd",
    "smembers",
    "sismember",
    "zrange",
    "hset",
    # The result's "logged" mark is taken back when Redis refused an event the mark stands for.
    "hdel",
    "hget",
    "hgetall",
    "hmget",
    "hexists",
    "hsetnx",
    # Its model cards are written whole, in one MULTI (dispatch.modelcard.publish_cards).
    "multi",
    "exec",
    "xadd",
    "xpending",
    "xrange",
    "xrevrange",
    "xlen",
    "xread",
    "xinfo|groups",
    "xinfo|stream",
    "fcall",
)
# What a worker may do to a task queue (its own selector): take, keep alive and re-queue entries,
# through the library's functions, which send these under the worker's ACL; and read.
QUEUE_COMMANDS: tuple[str, ...] = (
    "fcall",
    "xreadgroup",
    "xclaim",
    "xgroup|create",
    "xpending",
    "xrange",
    "xrevrange",
    "xlen",
    "xread",
    "xinfo|groups",
    "xinfo|stream",
    "zrange",
)

_HEX12 = "[0-9a-f]" * 12


def worker_acl_rules(name: str, password: str, keys: Keys | None = None) -> list[str]:
    """The ACL SETUSER rules (after the user name) for worker `name`, Redis 7 syntax."""
    if not name or any(c.isspace() or c in "*?[]\\{}:" for c in name):
        raise ValueError(
            f"a worker name for an ACL must have no spaces, glob characters, braces or colons: {name!r}"
        )
    k = keys or Keys()
    queues = [
        f"{k.core}q:{_HEX12}",
        f"{k.core}q:{{{k.core}q:{_HEX12}}}:*",
        f"{k.core}qb:{{{k.core}q:{_HEX12}}}",
        k.pinned(name),
        k.background(name),
    ]
    rules = ["reset", "on", f">{password}", "resetchannels"]
    # The queues are read-only here (XREAD of them with the ledger in one command is matched by
    # this first set of rules); what changes them is in their own selector below.
    rules += [f"%R~{q}" for q in queues]
    rules += [
        # Its own outputs only: the API serves a task's output only from a worker that ran it.
        f"~{k.run_out(name, '*')}",
        f"~{k.run_result(name, '*')}",
        f"~{k.live(name)}",
        f"~{k.card(name)}",
        # How its machine is woken while it sleeps (dispatch.wake): its own record only.
        f"~{k.sleeper(name)}",
        f"~{k.forgotten}",
        # The registries: its own entry in the live workers, and the queues it makes.
        f"~{k.workers}",
        f"~{k.queues}",
        f"%R~{k.live('*')}",
        f"%R~{k.prefix}p:*",
        f"%R~{k.cancel('*')}",
        f"%R~{k.events}",
        # Operators' pulls and deletes for its machine (dispatch.control): its own stream only.
        f"%R~{k.control(name)}",
    ]
    rules += [f"+{c}" for c in WORKER_COMMANDS]
    # Read and write: a key a function is given must be both (Redis cannot tell which it needs).
    rules.append("(" + " ".join([*(f"~{q}" for q in queues), *(f"+{c}" for c in QUEUE_COMMANDS)]) + ")")
    # Its own background queue takes its benchmark and grading requests.
    rules.append(f"(~{k.background(name)} +xadd)")
    # It lists its inbox, and may take no other worker's off the list (the ingest reads only it).
    rules.append(f"(~{k.inboxes} +sadd)")
    # The same for its sleeper record.
    rules.append(f"(~{k.sleepers} +sadd)")
    # Append-only: XADD (directly or from the batch-append function), and nothing else, on its inbox
    # and the dead letters.
    rules.append(f"(~{k.inbox(name)} ~{k.dead} +xadd +fcall)")
    return rules


# The backend a worker's line names when none is given: Ollama's own address on the worker's machine.
DEFAULT_BACKEND: Final = "http://127.0.0.1:11434"


def worker_url(admin_url: str, name: str, password: str, *, host: str | None = None, ca: str = "") -> str:
    """The URL worker `name` connects with: the instance's scheme, address and database, the
    worker's own user and password instead of the admin's, and the CA file a TLS connection
    trusts in its query (so that the one URL is the whole setting; no client certificate: `up
    --tls` asks for none). `host`: the address the worker's machine dials, when not the URL's."""
    parts = urlsplit(admin_url)
    query = dict(parse_qsl(parts.query))
    address = parts.netloc.rpartition("@")[2]
    if host is not None:
        address = f"{host}:{parts.port}" if parts.port else host
    trusted = ca or query.get("ssl_ca_certs", "")
    netloc = f"{quote(name, safe='')}:{quote(password, safe='')}@{address}"
    tls = parts.scheme in ("rediss", "rediss+cluster")
    return urlunsplit(
        parts._replace(netloc=netloc, query=urlencode({"ssl_ca_certs": trusted}) if tls and trusted else "")
    )


def worker_command(name: str, url: str, *, backend: str = DEFAULT_BACKEND) -> str:
    """The one command worker `name`'s machine runs, quoted for a POSIX shell: its own id, --inbox
    (its ACL lets it append events only to its inbox) and its whole URL."""
    argv = ["routeledger", "worker", "--id", name, "--inbox", "--backend", backend, "--redis-url", url]
    return " ".join(shlex.quote(a) for a in argv)


@acl_app.command("worker")
@command()
def acl_worker(
    inst: Instance,
    name: Annotated[str, typer.Argument(help="The worker's name (its --id); also the Redis user name.")],
    password: Annotated[
        str | None, typer.Option(help="The user's password (default: a new random one, printed).")
    ] = None,
    apply: Annotated[
        bool,
        typer.Option(
            "--apply",
            help="Make the user on the running routeledger now (as its admin) and print only the "
            "command the worker's machine runs.",
        ),
    ] = False,
    backend: Annotated[
        str, typer.Option(help="The backend URL as the worker's machine reaches it.")
    ] = DEFAULT_BACKEND,
    host: Annotated[
        str | None,
        typer.Option(help="The address the worker's machine dials to reach Redis (default: the instance's)."),
    ] = None,
    ca: Annotated[
        str | None,
        typer.Option(
            help="Where the worker's machine keeps its copy of the CA file (default: this machine's "
            "path, right for a worker here or a copy made at the same path)."
        ),
    ] = None,
) -> None:
    """Print the ACL SETUSER line that lets worker NAME touch only what a worker needs (Redis 7), and
    the command the worker's machine runs (with --apply: make the user, print the command)."""
    keys = inst.keys
    secret = password or secrets.token_urlsafe(24)
    try:
        rules = worker_acl_rules(name, secret, keys)
    except ValueError as exc:
        fail(str(exc))
    acl = ["ACL", "SETUSER", name, *rules]
    try:
        admin_url = redis_url_for(inst.settings)
    except RouteledgerError:
        if apply:
            raise
        admin_url = ""
    run = (
        worker_command(name, worker_url(admin_url, name, secret, host=host, ca=ca or ""), backend=backend)
        if admin_url
        else f"routeledger worker --id {name} --inbox --backend {backend} --redis-url "
        f"'redis://{name}:{secret}@HOST:PORT/0' (rediss:// and ?ssl_ca_certs=CA_FILE for a TLS Redis)"
    )
    if apply:

        async def make_user(client: aioredis.Redis) -> None:
            await send_all(client, [acl], raise_on_error=True)

        inst.run(make_user)
        typer.echo(f"# made Redis user {name}; on the worker's machine run:", err=True)
        typer.echo(run)
        return
    # Only the ACL line goes to stdout, so that `... > file; redis-cli < file` sends nothing else.
    typer.echo(
        "# Redis >= 7. Apply with: redis-cli -u ADMIN_URL < FILE (or run this with --apply); then on\n"
        "# the worker's machine run:",
        err=True,
    )
    typer.echo(run, err=True)
    typer.echo(" ".join(shlex.quote(p) for p in acl))
