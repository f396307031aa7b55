"""The Lua scripts a worker runs, as Redis 7 functions where the server has them (EVALSHA on 6.2).

A worker on another machine must not run Lua of its own choosing (`EVAL "while true do end"` blocks
the server): its ACL grants FCALL, never EVAL or SCRIPT LOAD, and FUNCTION LOAD is an admin's. So
every script a worker needs is a function of one library, `routeledger`, loaded by the processes
that run with the admin's credentials (the projector on start, and any admin client that finds a
function missing). A function's name carries a hash of its body, so that a library of another
version is never called by mistake: a worker whose code differs from the library's is told so.

Redis 6.2 has no functions: there, every script is sent with EVALSHA as before (6.2 cannot enforce
these ACLs anyway). Redis runs a function with its caller's ACL, like any script, so a function
grants nothing: the commands and keys it touches must be the caller's own.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline
from redis.exceptions import NoPermissionError, ResponseError

from events.errors import ScriptLibraryError

LIBRARY: Final = "routeledger"
# This layer's own Lua (the ledger's), beside the modules that run it.
EVENTS_LUA: Final = Path(__file__).parent / "lua"
# Function name -> (body, flags), for every script defined so far.
_DEFINED: dict[str, tuple[str, tuple[str, ...]]] = {}
# Per client: True, the server runs functions; False, it has none (6.2): EVALSHA.
_HAS_FUNCTIONS: weakref.WeakKeyDictionary[aioredis.Redis, bool] = weakref.WeakKeyDictionary()


def read_lua(*files: Path) -> str:
    """A script's body from its .lua files, joined in order: the files of shared functions first
    (`lib_*.lua`), then the script's own. Each file's header says what it does and names every
    KEYS and ARGV it takes; read once, when the module that runs it is imported."""
    return "".join(path.read_text(encoding="utf-8") for path in files)


class ScriptDef:
    """A script's body under a name: defined once per module, bound to a client with `bind`."""

    def __init__(self, name: str, body: str, *, allow_oom: bool = False) -> None:
        self.function = f"rl_{name}_{hashlib.sha1(body.encode()).hexdigest()[:10]}"
        self.body = body
        # allow-oom: runs when Redis is at its memory limit (a script that frees or keeps entries
        # alive, as EVAL of it did); other functions are refused whole then (an OOM error).
        flags = ("allow-oom",) if allow_oom else ()
        _DEFINED[self.function] = (body, flags)

    def bind(self, redis: aioredis.Redis) -> Script:
        return Script(redis, self)


class Script:
    """A script bound to a client; called like redis-py's Script (`keys`, `args`, `client`)."""

    def __init__(self, redis: aioredis.Redis, definition: ScriptDef) -> None:
        self.redis = redis
        self.definition = definition
        self._eval = redis.register_script(definition.body)

    async def __call__(
        self, keys: Sequence[Any] = (), args: Sequence[Any] = (), client: Pipeline | None = None
    ) -> Any:
        name = self.definition.function
        if client is not None:
            # Queued on a pipeline: the client's mode is known by then (every process runs a
            # script on its own before it pipelines one).
            if _HAS_FUNCTIONS.get(self.redis):
                queued: Any = client.fcall(name, len(keys), *keys, *args)
                # A cluster pipeline hands itself back, and awaiting it empties its queue
                # (redis-py's ClusterPipeline.initialize): the call would be dropped unsent.
                return queued if isinstance(queued, ClusterPipeline) else await queued
            return await self._eval(keys=keys, args=args, client=client)
        if _HAS_FUNCTIONS.get(self.redis, True):
            try:
                return await self._fcall(keys, args)
            except ResponseError as exc:
                if "unknown command" not in str(exc).lower():
                    raise
                _HAS_FUNCTIONS[self.redis] = False
        return await self._eval(keys=keys, args=args)

    def command(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        """The call as one command to send with others (events.connection.send_all), once the
        client is known to run functions (it has run a script on its own); else None: queue it
        on a pipeline instead."""
        if not _HAS_FUNCTIONS.get(self.redis):
            return None
        return ("FCALL", self.definition.function, len(keys), *keys, *args)

    async def _fcall(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        name = self.definition.function
        call: Any = self.redis.fcall
        try:
            reply = await call(name, len(keys), *keys, *args)
        except ResponseError as exc:
            if "function not found" not in str(exc).lower():
                raise
            await load_library(self.redis)
            reply = await call(name, len(keys), *keys, *args)
        _HAS_FUNCTIONS[self.redis] = True
        return reply


def defined() -> list[str]:
    """The function name of every script defined so far (by the modules this process imported)."""
    return sorted(_DEFINED)


def bodies() -> dict[str, str]:
    """The body of every script defined so far, by function name (a Redis without functions runs
    it by the body's sha1, with EVALSHA)."""
    return {name: body for name, (body, _) in sorted(_DEFINED.items())}


def library_code() -> str:
    """The `routeledger` library: every script defined so far, as a function.

    A script is defined when its module is imported, and this layer imports nothing above it: a
    process that loads the library for others (the projector's, `up`'s) has imported every module
    that defines one through `routeledger.library`, so the library is whole. Any other process
    loads what it defined when a function it calls is missing; the next process that misses one
    of its own loads it again with its own, so a shared Redis ends with every function called."""
    parts = [f"#!lua name={LIBRARY}"]
    for name, (body, flags) in sorted(_DEFINED.items()):
        flag_list = ", ".join(f"'{f}'" for f in flags)
        parts.append(
            f"redis.register_function{{function_name='{name}', flags={{{flag_list}}}, "
            f"callback=function(KEYS, ARGV)\n{body}\nend}}"
        )
    return "\n".join(parts) + "\n"


async def load_library(redis: aioredis.Redis) -> bool:
    """Load (or replace) the library in Redis; False on a Redis without functions (6.2).

    Needs FUNCTION LOAD: a worker under its ACL has none, and is told to start an admin process of
    its own version instead."""
    try:
        await redis.function_load(library_code(), replace=True)
    except NoPermissionError as exc:
        raise ScriptLibraryError(
            f"Redis has no routeledger functions of this version loaded, and this user may not load "
            f"them ({exc}): start the projector (or `routeledger up`) of the same version with the "
            "admin's credentials, which loads them"
        ) from None
    except ResponseError as exc:
        if "unknown command" in str(exc).lower():
            return False
        raise
    return True
