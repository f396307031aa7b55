"""`routeledger bench run` and `routeledger bench judge`."""

from __future__ import annotations

import asyncio
import re
from typing import Annotated, Any

import redis.asyncio as aioredis
import typer
from rich.table import Table

from dispatch.benchmark import domains, on_demand, request_benchmark
from dispatch.lease import live_workers
from dispatch.payload import EMBED, Message
from dispatch.queues import TaskQueues, read_result
from dispatch.serving import embedding_only, holdings
from dispatch.submit import TaskRequest, submit_task
from events.event import BenchmarkResult, QualityScored
from events.ledger import Ledger
from projections.reader import snapshot
from routeledger.runtime import Instance, command, console, fail

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
    count: Annotated[int, typer.Option(min=1, help="Prompts per (worker, model).")] = 3,
    wait: Annotated[bool, typer.Option(help="Wait for the results and print them.")] = True,
    wait_s: Annotated[float, typer.Option("--timeout", help="Seconds to wait.")] = 600.0,
) -> None:
    """Send the domain's prompt set to every live holder (never only the current winner)."""
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
        queues = TaskQueues(client, keys, ledger)
        start = await ledger.last_id() or "0-0"
        snap = await snapshot(client, keys)
        sent = {}
        embedders = embedding_only(leases)
        for name, local, digest in targets:
            # Prompts the model has not been graded on first: each answer is then a new grade too.
            bench_id = await request_benchmark(
                queues,
                worker=name,
                model=local,
                digest=digest,
                domain=domain,
                prompts=on_demand(snap, digest, domain, count),
                embed=digest in embedders,
            )
            sent[bench_id] = (name, local)
            console.print(f"sent {count} {domain} prompts to {name} for {local} (bench {bench_id})")
        if not wait:
            return []
        return await _collect(ledger, start, sent, count, wait_s)

    rows = inst.run(go)
    if rows:
        table = Table(title=f"benchmark: {domain}")
        for col in (
            "worker",
            "model",
            "runs",
            "decode tok/s (median; embedding models: embed)",
            "reference pass rate",
        ):
            table.add_column(col)
        for r in rows:
            table.add_row(r["worker"], r["model"], str(r["runs"]), f"{r['tps']:.1f}", r["quality"])
        console.print(table)


async def _collect(
    ledger: Ledger, start: str, sent: dict[str, tuple[str, str]], count: int, wait_s: float
) -> list[dict[str, Any]]:
    speeds: dict[str, list[float]] = {b: [] for b in sent}
    grades: dict[str, list[float]] = {b: [] for b in sent}
    cursor = start
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while loop.time() < deadline and any(len(v) < count for v in speeds.values()):
        async for entry_id, event in ledger.read(cursor):
            cursor = entry_id
            if isinstance(event, BenchmarkResult) and event.bench_id in speeds:
                t = event.timings
                if t.eval_count and t.eval_duration:
                    speeds[event.bench_id].append(t.eval_count / (t.eval_duration / 1e9))
                elif event.kind == EMBED and t.prompt_eval_count and t.prompt_eval_duration:
                    # An embedding model's benchmark: its embedding rate.
                    speeds[event.bench_id].append(t.prompt_eval_count / (t.prompt_eval_duration / 1e9))
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
                "runs": len(tps),
                "tps": tps[len(tps) // 2] if tps else float("nan"),
                "quality": f"{sum(g) / len(g):.2f} of {len(g)}" if g else "not graded yet",
            }
        )
    return rows


@bench_app.command("judge")
@command()
def bench_judge(
    inst: Instance,
    judge: Annotated[str, typer.Option(help="The model on the fleet that grades answers.")],
    limit: Annotated[int, typer.Option(min=1, help="Grade at most this many answers.")] = 50,
) -> None:
    """Grade stored benchmark answers with a judge model (fixed rubric); appends QualityScored."""
    from dispatch.benchmark import prompt_by_id

    keys = inst.keys

    async def go(client: aioredis.Redis) -> tuple[int, int]:
        ledger = Ledger(client, keys)
        queues = TaskQueues(client, keys, ledger)
        graded = skipped = 0
        judged = {e.task_id async for _, e in _of(ledger, QualityScored) if e.grader.startswith("judge:")}
        async for _, result in _of(ledger, BenchmarkResult):
            if graded + skipped >= limit or result.task_id in judged:
                continue
            stored = await read_result(client, keys, result.task_id)
            prompt = prompt_by_id(result.prompt_id)
            if stored is None or prompt is None:
                skipped += 1
                continue
            answer = stored.text
            text = RUBRIC.format(question=prompt.prompt, answer=answer)
            req = TaskRequest(
                model=judge, messages=[Message(role="user", content=text)], max_tokens=16, client="judge"
            )
            task = (await submit_task(queues, req)).task
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
        stored = await read_result(client, keys, task_id)
        if stored is not None:
            return stored.text
        await asyncio.sleep(0.2)
    return None
