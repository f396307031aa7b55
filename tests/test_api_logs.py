"""The API's log: JSON lines that say what happened, never a prompt or an output."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import redis.asyncio as aioredis

from events.keys import Keys
from routeledger.embedded import free_port
from sim.backends.hosts import SimHosts
from tasks.payload import result_decoder
from tests.helpers import fast_config, make_test_fleet, running_agent, wait_until

SECRET_PROMPT = "the zebra-unicorn passphrase is 4711 mauve"


async def test_the_api_logs_json_lines_without_prompt_or_output_text(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    port = free_port()
    env = {**os.environ, "ROUTELEDGER_REDIS_URL": redis_url, "ROUTELEDGER_LOG_LEVEL": "debug"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "routeledger",
        "api",
        "--port",
        str(port),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with (
            SimHosts(make_test_fleet(), time_scale=0.0) as sim,
            httpx.AsyncClient(base_url=base) as http,
        ):

            async def up() -> bool:
                try:
                    return (await http.get("/healthz")).status_code == 200
                except httpx.HTTPError:
                    return False

            await wait_until(up, timeout=30)
            async with running_agent(redis_client, sim.url("a"), fast_config("a")):
                body = {"model": "m", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
                reply = await http.post("/v1/chat/completions", json=body, timeout=30)
                assert reply.status_code == 200
                task_id = reply.headers["x-routeledger-task"]
                bad = await http.post(
                    "/v1/chat/completions", json={"model": "nope", "messages": body["messages"]}
                )
                assert bad.status_code == 404
    finally:
        proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    output = result_decoder.decode(await redis_client.hget(Keys().result(task_id), "result")).text
    log = err.decode()
    lines = [json.loads(line) for line in log.splitlines() if line.strip()]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    assert any(task_id in json.dumps(line) for line in lines), "the access log names the task"
    assert SECRET_PROMPT not in log and "zebra-unicorn" not in log
    assert output and output not in log
