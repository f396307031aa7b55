"""`routeledger sim traffic`: a light trickle of varied requests, so that a demo fleet looks alive.

Requests go through the API's one way in (dispatch.gateway.Gateway.submit, with its checks: the
memory guard, a deadline): each is routed with a recorded breakdown, queued, and run by whichever
worker the plan lets take it. Nobody waits for the answers; they expire like any other result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from typing import Annotated, Final

import redis.asyncio as aioredis
import typer
from redis.exceptions import RedisError

from dispatch.errors import ModelNotServedError
from dispatch.gateway import Gateway
from events.keys import Keys
from routeledger.runtime import Instance, command, setup_logging
from tasks.errors import TaskError
from tasks.payload import Message, TaskMessage

log = logging.getLogger("routeledger.traffic")

DEFAULT_MODELS: Final = ("qwen3:8b", "elyza-jp-8b", "auto")
# A mix of domains, so that `auto` has choices to make and the quality terms differ.
PROMPTS: Final = (
    "Explain in two sentences why a faster machine should take most of the work.",
    "Summarise the difference between a queue and a stack.",
    "Write a haiku about a laptop fan at night.",
    "What is the capital of Portugal, and why is it on a river?",
    "def fib(n):\n    # make this iterative and explain the change\n    return fib(n - 1) + fib(n - 2)",
    "Fix this SQL: SELECT name, count(*) FROM users GROUP name;",
    "Write a Python function that merges two sorted lists.",
    "日本の首都について短く説明してください。",
    "この文章を丁寧な敬語に直してください。「明日行けない」",
    "おすすめの週末の過ごし方を三つ教えてください。",
)


async def trickle(
    redis: aioredis.Redis,
    keys: Keys,
    *,
    rate: float,
    models: tuple[str, ...] = DEFAULT_MODELS,
    max_tokens: tuple[int, int] = (32, 120),
    count: int | None = None,
    seed: int | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Submit requests at `rate` per second on average (Poisson arrivals) until `stop` is set or
    `count` were submitted; returns how many were."""
    rng = random.Random(seed)
    gateway = Gateway(redis, keys)
    stop = stop or asyncio.Event()
    sent = 0
    warned: set[str] = set()
    while not stop.is_set() and (count is None or sent < count):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
            break
        model = rng.choice(models)
        try:
            req = TaskMessage(
                model=model,
                messages=[Message(role="user", content=rng.choice(PROMPTS))],
                max_tokens=rng.randint(*max_tokens),
                client="sim-traffic",
            )
            await gateway.submit(req, waits=False)
            sent += 1
            warned.discard(model)
        except ModelNotServedError as exc:
            # Workers come up after the traffic starts in a demo: say so once, then keep trying.
            if model not in warned:
                log.info("not sending %s yet: %s", model, exc)
                warned.add(model)
        except (TaskError, RedisError, OSError) as exc:
            log.warning("could not submit: %s", exc)
    return sent


@command()
def traffic_cmd(
    inst: Instance,
    rate: Annotated[float, typer.Option("--rate", min=0.001, help="Requests per second, on average.")] = 0.2,
    model: Annotated[
        list[str] | None, typer.Option("--model", help="A model to ask (repeatable; default: the demo's).")
    ] = None,
    # Short answers keep the demo's laptop (12 tok/s, the only ELYZA holder) ahead of its queue.
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="Most output tokens per request.")
    ] = 120,
    count: Annotated[int | None, typer.Option("--count", min=1, help="Stop after this many.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of the choices and arrival times.")] = None,
) -> None:
    """Submit a light, varied stream of simulated requests until Ctrl-C."""
    setup_logging("info")

    async def go(client: aioredis.Redis) -> int:
        # Ctrl-C and SIGTERM end the trickle, which then says how many it sent.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await trickle(
            client,
            inst.keys,
            rate=rate,
            models=tuple(model or DEFAULT_MODELS),
            max_tokens=(min(32, max_tokens), max_tokens),
            count=count,
            seed=seed,
            stop=stop,
        )

    sent = inst.run(go)
    log.info("sent %d requests", sent)
