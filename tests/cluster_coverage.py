"""Which Lua scripts and MULTI blocks of the code base ran on a Redis Cluster, recorded as the tests
run, and checked at the end of a session against an inventory taken from the source.

A script that touches keys in two slots fails on a cluster (CROSSSLOT) but passes on one Redis, and
so does a MULTI whose keys are in two slots; a script queued on a cluster pipeline can also be lost
unsent. So every script and every MULTI must run on a cluster in some test of the cluster tier (a
module marked `pytest.mark.cluster_tier`, whose tests that take `redis_backend` run on one Redis and
again on a 3-master cluster).

The inventory, from the source of the packages:
- the scripts events/scripts.py loads as one function library (`ScriptDef`), by their plain names;
- every `register_script(NAME)` outside events/scripts.py, as `module:NAME`;
- every MULTI site, as `module:function`: a `.pipeline(...)` that is not `transaction=False` (a plain
  client's default is a transaction), a `.multi()` and a `.transaction(...)`.

The record, while a cluster test of the tier runs: a script is recorded when its call on a cluster
client returns, or, queued on a cluster pipeline, when that pipeline is executed with the script
still in its queue and the script's reply is no error; a MULTI site when a transaction pipeline it
made (or called `multi()` on) is executed on a cluster. The wrapping is installed once per session
and costs one flag test per call outside the tier's cluster runs.

The check runs when the tier ran whole: every tier module was collected and every one of its
cluster tests (cluster-parametrized, or taking `redis_cluster`) ran, none deselected, none failed.

In a parallel run (pytest-xdist) each worker process sees only the tests it ran: each writes what it
collected, ran and recorded (`TierRun.state`) to a file in a folder the controller made, and the
controller adds them up (`TierRun.add`) and gives the verdict on the union.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import sys
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

import pytest
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.commands.core import AsyncScript

from events import scripts
from events.connection import ClusterClient

ROOT: Final = Path(__file__).resolve().parent.parent
TESTS: Final = ROOT / "tests"
PACKAGES: Final = (
    "api",
    "dispatch",
    "events",
    "pipelines",
    "projections",
    "replay",
    "routeledger",
    "tasks",
    "workers",
)
_SCRIPT_COMMANDS: Final = frozenset({"FCALL", "FCALL_RO", "EVALSHA", "EVALSHA_RO"})


# -- the inventory -------------------------------------------------------------------------------


def _plain(function: str) -> str:
    # A function's name is its plain name and a hash of its body: `rl_<name>_<hash>`.
    return function.removeprefix("rl_").rsplit("_", 1)[0]


def defined_scripts() -> set[str]:
    """The scripts events/scripts.py loads as functions, by their plain names: those its library
    holds, and every `ScriptDef("name", ...)` in the packages (one in a module the library does not
    import is found all the same)."""
    importlib.import_module("routeledger.library")
    return {_plain(name) for name in scripts.defined()} | written_scripts()


def written_scripts() -> set[str]:
    """The name of every `ScriptDef("name", ...)` written in the packages, read from their source."""
    found: set[str] = set()
    for _module, tree in _modules("ScriptDef"):
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "ScriptDef"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(str(node.args[0].value))
    return found


def _modules(*needles: str) -> Iterable[tuple[str, ast.Module]]:
    """The packages' modules whose text holds one of `needles`, parsed (a session starts faster)."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if any(n in text for n in needles):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                yield module, ast.parse(text, str(path))


def _registrations() -> dict[str, ast.expr]:
    """`module:NAME` -> the argument of each `register_script(...)` call outside events/scripts.py."""
    found: dict[str, ast.expr] = {}
    for module, tree in _modules("register_script"):
        if module == "events.scripts":  # binds the defined scripts (EVALSHA on a Redis without functions)
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_script"
                and node.args
            ):
                arg = node.args[0]
                found[f"{module}:{arg.id if isinstance(arg, ast.Name) else ast.unparse(arg)}"] = arg
    return found


def registered_scripts() -> set[str]:
    """Every `register_script(NAME)` in the packages, as `module:NAME`, but the one in
    events/scripts.py that binds the defined scripts."""
    return set(_registrations())


def registered_bodies() -> dict[str, str | None]:
    """The body of each registered script (the module's constant it names, or a literal); None
    where the argument is not one, so that the script cannot be told by its body."""
    bodies: dict[str, str | None] = {}
    for name, arg in _registrations().items():
        module = name.split(":", 1)[0]
        body: Any = None
        if isinstance(arg, ast.Constant):
            body = arg.value
        else:
            # A name of the module, or a dotted one (`store._APPLY`) read from there.
            parts = ast.unparse(arg).split(".")
            body = importlib.import_module(module)
            for part in parts if all(p.isidentifier() for p in parts) else ["?"]:
                body = getattr(body, part, None)
        bodies[name] = body if isinstance(body, str) else None
    return bodies


class _Sites(ast.NodeVisitor):
    """MULTI sites of one module, each named by the qualified name of the function it is in."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.scope: list[str] = []
        self.found: set[str] = set()

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, function: bool) -> None:
        self.scope.append(node.name)
        if function:
            self.scope.append("<locals>")
        self.generic_visit(node)
        del self.scope[-2 if function else -1 :]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._enter(node, False)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._enter(node, True)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._enter(node, True)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and _is_multi(node.func.attr, node):
            where = ".".join(self.scope[:-1]) if self.scope else "<module>"
            self.found.add(f"{self.module}:{where}")
        self.generic_visit(node)


def _is_multi(attr: str, call: ast.Call) -> bool:
    if attr in ("multi", "transaction"):
        return True
    if attr != "pipeline":
        return False
    given = [k.value for k in call.keywords if k.arg == "transaction"]
    if given:  # anything but a literal false value may be a transaction
        return not (isinstance(given[0], ast.Constant) and not given[0].value)
    if call.args:  # `keys.pipeline(pipeline_id)` names a key: only a literal says transaction
        return isinstance(call.args[0], ast.Constant) and bool(call.args[0].value)
    return True  # a plain client's pipeline() is a transaction


def multi_sites() -> set[str]:
    """Every place in the packages that makes a MULTI, as `module:function`."""
    found: set[str] = set()
    for module, tree in _modules("pipeline(", "multi(", "transaction("):
        visitor = _Sites(module)
        visitor.visit(tree)
        found |= visitor.found
    return found


def tier_modules(tests: Path = TESTS) -> set[Path]:
    """The test modules of the cluster tier: those whose module-level `pytestmark` names it."""
    found: set[Path] = set()
    for path in sorted(tests.rglob("test_*.py")):
        text = path.read_text()
        if "cluster_tier" not in text:
            continue
        for node in ast.parse(text, str(path)).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
                and any(
                    isinstance(n, ast.Attribute) and n.attr == "cluster_tier" for n in ast.walk(node.value)
                )
            ):
                found.add(path.resolve())
    return found


# -- the record ----------------------------------------------------------------------------------


# Modules whose frames stand between a call site and redis-py: the client routeledger builds on it.
_CLIENT_MODULES: Final = frozenset({__name__, "redis", "events.connection"})


def _caller() -> FrameType | None:
    """The innermost frame outside redis-py, routeledger's client of it and this module."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module not in _CLIENT_MODULES and not module.startswith("redis."):
            return frame
        frame = frame.f_back
    return None


def _site() -> str:
    frame = _caller()
    if frame is None:
        return "<unknown>"
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_qualname}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class Record:
    """What ran on a cluster client while `active` (a cluster test of the tier runs)."""

    active: bool = False
    scripts: set[str] = field(default_factory=set)
    multi: set[str] = field(default_factory=set)
    # A registered script (made through a cluster client) -> its `module:NAME`.
    names: weakref.WeakKeyDictionary[AsyncScript, str] = field(default_factory=weakref.WeakKeyDictionary)
    # (module, sha1 of the body) -> `module:NAME`, from the inventory.
    by_body: dict[tuple[str, str], str] = field(default_factory=dict)
    # A cluster pipeline -> the scripts queued on it: (what its command names: a function or a
    # sha1, the script's name).
    queued: weakref.WeakKeyDictionary[ClusterPipeline, list[tuple[frozenset[str], str]]] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    # A cluster transaction pipeline -> the MULTI sites that made it or called its multi().
    transactions: weakref.WeakKeyDictionary[ClusterPipeline, set[str]] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    installed: bool = False

    def install(self) -> None:
        """Wrap the script calls and the cluster client's pipelines (once per process)."""
        if self.installed:
            return
        self.installed = True
        for name, body in registered_bodies().items():
            if body is not None:
                self.by_body[(name.split(":", 1)[0], hashlib.sha1(body.encode()).hexdigest())] = name
        record = self

        script_call = scripts.Script.__call__

        async def call_script(
            self: scripts.Script, keys: Sequence[Any] = (), args: Sequence[Any] = (), client: Any = None
        ) -> Any:
            if not record.active or not isinstance(self.redis, RedisCluster):
                return await script_call(self, keys, args, client)
            reply = await script_call(self, keys, args, client)
            name = _plain(self.definition.function)
            signature = frozenset({self.definition.function, self._eval.sha})
            record._ran(name, signature, client)
            return reply

        registered_call = AsyncScript.__call__

        async def call_registered(
            self: AsyncScript, keys: Any = None, args: Any = None, client: Any = None
        ) -> Any:
            name = record.names.get(self) if record.active else None
            reply = await registered_call(self, keys, args, client)
            if name is not None:
                record._ran(name, frozenset({self.sha}), client)
            return reply

        register = RedisCluster.register_script

        def register_script(self: RedisCluster, script: Any) -> AsyncScript:
            made: AsyncScript = register(self, script)
            frame = _caller()
            module = frame.f_globals.get("__name__", "?") if frame is not None else "?"
            if module != "events.scripts":
                record.names[made] = record.by_body.get(
                    (module, made.sha), f"{module}:<script {made.sha[:10]}>"
                )
            return made

        # routeledger's cluster client makes its pipelines (events.connection.ClusterClient).
        make_pipeline = ClusterClient.pipeline

        def pipeline(self: ClusterClient, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
            pipe = make_pipeline(self, transaction, shard_hint)
            if transaction and record.active:
                record.transactions[pipe] = {_site()}
            return pipe

        multi = ClusterPipeline.multi

        def pipe_multi(self: ClusterPipeline) -> None:
            multi(self)
            if record.active:
                record.transactions.setdefault(self, set()).add(_site())

        execute = ClusterPipeline.execute

        async def pipe_execute(
            self: ClusterPipeline, raise_on_error: bool = True, allow_redirections: bool = True
        ) -> Any:
            if not record.active:
                return await execute(self, raise_on_error, allow_redirections)
            stack = [c.args for c in getattr(self._execution_strategy, "_command_queue", ())]
            queued = record.queued.pop(self, [])
            reply = await execute(self, raise_on_error, allow_redirections)
            replies = reply if isinstance(reply, list) and len(reply) == len(stack) else [None] * len(stack)
            sent = {
                _text(args[1])
                for args, answer in zip(stack, replies, strict=True)
                if len(args) > 1
                and _text(args[0]).upper() in _SCRIPT_COMMANDS
                and not isinstance(answer, Exception)
            }
            record.scripts.update(name for signature, name in queued if signature & sent)
            if stack and self in record.transactions:
                record.multi.update(record.transactions[self])
            return reply

        scripts.Script.__call__ = call_script  # type: ignore[method-assign]
        AsyncScript.__call__ = call_registered  # type: ignore[method-assign]
        RedisCluster.register_script = register_script  # type: ignore[method-assign,assignment]
        ClusterClient.pipeline = pipeline  # type: ignore[method-assign]
        ClusterPipeline.multi = pipe_multi  # type: ignore[method-assign]
        ClusterPipeline.execute = pipe_execute  # type: ignore[method-assign]

    @contextlib.contextmanager
    def recording(self) -> Iterator[Record]:
        """Record from empty within the block, whatever test runs (the record is put back after)."""
        saved = self.active, self.scripts, self.multi
        self.active, self.scripts, self.multi = True, set(), set()
        try:
            yield self
        finally:
            self.active, self.scripts, self.multi = saved

    def _ran(self, name: str, signature: frozenset[str], client: Any) -> None:
        if client is None:
            self.scripts.add(name)  # the call returned: it ran
        elif isinstance(client, ClusterPipeline):
            self.queued.setdefault(client, []).append((signature, name))


# -- the session's verdict -----------------------------------------------------------------------


def _cluster_test(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    return params.get("redis_backend") == "cluster" or "redis_cluster" in getattr(item, "fixturenames", ())


# The session's record (installed by tests/conftest.py at the session's start).
RECORD: Final = Record()


@dataclass
class TierRun:
    """Which cluster tests of the tier were collected, which ran and how, and the verdict."""

    record: Record = field(default_factory=lambda: RECORD)
    tier: set[Path] = field(default_factory=set)
    modules: set[Path] = field(default_factory=set)
    counted: set[str] = field(default_factory=set)
    ran: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    lines: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.tier = tier_modules()
        self.record.install()

    def collected(self, items: Iterable[pytest.Item]) -> None:
        for item in items:
            path = Path(item.path).resolve()
            if path in self.tier:
                self.modules.add(path)
                if _cluster_test(item):
                    self.counted.add(item.nodeid)

    def entering(self, item: pytest.Item) -> None:
        self.record.active = item.nodeid in self.counted

    def left(self) -> None:
        self.record.active = False

    def reported(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self.counted:
            return
        if report.failed:
            self.failed.add(report.nodeid)
        if report.when == "call" or report.skipped:
            self.ran.add(report.nodeid)  # a test that skips itself (on a cluster) has run

    def state(self) -> dict[str, list[str]]:
        """What this process collected, ran and recorded, for the controller of a parallel run."""
        return {
            "modules": sorted(str(p) for p in self.modules),
            "counted": sorted(self.counted),
            "ran": sorted(self.ran),
            "failed": sorted(self.failed),
            "scripts": sorted(self.record.scripts),
            "multi": sorted(self.record.multi),
        }

    def add(self, state: dict[str, list[str]]) -> None:
        """Add what one worker of a parallel run saw (its `state`) to this run's."""
        self.modules |= {Path(p) for p in state["modules"]}
        self.counted |= set(state["counted"])
        self.ran |= set(state["ran"])
        self.failed |= set(state["failed"])
        self.record.scripts |= set(state["scripts"])
        self.record.multi |= set(state["multi"])

    def why_not_whole(self) -> str | None:
        if not self.tier:
            return "no test module is marked cluster_tier"
        if missing := sorted(p.name for p in self.tier - self.modules):
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            return f"{len(missing)} of its {len(self.tier)} modules were not collected ({shown})"
        if not self.counted:
            return "none of its tests runs on the cluster"
        if not_run := self.counted - self.ran:
            return (
                f"{len(not_run)} of its {len(self.counted)} cluster tests did not run "
                "(deselected, or the run stopped)"
            )
        if self.failed:
            return f"{len(self.failed)} of its cluster tests failed"
        return None

    def verdict(self) -> bool:
        """Write the check's lines; False when a script or MULTI site never ran on the cluster."""
        why = self.why_not_whole()
        if why is not None:
            self.lines = [f"cluster coverage: check skipped, the cluster tier did not run whole: {why}"]
            return True
        wanted = {f"script {s}" for s in defined_scripts() | registered_scripts()}
        wanted |= {f"MULTI {s}" for s in multi_sites()}
        seen = {f"script {s}" for s in self.record.scripts} | {f"MULTI {s}" for s in self.record.multi}
        missing = sorted(wanted - seen)
        if not missing:
            self.lines = [
                f"cluster coverage: every Lua script ({sum(w.startswith('script') for w in wanted)}) and "
                f"MULTI site ({sum(w.startswith('MULTI') for w in wanted)}) of the code base ran on the "
                f"cluster in {len(self.counted)} cluster tests"
            ]
            return True
        self.lines = [
            f"cluster coverage: FAILED, {len(missing)} of the code base's Lua scripts and MULTI sites "
            "never ran on the cluster tier's cluster:"
        ]
        self.lines += [f"  {m}: add a cluster-tier test that reaches {m.split(' ', 1)[1]}" for m in missing]
        self.lines.append(
            "  (a test of a module with `pytestmark = pytest.mark.cluster_tier` that takes redis_client, "
            "redis_url or keys runs on the cluster too; tests/cluster_coverage.py says what is recorded; "
            "a `.pipeline()` without transaction= is a MULTI on one Redis but not on a cluster: write "
            "transaction=True or transaction=False)"
        )
        return False
