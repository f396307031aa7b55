"""`routeledger sim …`: the simulated fleet and the scheduling simulator."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

from routeledger.cli_schedule import schedule
from routeledger.runtime import console, guarded, run_async
from sim.errors import FleetError

sim_app = typer.Typer(help="Simulated backends and the scheduling simulator.", no_args_is_help=True)


@sim_app.command("hosts")
@guarded
def hosts(
    preset: Annotated[str, typer.Option("--preset", help="A shipped fleet preset (seed, …).")] = "seed",
    fleet_file: Annotated[
        Path | None, typer.Option("--fleet-file", help="A fleet TOML file (instead of --preset).")
    ] = None,
    time_scale: Annotated[
        float,
        typer.Option(
            "--time-scale",
            help="Multiply every simulated wait by this (0: no waiting; reported timings stay simulated).",
        ),
    ] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the generated text and the faults.")] = 0,
    host: Annotated[str, typer.Option("--host", help="Address every machine binds.")] = "127.0.0.1",
    json_: Annotated[
        bool, typer.Option("--json", help='Print one line {"hosts": {name: url}, "control": url} and serve.')
    ] = False,
) -> None:
    """Run simulated Ollama machines, each on its own port, until Ctrl-C."""
    from sim.backends.hosts import SimHosts
    from sim.fleetspec import load_fleet

    if time_scale < 0:
        raise FleetError(f"--time-scale must be >= 0, got {time_scale}")
    fleet = load_fleet(fleet_file if fleet_file is not None else preset)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with SimHosts(fleet, time_scale=time_scale, seed=seed, host=host) as sim:
            if json_:
                wake = {n: sim.wake_port(n) for n in sim.wake_listeners}
                line = json.dumps({"hosts": sim.urls, "control": sim.control_url, "wake_ports": wake})
                print(line, flush=True)  # noqa: T201
            else:
                width = max(len(n) for n in sim.names) if sim.names else 0
                for name, url in sim.urls.items():
                    asleep = (
                        f"  asleep: magic packet on udp {sim.host}:{sim.wake_port(name)}"
                        if name in sim.wake_listeners
                        else ""
                    )
                    console.print(f"{name:<{width}}  {url}{asleep}", highlight=False)
                console.print(f"{'control':<{width}}  {sim.control_url}/sim/<machine>/…", highlight=False)
                console.print(
                    f"[dim]fleet {fleet.name or '?'}, time scale {time_scale:g}, seed {seed}; Ctrl-C stops[/]"
                )
            await stop.wait()

    with contextlib.suppress(KeyboardInterrupt):
        _run_fast(serve())


def _run_fast(coro: Coroutine[Any, Any, None]) -> None:
    # The sim shares two cores with workers and Redis in the dispatch benchmark; uvloop takes about a
    # quarter off its cost per request.
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it on Linux and macOS
        run_async(coro)
        return
    uvloop.run(coro)


# `sim schedule` lives in its own module.
sim_app.command("schedule")(schedule)
