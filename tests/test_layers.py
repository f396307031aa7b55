"""Dependencies point one way (DESIGN.md section 2), read from the code's own imports.

`events` <- `tasks` and `projections` <- `router` <- `dispatch` <- `workers`, `pipelines` <- `api`
(`tasks` on `events` alone), with `routeledger` (the composition root) above all; `replay` and
`sim` sit beside them: nothing below `routeledger` imports them, except `replay` using the
simulator; `api`, `workers` and `sim` never import one another. `events`, `tasks` and
`projections` load no project module by name (importlib), and no two modules import each other,
directly or round a loop.

What the code breaks today is listed here, each entry to be removed as it is fixed: the test fails
on a new break and on a listed one that is gone, so the lists only shrink.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each layered package's rank: a module may import its own rank or below.
RANK = {
    "events": 0,
    "tasks": 1,
    "projections": 1,
    "router": 2,
    "dispatch": 3,
    "workers": 4,
    "pipelines": 4,
    "api": 5,
    "routeledger": 6,
}
BESIDE = ("replay", "sim")
PACKAGES = (*RANK, *BESIDE)
# Packages that load nothing by name: the bottom of the graph must show all it depends on.
NO_IMPORTLIB = ("events", "tasks", "projections")
# Packages that never import one another.
APART = ("api", "workers", "sim")

# Breaks and import loops the code has today: none left (an entry names one: `importer -> target`,
# or the modules of a loop, sorted).
KNOWN_BREAKS: set[str] = set()
KNOWN_CYCLES: set[tuple[str, ...]] = set()


@dataclass(frozen=True)
class Import:
    """One import statement's target, as `importer -> target` (module names)."""

    importer: str
    target: str
    # Named by `from target import ...` (not `import target`).
    from_import: bool = False

    def __str__(self) -> str:
        return f"{self.importer} -> {self.target}"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the project's packages, by name (a package by its own name)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_in(importer: str, source: str) -> list[Import]:
    """What a module's source imports, anywhere in it (a function's own imports included)."""
    out: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [Import(importer, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(Import(importer, node.module, from_import=True))
            # `from package import module` names a module too.
            out += [Import(importer, f"{node.module}.{alias.name}", from_import=True) for alias in node.names]
    return out


def top(name: str) -> str:
    return name.split(".", 1)[0]


def breaks(imports: Iterable[Import], known_modules: Iterable[str]) -> set[str]:
    """Each import that goes against the layers, as `importer -> target`."""
    names = set(known_modules)
    out: set[str] = set()
    for i in imports:
        src, dst = top(i.importer), top(i.target)
        if i.target in ("importlib", "importlib.import_module") and src in NO_IMPORTLIB:
            # `from importlib import resources` reads package data; a module loaded by name is not.
            if i.target == "importlib.import_module" or not i.from_import:
                out.add(f"{i.importer} -> importlib")
            continue
        if src == dst or i.target not in names:
            continue  # within a package, a library, or `from module import name` of a non-module
        upward = src in RANK and dst in RANK and RANK[dst] > RANK[src]
        # The task store depends only on events (DESIGN.md section 2).
        upward = upward or (src == "tasks" and dst != "events")
        beside = dst in BESIDE and src != "routeledger" and not (src == "replay" and dst == "sim")
        apart = src in APART and dst in APART
        if upward or beside or apart:
            out.add(str(i))
    return out


def cycles(imports: Iterable[Import], known_modules: Iterable[str]) -> set[tuple[str, ...]]:
    """The groups of modules that import each other (round a loop), each sorted."""
    names = set(known_modules)
    graph: dict[str, set[str]] = {name: set() for name in names}
    for i in imports:
        if i.target in names and i.target != i.importer:
            graph[i.importer].add(i.target)
    # Tarjan's strongly connected components, without recursion.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.add(tuple(sorted(group)))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def project_imports() -> tuple[list[Import], set[str]]:
    found = modules()
    imports = [i for name, path in found.items() for i in imports_in(name, path.read_text())]
    return imports, set(found)


def test_the_code_breaks_the_layers_only_where_it_is_known_to() -> None:
    imports, names = project_imports()
    assert breaks(imports, names) == KNOWN_BREAKS


def test_no_modules_import_each_other_but_the_known_loops() -> None:
    imports, names = project_imports()
    assert cycles(imports, names) == KNOWN_CYCLES


def test_a_projections_module_that_imports_dispatch_is_a_break() -> None:
    names = {"projections.folder", "projections.snapshot", "dispatch.submit", "events.event"}
    source = "\n".join(
        [
            "from events.event import Event",
            "from projections.snapshot import Stat",
            "from dispatch.submit import X",
        ]
    )
    assert breaks(imports_in("projections.folder", source), names) == {
        "projections.folder -> dispatch.submit"
    }


def test_importlib_in_the_bottom_layers_and_imports_between_api_workers_and_sim_are_breaks() -> None:
    names = {"events.scripts", "workers.agent", "api.app", "sim.hosts", "replay.fold", "dispatch.submit"}
    for source in ("import importlib\n", "from importlib import import_module\n"):
        assert breaks(imports_in("events.scripts", source), names) == {"events.scripts -> importlib"}
    # Package data read through importlib.resources loads no module.
    assert not breaks(imports_in("events.scripts", "from importlib import resources\n"), names)
    assert breaks(imports_in("api.app", "import workers.agent\nimport sim.hosts\n"), names) == {
        "api.app -> workers.agent",
        "api.app -> sim.hosts",
    }
    assert breaks(imports_in("dispatch.submit", "from replay import fold\n"), names) == {
        "dispatch.submit -> replay.fold"
    }
    # The composition root imports everything; replay's what-if runs the simulator.
    assert not breaks(imports_in("replay.fold", "from sim import hosts\n"), names)


def test_two_modules_that_import_each_other_round_a_loop_are_found() -> None:
    imports = [Import("a.x", "a.y"), Import("a.y", "a.z"), Import("a.z", "a.x"), Import("a.w", "a.x")]
    assert cycles(imports, {"a.x", "a.y", "a.z", "a.w"}) == {("a.x", "a.y", "a.z")}


def test_every_submission_enters_through_the_gateway() -> None:
    # The checks a task is held to (memory, queue depth, the key's limits, a deadline) live in
    # Gateway.submit; the steps below it route and queue. No caller may step past the checks.
    below = {"route_and_submit", "submit_task"}
    callers: set[str] = set()
    for name, path in modules().items():
        if name in ("dispatch.submit", "dispatch.gateway"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if called in below:
                    callers.add(f"{name}: {called}")
    assert callers == set()


def test_the_task_store_importing_anything_but_events_is_a_break() -> None:
    names = {"tasks.payload", "projections.status", "events.event"}
    source = "from events.event import Timings\nfrom projections.status import TaskStatus\n"
    assert breaks(imports_in("tasks.payload", source), names) == {"tasks.payload -> projections.status"}
