"""`routeledger sim …`: the simulated fleet and the scheduling simulator."""

from __future__ import annotations

import typer

sim_app = typer.Typer(help="Simulated backends and the scheduling simulator.", no_args_is_help=True)
