"""The vectorised fold: the projector's rules (projections/folder.py) as polars expressions.

Every statistic is one group_by: n, sum and sum of squares, and the decayed sums referenced to
the newest sample of the group, T = max(t): sum(x * 2 ** (-(T - t) / H)). That is what folding
the samples one at a time with `projections.snapshot.fold` gives, in any order.

Task rows are one per task ever, so they stay a frame (`TASK_FIELDS` as columns) until they are
written: a rebuild encodes them straight from its columns (`encoded_task_rows`), a batch at a time,
and leaves out, before any row is built, the tasks whose day shard is already past retention.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import repeat
from typing import Any, Final

import msgspec
import polars as pl

from events.event import WorkerHeartbeat, WorkerOnline
from projections.folder import (
    EMBED,
    MAX_DECODE_TPS,
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TPS,
    MAX_SAMPLE_BYTES_PER_TOKEN,
    MIN_DECODE_TOKENS,
    MIN_PROMPT_TOKENS,
    MIN_SAMPLE_BYTES_PER_TOKEN,
    MIN_UNKNOWN_LOAD_S,
    NS_PER_S,
    resources_dict,
)
from projections.shift import HELD, MIN_LONG_RUN, MIN_RATIO, WINDOWS, Folded, fold_sample
from projections.snapshot import (
    CLOCK_WINDOW,
    RECENT_SAMPLES,
    DemandRow,
    FleetRow,
    LengthRow,
    PipelineRow,
    QualityRow,
    SpeedRow,
    Stamped,
    Stat,
    TaskRow,
    clock_skew_ms,
)
from projections.status import TERMINAL_RANK
from projections.store import DAY_MS, decode_task, oldest_live_day
from projections.tables import DEFAULT_TASK_RETENTION_DAYS, Tables
from replay.frames import HEARTBEAT, MENTIONS, ONLINE, Frames, Report

_SPEED_COLS: Final = [
    "seq",
    "at",
    "ms",
    "worker",
    "digest",
    "prompt_eval_count",
    "prompt_eval_duration",
    "prompt_eval_cached_count",
    "eval_count",
    "eval_duration",
    "load_duration",
    "ttft_ms",
    "in_flight",
    "cold",
    "counted",
    "kind",
]
_STAT_COLS: Final = ["n", "sum", "sumsq", "dn", "dsum", "dsumsq", "updated_at"]
# The task frame's columns: TaskRow's fields, in its order, so that a row encoded from its columns
# as a map is byte for byte the encoded TaskRow.
TASK_FIELDS: Final[tuple[str, ...]] = TaskRow.__struct_fields__
# Task rows encoded per batch: bounds the Python objects alive at once.
ENCODE_BATCH: Final = 50_000
_encode: Final = msgspec.msgpack.Encoder().encode


def _rate(count: str, duration: str, cap: float) -> pl.Expr:
    return _rate_of(pl.col(count), pl.col(duration), cap)


def _rate_of(c: pl.Expr, d: pl.Expr, cap: float) -> pl.Expr:
    value = pl.when((c > 0) & (d > 0)).then(c / (d / NS_PER_S))
    return pl.when(value <= cap).then(value)


def ledger_ms_expr() -> pl.Expr:
    """A sample's time bounded by its entry's stream-id ms (the ledger's clock), as
    projections.folder takes it (Folder._ledger_ms)."""
    return pl.when(pl.col("ms") > 0).then(pl.min_horizontal("at", "ms")).otherwise(pl.col("at"))


def decode_tps_expr() -> pl.Expr:
    """Decode tokens per second, null when unknown or absurd (as projections.folder.decode_tps)."""
    return _rate("eval_count", "eval_duration", MAX_DECODE_TPS)


def _stat_exprs(value: str, half_life_s: float, prefix: str = "") -> list[pl.Expr]:
    """The aggregations of `stats` for column `value`, over its non-null values only."""
    valid = pl.col(value).is_not_null()
    x, t = pl.col(value).filter(valid), pl.col("at").filter(valid)
    w = pl.lit(2.0).pow(-(t.max() - t) / 1000.0 / half_life_s)
    return [
        valid.sum().cast(pl.Int64).alias(f"{prefix}n"),
        x.sum().alias(f"{prefix}sum"),
        (x * x).sum().alias(f"{prefix}sumsq"),
        w.sum().alias(f"{prefix}dn"),
        (w * x).sum().alias(f"{prefix}dsum"),
        (w * x * x).sum().alias(f"{prefix}dsumsq"),
        t.max().alias(f"{prefix}updated_at"),
    ]


def stats(
    frame: pl.DataFrame | pl.LazyFrame, keys: list[str], value: str, half_life_s: float
) -> pl.DataFrame:
    """The sufficient statistics of column `value` per group of `keys` (null values left out)."""
    return (
        frame.lazy()
        .filter(pl.col(value).is_not_null())
        .group_by(keys)
        .agg(_stat_exprs(value, half_life_s))
        .collect()
    )


def _stat_rows(frame: pl.DataFrame, keys: list[str]) -> dict[Any, Stat]:
    out: dict[Any, Stat] = {}
    for row in frame.select(*keys, *_STAT_COLS).iter_rows():
        key = row[0] if len(keys) == 1 else tuple(row[: len(keys)])
        n, s, ss, dn, ds, dss, upd = row[len(keys) :]
        out[key] = Stat(n=n, sum=s, sumsq=ss, dn=dn, dsum=ds, dsumsq=dss, updated_at=upd)
    return out


def counted_completions(frames: Frames) -> pl.LazyFrame:
    """The completion that counts for each task: the first one not flagged as a duplicate.

    Lazy, over the completed frame: each use collects only its own columns, so that no copy of
    every completion is made."""
    fresh = ~pl.col("duplicate")
    first = pl.when(fresh).then(pl.col("task_id")).is_first_distinct()
    return frames.frame("completed").lazy().filter(fresh & first)


def oldest_live_ms(retention_days: int, now_ms: int) -> int:
    """The first stream-id ms whose day shard is still within retention at ledger time `now_ms`."""
    return oldest_live_day(retention_days, now_ms) * DAY_MS


def fold_frames(
    frames: Frames,
    half_life_s: float,
    demand_half_life_s: float,
    task_retention_days: int = DEFAULT_TASK_RETENTION_DAYS,
    *,
    now_ms: int | None = None,
) -> Tables:
    """Every table from the collected frames: with `now_ms`, the task rows and benchmark marks of
    day shards past retention then are left out (what a rebuild does not write); without it, every
    one, whatever its day shard."""
    tables, tasks = fold_tables(frames, half_life_s, demand_half_life_s, task_retention_days, now_ms=now_ms)
    tables.tasks = task_rows(tasks)
    return tables


def fold_tables(
    frames: Frames,
    half_life_s: float,
    demand_half_life_s: float,
    task_retention_days: int = DEFAULT_TASK_RETENTION_DAYS,
    *,
    now_ms: int | None = None,
) -> tuple[Tables, pl.DataFrame]:
    """As `fold_frames`, but the task rows stay a frame (columns `TASK_FIELDS`, one row per task)
    beside the tables, whose `tasks` is left empty."""
    frames.flush()
    tables = Tables(
        half_life_s=half_life_s,
        demand_half_life_s=demand_half_life_s,
        task_retention_days=task_retention_days,
    )
    cutoff_ms = None if now_ms is None else oldest_live_ms(task_retention_days, now_ms)
    counted = counted_completions(frames)
    bench = frames.frame("bench").unique(["bench_id", "task_id"], keep="first", maintain_order=True)
    marks = bench if cutoff_ms is None else bench.filter(pl.col("ms") >= cutoff_ms)
    # Each mark with its first entry's stream ms, which names its day shard.
    tables.benched = {(b, t): ms for b, t, ms in marks.select("bench_id", "task_id", "ms").iter_rows()}
    # A benchmark run is recorded twice: its BenchmarkResult is the speed sample, and its
    # TaskCompleted only keeps the task's history. Benchmark answers are short by design, so they
    # say nothing of output length either.
    ordinary = counted.filter(pl.col("bench_id").is_null())
    # A task submitted with runtime options (its first submission says) is no speed sample: from
    # that submission on, as the live fold knows it (a completion the ledger holds before it counts).
    first_sub = frames.frame("submitted").lazy().filter(pl.col("task_id").is_first_distinct())
    marked = first_sub.filter(pl.col("runtime_options")).select("task_id", pl.col("seq").alias("marked_at"))
    sampled = (
        ordinary.join(marked, on="task_id", how="left", maintain_order="left")
        .filter(pl.col("marked_at").is_null() | (pl.col("marked_at") > pl.col("seq")))
        .drop("marked_at")
    )
    _speed(tables, sampled, bench)
    _length(tables, ordinary)
    _quality(tables, frames.frame("quality"))
    _demand(tables, frames.frame("submitted"))
    _fleet(tables, frames)
    tables.pipelines = pipeline_rows(frames, cutoff_ms)
    return tables, task_frame(frames, counted, cutoff_ms)


_SPEED_FIELDS: Final = ("decode_tps", "prompt_tps", "load_s", "ttft_s", "in_flight", "embed_tps")


def _speed(tables: Tables, counted: pl.LazyFrame, bench: pl.DataFrame) -> None:
    raw = pl.concat([counted.select(_SPEED_COLS), bench.lazy().select(_SPEED_COLS)])
    # An embedding's prompt rate is its embedding rate, and it has no decode, prompt or TTFT
    # sample (Folder._speed_sample).
    embed = pl.col("kind").fill_null("") == EMBED
    # Only runs long enough to be measurements (projections.folder.decode_sample, prompt_sample_tps).
    decode = pl.when(~embed & (pl.col("eval_count") >= MIN_DECODE_TOKENS)).then(decode_tps_expr())
    # The evaluated tokens only (Timings.evaluated_prompt_tokens): cached ones took no time.
    cached = pl.min_horizontal(
        pl.col("prompt_eval_cached_count").fill_null(0).clip(lower_bound=0), pl.col("prompt_eval_count")
    )
    evaluated = pl.col("prompt_eval_count") - cached
    prompt = _rate_of(evaluated, pl.col("prompt_eval_duration"), MAX_PROMPT_TPS)
    ttft = pl.when(~embed).then(pl.col("ttft_ms"))
    ld = pl.col("load_duration")
    cold = pl.col("cold")
    # Only a cold run is a load sample; one that does not say, from MIN_UNKNOWN_LOAD_S (cold_load_s).
    real_load = (cold.is_null() & (ld / NS_PER_S >= MIN_UNKNOWN_LOAD_S)) | cold.fill_null(False)
    samples = raw.select(
        "seq",
        ledger_ms_expr().alias("at"),
        "worker",
        "digest",
        decode.alias("decode_tps"),
        pl.when(~embed & (evaluated >= MIN_PROMPT_TOKENS)).then(prompt).alias("prompt_tps"),
        pl.when(embed).then(prompt).alias("embed_tps"),
        pl.when((ld > 0) & real_load).then(ld / NS_PER_S).alias("load_s"),
        pl.when(ttft.is_finite() & (ttft > 0)).then(ttft / 1000.0).alias("ttft_s"),
        pl.when(decode.is_not_null() & (pl.col("in_flight") >= 0))
        .then(pl.col("in_flight").cast(pl.Float64))
        .alias("in_flight"),
        (decode.is_not_null() & pl.col("counted").is_not_null()).alias("counted"),
    )
    keys = ["worker", "digest"]
    # Every field's statistics in one group_by over the samples, never materialised: each field
    # over its own non-null samples, as `stats` takes them.
    folded = samples.group_by(keys).agg(
        *[e for field in _SPEED_FIELDS for e in _stat_exprs(field, tables.half_life_s, prefix=f"{field}.")],
        pl.col("counted").sum().cast(pl.Int64).alias("counted_n"),
    )
    frame = folded.collect()
    for field in _SPEED_FIELDS:
        part = frame.select(*keys, *[pl.col(f"{field}.{c}").alias(c) for c in _STAT_COLS]).filter(
            pl.col("n") > 0
        )
        for key, stat in _stat_rows(part, keys).items():
            row = tables.speed.get(key)
            if row is None:
                row = tables.speed[key] = SpeedRow(worker=key[0], digest=key[1])
            setattr(row, field, stat)
    for worker, digest, counted_n in frame.select(*keys, "counted_n").iter_rows():
        row = tables.speed.get((worker, digest))
        if row is not None:
            row.counted_n = counted_n
    # The recent windows (projections.shift): each field's newest samples in ledger order, as the
    # live fold keeps them one at a time.
    ordered = samples.sort("seq")
    for field, window in WINDOWS.items():
        tails = (
            ordered.filter(pl.col(field).is_not_null())
            .group_by(keys, maintain_order=True)
            .agg(pl.col(field).tail(RECENT_SAMPLES))
            .collect()
        )
        for worker, digest, values in tails.iter_rows():
            setattr(tables.speed[(worker, digest)], window, list(values))
        _held_out(tables, ordered, field, window)
    # The newest decode sample's time, held out of the long run or not (as the live fold keeps it).
    newest = (
        samples.filter(pl.col("decode_tps").is_not_null())
        .group_by(keys)
        .agg(pl.col("at").max().alias("sampled_at"))
        .collect()
    )
    for worker, digest, sampled_at in newest.iter_rows():
        tables.speed[(worker, digest)].sampled_at = sampled_at


def _held_out(tables: Tables, ordered: pl.LazyFrame, field: str, window: str) -> None:
    """Fold again, one sample at a time, the rows of `field` where a shift may have held samples
    out of the long run (projections.shift.fold_sample): the group_by above folded them all.

    A group whose samples all lie within a factor of MIN_RATIO of each other never had a shift
    (every long-run mean lies between its smallest and largest sample, so no sample is off by
    more than the floor), and its vectorised statistics stand: only the others pay for a pass
    in Python, in ledger order as the projector folded them.
    """
    keys = ["worker", "digest"]
    x = pl.col(field)
    spread = (
        ordered.filter(x.is_not_null())
        .group_by(keys)
        .agg(x.min().alias("lo"), x.max().alias("hi"), pl.len().alias("n"))
        # A hair under the floor: a mean rounded just outside [lo, hi] is left to the exact pass.
        .filter((pl.col("n") > MIN_LONG_RUN) & (pl.col("hi") >= pl.col("lo") * MIN_RATIO * (1 - 1e-9)))
        .select(keys)
    )
    redo = (
        ordered.filter(x.is_not_null())
        .join(spread, on=keys, how="semi")
        .sort("seq")
        .select(*keys, "at", field)
        .collect()
    )
    state: dict[tuple[str, str], Folded] = {}
    h = tables.half_life_s
    for worker, digest, at, value in redo.iter_rows():
        s = state.get((worker, digest))
        state[(worker, digest)] = (
            fold_sample(field, Stat(), [], value, at, h)
            if s is None
            else fold_sample(field, s.stat, s.window, value, at, h, s.held, s.held_since)
        )
    held, since = HELD[field]
    for key, s in state.items():
        row = tables.speed[key]
        setattr(row, field, s.stat)
        setattr(row, window, s.window)
        setattr(row, held, s.held)
        setattr(row, since, s.held_since)


def _length(tables: Tables, counted: pl.LazyFrame) -> None:
    ec = pl.col("eval_count")
    samples = counted.filter((ec >= 0) & (ec <= MAX_OUTPUT_TOKENS)).select(
        ledger_ms_expr().alias("at"), "digest", "domain", ec.cast(pl.Float64).alias("x")
    )
    keys = ["digest", "domain"]
    for key, stat in _stat_rows(stats(samples, keys, "x", tables.half_life_s), keys).items():
        tables.length[key] = LengthRow(digest=key[0], domain=key[1], output_tokens=stat)
    # The prompt's bytes per token (projections.folder.prompt_sample's rule).
    pb, pc = pl.col("prompt_bytes"), pl.col("prompt_eval_count")
    ratio = pb / pc
    prompts = counted.filter(
        (pb > 0)
        & (pc > 0)
        & (pl.col("prompt_eval_cached_count").fill_null(0) <= 0)
        & (ratio >= MIN_SAMPLE_BYTES_PER_TOKEN)
        & (ratio <= MAX_SAMPLE_BYTES_PER_TOKEN)
    ).select(
        ledger_ms_expr().alias("at"),
        "digest",
        "domain",
        pb.cast(pl.Float64).alias("bytes"),
        pc.cast(pl.Float64).alias("tokens"),
    )
    for column in ("bytes", "tokens"):
        for key, stat in _stat_rows(stats(prompts, keys, column, tables.half_life_s), keys).items():
            row = tables.length.get(key)
            if row is None:
                row = tables.length[key] = LengthRow(digest=key[0], domain=key[1])
            setattr(row, "prompt_bytes" if column == "bytes" else "prompt_tokens", stat)


def _quality(tables: Tables, quality: pl.DataFrame) -> None:
    """projections.folder's rule: valid scores, not a failed answer cut off at its budget, and one
    grade per (grader, prompt) of a (digest, domain), the first in ledger order."""
    score, prompt = pl.col("score"), pl.col("prompt_id")
    valid = score.is_finite() & (score >= 0.0) & (score <= 1.0) & ~(pl.col("truncated") & (score < 1.0))
    keys = ["digest", "domain"]
    first = (prompt == "") | pl.struct(*keys, "grader", "prompt_id").is_first_distinct()
    samples = quality.sort("seq").filter(valid).filter(first).with_columns(ledger_ms_expr().alias("at"))
    marks = (
        samples.filter(prompt != "")
        .group_by(keys)
        .agg(pl.concat_str([pl.col("grader"), prompt], separator="/").sort().alias("graded"))
    )
    graded = {(str(d), str(m)): list(g) for d, m, g in marks.iter_rows()}
    for key, stat in _stat_rows(stats(samples, keys, "score", tables.half_life_s), keys).items():
        tables.quality[key] = QualityRow(digest=key[0], domain=key[1], score=stat, graded=graded.get(key, []))


def _demand(tables: Tables, submitted: pl.DataFrame) -> None:
    first = submitted.lazy().filter(pl.col("task_id").is_first_distinct())
    samples = first.select(ledger_ms_expr().alias("at"), "digest", pl.lit(1.0).alias("x"))
    for digest, stat in _stat_rows(
        stats(samples, ["digest"], "x", tables.demand_half_life_s), ["digest"]
    ).items():
        tables.demand[digest] = DemandRow(digest=digest, arrivals=stat)


def _fleet(tables: Tables, frames: Frames) -> None:
    offline = frames.frame("offline").with_columns(
        pl.when(pl.col("reason") == "forgotten")
        .then(pl.lit("forgotten"))
        .otherwise(pl.lit("offline"))
        .alias("reason")
    )
    # Timed as the live fold times them: `at` bounded by the ledger's clock (the online frame's is).
    status = (
        pl.concat([frames.frame("online"), offline.with_columns(ledger_ms_expr().alias("at"))])
        .sort("at", "seq")
        .group_by("worker")
        .last()
    )
    reports = frames.report_frame
    newest = reports.sort("at", "seq").group_by("worker").last()
    # Loaded models come from heartbeats and changes; resources from heartbeats only (a change
    # carries none: they live in the lease).
    loaded = reports.filter(pl.col("kind") != ONLINE).sort("at", "seq").group_by("worker").last()
    beats = reports.filter(pl.col("kind") == HEARTBEAT).sort("at", "seq").group_by("worker").last()
    claimed = frames.frame("claimed")
    workers = (
        set(status["worker"].to_list()) | set(reports["worker"].to_list()) | set(claimed["worker"].to_list())
    )
    rows = {w: FleetRow(worker=w) for w in workers}
    for worker, at, reason in status.select("worker", "at", "reason").iter_rows():
        rows[worker].status, rows[worker].status_since = reason, at
    for worker, at, ref in newest.select("worker", "at", "ref").iter_rows():
        report: Report = frames.reports[ref]
        row = rows[worker]
        row.last_heartbeat = at
        row.slots = Stamped(value=report.slots, at=at)
        row.inventory = Stamped(value={m.name: m.digest for m in report.inventory}, at=at)
        row.serves = Stamped(value=report.serves, at=at)
    for worker, at, ref in loaded.select("worker", "at", "ref").iter_rows():
        said = frames.reports[ref]
        assert not isinstance(said, WorkerOnline)
        rows[worker].loaded = Stamped(value=list(said.loaded), at=at)
    for worker, at, ref in beats.select("worker", "at", "ref").iter_rows():
        beat = frames.reports[ref]
        assert isinstance(beat, WorkerHeartbeat)
        rows[worker].resources = Stamped(value=resources_dict(beat), at=at)
    for worker, task_ids in _in_flight(frames, claimed).items():
        rows[worker].in_flight = task_ids
    # The worker's clock against the ledger's, from its newest claim (as the live fold keeps it).
    offsets = (
        claimed.filter(pl.col("ms") > 0)
        .group_by("worker")
        .agg((pl.col("at") - pl.col("ms")).sort_by("seq").last().alias("offset"))
    )
    for worker, offset in offsets.iter_rows():
        rows[worker].clock_offset_ms = offset
    _clock_skews(rows, claimed, frames.frame("completed"))
    _wakes(rows, frames)
    tables.fleet = rows


def _clock_skews(rows: dict[str, FleetRow], claimed: pl.DataFrame, completed: pl.DataFrame) -> None:
    """Each worker's last CLOCK_WINDOW offsets (`at` minus stream-id ms) of its claims and
    completions in ledger order, and their median, as the live fold keeps them (Folder._clock_sample)."""
    part = [
        f.filter(pl.col("ms") > 0).select(
            "seq", "ms", pl.col("worker").cast(pl.String), (pl.col("at") - pl.col("ms")).alias("offset")
        )
        for f in (claimed, completed)
    ]
    windows = (
        pl.concat(part)
        .group_by("worker")
        .agg(
            pl.col("offset").sort_by("seq").tail(CLOCK_WINDOW).alias("window"),
            pl.col("ms").sort_by("seq").last().alias("ms"),
        )
    )
    for worker, window, ms in windows.iter_rows():
        row = rows.get(worker)
        if row is None:
            row = rows[worker] = FleetRow(worker=worker)
        row.clock_window = [int(x) for x in window]
        row.clock_skew = Stamped(value=clock_skew_ms(row.clock_window), at=ms)


# The order of a wake's events in `_wakes`, for ties of `seq` (none: one entry, one event).
_REQUESTED, _FAILED, _ONLINE = 0, 1, 2


def _wakes(rows: dict[str, FleetRow], frames: Frames) -> None:
    """Each woken machine's pending request and last measured wake, as the live fold keeps them:
    in ledger order a WakeRequested opens a wake, a WakeFailed drops it, and the next WorkerOnline
    measures it (from the request's `at` to its own; a negative span measures nothing). The measure
    kept is the one with the latest WorkerOnline `at`, the later in the ledger on a tie (`_stamp`)."""
    requested = frames.frame("wake_requested")
    failed = frames.frame("wake_failed")
    if requested.height == 0 and failed.height == 0:
        return
    woken = pl.concat([requested["worker"], failed["worker"]]).cast(pl.String).unique()
    online = frames.frame("online").filter(pl.col("worker").cast(pl.String).is_in(woken.implode()))

    def part(frame: pl.DataFrame, kind: int) -> pl.DataFrame:
        return frame.select(
            "seq",
            "at",
            pl.when(pl.col("ms") > 0).then(pl.col("ms")).otherwise(pl.col("at")).alias("t"),
            pl.col("worker").cast(pl.String),
            pl.lit(kind, dtype=pl.Int8).alias("kind"),
        )

    parts = [part(requested, _REQUESTED), part(failed, _FAILED), part(online, _ONLINE)]
    events = pl.concat(parts).sort("seq")
    pending: dict[str, int | None] = {}
    best: dict[str, tuple[int, int, float]] = {}
    for seq, at, t, worker, kind in events.iter_rows():
        if kind == _REQUESTED:
            pending[worker] = t
        elif kind == _FAILED:
            pending[worker] = None
        else:
            since = pending.get(worker)
            if since is None:
                continue
            measured = (t - since) / 1000.0
            if measured >= 0 and (worker not in best or (at, seq) >= best[worker][:2]):
                best[worker] = (at, seq, measured)
            pending[worker] = None
    for worker in woken.to_list():
        row = rows.get(worker)
        if row is None:
            row = rows[worker] = FleetRow(worker=worker)
        row.wake_pending = pending.get(worker)
        if worker in best:
            at, _, measured = best[worker]
            row.wake_s = Stamped(value=measured, at=at)


def _in_flight(frames: Frames, claimed: pl.DataFrame) -> dict[str, list[str]]:
    """Claimed tasks whose latest claim (ledger order) came after every release of them."""
    pair = ["worker", "task_id"]
    # Claims and releases of each (worker, task) in one group_by: the pair is held when its last
    # entry is a claim (and no end of the task came after it).
    claim = pl.lit(True).alias("claim")
    release = pl.lit(False).alias("claim")
    entries = pl.concat(
        [
            claimed.lazy().select("seq", *pair, claim),
            frames.frame("completed").lazy().select("seq", *pair, release),
            frames.frame("failed").lazy().select("seq", *pair, release),
            frames.frame("reclaimed")
            .lazy()
            .select("seq", pl.col("owner").alias("worker"), "task_id", release),
        ]
    )
    ended = pl.concat(
        [frames.frame("dead").select("seq", "task_id"), frames.frame("cancelled").select("seq", "task_id")]
    ).lazy()
    seq = pl.col("seq")
    # The pair as one integer (both names are categoricals): a group_by on one u64 column holds far
    # less than one on two keys.
    worker_code = pl.col("worker").to_physical().cast(pl.UInt64)
    pair_key = (worker_code * (2**32) + pl.col("task_id").to_physical().cast(pl.UInt64)).alias("pair")
    held = (
        entries.with_columns(pair_key)
        .group_by("pair")
        .agg(pl.col(*pair).first(), seq.max(), pl.col("claim").get(seq.arg_max()))
        .filter(pl.col("claim"))
        .join(ended.group_by("task_id").agg(seq.max().alias("end")), on="task_id", how="left")
        .filter(seq > pl.col("end").fill_null(-1))
        .group_by("worker")
        .agg(pl.col("task_id"))
        .collect(engine="streaming")
    )
    # Sorted as strings (as the live projector keeps them), not in the categorical's order.
    return {w: sorted(ids) for w, ids in held.iter_rows()}


_TASK_KINDS: Final = (
    "submitted",
    "claimed",
    "completed",
    "failed",
    "reclaimed",
    "stalled",
    "dead",
    "cancelled",
)


def _first(frame: pl.LazyFrame, key: str, *, last: bool = False) -> pl.LazyFrame:
    """The first (or last) row of each `key` in ledger order (the frames are in `seq` order)."""
    return frame.unique(key, keep="last" if last else "first", maintain_order=False)


def task_frame(frames: Frames, counted: pl.LazyFrame, cutoff_ms: int | None = None) -> pl.DataFrame:
    """One row per task (columns `TASK_FIELDS`); with `cutoff_ms`, only the tasks whose first
    entry's stream ms is at or after it (the row's day shard is named by that entry)."""
    tid = "task_id"
    parts = {name: frames.frame(name).lazy() for name in _TASK_KINDS}
    done_counted = counted
    if cutoff_ms is not None:
        # A task is kept when none of its entries came before the cutoff. Filtering every kind by
        # its entries' ms, and then leaving out the few tasks that had an entry on both sides,
        # keeps the joins below to the kept tasks without a group_by over all of history.
        ms = pl.col("ms")
        recent = {name: part.filter(ms >= cutoff_ms) for name, part in parts.items()}
        recent_ids = pl.concat([part.select(tid) for part in recent.values()]).unique()
        older = pl.concat([part.filter(ms < cutoff_ms).select(tid) for part in parts.values()])
        straddling = older.join(recent_ids, on=tid, how="semi").unique()
        # In ledger order still: `_first` takes the first row of each task.
        parts = {
            name: part.join(straddling, on=tid, how="anti", maintain_order="left")
            for name, part in recent.items()
        }
        done_counted = done_counted.filter(ms >= cutoff_ms).join(straddling, on=tid, how="anti")
    sub, clm, done = parts["submitted"], parts["claimed"], parts["completed"]
    fail, recl, stall = parts["failed"], parts["reclaimed"], parts["stalled"]
    dead, canc = parts["dead"], parts["cancelled"]
    # Every task with the stream ms of its first entry (the projector creates the row there).
    ids = (
        pl.concat([part.select(tid, "ms") for part in parts.values()])
        .group_by(tid)
        .agg(pl.col("ms").min().alias("first_ms"))
    )
    entries = task_entries(parts, frames.frame(MENTIONS).lazy())
    first_sub = _first(sub, tid).select(
        tid,
        "model",
        "digest",
        "domain",
        "queue",
        ledger_ms_expr().alias("submitted_at"),
        "pipeline_id",
        "runtime_options",
    )
    last_claim = _first(clm, tid, last=True).select(
        tid, pl.col("worker").alias("claim_worker"), ledger_ms_expr().alias("claimed_at")
    )
    finished = done_counted.select(
        tid,
        pl.col("worker").alias("done_worker"),
        ledger_ms_expr().alias("finished_at"),
        "eval_count",
        "prompt_eval_count",
        decode_tps_expr().alias("decode_tps"),
        "ttft_ms",
        "wall_ms",
        pl.col("attempt").alias("completed_attempt"),
    )
    completions = done.group_by(tid).agg(pl.len().cast(pl.Int64).alias("completions"))
    attempts = (
        pl.concat(
            [
                clm.select(tid, "attempt"),
                done.select(tid, "attempt"),
                fail.select(tid, "attempt"),
                recl.select(tid, "attempt"),
                dead.select(tid, pl.col("attempts").alias("attempt")),
            ]
        )
        .group_by(tid)
        .agg(pl.col("attempt").max().alias("attempts"))
    )
    rank = TERMINAL_RANK
    terminal = (
        pl.concat(
            [
                done_counted.select(tid, pl.lit(rank["completed"]).alias("rank")),
                canc.select(tid, pl.lit(rank["cancelled"]).alias("rank")),
                dead.select(tid, pl.lit(rank["dead"]).alias("rank")),
                fail.filter(~pl.col("retryable")).select(tid, pl.lit(rank["failed"]).alias("rank")),
            ]
        )
        .group_by(tid)
        .agg(pl.col("rank").max())
    )

    def phase_of(frame: pl.LazyFrame, status: str) -> pl.LazyFrame:
        return frame.select("seq", tid, pl.lit(status).alias("phase"))

    # The latest of the kinds that set a phase, by ledger position across kinds.
    phase = (
        pl.concat(
            [
                phase_of(sub, "queued"),
                phase_of(clm, "running"),
                phase_of(fail.filter(pl.col("retryable")), "queued"),
                phase_of(recl, "queued"),
                phase_of(stall, "stalled"),
            ]
        )
        .group_by(tid)
        .agg(pl.col("phase").sort_by("seq").last())
    )
    message = pl.col("message")
    error = (
        pl.concat(
            [
                fail.select(
                    "seq",
                    tid,
                    pl.when(message == "")
                    .then(pl.col("kind"))
                    .otherwise(pl.col("kind") + pl.lit(": ") + message)
                    .alias("error"),
                ),
                dead.select("seq", tid, pl.col("reason").alias("error")),
            ]
        )
        .group_by(tid)
        .agg(pl.col("error").sort_by("seq").last())
    )
    status = pl.col("phase").fill_null("queued")
    for name, r in sorted(rank.items(), key=lambda kv: kv[1]):
        status = pl.when(pl.col("rank") == r).then(pl.lit(name)).otherwise(status)
    joined = ids
    for part in (first_sub, last_claim, finished, completions, attempts, terminal, phase, error, entries):
        joined = joined.join(part, on=tid, how="left")
    table = joined.select(
        tid,
        status.alias("status"),
        pl.col("model").fill_null(""),
        pl.col("digest").fill_null(""),
        pl.col("domain").fill_null("general"),
        pl.col("queue").fill_null(""),
        pl.col("attempts").fill_null(0),
        pl.coalesce("done_worker", "claim_worker").alias("worker"),
        "submitted_at",
        "claimed_at",
        "finished_at",
        "eval_count",
        "prompt_eval_count",
        "decode_tps",
        "ttft_ms",
        "wall_ms",
        "error",
        (pl.col("completions").fill_null(0) - pl.col("completed_attempt").is_not_null().cast(pl.Int64)).alias(
            "duplicates"
        ),
        "pipeline_id",
        "completed_attempt",
        "first_ms",
        "entries",
        pl.col("runtime_options").fill_null(False),
    )
    out = table.collect()
    assert tuple(out.columns) == TASK_FIELDS, out.columns
    return out


def _packed(frame: pl.LazyFrame, key: str) -> pl.LazyFrame:
    """Per `key`, its entries (columns seq, ms, sq) packed as projections.snapshot.add_entry packs
    them, in ledger order: the first id's ms and seq, then per entry the ms since the one before."""
    ms = pl.col("ms")
    delta = (ms - ms.shift(1).over(key)).fill_null(ms)
    return (
        frame.sort("seq")
        .with_columns(delta.alias("dms"))
        .group_by(key)
        .agg(pl.concat_list("dms", "sq").list.explode(keep_nulls=False, empty_as_null=False).alias("entries"))
    )


def task_entries(parts: dict[str, pl.LazyFrame], mentions: pl.LazyFrame) -> pl.LazyFrame:
    """Per task, the ids of its entries (TaskRow.entries): every entry of the kinds that fold into
    its row, and the mentions of it (projections/mention.py) after the first of those, as the live
    projector lists a mention only on a row that exists."""
    tid = "task_id"
    own = pl.concat([part.select("seq", "ms", "sq", tid) for part in parts.values()])
    first = own.group_by(tid).agg(pl.col("seq").min().alias("first_seq"))
    later = (
        mentions.filter(pl.col(tid).is_not_null())
        .join(first, on=tid, how="inner")
        .filter(pl.col("seq") > pl.col("first_seq"))
        .select("seq", "ms", "sq", tid)
    )
    return _packed(pl.concat([own, later]), tid)


def pipeline_rows(frames: Frames, cutoff_ms: int | None = None) -> dict[str, PipelineRow]:
    """Every pipeline's row: created by the first entry naming it (a task submitted for it, or one
    of its own events), with its own events' ids and its tasks in the order first named. With
    `cutoff_ms`, a pipeline with an entry before it is left out (as `task_frame` leaves tasks)."""
    pid, tid = "pipeline_id", "task_id"
    submitted = (
        frames.frame("submitted")
        .lazy()
        .filter(pl.col(pid).is_not_null() & (pl.col(pid) != ""))
        .select("seq", "ms", "sq", pid, tid, pl.lit(False).alias("pipe"))
    )
    own = frames.frame(MENTIONS).lazy().filter(pl.col("pipe") & pl.col(pid).is_not_null())
    named = pl.concat([submitted, own.select("seq", "ms", "sq", pid, tid, "pipe")]).sort("seq")
    heads = named.group_by(pid).agg(
        pl.col("ms").first().alias("first_ms"),
        pl.col(tid).drop_nulls().unique(maintain_order=True).cast(pl.String).alias("tasks"),
    )
    if cutoff_ms is not None:
        heads = heads.filter(pl.col("first_ms") >= cutoff_ms)
    entries = _packed(named.filter(pl.col("pipe")).select("seq", "ms", "sq", pid), pid)
    table = heads.join(entries, on=pid, how="left").collect()
    return {
        p: PipelineRow(pipeline_id=p, first_ms=first, entries=packed or [], tasks=tasks)
        for p, first, tasks, packed in table.select(pid, "first_ms", "tasks", "entries").iter_rows()
    }


def encoded_task_rows(table: pl.DataFrame) -> Iterator[tuple[str, bytes]]:
    """(task_id, msgpack TaskRow) of every row of a task frame, `ENCODE_BATCH` rows at a time.

    Each row is encoded as a map of TaskRow's fields in TaskRow's order: the bytes of the encoded
    TaskRow, without making one. The columns already have TaskRow's types (`task_frame` names them
    all), and the rows are made and encoded by `map` over the columns, in C."""
    for offset in range(0, table.height, ENCODE_BATCH):
        columns = [column.to_list() for column in table.slice(offset, ENCODE_BATCH).get_columns()]
        rows = map(dict, map(zip, repeat(TASK_FIELDS), zip(*columns, strict=True)))
        yield from zip(columns[0], map(_encode, rows), strict=True)


def task_rows(table: pl.DataFrame) -> dict[str, TaskRow]:
    """The rows of a task frame as TaskRow structs, keyed by task id (decoded from their encoding:
    one C-level pass per row, cheaper than building them with keywords)."""
    return {task_id: decode_task(raw) for task_id, raw in encoded_task_rows(table)}
