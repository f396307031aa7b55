"""`routeledger status [--watch]`: the dashboard in the terminal, read from Redis directly.

The same data as GET /v1/dashboard/overview (dispatch.overview.overview), so it works without the
API running: the fleet, capacity and queues per model, recent tasks with who ran them and why,
recent reclaims, stalls and dead letters, and Redis's memory against its limit with the archive's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from typing import Annotated, Any

import redis.asyncio as aioredis
import typer
from redis.exceptions import RedisError
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dispatch.memory import MemoryWatch, human_bytes
from dispatch.overview import overview
from events.connection import redis_client
from events.errors import RouteledgerError
from routeledger.config import redis_url_for
from routeledger.runtime import Instance, command, console, print_json

_STATUS_STYLE = {
    "online": "green",
    "completed": "green",
    "draining": "yellow",
    "running": "yellow",
    "queued": "yellow",
    "submitted": "yellow",
}


def _clock(ms: int | None) -> str:
    return "-" if ms is None else dt.datetime.fromtimestamp(ms / 1000).strftime("%H:%M:%S")


def _ago(ms: int | None, now: int) -> str:
    if ms is None:
        return ""
    s = max(0, (now - ms) // 1000)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    return f"{s // 3600}h {s % 3600 // 60}m"


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _known(v: object) -> str:
    return "?" if v is None else str(v)


def _status(s: str) -> Text:
    return Text(s, style=_STATUS_STYLE.get(s, "red"))


def _gib(v: object) -> str:
    return "?" if not isinstance(v, int | float) else f"{v / 2**30:.1f}"


def machine(r: dict[str, Any] | None) -> str:
    """What a worker could read of its machine (its lease's when live), `-` when nothing."""
    if not r:
        return "-"
    parts: list[str] = []
    if r.get("cpu_percent") is not None:
        parts.append(f"cpu {r['cpu_percent']:.0f}%")
    if r.get("mem_total_bytes") is not None:
        parts.append(f"mem {_gib(r.get('mem_used_bytes'))}/{_gib(r['mem_total_bytes'])} GiB")
    if r.get("gpu_percent") is not None:
        parts.append(f"gpu {r['gpu_percent']:.0f}%")
    if r.get("vram_total_bytes") is not None:
        parts.append(f"vram {_gib(r.get('vram_used_bytes'))}/{_gib(r['vram_total_bytes'])} GiB")
    return " · ".join(parts) or "-"


def fleet_table(o: dict[str, Any]) -> Table:
    now = o["now"]
    t = Table(title="fleet", title_justify="left", expand=True)
    for col in ("worker", "status", "since", "slots busy", "models (* loaded)", "lease", "machine"):
        t.add_column(col)
    for w in o["workers"]:
        models = ", ".join(
            f"{'*' if m['loaded'] else ''}{m['name']}{'' if m['serving'] else ' (not served)'}"
            for m in w["models"]
        )
        lease = "expired" if w["lease_age_s"] is None else f"renewed {w['lease_age_s']:.1f}s ago"
        if w.get("clock_skewed"):
            lease += f", clock {w['clock_skew_s']:+.0f}s off"
        t.add_row(
            w["id"],
            _status(w["status"]),
            f"{_clock(w['since'])} ({_ago(w['since'], now)})",
            f"{_known(w['busy'])} / {_known(w['slots'])}",
            models or "none",
            lease,
            machine(w.get("resources")),
        )
    if not o["workers"]:
        t.add_row("no worker has registered", "", "", "", "", "", "")
    return t


def models_table(o: dict[str, Any]) -> Table:
    t = Table(title="capacity and queues", title_justify="left", expand=True)
    t.add_column("model")
    t.add_column("capacity (live slots)", justify="right")
    t.add_column("holders (* loaded)")
    t.add_column("queued", justify="right")
    t.add_column("running", justify="right")
    for m in o["models"]:
        holders = ", ".join(f"{'*' if w in m['loaded_on'] else ''}{w}" for w in m["holders"])
        queued = "?" if m["queued"] is None else str(m["queued"])
        running = "?" if m["running"] is None else str(m["running"])
        t.add_row(m["name"], str(m["capacity"]), holders, queued, running)
    if not o["models"]:
        t.add_row("no live worker serves a model", "", "", "", "")
    return t


def tasks_table(o: dict[str, Any], limit: int = 12) -> Table:
    t = Table(title="recent tasks", title_justify="left", expand=True)
    for col in ("when", "task", "model", "domain", "status", "ran on", "why: expected finish per candidate"):
        t.add_column(col)
    t.add_column("tok/s", justify="right")
    t.add_column("wall", justify="right")
    for task in o["tasks"][:limit]:
        why = " · ".join(f"{r['worker']} {r['expected_finish_s']:.1f}s" for r in task["ranking"]) or "-"
        others = task.get("others") or {}
        if others.get("count"):
            best = others.get("best_finish_s")
            why += f" · +{others['count']} more" + ("" if best is None else f" (best {best:.1f}s)")
        model = f"auto → {task['model']}" if task["auto"] else task["model"]
        wall = "-" if task["wall_ms"] is None else f"{task['wall_ms'] / 1000:.1f}s"
        t.add_row(
            _clock(task["submitted_at"]),
            task["task_id"][:8],
            model,
            task["domain"],
            _status(task["status"]),
            task["worker"] or "-",
            why,
            _num(task["decode_tps"]),
            wall,
        )
    if not o["tasks"]:
        t.add_row("no task yet", *[""] * 8)
    return t


def incidents_table(o: dict[str, Any], limit: int = 10) -> Table:
    t = Table(title="reclaims, stalls and dead letters", title_justify="left", expand=True)
    for col in ("when", "kind", "task", "model", "detail"):
        t.add_column(col)
    for i in o["incidents"][:limit]:
        t.add_row(_clock(i["at"]), i["type"].removeprefix("Task"), i["task_id"][:8], i["model"], i["detail"])
    if not o["incidents"]:
        t.add_row("none recently", "", "", "", "")
    return t


_LEVEL_STYLE = {"ok": "", "warn": "bold yellow", "unbounded": "bold yellow", "full": "bold red"}


def storage_line(o: dict[str, Any]) -> Text:
    """Redis memory against its limit and the archive, one line; a warning line under it when due."""
    r, a = o.get("redis") or {}, o.get("archive") or {}
    if not r:
        return Text("")
    if r["ratio"] is None:
        memory = f"Redis memory {human_bytes(r['used_bytes'])}, no limit"
    else:
        memory = (
            f"Redis memory {human_bytes(r['used_bytes'])} of {human_bytes(r['max_bytes'])} ({r['ratio']:.0%})"
        )
    line = Text(f"{memory} · archive: {a.get('summary', '?')}", style=_LEVEL_STYLE.get(r["level"], ""))
    if a.get("ran_at"):
        line.append(f" (last run {_clock(a['ran_at'])})")
    if r.get("warning"):
        line.append(f"\n{r['warning']}", style=_LEVEL_STYLE.get(r["level"], "") or "bold yellow")
    return line


def render(o: dict[str, Any]) -> Group:
    p = o["projection"]
    lag = (
        f"projector {p['lag_entries']} entries behind ({(p['lag_ms'] or 0) / 1000:.1f}s)"
        if p.get("lag_entries") is not None
        else f"projection: {p.get('status')}"
    )
    head = Text(f"routeledger status at {_clock(o['now'])} · {lag}", style="bold")
    return Group(head, storage_line(o), fleet_table(o), models_table(o), tasks_table(o), incidents_table(o))


@command()
def status_cmd(
    inst: Instance,
    watch: Annotated[bool, typer.Option("--watch", help="Keep the tables on screen, refreshed.")] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, help="Seconds between refreshes with --watch.")
    ] = 2.0,
    json_: Annotated[bool, typer.Option("--json", help="Print the data as JSON, once.")] = False,
) -> None:
    """The fleet, capacity, queues, recent tasks, reclaims, stalls and dead letters (from Redis)."""
    keys = inst.keys
    if json_:
        print_json(inst.run(lambda client: overview(client, keys)))
        return
    if not watch:
        console.print(render(inst.run(lambda client: overview(client, keys))))
        return

    async def follow(client: aioredis.Redis) -> None:
        first = render(await overview(client, keys, memory=MemoryWatch(client)))
        with Live(first, console=console, auto_refresh=False) as live:
            await _keep_showing(inst, live, interval)

    with contextlib.suppress(KeyboardInterrupt):
        inst.run(follow)


def _mask_url(url: str) -> str:
    """A Redis URL's address only (never its password or files)."""
    return url.split("?", 1)[0].rpartition("@")[2]


async def _keep_showing(inst: Instance, live: Live, interval: float) -> None:
    """Refresh the tables until Ctrl-C, riding through a restart of the instance: while Redis
    cannot be reached the screen says so and the last tables stay under it; the URL is read again
    on every try (a restarted `up` may have recorded another port)."""
    keys = inst.keys
    url = ""
    client: aioredis.Redis | None = None
    memory: MemoryWatch | None = None
    shown: Any = None
    lost = False
    try:
        while True:
            started = time.monotonic()
            try:
                current = redis_url_for(inst.settings)
                if client is None or memory is None or current != url:
                    if client is not None:
                        await client.aclose()
                    url, client = current, redis_client(current)
                    memory = MemoryWatch(client)
                shown = render(await overview(client, keys, memory=memory))
                live.update(shown, refresh=True)
                if lost:
                    # Said above the tables as well, so that a log of the screen keeps it.
                    live.console.print(f"routeledger is back ({_mask_url(url)})", highlight=False)
                    lost = False
            except (RouteledgerError, RedisError, OSError) as exc:
                if not lost:
                    live.console.print(
                        f"waiting for routeledger to come back ({str(exc) or type(exc).__name__})",
                        highlight=False,
                        markup=False,
                    )
                    lost = True
                waiting = Text(
                    f"waiting for routeledger to come back ({str(exc) or type(exc).__name__}); "
                    f"trying again every {interval:g}s · Ctrl-C stops",
                    style="yellow",
                )
                live.update(waiting if shown is None else Group(waiting, shown), refresh=True)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
    finally:
        if client is not None:
            await client.aclose()
