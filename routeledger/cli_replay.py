"""`routeledger projector` and `routeledger replay …`: fold the ledger live, or rebuild from it."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import redis.asyncio as aioredis
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from events.errors import RouteledgerError
from projections.projector import Projector
from projections.snapshot import Stamped, Stat
from projections.tables import Tables
from routeledger.errors import ConfigError
from routeledger.runtime import Instance, command, console, err_console, on_signals, print_json, setup_logging

if TYPE_CHECKING:
    import polars as pl

replay_app = typer.Typer(
    help="Rebuild, verify, export and inspect the projection tables.", no_args_is_help=True
)

UntilOpt = Annotated[
    str | None,
    typer.Option("--until", help="Only the ledger up to this stream id or time (ISO 8601 or epoch ms)."),
]


# Seconds a stopping projector may take to release its lease before the process ends anyway.
STOP_GRACE_S = 10.0


@command()
def projector_cmd(inst: Instance) -> None:
    """Fold the ledger into the projection tables, live (one active instance; others wait)."""
    s = inst.settings
    setup_logging(s.log_level)

    async def go(client: aioredis.Redis) -> None:
        stop = asyncio.Event()
        # A stop releases the lease at once; one that hangs on a Redis read ends the process anyway.
        on_signals(stop.set, exit_after_s=STOP_GRACE_S)
        projector = Projector(
            client,
            inst.keys,
            half_life_s=s.half_life_s,
            demand_half_life_s=s.demand_half_life_s,
            task_retention_days=s.task_retention_days,
            lease_ms=s.lease_ms,
            dead_max_entries=s.dead_max_entries,
        )
        await projector.run(stop)

    inst.run(go, fast=True)


class _Rate:
    """A rich progress bar over the ledger with events per second."""

    def __init__(self, total: int, label: str) -> None:
        self.progress = Progress(
            TextColumn(f"[bold]{label}[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=err_console,
            transient=False,
        )
        self.task = self.progress.add_task(label, total=total, rate="")
        self.done = 0
        self.started = time.perf_counter()

    def __call__(self, n: int) -> None:
        self.done += n
        elapsed = max(1e-9, time.perf_counter() - self.started)
        self.progress.update(self.task, advance=n, rate=f"{self.done / elapsed:,.0f} events/s")


@replay_app.command("rebuild")
@command()
def rebuild_cmd(
    inst: Instance,
    until: UntilOpt = None,
    no_switch: Annotated[
        bool, typer.Option("--no-switch", help="Write the new namespace but leave the live one in place.")
    ] = False,
    json_: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Rebuild every table from the ledger into a new namespace and switch to it atomically."""
    from replay.history import History
    from replay.rebuild import gc_paused, rebuild, until_to_stop

    s = inst.settings
    until_to_stop(until)  # a bad --until fails before any work

    async def go(client: aioredis.Redis) -> Any:
        total = await History(client, inst.keys, s.archive_dir).count()
        bar = _Rate(total, "rebuild")
        started = time.perf_counter()
        with bar.progress, gc_paused():
            result = await rebuild(
                client,
                inst.keys,
                until=until,
                half_life_s=s.half_life_s,
                demand_half_life_s=s.demand_half_life_s,
                task_retention_days=s.task_retention_days,
                switch=not no_switch,
                progress=bar,
                archive_dir=s.archive_dir,
            )
        return result, time.perf_counter() - started

    result, seconds = inst.run(go)
    if json_:
        print_json({**msgspec.to_builtins(result), "seconds": round(seconds, 3)})
        return
    eps = result.events / seconds if seconds > 0 else 0.0
    console.print(
        f"rebuilt {result.events:,} events into namespace [bold]{result.namespace}[/] "
        f"up to {result.checkpoint or '(empty ledger)'} in {seconds:.2f} s ({eps:,.0f} events/s)"
        + (f"; {result.poison} undecodable entries skipped" if result.poison else "")
    )
    if result.switched:
        console.print(f"rl:p:current now names {result.namespace} (was {result.previous or 'unset'})")
    else:
        console.print(f"rl:p:current still names {result.previous or 'nothing'} (--no-switch)")


@replay_app.command("verify")
@command()
def verify_cmd(
    inst: Instance,
    json_: Annotated[bool, typer.Option("--json", help="Print the differences as JSON.")] = False,
) -> None:
    """Rebuild in memory and compare with the live tables; exit 1 if any field differs."""
    from replay.rebuild import gc_paused
    from replay.verify import verify

    async def go(client: aioredis.Redis) -> Any:
        with gc_paused():
            return await verify(client, inst.keys, archive_dir=inst.settings.archive_dir)

    live, diffs = inst.run(go)
    if json_:
        print_json({"checkpoint": live.checkpoint, "differences": diffs})
    else:
        for d in diffs:
            console.print(
                f"[red]differs[/] {d.table}[{d.key}].{d.field}: live={d.live!r} rebuilt={d.rebuilt!r}",
                highlight=False,
            )
        if diffs:
            console.print(f"[bold red]{len(diffs)} field(s) differ[/] at checkpoint {live.checkpoint}")
        else:
            console.print(f"[green]the live tables match the ledger[/] at checkpoint {live.checkpoint}")
    if diffs:
        raise typer.Exit(1)


@replay_app.command("export")
@command()
def export_cmd(
    inst: Instance,
    parquet: Annotated[
        Path, typer.Option("--parquet", help="Directory for one Parquet file per event type.")
    ],
    until: UntilOpt = None,
) -> None:
    """Write the ledger as Parquet, one file per event type (for polars or duckdb)."""
    from replay.export import ledger_frames, write_parquet
    from replay.history import History
    from replay.rebuild import gc_paused, until_to_stop

    until_to_stop(until)

    async def go(client: aioredis.Redis) -> dict[str, pl.DataFrame]:
        archive_dir = inst.settings.archive_dir
        total = await History(client, inst.keys, archive_dir).count()
        bar = _Rate(total, "export")
        with bar.progress, gc_paused():
            return await ledger_frames(client, inst.keys, until=until, progress=bar, archive_dir=archive_dir)

    written = write_parquet(inst.run(go), parquet)
    for name, rows in sorted(written.items()):
        console.print(f"{parquet / (name + '.parquet')}  {rows:,} rows")


def _when(ms: int | None) -> str:
    return "" if ms is None else dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")


def _age(ms: int | None, now: int) -> str:
    if ms is None:
        return ""
    s = max(0.0, (now - ms) / 1000)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"


def stats_rows(tables: Tables, worker: str | None, model: str | None) -> list[dict[str, Any]]:
    """The tables as (table, key, field, n, value, updated_at) rows, filtered by worker and model.

    `model` matches a digest or its prefix (as `ollama list` shows twelve characters).
    """

    def digest_ok(d: str) -> bool:
        return model is None or d.startswith(model)

    rows: list[dict[str, Any]] = []

    def add(
        table: str, key: str, field: str, n: int | None, value: Any, at: int | None, **extra: Any
    ) -> None:
        rows.append(
            {"table": table, "key": key, "field": field, "n": n, "value": value, "updated_at": at, **extra}
        )

    for (w, d), srow in sorted(tables.speed.items()):
        if (worker is None or w == worker) and digest_ok(d):
            for field in ("decode_tps", "prompt_tps", "load_s", "ttft_s", "in_flight", "embed_tps"):
                st: Stat = getattr(srow, field)
                if st.n:
                    add(
                        "speed",
                        f"{w} / {d[:12]}",
                        field,
                        st.n,
                        st.mean,
                        st.updated_at,
                        decayed=st.decayed_mean,
                    )
    if worker is None:
        for (d, dom), lrow in sorted(tables.length.items()):
            if digest_ok(d):
                st = lrow.output_tokens
                add(
                    "length",
                    f"{d[:12]} / {dom}",
                    "output_tokens",
                    st.n,
                    st.mean,
                    st.updated_at,
                    decayed=st.decayed_mean,
                )
        for (d, dom), qrow in sorted(tables.quality.items()):
            if digest_ok(d):
                st = qrow.score
                add(
                    "quality",
                    f"{d[:12]} / {dom}",
                    "score",
                    st.n,
                    st.mean,
                    st.updated_at,
                    decayed=st.decayed_mean,
                )
        for d, drow in sorted(tables.demand.items()):
            if digest_ok(d):
                st = drow.arrivals
                add("demand", d[:12], "arrivals", st.n, None, st.updated_at)
    for w, frow in sorted(tables.fleet.items()):
        if (worker is None or w == worker) and model is None:
            add("fleet", w, "status", None, frow.status, frow.status_since)
            add("fleet", w, "last_heartbeat", None, None, frow.last_heartbeat)
            for field in ("slots", "inventory", "loaded", "serves", "resources"):
                stamped: Stamped = getattr(frow, field)
                add("fleet", w, field, None, stamped.value, stamped.at)
            add("fleet", w, "in_flight", len(frow.in_flight), frow.in_flight, None)
    return rows


@replay_app.command("stats")
@command()
def stats_cmd(
    inst: Instance,
    worker: Annotated[str | None, typer.Option("--worker", help="Only this worker's rows.")] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Only this model digest (or its prefix).")
    ] = None,
    until: UntilOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The tables as tables: field, n, value, updated_at and age (--until: as they were then)."""
    from projections import store
    from projections.errors import NoProjectionError
    from replay.rebuild import build, gc_paused, until_to_stop

    s = inst.settings
    keys = inst.keys
    until_to_stop(until)

    async def go(client: aioredis.Redis) -> Tables:
        if until is not None:
            with gc_paused():
                tables, _ = await build(
                    client,
                    keys,
                    until=until,
                    half_life_s=s.half_life_s,
                    demand_half_life_s=s.demand_half_life_s,
                    archive_dir=s.archive_dir,
                )
            return tables
        ns = await store.current(client, keys)
        if ns is None:
            raise NoProjectionError("no projection yet: start `routeledger up` (or `routeledger projector`)")
        return await store.load(client, keys, ns, with_tasks=False)

    tables = inst.run(go)
    rows = stats_rows(tables, worker, model)
    now = int(time.time() * 1000)
    if json_:
        print_json({"checkpoint": tables.checkpoint, "rows": rows})
        return
    table = Table(title=f"projection tables at {tables.checkpoint or '(nothing folded)'}")
    for col in ("table", "key", "field", "n", "value", "updated_at", "age"):
        table.add_column(col, justify="right" if col in ("n", "value") else "left")
    for r in rows:
        value = r["value"]
        shown = f"{value:,.3f}" if isinstance(value, float) else ("" if value is None else str(value))
        if len(shown) > 60:
            shown = shown[:57] + "…"
        n = "" if r["n"] is None else str(r["n"])
        table.add_row(
            r["table"], r["key"], r["field"], n, shown, _when(r["updated_at"]), _age(r["updated_at"], now)
        )
    console.print(table)


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """Seconds from `90`, `90s`, `30m`, `12h`, `7d` or `2w`."""
    raw = text.strip().lower()
    unit = _UNITS.get(raw[-1:])
    number = raw[:-1] if unit is not None else raw
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        raise ConfigError(
            f"--hot-window {text!r} is not a duration: write 7d, 12h, 30m, 90s or seconds"
        ) from None
    if value < 0 or value != value:
        raise ConfigError(f"--hot-window {text!r}: a duration must not be negative")
    return value


@command(settings=("archive_dir", "max_hot_entries"))
def archive_cmd(
    inst: Instance,
    hot_window: Annotated[
        str | None,
        typer.Option(
            "--hot-window", help="Keep entries younger than this in Redis (7d, 12h, 30m; default 7d)."
        ),
    ] = None,
    max_hot_entries: Annotated[
        int | None,
        typer.Option(
            "--max-hot-entries",
            min=0,
            help="Archive older entries beyond this many, however young (2,000,000).",
        ),
    ] = None,
    archive_dir: Annotated[
        str | None, typer.Option("--archive-dir", help="Archive directory (default: <data dir>/archive).")
    ] = None,
    segment_entries: Annotated[
        int, typer.Option("--segment-entries", min=1, help="Most entries in one segment file.")
    ] = 500_000,
    every: Annotated[
        float | None,
        typer.Option(
            "--every", min=1.0, help="Run again every this many seconds, for ever (what `up` runs)."
        ),
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Move ledger entries older than the hot window into Parquet segments and trim them off Redis."""
    from events.singleton import SingletonLease
    from replay.archive import ROLE, ArchiveOptions, ArchiveReport, archive
    from replay.errors import ArchiverBusyError

    s = inst.settings
    window = s.hot_window_s if hot_window is None else parse_duration(hot_window)
    options = ArchiveOptions(
        directory=s.archive_dir,
        hot_window_s=window,
        max_hot_entries=s.max_hot_entries,
        segment_entries=segment_entries,
    )

    async def once(client: aioredis.Redis, lease: SingletonLease) -> ArchiveReport | None:
        # One archiver at a time; the lease is held only while a run works, so that a one-off run
        # beside `up`'s looping archiver waits for a run, not for ever.
        deadline = time.monotonic() + 3 * lease.ttl_ms / 1000
        while not await lease.try_take():
            if every is not None:
                return None
            if time.monotonic() > deadline:
                raise ArchiverBusyError(
                    f"another archiver holds {inst.keys.singleton(ROLE)}; wait for it to finish and try again"
                )
            await asyncio.sleep(0.2)
        await lease.hold()
        try:
            return await archive(client, inst.keys, options, lease=lease)
        finally:
            await lease.release()

    async def go(client: aioredis.Redis) -> ArchiveReport | None:
        lease = SingletonLease(client, inst.keys, ROLE, ttl_ms=max(3000, s.lease_ms))
        if every is None:
            return await once(client, lease)
        setup_logging(s.log_level)
        log = logging.getLogger("routeledger.archive")
        while True:
            try:
                report = await once(client, lease)
            except RouteledgerError as exc:
                log.error("archive run failed: %s", exc)
            else:
                if report is not None:
                    log.info(
                        "archive: %s entries archived, %s trimmed, %s hot; %s segments, %s events in %s",
                        report.archived,
                        report.trimmed,
                        report.hot,
                        report.segments,
                        report.events,
                        report.directory,
                    )
            await asyncio.sleep(every)

    report = inst.run(go)
    if report is None:
        return
    if json_:
        print_json(report)
        return
    if report.note:
        console.print(f"[yellow]{report.note}[/]")
    console.print(
        f"archived {report.archived:,} entries into {len(report.written)} new segment(s); "
        f"trimmed {report.trimmed:,} from the stream, {report.hot:,} stay hot"
    )
    console.print(
        f"archive {report.directory}: {report.segments} segment(s), {report.events:,} events, "
        f"{report.bytes:,} bytes, up to {report.last_id or '(nothing yet)'}",
        highlight=False,
    )
