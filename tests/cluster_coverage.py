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

The record is taken on the server, from what the cluster's nodes themselves log, through nothing
but Redis's commands (no hook in the client): each node logs every command it runs (its slowlog,
with no threshold: `NODE_SETTINGS`), and when a cluster test of the tier ends, each node's log since
the test began is read (`ClusterLog`), in one transaction with what the node holds and its counts of
failed calls (`NodeRead`). From them (`ran_between`):
- a defined script ran when an FCALL of its function (`rl_<name>_<hash>`, which names it) ran with
  the function loaded and no error (on a Redis without functions, an EVALSHA of its body); a
  registered one when an EVALSHA of its body's sha1 ran with the script in the cache and no error
  (a body that two modules register is told by the call's keys, `_WHOSE`). What was only queued,
  or refused (CROSSSLOT, a key in two slots), never reaches the log; a node logs a call that failed
  too, but counts its failures, and a script counts when the calls that found it outnumber the
  failures of their command that may be theirs;
- a MULTI site ran when a transaction whose commands are those its source sends (and no other
  site's: `multi_commands`) ran, again beyond its command's failures.
A command run by a product process the test started counts as one the test ran.

The check runs when the tier ran whole: every tier module was collected and every one of its
cluster tests (cluster-parametrized, or taking `redis_cluster`) ran, none deselected, none failed.

In a parallel run (pytest-xdist) each worker process sees only the tests it ran: each writes what it
collected, ran and recorded (`TierRun.state`) to a file in a folder the controller made, and the
controller adds them up (`TierRun.add`) and gives the verdict on the union.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
import redis
from redis.crc import key_slot

from events import scripts
from projections.projector import ROLE as PROJECTOR_ROLE
from routeledger.embedded import EmbeddedCluster

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
    """MULTI sites of one module, each named by the qualified name of the function it is in, and the
    commands each site's transaction sends."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.scope: list[str] = []
        self.functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
        self.found: set[str] = set()
        self.commands: dict[str, frozenset[str] | None] = {}

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, function: bool) -> None:
        self.scope.append(node.name)
        if function:
            self.scope.append("<locals>")
            assert not isinstance(node, ast.ClassDef)
            self.functions.append(node)
        self.generic_visit(node)
        del self.scope[-2 if function else -1 :]
        if function:
            self.functions.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._enter(node, False)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._enter(node, True)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._enter(node, True)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and _is_multi(node.func.attr, node):
            where = ".".join(self.scope[:-1]) if self.scope else "<module>"
            site = f"{self.module}:{where}"
            self.found.add(site)
            sent = _sent(self.functions[-1], node) if self.functions else None
            known = self.commands.get(site, frozenset())
            # Two MULTIs in one function (a pipeline and its multi(), say): what either sends.
            self.commands[site] = None if sent is None or known is None else known | sent
        self.generic_visit(node)


# Methods of a pipeline that send no command of the transaction.
_NOT_SENT: Final = frozenset({"execute", "multi", "watch", "unwatch", "reset", "discard"})
# redis-py's methods whose command is not their name in capitals (as the server logs it).
_COMMAND_OF: Final = {"delete": "DEL", "incr": "INCRBY", "decr": "DECRBY"}


def _sent(function: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call) -> frozenset[str] | None:
    """The commands a transaction sends: the `pipe.<command>(...)` calls in `function` on the
    pipeline that `call` makes or calls multi() on. None where the source does not say (a
    `.transaction(func)`, a pipeline handed to another function): the site cannot be told then."""
    assert isinstance(call.func, ast.Attribute)
    pipe: str | None = None
    if call.func.attr == "multi" and isinstance(call.func.value, ast.Name):
        pipe = call.func.value.id
    elif call.func.attr == "pipeline":
        for node in ast.walk(function):
            if isinstance(node, ast.With | ast.AsyncWith):
                for item in node.items:
                    if item.context_expr is call and isinstance(item.optional_vars, ast.Name):
                        pipe = item.optional_vars.id
            elif (
                isinstance(node, ast.Assign)
                and node.value is call
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                pipe = node.targets[0].id
    if pipe is None:
        return None
    sent = {
        _COMMAND_OF.get(node.func.attr, node.func.attr.upper())
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == pipe
        and node.func.attr not in _NOT_SENT
    }
    return frozenset(sent) or None


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
    return set(multi_commands())


def multi_commands() -> dict[str, frozenset[str] | None]:
    """Every MULTI site of the packages -> the commands its transaction sends, as the server logs
    them (None where the source does not say)."""
    found: dict[str, frozenset[str] | None] = {}
    for module, tree in _modules("pipeline(", "multi(", "transaction("):
        visitor = _Sites(module)
        visitor.visit(tree)
        found |= visitor.commands
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

# Every node of the tier's cluster logs every command it runs (its slowlog, with no threshold), as
# the session's cluster is started with (tests/conftest.py); enough of them for any one test.
SLOWLOG_LEN: Final = 1_000_000
NODE_SETTINGS: Final = ("slowlog-log-slower-than 0", f"slowlog-max-len {SLOWLOG_LEN}")

# The client under which a node logs the commands a script runs.
_IN_SCRIPT: Final = "?:0"
# A logged argument longer than 128 bytes: its first 128 and how many more there were.
_CUT: Final = re.compile(rb"(.{128})\.\.\. \((\d+) more bytes\)", re.DOTALL)
# A function of the routeledger library: `rl_<name>_<hash>`.
_FUNCTION: Final = re.compile(r"rl_\w+_[0-9a-f]{10}")

# A module that registers a body another module registers too sends the same EVALSHA: the keys a
# call names tell whose call it was (module -> whether the call's keys are its own). A call that
# no rule tells is nobody's, so that an ambiguity fails the check rather than passing it.
_WHOSE: Final[dict[str, Callable[[Sequence[str]], bool]]] = {
    # The projector's fenced lease; events.singleton's SingletonLease holds the reaper's and others.
    "projections.projector": lambda keys: bool(keys) and keys[0].endswith(f"lease:{PROJECTOR_ROLE}"),
}


@dataclass(frozen=True)
class Inventory:
    """What the record tells the code base's scripts and MULTI sites by, on the server."""

    # sha1 of a script's body -> its body, and the names the check knows it by: the registrations
    # (`module:NAME`) of it, or the defined script (by its plain name) that a Redis without
    # functions runs with EVALSHA.
    bodies: dict[str, bytes]
    names: dict[str, tuple[str, ...]]
    # MULTI site -> the commands its transaction sends (None where the source does not say).
    sites: dict[str, frozenset[str] | None]

    @classmethod
    def of_source(cls) -> Inventory:
        importlib.import_module("routeledger.library")  # defines every script
        bodies: dict[str, bytes] = {}
        names: dict[str, list[str]] = {}
        known = [(_plain(f), b) for f, b in scripts.bodies().items()] + list(registered_bodies().items())
        for name, body in known:
            if body is not None:
                sha = hashlib.sha1(body.encode()).hexdigest()
                bodies[sha] = body.encode()
                names.setdefault(sha, []).append(name)
        return cls(bodies, {sha: tuple(sorted(n)) for sha, n in names.items()}, multi_commands())

    def loaded_by(self, body: bytes) -> set[str]:
        """The known scripts a SCRIPT LOAD (or EVAL) of `body`, as logged, puts in the cache."""
        cut = _CUT.fullmatch(body)
        if cut is None:
            return {hashlib.sha1(body).hexdigest()}
        head, more = cut.group(1), int(cut.group(2))
        return {sha for sha, b in self.bodies.items() if b[:128] == head and len(b) == 128 + more}

    def script_of(self, entry: Entry) -> str | None:
        """The script an FCALL or EVALSHA runs, by the name the check knows it by."""
        if entry.command in ("FCALL", "FCALL_RO"):
            function = entry.arg(1)
            return _plain(function) if _FUNCTION.fullmatch(function) else None
        names = self.names.get(entry.arg(1), ())
        if len(names) <= 1:
            return names[0] if names else None
        keys = entry.keys()
        ruled = [n for n in names if n.split(":", 1)[0] in _WHOSE]
        mine = [n for n in ruled if _WHOSE[n.split(":", 1)[0]](keys)]
        rest = [n for n in names if n not in ruled]
        if len(mine) == 1:
            return mine[0]
        return rest[0] if not mine and len(rest) == 1 else None

    def site_of(self, commands: Iterable[str]) -> str | None:
        """The one MULTI site whose transaction sends these commands (and no other's does)."""
        sent = set(commands)
        fits = [s for s, c in self.sites.items() if c is not None and sent and sent <= c]
        return fits[0] if len(fits) == 1 else None


@dataclass(frozen=True)
class Entry:
    """One command a node logged: its arguments (each cut at 128 bytes) and who sent it."""

    id: int
    args: tuple[bytes, ...]
    client: str

    @property
    def command(self) -> str:
        head = self.arg(0).upper()
        return f"{head} {self.arg(1).upper()}" if head in ("SCRIPT", "FUNCTION") else head

    def arg(self, i: int) -> str:
        return self.args[i].decode(errors="replace") if i < len(self.args) else ""

    def keys(self) -> list[str]:
        """The keys of an FCALL or EVALSHA (`name numkeys key...`)."""
        count = self.arg(2)
        return [a.decode(errors="replace") for a in self.args[3 : 3 + int(count)]] if count.isdigit() else []

    def slot(self) -> int | None:
        """The slot of the command's first argument, where it takes a key there (as a
        transaction's commands on a cluster all do)."""
        return key_slot(self.args[1]) if len(self.args) > 1 else None


@dataclass(frozen=True)
class NodeRead:
    """One node's state and log, read in one transaction (so nothing runs between their parts)."""

    run_id: str
    master: bool
    failed: dict[str, int]  # command, as INFO commandstats names it (`fcall`) -> failed calls
    noscript: int  # NOSCRIPT errors (an EVALSHA of a script not in the cache)
    scripts: frozenset[str]  # the inventory's registered scripts in the cache (by sha1)
    functions: frozenset[str]  # the functions loaded (none on a Redis without them)
    entries: tuple[Entry, ...]  # what it logged since the previous read, oldest first

    @classmethod
    def of(cls, client: redis.Redis, shas: Sequence[str]) -> NodeRead:
        functions = int(str(client.info("server")["redis_version"]).split(".")[0]) >= 7
        pipe = client.pipeline(transaction=True)
        pipe.execute_command("SLOWLOG", "GET", "-1")
        pipe.execute_command("SLOWLOG", "RESET")
        pipe.info("server")
        pipe.info("commandstats")
        pipe.info("errorstats")
        pipe.execute_command("ROLE")
        if functions:
            pipe.execute_command("FUNCTION", "LIST")
        else:
            pipe.echo("Redis 6.2: no functions")
        if shas:
            pipe.script_exists(*shas)
        log, _, server, commands, errors, role, libraries, *exists = pipe.execute()
        return cls(
            run_id=str(server["run_id"]),
            master=_text(role[0]) == "master",
            failed={k.removeprefix("cmdstat_"): int(v.get("failed_calls", 0)) for k, v in commands.items()},
            noscript=int(errors.get("errorstat_NOSCRIPT", {}).get("count", 0)),
            scripts=frozenset(
                sha for sha, held in zip(shas, exists[0] if exists else [], strict=True) if held
            ),
            functions=frozenset(_functions(libraries) if functions else ()),
            entries=tuple(
                Entry(
                    int(e[0]),
                    tuple(a if isinstance(a, bytes) else str(a).encode() for a in e[3]),
                    _text(e[4]),
                )
                for e in reversed(log)
            ),
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _functions(libraries: Any) -> Iterator[str]:
    """The function names of a FUNCTION LIST reply (RESP2: each map a flat list of pairs)."""

    def pairs(flat: Any) -> dict[str, Any]:
        return {_text(flat[i]): flat[i + 1] for i in range(0, len(flat) - 1, 2)}

    for library in libraries:
        for function in pairs(library).get("functions", []):
            yield _text(pairs(function)["name"])


@dataclass
class Ran:
    """What ran on a cluster between two reads of it."""

    scripts: set[str] = field(default_factory=set)
    multi: set[str] = field(default_factory=set)
    # Transactions the cluster ran that no MULTI site's commands explain (their commands).
    unmatched: set[str] = field(default_factory=set)


def ran_between(start: NodeRead | None, end: NodeRead, inventory: Inventory) -> Ran:
    """What one node ran, with no error, between two reads (`start` None: the node was not read
    before; it started since, or the record began).

    A node logs a call whether it succeeded or not, and counts the failed calls of each command. So
    a script counts as run when the calls of it that found it loaded outnumber the failed calls of
    their command that may be theirs: the node's failures less the calls that certainly found
    nothing (an EVALSHA of a script not in the cache, an FCALL of a function not loaded); a MULTI
    site when its transactions outnumber the failed EXECs and the failed calls of the commands it
    sends. A call for which what the node held is not known is not counted: the node restarted or its
    log overflowed since `start`, or its functions were replaced and not yet read again."""
    ran = Ran()
    if not end.master or (start is not None and not start.master):
        return ran  # a replica logs the writes of its master's scripts, as transactions
    if start is not None and (start.run_id != end.run_id or len(end.entries) >= SLOWLOG_LEN):
        start = None
    failed = Counter(end.failed)
    noscript = end.noscript
    if start is not None:
        failed.subtract(start.failed)
        noscript -= start.noscript
    found, missed = _script_calls(start, end, inventory, failed, noscript)
    for (script, command), n in found.items():
        if n > failed[command] - missed[command]:
            ran.scripts.add(script)
    transactions, ran.unmatched = _transactions(end.entries, inventory)
    for site, n in transactions.items():
        sent = inventory.sites[site] or frozenset()
        if n > failed["exec"] + sum(failed[c.lower()] for c in sent):
            ran.multi.add(site)
    return ran


def _script_calls(
    start: NodeRead | None, end: NodeRead, inventory: Inventory, failed: Counter[str], noscript: int
) -> tuple[Counter[tuple[str, str]], Counter[str]]:
    """The calls of the code base's scripts in `end`'s log that found their script, by (script,
    command), and the number of calls of each command that certainly found none (`failed`, `noscript`:
    the node's counts of failed calls by command and of NOSCRIPT errors over the log's time).

    What a node holds at a call is known forward from `start` (its cache and functions then, and
    what the log adds to them or flushes), and back from `end` for a call after the log's last
    change to them. Where the two disagree (the node ran what its log does not show), or a call
    found nothing more often than the node counts failures, nothing of that kind is counted."""
    kinds = {"EVALSHA": "script", "EVALSHA_RO": "script", "FCALL": "function", "FCALL_RO": "function"}
    held: dict[str, set[str] | None] = {
        "script": None if start is None else set(start.scripts),
        "function": None if start is None else set(start.functions),
    }
    added: dict[str, set[str]] = {"script": set(), "function": set()}
    last_change = {"script": -1, "function": -1}
    calls: list[tuple[int, str, bool | None]] = []  # (index in the log, kind, found looking forward)
    for i, e in enumerate(end.entries):
        command = e.command
        if e.client == _IN_SCRIPT:
            continue
        if command in ("SCRIPT FLUSH", "FUNCTION FLUSH"):
            kind = "script" if command == "SCRIPT FLUSH" else "function"
            held[kind], added[kind], last_change[kind] = set(), set(), i
        elif command in ("SCRIPT LOAD", "EVAL", "EVAL_RO"):
            added["script"] |= inventory.loaded_by(e.args[2 if command == "SCRIPT LOAD" else 1])
            last_change["script"] = i
        elif command in ("FUNCTION LOAD", "FUNCTION DELETE", "FUNCTION RESTORE"):
            held["function"], added["function"], last_change["function"] = None, set(), i
        elif command in kinds and (kinds[command] == "function" or e.arg(1) in inventory.names):
            kind, name, now = kinds[command], e.arg(1), held[kinds[command]]
            calls.append((i, kind, True if name in added[kind] else None if now is None else name in now))
    final = {"script": end.scripts, "function": end.functions}
    broken: set[str] = set()
    verdicts: list[tuple[Entry, str, bool | None]] = []
    for i, kind, forward in calls:
        e = end.entries[i]
        backward = e.arg(1) in final[kind] if i > last_change[kind] else None
        if None not in (forward, backward) and forward != backward:
            broken.add(kind)
        verdicts.append((e, kind, forward if forward is not None else backward))
    missed = Counter(e.command.lower() for e, _, found in verdicts if found is False)
    if missed["evalsha"] + missed["evalsha_ro"] > noscript:
        broken.add("script")
    broken |= {kinds[c.upper()] for c, n in missed.items() if n > failed[c]}
    found: Counter[tuple[str, str]] = Counter()
    for e, kind, ok in verdicts:
        script = inventory.script_of(e)
        if ok and kind not in broken and script is not None:
            found[(script, e.command.lower())] += 1
    return found, missed


def _transactions(entries: Sequence[Entry], inventory: Inventory) -> tuple[Counter[str], set[str]]:
    """The transactions in a node's log, by the MULTI site whose commands they are, and the commands
    of those no site's explain. A MULTI is logged when it is sent, its commands when EXEC runs them,
    one after another with nothing between but what their scripts run, all on one slot (EXEC itself
    is not logged)."""
    sites: Counter[str] = Counter()
    unmatched: set[str] = set()
    opened: set[str] = set()  # clients whose MULTI's commands are still to come
    run: list[Entry] = []

    def close() -> None:
        if run:
            sent = [e.command for e in run]
            site = inventory.site_of(sent)
            if site is None:
                unmatched.add(" ".join(sent))
            else:
                sites[site] += 1
            run.clear()

    for e in entries:
        if e.client == _IN_SCRIPT:
            continue
        if run and (
            e.client != run[0].client or e.command in ("MULTI", "DISCARD") or e.slot() != run[0].slot()
        ):
            close()
        if e.command == "MULTI":
            opened.add(e.client)
        elif e.command == "DISCARD":
            opened.discard(e.client)
        elif run or e.client in opened:
            opened.discard(e.client)
            run.append(e)
    close()
    return sites, unmatched


class ClusterLog:
    """What a cluster's nodes ran, read from their own logs: each `read` says what ran since the
    previous one. The nodes must log every command (`NODE_SETTINGS`)."""

    def __init__(self, cluster: EmbeddedCluster, inventory: Inventory | None = None) -> None:
        self.cluster = cluster
        self.inventory = inventory or Inventory.of_source()
        self.last: dict[int, NodeRead] = {}  # node's port -> its previous read

    def read(self) -> Ran:
        ran = Ran()
        shas = sorted(self.inventory.bodies)
        for node in self.cluster.nodes:
            if not node.running:
                self.last.pop(node.port, None)
                continue
            client = redis.Redis(
                host="127.0.0.1",
                port=node.port,
                password=self.cluster.password,
                socket_timeout=30,
                protocol=2,
            )
            try:
                now = NodeRead.of(client, shas)
            except (redis.RedisError, OSError):
                self.last.pop(node.port, None)  # read it afresh next time
                continue
            finally:
                client.close()
            seen = ran_between(self.last.get(node.port), now, self.inventory)
            self.last[node.port] = now
            ran.scripts |= seen.scripts
            ran.multi |= seen.multi
            ran.unmatched |= seen.unmatched
        return ran


@dataclass
class Record:
    """What ran on the cluster in the cluster tests of the tier."""

    scripts: set[str] = field(default_factory=set)
    multi: set[str] = field(default_factory=set)
    unmatched: set[str] = field(default_factory=set)

    def add(self, ran: Ran) -> None:
        self.scripts |= ran.scripts
        self.multi |= ran.multi
        self.unmatched |= ran.unmatched


# -- the session's verdict -----------------------------------------------------------------------


def _cluster_test(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    return params.get("redis_backend") == "cluster" or "redis_cluster" in getattr(item, "fixturenames", ())


# The session's record.
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
    # The session's cluster, while it runs; and whether the test running now is counted.
    log: ClusterLog | None = None
    current: bool = False

    def start(self) -> None:
        self.tier = tier_modules()

    def watch(self, cluster: EmbeddedCluster) -> None:
        """Read the session's cluster from now on (tests/conftest.py, once it has started it)."""
        self.log = ClusterLog(cluster)
        self.log.read()  # what ran before is no test's

    def unwatch(self) -> None:
        """The cluster stops (at the end of the session, in the last test's teardown)."""
        self._take()
        self.log = None

    def collected(self, items: Iterable[pytest.Item]) -> None:
        for item in items:
            path = Path(item.path).resolve()
            if path in self.tier:
                self.modules.add(path)
                if _cluster_test(item):
                    self.counted.add(item.nodeid)

    def entering(self, item: pytest.Item) -> None:
        self.current = item.nodeid in self.counted
        if self.current and self.log is not None:
            self.log.read()  # what ran before this test (another test's, or none counted) is not its

    def left(self) -> None:
        self._take()
        self.current = False

    def _take(self) -> None:
        if self.current and self.log is not None:
            self.record.add(self.log.read())

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
            "unmatched": sorted(self.record.unmatched),
        }

    def add(self, state: dict[str, list[str]]) -> None:
        """Add what one worker of a parallel run saw (its `state`) to this run's."""
        self.modules |= {Path(p) for p in state["modules"]}
        self.counted |= set(state["counted"])
        self.ran |= set(state["ran"])
        self.failed |= set(state["failed"])
        self.record.scripts |= set(state["scripts"])
        self.record.multi |= set(state["multi"])
        self.record.unmatched |= set(state.get("unmatched", ()))

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
        inventory = Inventory.of_source()
        for m in missing:
            self.lines.append(f"  {m}: add a cluster-tier test that reaches {m.split(' ', 1)[1]}")
            if (why := _unseeable(m, inventory)) is not None:
                self.lines.append(f"    (the nodes' logs cannot show it: {why})")
        if self.record.unmatched and any(m.startswith("MULTI") for m in missing):
            shown = sorted(self.record.unmatched)[:5]
            self.lines.append(f"  transactions the cluster ran that no MULTI site's commands name: {shown}")
        self.lines.append(
            "  (a test of a module with `pytestmark = pytest.mark.cluster_tier` that takes redis_client, "
            "redis_url or keys runs on the cluster too; tests/cluster_coverage.py says what is recorded; "
            "a `.pipeline()` without transaction= is a MULTI on one Redis but not on a cluster: write "
            "transaction=True or transaction=False)"
        )
        return False


def _unseeable(wanted: str, inventory: Inventory) -> str | None:
    """Why the record can never see `wanted` (`script NAME`, `MULTI SITE`) however it runs."""
    kind, name = wanted.split(" ", 1)
    if kind == "MULTI":
        if inventory.sites.get(name, frozenset()) is None:
            return "the commands its transaction sends are not written as `pipe.<command>(...)` in it"
        return None
    if ":" not in name:
        return None
    shas = [sha for sha, names in inventory.names.items() if name in names]
    if not shas:
        return "its body is not a string constant of its module, so its EVALSHA cannot be told"
    others = [n for n in inventory.names[shas[0]] if n != name]
    if others:
        return f"{', '.join(others)} registers the same body: _WHOSE must tell their calls apart by key"
    return None
