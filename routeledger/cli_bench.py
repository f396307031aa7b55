"""`routeledger bench run` and `routeledger bench judge`."""

from __future__ import annotations

import asyncio
import re
from typing import Annotated, Any

import redis.asyncio as aioredis
import typer
from rich.table import Table

from dispatch.benchmark import on_demand, request_benchmark
from dispatch.gateway import Gateway
from dispatch.serving import embedding_only, holdings
from dispatch.submit import preview_request
from dispatch.view import LiveView
from events.errors import RouteledgerError
from events.event import BenchmarkResult, QualityScored
from events.ledger import Ledger
from projections.benchset import BenchPrompt, SpeedPrompt, domains, pick_speed
from projections.folder import decode_sample, prompt_tps
from projections.reader import snapshot
from routeledger.runtime import Instance, command, console, fail
from router.choose import RouteQuery
from tasks.lease import live_workers
from tasks.payload import EMBED, Message, TaskMessage
from tasks.store import TaskStore

bench_app = typer.Typer(
    help="Benchmark every live holder of a model, and grade answers.", no_args_is_help=True
)

# The fixed rubric a judge model grades with; the score is read from its last line.
RUBRIC = (
    "You grade an answer to a question. Reply with one line 'SCORE: x' where x is a number from 0 to 1: "
    "1 when the answer is correct and complete, 0.5 when partly correct, 0 when wrong or empty.\n\n"
    "Question: {question}\n\nAnswer: {answer}"
)
_SCORE = re.compile(r"SCORE:\s*([01](?:\.\d+)?)", re.IGNORECASE)


@bench_app.command("run")
@command()
def bench_run(
    inst: Instance,
    model: Annotated[str | None, typer.Option(help="Only this model (name or digest prefix).")] = None,
    worker: Annotated[str | None, typer.Option(help="Only this worker.")] = None,
    domain: Annotated[str, typer.Option(help="Domain of the prompt set.")] = "general",
    count: Annotated[
        int, typer.Option(min=1, help="Speed prompts, and graded prompts, per (worker, model).")
    ] = 3,
    wait: Annotated[bool, typer.Option(help="Wait for the results and print them.")] = True,
    wait_s: Annotated[float, typer.Option("--timeout", help="Seconds to wait.")] = 600.0,
) -> None:
    """Send speed prompts and the domain's graded prompts to every live holder (never only the
    current winner); print each one's measured speed, the speed the router now uses for it, and
    its pass rate."""
    if domain not in domains():
        fail(f"no shipped prompts for domain {domain!r}; domains: {', '.join(domains())}")
    keys = inst.keys

    async def go(client: aioredis.Redis) -> list[dict[str, Any]]:
        leases = await live_workers(client, keys)
        targets = [t for t in holdings(leases, model) if worker is None or t[0] == worker]
        if not targets:
            what = f"model {model!r}" if model else "any model"
            fail(f"no live worker serves {what}{f' on {worker}' if worker else ''}")
        ledger = Ledger(client, keys)
        queues = TaskStore(client, keys, ledger)
        start = await ledger.last_id() or "0-0"
        snap = await snapshot(client, keys)
        sent = {}
        embedders = embedding_only(leases)
        expected = {}
        for name, local, digest in targets:
            embed = digest in embedders
            # Speed prompts (answers long enough to measure), then the graded prompts the model
            # has not been graded on first: each answer is then a new grade too.
            prompts: list[BenchPrompt | SpeedPrompt] | None = (
                None if embed else [*pick_speed(count), *on_demand(snap, digest, domain, count)]
            )
            bench_id = await request_benchmark(
                queues,
                worker=name,
                model=local,
                digest=digest,
                domain=domain,
                count=count,
                prompts=prompts,
                embed=embed,
            )
            sent[bench_id] = (name, local)
            expected[bench_id] = count if embed else 2 * count
            what = "embedding" if embed else f"speed and {count} {domain}"
            console.print(f"sent {count} {what} prompts to {name} for {local} (bench {bench_id})")
        if not wait:
            return []
        rows = await _collect(ledger, start, sent, expected, wait_s)
        # The speed the router uses for each holder now (the preview's field), once the projector
        # has folded the runs: the figure that decides, beside the runs' own.
        view = LiveView(client, keys)
        for row in rows:
            row["router"] = await _router_tps(view, row["digest"], row["worker"])
        return rows

    rows = inst.run(go)
    if rows:
        table = Table(title=f"benchmark: {domain}")
        for col in (
            "worker",
            "model",
            "runs",
            "speed samples",
            "decode tok/s (median of samples; embedding models: embed)",
            "tok/s the router uses",
            "reference pass rate",
        ):
            table.add_column(col)
        for r in rows:
            used = "unknown" if r["router"] is None else f"{r['router']:.1f}"
            table.add_row(
                r["worker"],
                r["model"],
                str(r["runs"]),
                str(r["samples"]),
                f"{r['tps']:.1f}",
                used,
                r["quality"],
            )
        console.print(table)


async def _collect(
    ledger: Ledger,
    start: str,
    sent: dict[str, tuple[str, str]],
    expected: dict[str, int],
    wait_s: float,
) -> list[dict[str, Any]]:
    """Each bench's runs as they come: its speed samples (the runs long enough to be one, as the
    projector folds them: projections.folder.decode_sample) and its grades."""
    runs: dict[str, int] = dict.fromkeys(sent, 0)
    digests: dict[str, str] = {}
    speeds: dict[str, list[float]] = {b: [] for b in sent}
    grades: dict[str, list[float]] = {b: [] for b in sent}
    cursor = start
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while loop.time() < deadline and any(runs[b] < expected[b] for b in sent):
        async for entry_id, event in ledger.read(cursor):
            cursor = entry_id
            if isinstance(event, BenchmarkResult) and event.bench_id in speeds:
                runs[event.bench_id] += 1
                digests[event.bench_id] = event.digest
                # An embedding model's benchmark: its embedding rate.
                embed = event.kind == EMBED
                rate = prompt_tps(event.timings) if embed else decode_sample(event.timings)
                if rate is not None:
                    speeds[event.bench_id].append(rate)
            elif isinstance(event, QualityScored) and event.bench_id in grades:
                grades[event.bench_id].append(event.score)
        await asyncio.sleep(0.2)
    rows = []
    for bench_id, (name, local) in sent.items():
        tps = sorted(speeds[bench_id])
        g = grades[bench_id]
        rows.append(
            {
                "worker": name,
                "model": local,
                "digest": digests.get(bench_id, ""),
                "runs": runs[bench_id],
                "samples": len(tps),
                "tps": tps[len(tps) // 2] if tps else float("nan"),
                "quality": f"{sum(g) / len(g):.2f} of {len(g)}" if g else "not graded yet",
            }
        )
    return rows


async def _router_tps(view: LiveView, digest: str, worker: str) -> float | None:
    """The decode (or embedding) speed the router uses for `worker` on `digest` now."""
    if not digest:
        return None
    try:
        out = await preview_request(view, RouteQuery(model=digest))
    except RouteledgerError:
        return None
    candidates = out.get("candidates")
    for candidate in candidates if isinstance(candidates, list) else []:
        if isinstance(candidate, dict) and candidate.get("worker") == worker:
            fields = candidate.get("fields") or {}
            field = fields.get("decode_tps") or fields.get("embed_tps")
            if isinstance(field, dict) and isinstance(field.get("value"), int | float):
                return float(field["value"])
    return None


@bench_app.command("judge")
@command()
def bench_judge(
    inst: Instance,
    judge: Annotated[str, typer.Option(help="The model on the fleet that grades answers.")],
    limit: Annotated[int, typer.Option(min=1, help="Grade at most this many answers.")] = 50,
) -> None:
    """Grade stored benchmark answers with a judge model (fixed rubric); appends QualityScored."""
    from projections.benchset import prompt_by_id

    keys = inst.keys

    async def go(client: aioredis.Redis) -> tuple[int, int]:
        ledger = Ledger(client, keys)
        gateway = Gateway(client, keys)
        graded = skipped = 0
        judged = {e.task_id async for _, e in _of(ledger, QualityScored) if e.grader.startswith("judge:")}
        async for _, result in _of(ledger, BenchmarkResult):
            if graded + skipped >= limit or result.task_id in judged:
                continue
            stored = await gateway.queues.result(result.task_id)
            prompt = prompt_by_id(result.prompt_id)
            if stored is None or prompt is None:
                skipped += 1
                continue
            answer = stored.text
            text = RUBRIC.format(question=prompt.prompt, answer=answer)
            req = TaskMessage(
                model=judge, messages=[Message(role="user", content=text)], max_tokens=16, client="judge"
            )
            task = (await gateway.submit(req, waits=False)).task
            verdict = await _result_text(client, keys, task.task_id)
            match = _SCORE.search(verdict or "")
            if match is None:
                skipped += 1
                console.print(f"[yellow]judge gave no score for {result.task_id}[/]: {verdict!r:.80}")
                continue
            await ledger.append(
                QualityScored(
                    digest=result.digest,
                    domain=result.domain,
                    score=min(1.0, float(match.group(1))),
                    grader=f"judge:{judge}",
                    task_id=result.task_id,
                    bench_id=result.bench_id,
                    worker=result.worker,
                )
            )
            graded += 1
        return graded, skipped

    graded, skipped = inst.run(go)
    console.print(f"graded {graded} answers with {judge}; {skipped} without a usable answer or score")


async def _of(ledger: Ledger, kind: type[Any]) -> Any:
    async for entry_id, event in ledger.read():
        if isinstance(event, kind):
            yield entry_id, event


async def _result_text(client: Any, keys: Any, task_id: str, wait_s: float = 300.0) -> str | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while loop.time() < deadline:
        stored = await TaskStore(client, keys).result(task_id)
        if stored is not None:
            return stored.text
        await asyncio.sleep(0.2)
    return None
