"""What runs on a Redis Cluster: a failover of the ledger's master under a working fleet, and every
Lua script of the code base with the cluster-tier suite that reaches it.

A script that touches keys in two slots fails on a cluster (CROSSSLOT) but passes on one Redis, so a
new script must be run by a suite of the cluster tier (`pytest.mark.cluster_tier`, which runs a
module on one Redis and on a 3-master cluster). The inventory below is taken from the source: the
scripts defined through events/scripts.py (loaded as one function library) and every
`register_script(...)` call in the packages. A script missing from ON_CLUSTER and NOT_YET fails
this module, so it cannot come in unseen.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis as syncredis
from redis.exceptions import RedisError

from dispatch.errors import ModelNotServedError, TaskLostError, TaskTimeoutError
from dispatch.gateway import Gateway
from dispatch.payload import Message
from dispatch.queues import _DEPTH_DEF, TaskQueues, parse_entry
from dispatch.submit import Submitted, TaskRequest, submit_task
from events import scripts
from events.codec import as_str
from events.connection import redis_client
from events.event import TaskCompleted, TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from routeledger.embedded import EmbeddedCluster, EmbeddedRedis
from sim.backends.hosts import SimHosts
from tests.helpers import events_of, fast_config, make_test_fleet, running_agent, wait_until
from tests.test_api_support import ghost_worker

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
    "projections.projector:_FIELD_OF": ("test_projector.py", "Projector._charge"),
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


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=0.0, seed=3) as sim:
        yield sim


async def _submit(queues: TaskQueues) -> Submitted:
    req = TaskRequest(model="m", messages=[Message(role="user", content="hi")])
    return await submit_task(queues, req)


async def _completions(ledger: Ledger) -> Counter[str]:
    return Counter(e.task_id for e in await events_of(ledger, TaskCompleted) if not e.duplicate)


async def _replicas_synced(cluster: EmbeddedCluster) -> bool:
    for node in cluster.nodes[len(cluster.masters) :]:
        client = syncredis.Redis(port=node.port, password=cluster.password)
        try:
            info = await asyncio.to_thread(client.info, "replication")
        finally:
            client.close()
        if info.get("master_link_status") != "up":
            return False
    return True


async def test_the_fleet_carries_on_through_a_failover_of_the_ledgers_master_and_counts_what_it_lost(
    tmp_path: Path, hosts: SimHosts
) -> None:
    # About 15 s: a 6-node cluster forms, fails over (node timeout 1 s) and runs 40 tasks.
    cluster = EmbeddedCluster(tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=1000)
    cluster.start()
    # A replica that has not synced once is not promoted: wait for every replica's first sync.
    await wait_until(lambda: _replicas_synced(cluster), timeout=20)
    redis = redis_client(cluster.url, socket_timeout=2)
    try:
        keys = Keys.for_client(redis)
        ledger = Ledger(redis, keys)
        queues = TaskQueues(redis, keys, ledger)
        acked: dict[str, str] = {}  # task id -> its queue
        refused = 0
        async with running_agent(redis, hosts.url("a"), fast_config("a", slots=2, lease_ms=5000)):
            for _ in range(15):
                sub = await _submit(queues)
                acked[sub.task.task_id] = sub.queue
                await asyncio.sleep(0.02)
            core: Any = redis.get_node_from_key(keys.events)  # type: ignore[attr-defined]
            victim = next(n for n in cluster.masters if n.port == core.port)
            victim.kill()
            killed = time.monotonic()
            window: float | None = None
            while window is None and time.monotonic() - killed < 20:
                # Submitting through the failover: a refusal is a task never acknowledged.
                try:
                    sub = await _submit(queues)
                    acked[sub.task.task_id] = sub.queue
                    window = time.monotonic() - killed
                except (RedisError, ModelNotServedError):
                    refused += 1
                    await asyncio.sleep(0.05)
            assert window is not None, "no task was accepted on the promoted master"
            await asyncio.to_thread(cluster.wait_ok)
            after = []
            for _ in range(15):
                sub = await _submit(queues)
                acked[sub.task.task_id] = sub.queue
                after.append(sub.task.task_id)

            async def after_done() -> bool:
                done = await _completions(ledger)
                return all(t in done for t in after)

            await wait_until(after_done, timeout=20)
        done = await _completions(ledger)
        queued: set[str] = set()
        for queue in set(acked.values()):
            entries: Any = await redis.xrange(queue)
            for entry_id, fields in entries:
                queued.add(parse_entry(queue, as_str(entry_id), fields).task.task_id)
        lost = sorted(t for t in acked if t not in done and t not in queued)
        twice = sorted(t for t, n in done.items() if n > 1)
        print(
            json.dumps(
                {
                    "failover_window_s_to_first_accepted_task": round(window, 3),
                    "submitted_and_acknowledged": len(acked),
                    "refused_during_failover": refused,
                    "completed": sum(1 for t in acked if t in done),
                    "still_queued": len(queued & set(acked)),
                    "lost": len(lost),
                    "completed_twice": len(twice),
                }
            )
        )
        # Replication is asynchronous: what the old master acknowledged last may be gone, so loss
        # is counted (above), not ruled out. What must hold: nothing is counted twice, and the fleet
        # serves every task submitted after the failover without a restart.
        assert twice == []
        assert all(done[t] == 1 for t in after)
    finally:
        await redis.aclose()
        cluster.stop()


async def test_a_client_that_reaches_a_failed_masters_slots_only_through_pipelines_follows_its_replica(
    tmp_path: Path,
) -> None:
    # On a cluster, a multi-key EXISTS or DEL is a pipeline, as are the gateway's and the
    # projector's batched reads; redis-py re-learnt the layout only before a retry, which
    # routeledger's clients never make, so such a client kept sending them to the dead master.
    cluster = EmbeddedCluster(tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=1000)
    cluster.start()
    await wait_until(lambda: _replicas_synced(cluster), timeout=20)
    redis = redis_client(cluster.url, socket_timeout=2)
    try:
        keys = ["{p}a", "{p}b"]
        await redis.set(keys[0], "1")
        node: Any = redis.get_node_from_key(keys[0])  # type: ignore[attr-defined]
        next(n for n in cluster.masters if n.port == node.port).kill()
        killed = time.monotonic()
        answered: int | None = None
        while answered is None and time.monotonic() - killed < 20:
            try:
                answered = await redis.exists(*keys)
            except RedisError:
                await asyncio.sleep(0.1)
        assert answered == 1, "the client never reached the promoted replica"
        print(json.dumps({"pipelined_reads_follow_failover_after_s": round(time.monotonic() - killed, 2)}))
    finally:
        await redis.aclose()
        cluster.stop()


def _replica_of(cluster: EmbeddedCluster, master_port: int) -> EmbeddedRedis:
    """The replica that follows the master on `master_port`, once it has everything the master has."""
    for node in cluster.nodes[len(cluster.masters) :]:
        client = syncredis.Redis(port=node.port, password=cluster.password)
        try:
            role: Any = client.role()
            if int(role[2]) != master_port:
                continue
            master = syncredis.Redis(port=master_port, password=cluster.password)
            try:
                deadline = time.monotonic() + 10
                wanted = int(master.info("replication")["master_repl_offset"])
                while int(cast(Any, client.role())[4]) < wanted:
                    assert time.monotonic() < deadline, "the replica did not catch up with its master"
                    time.sleep(0.02)
            finally:
                master.close()
            return node
        finally:
            client.close()
    raise AssertionError(f"no replica follows the master on port {master_port}")


async def test_a_task_whose_writes_died_with_its_master_is_reported_lost_to_the_client_waiting_on_it(
    tmp_path: Path,
) -> None:
    # The failover window made to happen: the master acknowledges a task that no replica received
    # (its replica is frozen and its replication link cut), then dies; the replica is promoted.
    cluster = EmbeddedCluster(tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=1000)
    cluster.start()
    await wait_until(lambda: _replicas_synced(cluster), timeout=20)
    redis = redis_client(cluster.url, socket_timeout=2)
    try:
        keys = Keys.for_client(redis)
        ledger = Ledger(redis, keys)
        await ghost_worker(redis)  # a lease for model m: its tasks are accepted and wait in its queue
        gateway = Gateway(redis, keys)
        seen: list[str] = []
        gateway.on_lost = seen.append

        def request(text: str) -> TaskRequest:
            return TaskRequest(model="m", messages=[Message(role="user", content=text)])

        kept = await gateway.submit(request("kept"))
        core: Any = redis.get_node_from_key(keys.events)  # type: ignore[attr-defined]
        victim = next(n for n in cluster.masters if n.port == core.port)
        replica = await asyncio.to_thread(_replica_of, cluster, victim.port)
        assert replica.process is not None
        os.kill(replica.process.pid, signal.SIGSTOP)
        try:
            master = syncredis.Redis(port=victim.port, password=cluster.password)
            try:
                master.client_kill_filter(_type="replica")
            finally:
                master.close()
            lost = await gateway.submit(request("lost"))
            victim.kill()
            killed = time.monotonic()
        finally:
            os.kill(replica.process.pid, signal.SIGCONT)
        waiting_lost = asyncio.create_task(gateway.wait(lost.task_id, timeout_s=30))
        waiting_kept = asyncio.create_task(gateway.wait(kept.task_id, timeout_s=6))
        with pytest.raises(TaskLostError):
            await asyncio.wait_for(waiting_lost, 25)
        told_after = time.monotonic() - killed
        # The task acknowledged before the window is still there: waited for, never called lost.
        with pytest.raises(TaskTimeoutError):
            await asyncio.wait_for(waiting_kept, 25)
        submitted = {e.task_id for e in await events_of(ledger, TaskSubmitted)}
        print(json.dumps({"lost_task_reported_to_its_client_after_kill_s": round(told_after, 2)}))
        assert seen == [lost.task_id] and gateway.lost == 1
        assert kept.task_id in submitted and lost.task_id not in submitted
    finally:
        await redis.aclose()
        cluster.stop()


async def test_a_script_queued_on_a_cluster_pipeline_is_sent_with_the_commands_around_it(
    redis_cluster: EmbeddedCluster,
) -> None:
    redis_cluster.flush()
    redis = redis_client(redis_cluster.url)
    try:
        keys = Keys.for_client(redis)
        depth = _DEPTH_DEF.bind(redis)
        queue = [keys.queue("d" * 64), keys.bands("d" * 64)]
        await redis.xadd(queue[0], {"x": "1"})
        assert await depth(keys=queue) == 1  # the first call learns that the server has functions
        pipe = redis.pipeline(transaction=False)
        pipe.set(keys.task("t1"), "1")
        await depth(keys=queue, client=pipe)
        pipe.exists(keys.task("t1"))
        assert await pipe.execute() == [True, 1, 1]
    finally:
        await redis.aclose()
