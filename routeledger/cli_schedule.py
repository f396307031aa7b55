"""`routeledger sim schedule`: the scheduling simulator's table, plot and JSON (routeledger/cli_sim.py
makes it a command of `sim`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import msgspec
import typer
from rich.table import Table

from routeledger.runtime import console, err_console, guarded
from sim.errors import FleetError


def _loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FleetError(f"--load takes numbers separated by commas, got {text!r}") from None
    if not loads or any(not 0 < x < 1.5 for x in loads):
        raise FleetError(f"every load must be in (0, 1.5), got {text!r}")
    return loads


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    return "inf" if x == float("inf") else f"{x:.{digits}f}"


@guarded
def schedule(
    fleet: Annotated[str | None, typer.Option("--fleet", help="A shipped preset: seed, trio, lab.")] = None,
    fleet_file: Annotated[Path | None, typer.Option("--fleet-file", help="A fleet TOML file.")] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="The model to load the fleet with (default: most served).")
    ] = None,
    load: Annotated[str, typer.Option("--load", help="Loads, comma-separated.")] = "0.3,0.6,0.9",
    policies: Annotated[str, typer.Option("--policies", help="'all' or a comma-separated list.")] = "all",
    tasks: Annotated[int, typer.Option("--tasks", help="Tasks per run.")] = 10_000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the workload.")] = 1,
    dist: Annotated[
        str | None,
        typer.Option("--dist", help="Output lengths: exp, lognormal or fixed (default: the model's)."),
    ] = None,
    mean_tokens: Annotated[float | None, typer.Option("--mean-tokens", help="Mean output tokens.")] = None,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Prompt tokens per task.")] = 64,
    burst: Annotated[int, typer.Option("--burst", help="Children per pipeline (submitted at once).")] = 1,
    workload: Annotated[
        str,
        typer.Option(
            "--workload",
            help="poisson: independent tasks; chat: conversations of 2-8 turns, each resending the"
            " conversation (--prompt-tokens: mean new message), 30 s mean think time.",
        ),
    ] = "poisson",
    join: Annotated[
        list[str] | None, typer.Option("--join", help="WORKER@SECONDS: offline until then (repeatable).")
    ] = None,
    leave: Annotated[
        list[str] | None, typer.Option("--leave", help="WORKER@SECONDS: offline from then (repeatable).")
    ] = None,
    mix: Annotated[
        str | None,
        typer.Option(
            "--mix",
            help="A workload mix: a [[class]] TOML file, or a shipped one (chat-code, rag);"
            " replaces --dist, --mean-tokens and --prompt-tokens.",
        ),
    ] = None,
    paced: Annotated[
        bool,
        typer.Option(
            "--paced",
            help="Chat turns are placed where their reader finishes reading, as with the API's"
            " paced_streams on (off by default, as there).",
        ),
    ] = False,
    json_: Annotated[bool, typer.Option("--json", help="Print the results as one JSON line last.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write mean response vs load as a PNG.")] = None,
) -> None:
    """Simulate the policies on a fleet at several loads, beside the best threshold and the lower bound."""
    from sim.fleetspec import load_fleet
    from sim.scheduling.experiment import parse_policies, run_matrix
    from sim.scheduling.workload import WORKLOADS, WorkloadSpec, default_model, load_mix

    if workload not in WORKLOADS:
        raise FleetError(f"unknown workload {workload!r}; workloads: {', '.join(WORKLOADS)}")
    if (fleet is None) == (fleet_file is None):
        raise FleetError("give exactly one of --fleet NAME or --fleet-file FILE")
    spec_fleet = load_fleet(fleet_file if fleet_file is not None else str(fleet))
    chosen = model or default_model(spec_fleet)
    names = parse_policies(policies)
    chosen_mix = load_mix(mix) if mix is not None else None

    def at(items: list[str] | None, flag: str) -> tuple[tuple[str, float], ...]:
        out = []
        for item in items or []:
            worker, _, when = item.partition("@")
            try:
                out.append((worker, float(when)))
            except ValueError:
                raise FleetError(f"{flag} takes WORKER@SECONDS, got {item!r}") from None
        return tuple(out)

    base = WorkloadSpec(
        tasks=tasks,
        seed=seed,
        dist=dist,
        mean_tokens=mean_tokens,
        prompt_tokens=prompt_tokens,
        burst=burst,
        joins=at(join, "--join"),
        leaves=at(leave, "--leave"),
        kind=workload,
        mix=chosen_mix,
        paced=paced,
    )
    rows = run_matrix(
        spec_fleet,
        chosen,
        _loads(load),
        names,
        base,
        progress=None if json_ else lambda s: err_console.print(f"[dim]{s}[/]", highlight=False),
    )
    chat = workload == "chat"
    title = f"fleet {spec_fleet.name or '?'}, model {chosen}, {tasks} tasks, seed {seed}"
    if chosen_mix is not None:
        title += f", mix {chosen_mix.name or '?'}"
    table = Table(title=title + (", chat" if chat else ""))
    slowed = any(w.slowdown for w in spec_fleet.worker)
    columns = ["policy", "load", "mean s", "p95 s", "makespan s", "vs best threshold", "vs lower bound"]
    if chat:
        columns[2:2] = ["mean ttft s", "p95 ttft s"]
    if slowed:
        columns += ["vs oracle", "detect s", "away s", "misrouted", "back s"]
    for col in columns:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        name = r.policy + (f" (K={','.join(map(str, r.thresholds))})" if r.thresholds else "")
        cells = [name, f"{r.load:g}"]
        if chat:
            cells += [_fmt(r.mean_ttft_s, 2), _fmt(r.p95_ttft_s, 2)]
        cells += [
            _fmt(r.mean_s),
            _fmt(r.p95_s),
            _fmt(r.makespan_s, 0),
            _fmt(r.vs_best_threshold, 3),
            _fmt(r.vs_lower_bound, 2),
        ]
        if slowed:
            misrouted = "-" if r.misrouted is None else str(r.misrouted)
            cells += [
                _fmt(r.vs_oracle, 3),
                _fmt(r.detect_s, 0),
                _fmt(r.away_s, 0),
                misrouted,
                _fmt(r.back_s, 0),
            ]
        table.add_row(*cells)
    # A mix's per-class p99 in a table of its own: beside the others' columns it would not fit.
    classes: Table | None = None
    if chosen_mix is not None:
        classes = Table(title=f"p99 response s by class, mix {chosen_mix.name or '?'}")
        domains = [c.domain for c in chosen_mix.classes]
        for col in ["policy", "load", *domains]:
            classes.add_column(col, justify="left" if col == "policy" else "right")
        for r in rows:
            p99 = r.class_p99_s or {}
            classes.add_row(r.policy, f"{r.load:g}", *[_fmt(p99.get(d)) for d in domains])
    if plot is not None:
        from sim.scheduling.plot import line_chart

        series: dict[str, list[tuple[float, float]]] = {}
        bound: dict[float, float] = {}
        for r in rows:
            series.setdefault(r.policy, []).append((r.load, r.mean_s))
            if r.vs_lower_bound:
                bound[r.load] = r.mean_s / r.vs_lower_bound
        png, _ = line_chart(
            series,
            shade_below=sorted(bound.items()),
            title=f"fleet {spec_fleet.name or '?'}, {chosen}: mean response vs load",
        )
        plot.write_bytes(png)
        err_console.print(f"[dim]wrote {plot}[/]", highlight=False)
    if json_:
        results = [msgspec.to_builtins(r) for r in rows]
        for r in results:
            if not chat:
                del r["mean_ttft_s"], r["p95_ttft_s"]
            if r["class_p99_s"] is None:
                del r["class_p99_s"]
            else:
                r["class_p99_s"] = {d: None if v == float("inf") else v for d, v in r["class_p99_s"].items()}
            for k in ("mean_s", "p95_s", "makespan_s", "mean_ttft_s", "p95_ttft_s"):
                if r.get(k) == float("inf"):
                    r[k] = None
        print(json.dumps({"fleet": spec_fleet.name, "tasks": tasks, "results": results}))  # noqa: T201
    else:
        console.print(table)
        if classes is not None:
            console.print(classes)
