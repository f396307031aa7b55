"""`routeledger worker`, `routeledger reaper` and `routeledger task submit`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import redis.asyncio as aioredis
import typer
from redis.exceptions import NoPermissionError, RedisError

from dispatch.errors import WakeError
from dispatch.gateway import Gateway
from dispatch.wake import (
    DEFAULT_BROADCAST,
    DEFAULT_PORT,
    DEFAULT_WAKE_S,
    SleepRecord,
    normalize_mac,
    read_record,
    record_from_lease,
    write_record,
)
from events.clock import set_offset_ms
from events.event import WorkerOffline
from events.keys import Keys
from events.ledger import Ledger
from routeledger.config import redis_url_for
from routeledger.errors import RedisSettingsError
from routeledger.runtime import (
    Instance,
    cancel_soon,
    command,
    console,
    fail,
    on_signals,
    print_json,
    setup_logging,
)
from routeledger.startup import permission_problem, wait_for_redis
from tasks.lease import decode_lease, live_workers
from tasks.payload import Message, TaskMessage
from tasks.store import TaskStore
from workers.admission import RouterGate
from workers.agent import WorkerAgent
from workers.backend import make_backend
from workers.config import WORKER_NAME, WorkerConfig
from workers.reaper import Reaper, ReaperConfig

log = logging.getLogger("routeledger.cli")

worker_app = typer.Typer(
    help="Run a worker agent beside a backend (or retire one with `forget`).",
    invoke_without_command=True,
)
task_app = typer.Typer(help="Submit and inspect tasks.", no_args_is_help=True)


def _stop_on_signals(stop: asyncio.Event, starting: Callable[[], bool]) -> None:
    """SIGINT or SIGTERM sets `stop` (a running process drains); while `starting()` it also cancels
    the command, which has nothing to drain yet and may be waiting on a Redis that never answers."""
    main = asyncio.current_task()

    def on_signal() -> None:
        stop.set()
        if main is not None and starting():
            cancel_soon(main)

    on_signals(on_signal)


@worker_app.callback()
@command()
def worker(
    inst: Instance,
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Backend URL, e.g. http://127.0.0.1:11434.")] = None,
    kind: Annotated[str, typer.Option(help="Backend protocol: ollama or openai.")] = "ollama",
    id_: Annotated[str | None, typer.Option("--id", help="Worker name (default: this host's name).")] = None,
    slots: Annotated[int, typer.Option(min=1, help="Tasks run at once.")] = 1,
    models: Annotated[
        str | None,
        typer.Option(help="Comma-separated held models to serve; an empty string serves nothing."),
    ] = None,
    bench: Annotated[
        bool, typer.Option(help="Benchmark itself on joining and when its speed rows are thin or stale.")
    ] = True,
    gate: Annotated[
        str, typer.Option(help="router: take work only when the plan says so; plain: take whatever comes.")
    ] = "router",
    inbox: Annotated[
        bool,
        typer.Option(
            help="Append events to this worker's own inbox stream, checked and moved into the ledger by "
            "the projector (needed under the ACL `routeledger acl worker` prints)."
        ),
    ] = False,
    wake_mac: Annotated[
        str | None,
        typer.Option(
            help="This machine sleeps and wakes on LAN: its MAC address. The worker keeps a record of "
            "how to wake it, which the reaper reads while the machine is asleep."
        ),
    ] = None,
    wake_broadcast: Annotated[str, typer.Option(help="Where the magic packet goes.")] = DEFAULT_BROADCAST,
    wake_port: Annotated[int, typer.Option(min=1, max=65535, help="UDP port of the magic packet.")] = (
        DEFAULT_PORT
    ),
    wake_s: Annotated[
        float,
        typer.Option(min=0.0, help="Seconds from the magic packet to serving, until a wake is measured."),
    ] = DEFAULT_WAKE_S,
) -> None:
    """Run a worker: consume the streams of the models the backend holds, through the `workers` group."""
    if ctx.invoked_subcommand is not None:
        return
    if backend is None:
        fail("a worker needs its backend: pass --backend URL (e.g. http://127.0.0.1:11434)")
    if kind not in ("ollama", "openai"):
        fail(f"--kind must be ollama or openai, not {kind!r}")
    if gate not in ("router", "plain"):
        fail(f"--gate must be router or plain, not {gate!r}")
    name = id_ or socket.gethostname()
    if not WORKER_NAME.fullmatch(name):
        fail(
            f"worker name {name!r} is not a valid name: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (pass --id NAME)"
        )
    if wake_mac is not None:
        try:
            wake_mac = normalize_mac(wake_mac)
        except WakeError as exc:
            fail(exc.message)
    s = inst.settings
    setup_logging(s.log_level)
    if s.clock_offset_ms:
        # Every time this worker writes (events, its lease, results) comes from the shifted clock.
        set_offset_ms(s.clock_offset_ms)
        log.warning("this worker's clock is shifted by %+d ms (clock_offset_ms)", s.clock_offset_ms)
    serves = None if models is None else [m.strip() for m in models.split(",") if m.strip()]
    cfg = WorkerConfig(
        name=name,
        slots=slots,
        serves=serves,
        lease_ms=s.lease_ms,
        heartbeat_ms=s.heartbeat_ms,
        delivery_limit=s.delivery_limit,
        dead_max_entries=s.dead_max_entries,
        auto_bench=bench,
        inbox=inbox,
    )

    url = redis_url_for(s)

    async def go(client: aioredis.Redis) -> None:
        stop = asyncio.Event()
        agent: WorkerAgent | None = None
        _stop_on_signals(stop, lambda: agent is None or not agent.online)
        await wait_for_redis(client, url)
        be = make_backend(
            backend, kind, timeout_s=s.backend_timeout_s, idle_timeout_s=min(120.0, s.backend_timeout_s)
        )
        keys = inst.keys
        agent = WorkerAgent(
            client, keys, be, cfg, gate=RouterGate(client, keys) if gate == "router" else None
        )
        watcher = asyncio.create_task(_forward(stop, agent.stopping))
        sleeper = None
        if wake_mac is not None:
            mac = wake_mac
            sleeper = asyncio.create_task(
                _keep_record(client, keys, name, mac, wake_broadcast, wake_port, wake_s, agent.stopping)
            )
        try:
            await agent.run()
        except NoPermissionError as exc:
            # Said as what it is: Redis answered, and its ACL refused this user something.
            raise RedisSettingsError(permission_problem(exc, url, inbox=inbox)) from None
        finally:
            watcher.cancel()
            if sleeper is not None:
                sleeper.cancel()
            await be.aclose()

    inst.run(go, fast=True)


async def _keep_record(
    client: aioredis.Redis,
    keys: Keys,
    name: str,
    mac: str,
    broadcast: str,
    port: int,
    wake_s: float,
    stopping: asyncio.Event,
) -> None:
    """Keep this machine's sleeper record saying what its lease says it serves (dispatch.wake): written
    once the lease is taken, and again whenever what it serves changes."""
    last: SleepRecord | None = None
    while not stopping.is_set():
        try:
            raw: Any = await client.get(keys.live(name))
            if isinstance(raw, bytes):
                old = await read_record(client, keys, name)
                rec = record_from_lease(decode_lease(raw), mac, broadcast=broadcast, port=port, wake_s=wake_s)
                if last is None or _differs(rec, last) or old is None:
                    await write_record(client, keys, rec)
                    last = rec
        except (RedisError, OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("cannot keep the sleeper record (%s); retrying", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), 0.5 if last is None else 5.0)


def _differs(a: SleepRecord, b: SleepRecord) -> bool:
    return msgspec.structs.replace(a, updated_at=0) != msgspec.structs.replace(b, updated_at=0)


async def _forward(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


@worker_app.command("forget")
@command()
def forget(
    inst: Instance,
    name: Annotated[str, typer.Argument(help="The worker to retire for good.")],
    force: Annotated[bool, typer.Option(help="Forget it even though it is live right now.")] = False,
) -> None:
    """Retire a machine that is gone for good, so that it stops counting anywhere."""
    keys = inst.keys

    async def go(client: aioredis.Redis) -> None:
        live = await live_workers(client, keys)
        if name in live and not force:
            fail(f"worker {name!r} is live right now; stop it first, or pass --force")
        await client.sadd(keys.forgotten, name)
        await client.delete(keys.live(name), keys.card(name))
        await client.srem(keys.workers, name)
        await Ledger(client, keys).append(WorkerOffline(worker=name, reason="forgotten"))

    inst.run(go)
    console.print(f"forgot worker {name}")


@command()
def reaper_cmd(inst: Instance) -> None:
    """Reclaim tasks whose worker died, dead-letter spent ones, report stalled ones (one active at a time)."""
    s = inst.settings
    setup_logging(s.log_level)
    cfg = ReaperConfig(
        lease_ms=s.lease_ms,
        delivery_limit=s.delivery_limit,
        stall_after_s=s.stall_after_s,
        dead_max_entries=s.dead_max_entries,
    )

    async def go(client: aioredis.Redis) -> None:
        stop = asyncio.Event()
        connected = False
        _stop_on_signals(stop, lambda: not connected)
        await wait_for_redis(client, redis_url_for(s))
        connected = True
        await Reaper(client, inst.keys, cfg).run(stop)

    inst.run(go, fast=True)


@task_app.command("submit")
@command()
def task_submit(
    inst: Instance,
    model: Annotated[str, typer.Option(help="Model name, alias, digest prefix, or auto.")],
    prompt: Annotated[str, typer.Option(help="The user message.")],
    domain: Annotated[
        str, typer.Option(help="Domain of the request (general, code, japanese, …).")
    ] = "general",
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", min=1, help="Cap on output tokens.")
    ] = None,
    wait: Annotated[bool, typer.Option(help="Wait for the result and print it.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds --wait waits.")] = 600.0,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Queue a chat task for a model; fails at once if no live worker serves it."""
    if not prompt.strip():
        fail("--prompt is empty; give the model something to answer")
    keys = inst.keys
    req = TaskMessage(
        model=model,
        messages=[Message(role="user", content=prompt)],
        domain=domain,
        max_tokens=max_tokens,
        client="cli",
    )

    async def go(client: aioredis.Redis) -> dict[str, object]:
        # The API's one way in, with its checks (memory, a deadline: --timeout when it waits).
        sub = await Gateway(client, keys).submit(req, waits=wait, timeout_s=timeout)
        task, decision = sub.task, sub.decision
        out: dict[str, object] = {
            "task_id": task.task_id,
            "model": task.model,
            "digest": task.digest,
            "domain": task.domain,
            "queue": sub.queue,
            "expected_worker": decision.ranking.best.worker if decision else None,
            "expected_finish_s": round(decision.ranking.best.expected_finish_s, 3) if decision else None,
        }
        if wait:
            out.update(await _wait_result(client, keys, task.task_id, timeout))
        return out

    out = inst.run(go)
    if json_:
        print_json(out)
        return
    console.print(
        f"task {out['task_id']} ({out['model']}, {out['domain']}) queued on {out['queue']};"
        f" expected on {out['expected_worker']} in {out['expected_finish_s']}s"
    )
    if wait:
        console.print(
            f"[bold]{out.get('status')}[/] on {out.get('worker')}: {out.get('text', out.get('error', ''))}"
        )


async def _wait_result(client: aioredis.Redis, keys: Keys, task_id: str, wait_s: float) -> dict[str, object]:
    """Poll the result hash until the task has an outcome."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while loop.time() < deadline:
        result = await TaskStore(client, keys).result(task_id)
        if result is not None:
            return msgspec.to_builtins(result)  # type: ignore[no-any-return]
        await asyncio.sleep(0.1)
    fail(f"task {task_id} has no result after {wait_s:.0f}s (it is still queued or running)", 1)
