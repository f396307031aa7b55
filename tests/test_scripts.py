"""The scripts a worker runs are functions of the routeledger library on Redis 7 and EVALSHA scripts on
6.2, with the same replies; a user that may not load the library is told who loads it."""

from __future__ import annotations

import re
import subprocess
import sys
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from events.connection import redis_client as open_redis
from events.connection import send_all
from events.errors import ScriptLibraryError
from events.keys import Keys
from events.scripts import LIBRARY, library_code, load_library
from routeledger.embedded import find_redis_server, redis_version
from tasks.lease import LeaseInfo, Leases
from tests.cluster_coverage import written_scripts


async def test_a_lease_script_gives_the_same_answers_on_redis_7_and_6_2(any_redis_url: str) -> None:
    client = aioredis.Redis.from_url(any_redis_url)
    try:
        leases = Leases(client, Keys())
        first = await leases.put(LeaseInfo(worker="a", token="t1", slots=1), 5000)
        twin = await leases.put(LeaseInfo(worker="a", token="t2", slots=1), 5000)
        assert (first.ok, first.lapsed) == (True, True)
        assert (twin.ok, twin.holder) == (False, "t1")
        info = await client.info("server")
        if int(str(info["redis_version"]).split(".")[0]) >= 7:
            # Loaded on first use by a client that may load it, and called with FCALL since.
            assert await client.function_list(library=LIBRARY)
    finally:
        await client.aclose()


async def test_the_library_holds_every_script_a_worker_calls_once_under_a_versioned_name() -> None:
    code = library_code()
    assert code.startswith(f"#!lua name={LIBRARY}\n")
    for name in ("take", "keep", "finish", "requeue", "close_run", "result_once", "lease", "append_many"):
        assert len(re.findall(rf"function_name='rl_{name}_[0-9a-f]{{10}}'", code)) == 1, name


async def test_a_user_that_may_not_load_the_library_is_told_to_start_an_admin_process(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    version = redis_version(find_redis_server())
    if version is None or version < (7,):
        pytest.skip(f"functions need Redis 7; this redis-server is {version}")
    await redis_client.function_flush()
    await redis_client.execute_command(
        "ACL",
        "SETUSER",
        "w",
        "reset",
        "on",
        ">pw",
        "~rl:live:w",
        "~rl:workers",
        "+fcall",
        "+get",
        "+set",
        "+sadd",
    )
    parts = urlsplit(redis_url)
    worker = aioredis.Redis.from_url(f"redis://w:pw@{parts.hostname}:{parts.port}/0")
    try:
        with pytest.raises(ScriptLibraryError, match="start the projector"):
            await Leases(worker, Keys()).put(LeaseInfo(worker="w", token="t", slots=1), 5000)
        assert await load_library(redis_client)
        taken = await Leases(worker, Keys()).put(LeaseInfo(worker="w", token="t", slots=1), 5000)
        assert taken.ok
    finally:
        await worker.aclose()
        await redis_client.execute_command("ACL", "DELUSER", "w")


async def test_a_script_becomes_a_command_to_send_with_others_only_once_its_client_runs_functions(
    any_redis_url: str,
) -> None:
    client = open_redis(any_redis_url)
    try:
        leases = Leases(client, Keys())
        info = LeaseInfo(worker="a", token="t1", slots=1)
        assert leases.put_command(info, 5000) is None
        await leases.put(info, 5000)
        command = leases.put_command(info, 5000)
        version = int(str((await client.info("server"))["redis_version"]).split(".")[0])
        if version < 7:
            # Redis 6.2 has no functions: the script stays a pipelined EVALSHA.
            assert command is None
            return
        assert command is not None and command[:2] == ("FCALL", leases._lease.definition.function)
        (reply,) = await send_all(client, [command])
        assert Leases.taken(reply).ok
    finally:
        await client.aclose()


def test_a_process_routeledger_starts_defines_every_script_of_the_code_base() -> None:
    # The library a projector loads is what its process defined: it must be every ScriptDef.
    written = written_scripts()
    code = "import routeledger.runtime, events.scripts as s; print(' '.join(s.defined()))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    # A function's name is rl_<script>_<hash of its body>.
    loaded = {name[len("rl_") :].rsplit("_", 1)[0] for name in done.stdout.split()}
    assert written and loaded == written
