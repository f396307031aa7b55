"""`routeledger route preview`: what the router would do with a request now, and why."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from dispatch.submit import preview_request
from dispatch.view import LiveView
from routeledger.runtime import Instance, command, console, print_json
from router.choose import RouteQuery

route_app = typer.Typer(help="See the router's decisions.", no_args_is_help=True)


@route_app.command("preview")
@command()
def route_preview(
    inst: Instance,
    model: Annotated[str, typer.Option(help="Model name, alias, digest prefix, or auto.")],
    domain: Annotated[str, typer.Option(help="Domain of the request.")] = "general",
    tokens: Annotated[int | None, typer.Option(min=1, help="Output tokens the request may produce.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the preview JSON.")] = False,
) -> None:
    """Ranked candidates with every term and source, and the current plan (who would take it now)."""
    query = RouteQuery(model=model, domain=domain, max_tokens=tokens)
    result: dict[str, Any] = inst.run(lambda client: preview_request(LiveView(client, inst.keys), query))
    if json_:
        print_json(result)
        return
    plan = result["plan"]
    console.print(
        f"[bold]{result['model']}[/] ({str(result['digest'])[:12]}), domain {plan['domain']}: "
        f"[bold]{plan['taker']}[/] would take it now, wait {plan['expected_wait_s']:.2f}s, "
        f"finish in {plan['expected_finish_s']:.2f}s"
    )
    table = Table(title="candidates, best first")
    for col in (
        "worker",
        "finish s",
        "terms",
        "decode tok/s",
        "prompt tok/s",
        "load s",
        "output tokens",
        "quality",
    ):
        table.add_column(col)
    # Sleeping machines after the live ones: what each would do if woken now (its wake_s in its terms).
    for c in [*result["candidates"], *result.get("sleeping", [])]:
        fields = c["fields"]
        table.add_row(
            f"{c['worker']} (asleep: {c['wake']['reason']})" if c.get("asleep") else c["worker"],
            f"{c['expected_finish_s']:.2f}",
            "\n".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in c["terms"].items()),
            *(
                _field(fields.get(name))
                for name in ("decode_tps", "prompt_tps", "load_s", "output_tokens", "quality")
            ),
        )
    console.print(table)


def _field(f: dict[str, Any] | None) -> str:
    if not f:
        return "-"
    age = f.get("age_s")
    age_text = "" if age is None else f", age {age / 3600:.1f} h" if age >= 3600 else f", age {age:.0f} s"
    return f"{f['value']:.3g}\n{f['source']} (n={f['n']}{age_text})"
