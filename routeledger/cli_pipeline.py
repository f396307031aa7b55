"""`routeledger pipeline show ID`: a pipeline as a tree, with who ran each part, when and how long."""

from __future__ import annotations

from typing import Annotated, Any

import redis.asyncio as aioredis
import typer
from rich.markup import escape
from rich.tree import Tree

from events.ledger import Ledger
from pipelines.history import pipeline_from_ledger, pipeline_view
from routeledger.runtime import Instance, command, console, fail, print_json

pipeline_app = typer.Typer(
    help="Look at pipelines (decompose, run in parallel, integrate).", no_args_is_help=True
)


@pipeline_app.command("show")
@command()
def pipeline_show(
    inst: Instance,
    pipeline_id: Annotated[str, typer.Argument(help="The pipeline's id (X-Routeledger-Pipeline).")],
    json_: Annotated[bool, typer.Option("--json", help="Print the pipeline's JSON.")] = False,
) -> None:
    """The tree: fan-out vs capacity, the plan's makespan, each part's worker and timings.

    Read from the pipeline's hash while it lasts (24 h), then from the ledger (no prompts there).
    """
    keys = inst.keys

    async def go(client: aioredis.Redis) -> dict[str, Any] | None:
        view = await pipeline_view(client, keys, pipeline_id)
        return view if view is not None else await pipeline_from_ledger(Ledger(client, keys), pipeline_id)

    view = inst.run(go)
    if view is None:
        fail(f"no pipeline {pipeline_id} in the pipeline records or the ledger", code=1)
    if json_:
        print_json(view)
        return
    console.print(tree(view))


def _s(value: object) -> str:
    return "?" if value is None else f"{float(value):.2f}s"  # type: ignore[arg-type]


def _node(label: str, part: dict[str, Any], t0: int | None) -> str:
    worker = part.get("worker") or "-"
    planned = part.get("expected_worker")
    text = f"[bold]{label}[/] {str(part.get('task_id', ''))[:12]} {escape(str(part.get('model') or ''))}"
    text += f"  [cyan]{escape(worker)}[/]"
    if planned is not None:
        text += f" (plan: {escape(str(planned))})"
    started, finished = part.get("started_at"), part.get("finished_at")
    if t0 is not None and started is not None and finished is not None:
        text += f"  +{(started - t0) / 1000:.2f}s → +{(finished - t0) / 1000:.2f}s"
    text += f"  {_s(part.get('wall_s'))}  {part.get('status', '?')}"
    if int(part.get("attempt") or 1) > 1:
        text += f" (attempt {part['attempt']})"
    if part.get("prompt"):
        prompt = str(part["prompt"]).replace("\n", " ")
        text += f"  [dim]{escape(prompt[:60] + ('…' if len(prompt) > 60 else ''))}[/]"
    return text


def tree(view: dict[str, Any]) -> Tree:
    """The pipeline as a rich Tree; times are seconds from its start."""
    head = (
        f"[bold]pipeline {view['pipeline_id']}[/] {view['status']}, policy {view.get('policy')}: "
        f"fan-out {view.get('fan_out_vs_capacity') or view.get('fan_out')} slots, "
        f"plan makespan {_s(view.get('expected_makespan_s'))}"
    )
    if view.get("makespan_s") is not None:
        head += f", makespan {_s(view['makespan_s'])}"
    if view.get("elapsed_s") is not None:
        head += f", elapsed {_s(view['elapsed_s'])}"
    if view.get("from_ledger"):
        head += " [dim](from the ledger)[/]"
    root = Tree(head)
    t0 = view.get("created_at")
    for i, step in enumerate(view.get("decomposer") or []):
        root.add(_node(f"decomposer #{i + 1}", step, t0))
    children = root.add(f"children ({len(view.get('children') or [])})")
    for child in view.get("children") or []:
        children.add(_node(f"child {child.get('index', 0) + 1}", child, t0))
    if view.get("integration"):
        root.add(_node("integration", view["integration"], t0))
    if view.get("failed_children"):
        root.add(f"[red]failed: {', '.join(view['failed_children'])}[/]")
    if view.get("error"):
        root.add(f"[red]{escape(str(view['error']))}[/]")
    return root
