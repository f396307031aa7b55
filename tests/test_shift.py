"""Speed that follows a changing machine: the run test on the recent window, the projector's one
notice per shift in the ledger with both values, the same windows from a rebuild, the router and
the preview reading the recent value, the probe of a machine that looks slow, and a shift that
lasts becoming the long run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from dispatch.benchmark import PROBE_AFTER_S, PROBE_PROMPTS, needs_benchmark, request_benchmark
from dispatch.view import fleet_view
from events.event import BenchmarkResult, SpeedShiftDetected
from events.keys import Keys
from events.ledger import Ledger
from projections.projector import Projector
from projections.reader import snapshot
from projections.shift import ADOPT_AFTER_S, ADOPT_SAMPLES, Folded, detect, fold_sample
from projections.snapshot import Snapshot, SpeedRow, Stat, fold, push_recent
from replay.rebuild import build
from replay.verify import diff_rows
from router.choose import RouteQuery
from router.estimate import build_estimator
from router.preview import preview
from sim.backends.hosts import SimHosts
from tasks.lease import live_workers
from tasks.store import TaskStore
from tests.helpers import MODEL_DIGEST, events_of, make_test_fleet, wait_until
from tests.reliability.support import spawn_worker, stop_all
from tests.router_helpers import NOW, QWEN, backlog, estimator, view, worker
from tests.test_projector import D1, T0, completed, fold_all, timings

H = 7 * 86_400.0


def _row(worker_name: str, digest: str, fast: int, slow: list[float], speed: float = 83.0) -> SpeedRow:
    """A speed row of `fast` samples near `speed`, then the samples `slow`, folded as the projector does."""
    row = SpeedRow(worker=worker_name, digest=digest)
    at = NOW - (fast + len(slow)) * 10_000
    for i, x in enumerate([speed * (1 + 0.02 * ((i % 3) - 1)) for i in range(fast)] + slow):
        row.decode_tps = fold(row.decode_tps, x, at + i * 10_000, H)
        row.decode_recent = push_recent(row.decode_recent, x)
    return row


def test_one_slow_sample_is_noise_and_two_in_a_row_are_a_shift_with_their_mean() -> None:
    one = _row("rtx", D1, 30, [5.0])
    two = _row("rtx", D1, 30, [5.0, 5.0])
    assert detect("decode_tps", one.decode_tps, one.decode_recent) is None
    shift = detect("decode_tps", two.decode_tps, two.decode_recent)
    assert shift is not None and shift.slower
    assert shift.recent == pytest.approx(5.0)
    assert shift.samples == 2
    assert shift.long_run == pytest.approx(two.decode_tps.decayed_mean)


def test_a_shift_holds_through_one_fast_sample_and_clears_after_two() -> None:
    row = _row("rtx", D1, 30, [5.0, 5.0, 5.0, 83.0])
    assert detect("decode_tps", row.decode_tps, row.decode_recent) is not None
    back = _row("rtx", D1, 30, [5.0, 5.0, 5.0, 83.0, 82.0])
    assert detect("decode_tps", back.decode_tps, back.decode_recent) is None


def test_a_noisy_machine_needs_a_larger_change_than_a_steady_one() -> None:
    noisy = SpeedRow(worker="w", digest=D1)
    for i in range(40):
        x = 80.0 if i % 2 else 20.0  # spread: the long run's coefficient of variation is 0.6
        noisy.decode_tps = fold(noisy.decode_tps, x, NOW + i, H)
        noisy.decode_recent = push_recent(noisy.decode_recent, x)
    for x in (25.0, 25.0):  # half the mean: a shift on a steady machine, noise on this one
        noisy.decode_tps = fold(noisy.decode_tps, x, NOW + 100, H)
        noisy.decode_recent = push_recent(noisy.decode_recent, x)
    steady = _row("w", D1, 40, [25.0, 25.0], speed=50.0)
    assert detect("decode_tps", noisy.decode_tps, noisy.decode_recent) is None
    assert detect("decode_tps", steady.decode_tps, steady.decode_recent) is not None


async def test_the_projector_appends_one_notice_per_shift_with_both_values_and_a_rebuild_agrees(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    fast = [completed(f"f{i}", "rtx3070ti", at=T0 + i * 1000, timings=timings(tps=83.0)) for i in range(10)]
    slow = [
        completed(f"s{i}", "rtx3070ti", at=T0 + 20_000 + i * 1000, timings=timings(tps=5.0)) for i in range(4)
    ]
    back = [
        completed(f"b{i}", "rtx3070ti", at=T0 + 40_000 + i * 1000, timings=timings(tps=83.0))
        for i in range(2)
    ]
    projector = await fold_all(redis_client, keys, [*fast, *slow, *back])
    notices = [e async for _, e in Ledger(redis_client, keys).read() if isinstance(e, SpeedShiftDetected)]
    decode = [n for n in notices if n.field == "decode_tps"]
    assert [n.cleared for n in decode] == [False, True]
    assert decode[0].worker == "rtx3070ti" and decode[0].digest == D1
    assert decode[0].recent == pytest.approx(5.0)
    assert decode[0].long_run is not None and decode[0].long_run > 40.0
    assert decode[0].samples == 2
    snap = await snapshot(redis_client, keys)
    assert snap.speed["rtx3070ti", D1].decode_recent[-2:] == pytest.approx([83.0, 83.0])
    # The shift's samples stayed out of the long run: the first slow one (not yet a shift) and the
    # second fast one (the shift over) joined it, the rest only the window.
    assert snap.speed["rtx3070ti", D1].decode_tps.n == len(fast) + 2
    assert snap.speed["rtx3070ti", D1].sampled_at == back[-1].at
    # Folding the notices changes nothing: a rebuild of the whole ledger gives the same tables.
    assert projector.tables is not None
    rebuilt, _ = await build(redis_client, keys)
    assert diff_rows("speed", projector.tables.speed, rebuilt.speed) == []
    assert rebuilt.speed["rtx3070ti", D1].decode_recent == pytest.approx(
        snap.speed["rtx3070ti", D1].decode_recent
    )


async def test_the_projector_notes_an_adopted_shift_once_and_a_rebuild_folds_the_same_long_run(
    redis_client: aioredis.Redis, keys: Keys
) -> None:
    fast = [completed(f"f{i}", "rtx3070ti", at=T0 + i * 1000, timings=timings(tps=83.0)) for i in range(10)]
    step = 2 * 3_600_000
    slow = [
        completed(f"s{i}", "rtx3070ti", at=T0 + 60_000 + i * step, timings=timings(tps=30.0))
        for i in range(20)
    ]
    projector = await fold_all(redis_client, keys, [*fast, *slow])
    notices = [e async for _, e in Ledger(redis_client, keys).read() if isinstance(e, SpeedShiftDetected)]
    decode = [n for n in notices if n.field == "decode_tps"]
    assert [(n.cleared, n.adopted) for n in decode] == [(False, False), (False, True)]
    adopted = decode[1]
    assert adopted.long_run is not None and adopted.long_run > 75.0
    assert adopted.recent == pytest.approx(30.0)
    row = (await snapshot(redis_client, keys)).speed["rtx3070ti", D1]
    assert row.decode_tps.decayed_mean == pytest.approx(30.0, rel=0.01)
    assert detect("decode_tps", row.decode_tps, row.decode_recent) is None
    assert projector.tables is not None
    rebuilt, _ = await build(redis_client, keys)
    assert diff_rows("speed", projector.tables.speed, rebuilt.speed) == []


def test_the_router_and_the_preview_read_the_recent_value_of_a_shifted_field() -> None:
    laptop = _row("macbookair", QWEN, 30, [], speed=11.4)
    gpu = _row("rtx3070ti", QWEN, 30, [5.0, 5.0])
    snap = Snapshot(speed={("macbookair", QWEN): laptop, ("rtx3070ti", QWEN): gpu}, taken_at=NOW)
    est = estimator(snap)
    sp = est.speed("rtx3070ti", QWEN).decode_tps
    assert sp.value == pytest.approx(5.0)
    assert sp.source.startswith("recent n=2 (shift from long-run")
    fv = view([worker("macbookair", {QWEN}), worker("rtx3070ti", {QWEN})], {QWEN: backlog(QWEN, 1)})
    data = json.loads(json.dumps(preview(RouteQuery(model="qwen3:8b"), {"qwen3:8b": QWEN}, fv, est, NOW)))
    first = data["candidates"][0]
    assert first["worker"] == "macbookair"
    gpu_fields = next(c for c in data["candidates"] if c["worker"] == "rtx3070ti")["fields"]
    assert gpu_fields["decode_tps"]["source"].startswith("recent")


def test_a_machine_that_looks_slow_is_probed_only_after_a_quiet_while() -> None:
    row = _row("rtx3070ti", QWEN, 30, [5.0, 5.0])
    snap = Snapshot(speed={("rtx3070ti", QWEN): row})
    newest = row.decode_tps.updated_at
    assert newest is not None

    def need(after_s: float) -> tuple[int, str] | None:
        return needs_benchmark(
            snap,
            "rtx3070ti",
            QWEN,
            newest + int(after_s * 1000),
            min_samples=3,
            stale_after_s=H,
            probe_after_s=PROBE_AFTER_S,
        )

    assert need(PROBE_AFTER_S / 2) is None
    probe = need(PROBE_AFTER_S)
    assert probe is not None and probe[0] == PROBE_PROMPTS and probe[1].startswith("probe:")
    steady = Snapshot(speed={("rtx3070ti", QWEN): _row("rtx3070ti", QWEN, 30, [])})
    assert (
        needs_benchmark(
            steady,
            "rtx3070ti",
            QWEN,
            NOW + 3_600_000,
            min_samples=3,
            stale_after_s=H,
            probe_after_s=PROBE_AFTER_S,
        )
        is None
    )


def test_a_stat_never_measured_has_no_shift() -> None:
    assert detect("decode_tps", Stat(), [5.0, 5.0]) is None


def _fold_all(folded: Folded, xs: list[float], at: int, step_ms: int) -> tuple[Folded, list[Folded]]:
    """`folded` after the samples `xs`, one every `step_ms` from `at`, and the state after each."""
    states = []
    for i, x in enumerate(xs):
        folded = fold_sample(
            "decode_tps", folded.stat, folded.window, x, at + i * step_ms, H, folded.held, folded.held_since
        )
        states.append(folded)
    return folded, states


EMPTY = Folded(stat=Stat(), window=[], held=0, held_since=None, shift=None)


def test_a_long_slowdown_leaves_the_long_run_where_it_was_and_two_fast_samples_clear_it() -> None:
    # A young row (a few samples of the machine's usual speed), then an evening of slow samples,
    # probes and all, 10 s apart: 2,000 s, far short of a shift that lasts.
    young, _ = _fold_all(EMPTY, [60.0] * 8, NOW, 10_000)
    slow, states = _fold_all(young, [6.0] * 200, NOW + 80_000, 10_000)
    before = slow.stat
    assert all(s.shift is not None and s.shift.slower and s.adopted is None for s in states[1:])
    assert before.n == 9 and before.decayed_mean is not None and before.decayed_mean > 50.0
    at = NOW + 80_000 + 200 * 10_000
    first, _ = _fold_all(slow, [60.0], at, 10_000)
    assert first.shift is not None and first.stat == before  # one fast sample: still the shift, held out
    second, _ = _fold_all(first, [59.0], at + 10_000, 10_000)
    assert second.shift is None and second.stat.n == before.n + 1 and second.held == 0


def test_a_shift_that_lasts_becomes_the_long_run_with_one_adopted_notice() -> None:
    history, _ = _fold_all(EMPTY, [83.0 * (1 + 0.02 * ((i % 3) - 1)) for i in range(200)], NOW, 60_000)
    # A permanent change: 20 samples at the new speed, two hours apart (a machine probed, or used).
    # The first joins the long run (one odd sample is noise); the next ADOPT_SAMPLES are held out
    # and span (ADOPT_SAMPLES - 1) steps, past ADOPT_AFTER_S.
    step = 2 * 3_600_000
    assert (ADOPT_SAMPLES - 1) * step >= ADOPT_AFTER_S * 1000
    after, states = _fold_all(history, [30.0] * 20, NOW + 200 * 60_000, step)
    adopted = [s for s in states if s.adopted is not None]
    assert len(adopted) == 1
    assert adopted[0].adopted is not None and adopted[0].adopted.long_run > 75.0
    assert adopted[0].adopted.recent == pytest.approx(30.0)
    assert states.index(adopted[0]) == ADOPT_SAMPLES
    assert after.shift is None and after.held == 0
    assert after.stat.decayed_mean == pytest.approx(30.0)


def test_a_slowdown_of_fewer_samples_or_less_time_than_adoption_asks_returns_to_the_old_long_run() -> None:
    history, _ = _fold_all(EMPTY, [83.0] * 50, NOW, 60_000)
    old = history.stat
    start = NOW + 50 * 60_000
    # One held out fewer than ADOPT_SAMPLES, however far apart; then many within a short evening.
    # The first slow sample joins the long run (alone, it is noise); the rest are held out.
    for count, step in ((ADOPT_SAMPLES, 3_600_000), (60, 120_000)):
        slow, states = _fold_all(history, [5.0] * count, start, step)
        assert all(s.adopted is None for s in states)
        assert slow.held == count - 1 and slow.stat.n == old.n + 1
        back, _ = _fold_all(slow, [83.0, 83.0], start + count * step, step)
        assert back.shift is None and back.held == 0 and back.stat.n == old.n + 2
        assert back.stat.decayed_mean == pytest.approx(83.0, rel=0.03)


def test_the_probe_waits_from_the_newest_sample_even_one_kept_out_of_the_long_run() -> None:
    row = _row("rtx3070ti", QWEN, 30, [5.0, 5.0])
    newest = row.decode_tps.updated_at
    assert newest is not None
    row.sampled_at = newest + 100_000  # a held-out sample, 100 s after the long run's newest
    snap = Snapshot(speed={("rtx3070ti", QWEN): row})
    at = newest + int(PROBE_AFTER_S * 1000)
    kwargs = {"min_samples": 3, "stale_after_s": H, "probe_after_s": PROBE_AFTER_S}
    assert needs_benchmark(snap, "rtx3070ti", QWEN, at, **kwargs) is None
    assert needs_benchmark(snap, "rtx3070ti", QWEN, at + 100_000, **kwargs) is not None


async def test_a_sim_host_slowed_at_run_time_under_a_worker_process_is_noticed_in_the_ledger_and_the_preview(
    redis_url: str, redis_client: aioredis.Redis, ledger: Ledger, tmp_path: Path
) -> None:
    """The whole path: a `routeledger worker` process on a sim host, the projector folding as it
    runs, the host's speed changed through its control API, and the preview the API serves."""
    keys = Keys()
    queues = TaskStore(redis_client, keys, ledger)
    stop = asyncio.Event()
    folding = asyncio.create_task(Projector(redis_client, keys).run(stop))

    async def results(n: int) -> bool:
        return len(await events_of(ledger, BenchmarkResult)) >= n

    async def noticed() -> bool:
        return bool(await events_of(ledger, SpeedShiftDetected))

    procs = []
    try:
        async with SimHosts(make_test_fleet(), time_scale=0.0, seed=3) as sim:
            procs.append(spawn_worker(redis_url, sim.url("a"), "a", tmp_path / "worker.log"))
            await wait_until(lambda: _live(redis_client, keys, "a"), timeout=20)
            await request_benchmark(queues, worker="a", model="m", digest=MODEL_DIGEST, count=8)
            await wait_until(lambda: results(8), timeout=20)
            async with httpx.AsyncClient(base_url=sim.url("a")) as http:
                assert (await http.post("/sim/speed", json={"factor": 0.06})).status_code == 200
            await request_benchmark(queues, worker="a", model="m", digest=MODEL_DIGEST, count=2)
            await wait_until(lambda: results(10), timeout=20)
            await wait_until(noticed, timeout=20)
            snap = await snapshot(redis_client, keys)
            leases = await live_workers(redis_client, keys)
    finally:
        stop_all(procs)
        stop.set()
        await asyncio.wait_for(folding, 10)
    notice = next(e for e in await events_of(ledger, SpeedShiftDetected) if e.field == "decode_tps")
    assert notice.worker == "a" and notice.digest == MODEL_DIGEST
    assert not notice.cleared and not notice.adopted
    assert notice.long_run is not None and notice.recent is not None
    assert notice.recent == pytest.approx(0.06 * notice.long_run, rel=0.2)
    now = snap.taken_at
    est = build_estimator(snap, now)
    fv = fleet_view(leases, {}, snap, now)
    data = json.loads(json.dumps(preview(RouteQuery(model="m"), {"m": MODEL_DIGEST}, fv, est, now)))
    fields = next(c for c in data["candidates"] if c["worker"] == "a")["fields"]
    assert fields["decode_tps"]["source"].startswith("recent n=2")
    assert fields["decode_tps"]["value"] == pytest.approx(notice.recent)


async def _live(redis: aioredis.Redis, keys: Keys, name: str) -> bool:
    return name in await live_workers(redis, keys)
