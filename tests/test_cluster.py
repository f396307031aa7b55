"""What runs on a Redis Cluster: every Lua script of the code base, and which cluster-tier suite
reaches it.

A script that touches keys in two slots fails on a cluster (CROSSSLOT) but passes on one Redis, so a
new script must be run by a suite of the cluster tier (`pytest.mark.cluster_tier`, which runs a
module on one Redis and on a 3-master cluster). The inventory below is taken from the source: the
scripts defined through events/scripts.py (loaded as one function library) and every
`register_script(...)` call in the packages. A script missing from ON_CLUSTER and NOT_YET fails
this module, so it cannot come in unseen.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from events import scripts

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PACKAGES = ("api", "dispatch", "events", "pipelines", "projections", "replay", "routeledger", "workers")

# Script -> (the cluster-tier suite that runs it, the code path by which that suite reaches it). The
# suites were found by reading them, not by recording their calls.
ON_CLUSTER: dict[str, tuple[str, str]] = {
    "append_many": ("test_ledger.py", "Ledger.append_many"),
    "submit": ("test_take.py", "TaskQueues.submit"),
    "take": ("test_take.py", "TaskQueues.take"),
    "take_given": ("test_take_given.py", "TaskQueues.take_given"),
    "finish": ("test_take.py", "TaskQueues.finish"),
    "requeue": ("test_take.py", "TaskQueues.requeue"),
    "cancel_queued": ("test_take.py", "TaskQueues.cancel_queued"),
    "result_once": ("test_take.py", "TaskQueues.record_result"),
    "close_run": ("test_take.py", "TaskQueues.close_run"),
    "lease": ("test_liveness.py", "Leases.put"),
    "prune_workers": ("test_ingest.py", "Leases.prune"),
    "backlog": ("test_take_given.py", "the router gate's QueueView.backlogs_and_cursors"),
    "untaken": ("test_liveness.py", "the Reaper's sweep"),
    "hand_back": ("test_liveness.py", "the Reaper's sweep"),
    "hand_back_requeued": ("test_liveness.py", "the Reaper's sweep"),
    "revive": ("test_liveness.py", "the Reaper's sweep"),
    "keep": ("test_one_dispatch.py", "worker processes renewing what they hold"),
    "take_over": ("test_one_dispatch.py", "worker processes taking a run's output log"),
    "projections.ingest:_MOVE": ("test_ingest.py", "Ingest"),
    "projections.store:_APPLY": ("test_projector.py", "the projector's NamespaceWriter.apply"),
    "projections.store:_ADOPT": ("test_projector.py", "Projector.start"),
    "projections.projector:RENEW_LEASE": ("test_projector.py", "Projector.acquire"),
    "projections.projector:RELEASE_LEASE": ("test_projector.py", "Projector.release"),
    "events.singleton:RENEW_LEASE": ("test_projector.py", "the singleton lease"),
    "events.singleton:RELEASE_LEASE": ("test_projector.py", "the singleton lease"),
    "dispatch.quota:_ADMIT": ("test_take_given.py", "Quotas.admit"),
}
# Scripts that no cluster-tier suite reaches yet: each is a known gap, listed so that it is seen.
NOT_YET: dict[str, str] = {
    "release_lease": "a worker's lease given up at a clean stop (Leases.release)",
    "depth": "TaskQueues.depth (status and overview)",
    "dispatch.quota:_SETTLE": "Quotas.settle / settle_all, a completion charged to its key",
}


def defined_scripts() -> set[str]:
    """The scripts events/scripts.py loads as functions, by their plain names."""
    for module in scripts._MODULES:
        importlib.import_module(module)
    # A function's name is its plain name and a hash of its body: `rl_<name>_<hash>`.
    return {name.removeprefix("rl_").rsplit("_", 1)[0] for name in scripts._DEFINED}


def registered_scripts() -> set[str]:
    """Every `register_script(NAME)` in the packages, as `module:NAME`, but the one in
    events/scripts.py that binds the defined scripts."""
    found: set[str] = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "register_script"
                    and module != "events.scripts"
                ):
                    arg = node.args[0]
                    found.add(f"{module}:{arg.id if isinstance(arg, ast.Name) else ast.unparse(arg)}")
    return found


def test_every_lua_script_in_the_code_base_is_listed_with_the_cluster_suite_that_runs_it() -> None:
    inventory = defined_scripts() | registered_scripts()
    listed = set(ON_CLUSTER) | set(NOT_YET)
    assert not set(ON_CLUSTER) & set(NOT_YET)
    assert inventory - listed == set(), "new scripts: add each to ON_CLUSTER (with its suite) or NOT_YET"
    assert listed - inventory == set(), "scripts listed here that the code no longer has"


def test_each_suite_named_for_a_script_runs_on_the_cluster_tier() -> None:
    for script, (suite, _path) in ON_CLUSTER.items():
        text = (TESTS / suite).read_text()
        assert "pytestmark = pytest.mark.cluster_tier" in text, (
            f"{script}: {suite} is not in the cluster tier"
        )
