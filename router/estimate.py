"""Estimates: every number a decision needs, shrunk toward a prior, each with its breakdown.

An estimate of a field with decayed evidence `n` (Stat.weight_at, from the field's own
`updated_at`) and decayed mean `x̄` is `(n·x̄ + k·prior)/(n + k)`. The prior chain (DESIGN.md
section 5):

- speed of (worker, digest): the worker's measured speed on *other* models times the model's
  relative cost, from a two-way fit `log speed = a[worker] + b[model]`; else the model's pooled
  value across workers; else a default. The worker's effect leaves the cell itself out, so a row
  whose speed agrees with its prior moves no total.
- output tokens and quality of (digest, domain): the model's pooled value over other domains;
  else a default. Both belong to the digest, so a worker that gains a model has them at once.
- quality does not age: a grade of a fixed digest stays true (the weights did not change), so
  quality reads the lifetime sums, not the decayed ones. It is a Beta posterior: the prior (the
  pooled value, else `default_quality`) counts as `k_quality` grades, Beta(k·m0, k·(1-m0)), and
  each grade in [0, 1] adds its score to the successes and the rest to the failures. The field
  carries the posterior's standard deviation and a two-sided `quality_interval` interval (normal
  approximation, clipped to [0, 1]), so `auto` can weigh how well each model was measured.
- concurrency of (worker, digest): with k generations at once each runs at k**(e-1) of its solo
  speed. The speed table keeps the in-flight count of every sample but only as its own moments
  (no cross term with speed), so the exponent is read from how much the decode speed varies
  beyond the noise that rows with a constant in-flight count show: the speed's coefficient of
  variation over the in-flight count's is the elasticity 1 - e (delta method). It is shrunk
  toward e = 1 (no slowdown) and is 1 exactly where the in-flight count never varied.

`Estimator` does the fits once per snapshot; a decision then only looks numbers up. Resource
metrics (CPU, GPU, VRAM) are not read here at all: self-reported load misled the story's router.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Final

import msgspec

from projections.shift import Shift, row_shifts
from projections.snapshot import LengthRow, QualityRow, Snapshot, SpeedRow, Stat

SPEED_FIELDS: tuple[str, ...] = ("decode_tps", "prompt_tps", "load_s", "embed_tps")


# Prompt tokens one image is counted as before the backend counts it: one 336-pixel tile of a CLIP
# ViT-L/14 encoder, 24 x 24 patches, what LLaVA-style vision models spend on an image (and what the
# simulator charges, sim.backends.ask.IMAGE_TOKENS). Models differ (Gemma 3 spends 256, tiling
# encoders more on large images); not learned yet: the backend's prompt_eval_count includes the
# images, so the prompt speed it measures is in these same units.
DEFAULT_IMAGE_TOKENS: Final = 576


class EstimateParams(msgspec.Struct, kw_only=True, frozen=True):
    """Prior strengths (in samples) and the defaults at the end of every prior chain."""

    # A speed prior is worth a tenth of a sample: one answer of MIN_DECODE_TOKENS or more on
    # one machine varies by a few percent, while the prior (the model's speed on other machines)
    # can be off by the whole gap between machines (7.3x in the story). At 1.0, three benchmark
    # answers on a machine 3x slower than its peer still read 26% fast.
    k_speed: float = 0.1
    k_length: float = 2.0
    k_quality: float = 2.0
    default_decode_tps: float = 20.0
    default_prompt_tps: float = 200.0
    default_load_s: float = 5.0
    # No default embedding rate: where none was measured, the prompt speed stands in for it.
    default_output_tokens: float = 256.0
    default_quality: float = 0.5
    default_image_tokens: float = float(DEFAULT_IMAGE_TOKENS)
    # Output lengths' spread (coefficient of variation) where too few were measured to say: about
    # an exponential's, wider than most models' measured spread, so an unknown spread errs long.
    default_length_cv: float = 1.0
    # Lengths measured before a (digest, domain)'s own spread is used for its tail.
    min_length_samples_for_tail: int = 20
    # The quantile of output length taken as "as long as a task plausibly runs".
    length_tail_quantile_z: float = 2.326  # the 99th percentile of a normal

    # A prompt's UTF-8 bytes per token (tasks.payload.estimate_tokens's figure) until a model's
    # own is learned from `min_prompt_ratio_samples` runs (projections.folder.prompt_sample); a
    # learned one is held within [min_bytes_per_token, max_bytes_per_token].
    default_bytes_per_token: float = 4.0
    min_prompt_ratio_samples: int = 5
    min_bytes_per_token: float = 1.5
    max_bytes_per_token: float = 8.0

    # Two-sided coverage of the quality interval the breakdown shows.
    quality_interval: float = 0.9
    fit_iterations: int = 12
    # Prior strength of "no concurrency slowdown" (in samples) and the floor of the exponent.
    k_concurrency: float = 5.0
    min_parallel_exponent: float = 0.2

    def default(self, field: str) -> float:
        """The last prior of a field."""
        return float(getattr(self, f"default_{field}"))


class Field(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One estimated number and why: value, own sample count, source text and age of the evidence."""

    value: float
    n: int
    source: str
    age_s: float | None
    weight: float = 0.0  # decayed evidence of the own samples, what the shrinkage used
    prior: float | None = None
    # Posterior standard deviation and interval, where the estimate has one (quality).
    sd: float | None = None
    interval: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, object]:
        """The breakdown as the preview JSON and TaskRouted show it."""
        out: dict[str, object] = {
            "value": self.value,
            "n": self.n,
            "source": self.source,
            "age_s": self.age_s,
        }
        if self.sd is not None:
            out["sd"] = self.sd
        if self.interval is not None:
            out["interval"] = list(self.interval)
        return out


class SpeedEstimate(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """What a worker is expected to do with a model."""

    decode_tps: Field
    prompt_tps: Field
    load_s: Field
    # Prompt tokens per second of an embedding (what an embedding model's tasks cost).
    embed_tps: Field


class Concurrency(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """How a worker shares itself: k tasks at once each run at k**(exponent-1) of solo speed.

    `mean_in_flight` is the in-flight count the speed samples were taken at on average, so that
    the measured (blended) speed can be turned into the solo speed: solo = measured / share(mean).
    """

    exponent: Field
    mean_in_flight: float = 1.0

    def share(self, k: float) -> float:
        """Each task's speed with `k` at once, relative to running alone."""
        e = self.exponent.value
        return 1.0 if e == 1.0 or k <= 1.0 else float(k ** (e - 1.0))

    def factor(self, k: int) -> float:
        """Seconds with `k` at once per second the measured speeds predict (1.0 when e = 1)."""
        if self.exponent.value == 1.0:
            return 1.0
        return self.share(self.mean_in_flight) / self.share(float(k))


_NO_SLOWDOWN_SOURCE = "no concurrency evidence (in-flight count never varied)"


class _Prior(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    value: float
    source: str
    age_s: float | None


def format_age(age_s: float | None) -> str:
    """A short human age: '40 s', '12 min', '20 h', '3 d'."""
    if age_s is None:
        return "never"
    if age_s < 90:
        return f"{age_s:.0f} s"
    if age_s < 5400:
        return f"{age_s / 60:.0f} min"
    if age_s < 2 * 86_400:
        return f"{age_s / 3600:.0f} h"
    return f"{age_s / 86_400:.0f} d"


class _Cell(msgspec.Struct, kw_only=True, gc=False):
    """One measured (row, column) of a table, reduced to what the fits need."""

    mean: float  # decayed mean
    weight: float  # decayed weight at `now`
    n: int
    updated_at: int | None


def _cell(stat: Stat, now_ms: int, half_life_s: float) -> _Cell | None:
    mean = stat.decayed_mean
    if mean is None:
        return None
    weight = stat.weight_at(now_ms, half_life_s)
    if weight <= 0.0:
        return None
    return _Cell(mean=mean, weight=weight, n=stat.n, updated_at=stat.updated_at)


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _lifetime_cell(stat: Stat) -> _Cell | None:
    """A field that does not age: its lifetime mean, every sample at full weight."""
    mean = stat.mean
    if mean is None:
        return None
    return _Cell(mean=mean, weight=float(stat.n), n=stat.n, updated_at=stat.updated_at)


def normal_quantile(p: float) -> float:
    """The standard normal quantile of `p` in (0, 1) (bisection on erf: exact enough, no scipy)."""
    lo, hi = -10.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if 0.5 * (1.0 + math.erf(mid / math.sqrt(2.0))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def beta_posterior(successes: float, n: float, prior: float, k: float) -> tuple[float, float]:
    """(mean, standard deviation) of Beta(k·prior + successes, k·(1-prior) + n - successes)."""
    a = k * prior + successes
    b = k * (1.0 - prior) + (n - successes)
    total = a + b
    if total <= 0.0:
        return prior, 0.5
    mean = a / total
    var = a * b / (total * total * (total + 1.0))
    return mean, math.sqrt(max(0.0, var))


def _newest(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


class _Pool:
    """Weighted sums of one column (or row) so that leave-one-out means cost O(1)."""

    __slots__ = ("cells", "n", "newest", "wsum", "wxsum")

    def __init__(self) -> None:
        self.wsum = 0.0
        self.wxsum = 0.0
        self.n = 0
        self.newest: int | None = None
        self.cells: dict[str, _Cell] = {}

    def add(self, key: str, cell: _Cell) -> None:
        self.cells[key] = cell
        self.wsum += cell.weight
        self.wxsum += cell.weight * cell.mean
        self.n += cell.n
        self.newest = _newest(self.newest, cell.updated_at)

    def without(self, key: str | None) -> tuple[float, float, int, int | None] | None:
        """(mean, weight, n, newest) of the pool with `key` left out, or None when nothing is left."""
        own = self.cells.get(key) if key is not None else None
        wsum, wxsum, n = self.wsum, self.wxsum, self.n
        if own is not None:
            wsum -= own.weight
            wxsum -= own.weight * own.mean
            n -= own.n
        if wsum <= 1e-12 or len(self.cells) - (own is not None) == 0:
            return None
        # The age shown is the pool's newest sample (the left-out one included: an age, not a value).
        return wxsum / wsum, wsum, n, self.newest


class _TwoWay:
    """`log x[w, m] = a[w] + b[m]`, fitted by weighted alternating least squares.

    The prior for a cell uses the worker's effect computed without that cell, so the cell's own
    samples are never counted twice (once as evidence, once as prior).
    """

    def __init__(self, cells: Mapping[tuple[str, str], _Cell], iterations: int) -> None:
        self.by_worker: dict[str, dict[str, tuple[float, float]]] = {}
        self.by_model: dict[str, dict[str, tuple[float, float]]] = {}
        self.n_worker: dict[str, int] = {}
        self.n_model: dict[str, int] = {}
        self.newest_worker: dict[str, int | None] = {}
        self.newest_model: dict[str, int | None] = {}
        for (w, m), c in cells.items():
            self.newest_worker[w] = _newest(self.newest_worker.get(w), c.updated_at)
            self.newest_model[m] = _newest(self.newest_model.get(m), c.updated_at)
            y = math.log(max(c.mean, 1e-6))
            self.by_worker.setdefault(w, {})[m] = (y, c.weight)
            self.by_model.setdefault(m, {})[w] = (y, c.weight)
            self.n_worker[w] = self.n_worker.get(w, 0) + c.n
            self.n_model[m] = self.n_model.get(m, 0) + c.n
        self.a: dict[str, float] = dict.fromkeys(self.by_worker, 0.0)
        self._sums: dict[str, tuple[float, float]] = {}
        self.b: dict[str, float] = {
            m: sum(y * wt for y, wt in ws.values()) / sum(wt for _, wt in ws.values())
            for m, ws in self.by_model.items()
        }
        for _ in range(iterations):
            for w, ms in self.by_worker.items():
                self.a[w] = sum((y - self.b[m]) * wt for m, (y, wt) in ms.items()) / sum(
                    wt for _, wt in ms.values()
                )
            for m, ws in self.by_model.items():
                self.b[m] = sum((y - self.a[w]) * wt for w, (y, wt) in ws.items()) / sum(
                    wt for _, wt in ws.values()
                )

    def prior(self, worker: str, model: str) -> tuple[float, int, int] | None:
        """(value, worker's n on other models, model's n on other workers), or None without both."""
        mine = self.by_worker.get(worker)
        others = self.by_model.get(model)
        if not mine or not others:
            return None
        own = mine.get(model)
        if len(mine) - (own is not None) == 0 or len(others) - (worker in others) == 0:
            return None
        sums = self._sums.get(worker)
        if sums is None:
            sums = (
                sum((y - self.b[m]) * wt for m, (y, wt) in mine.items()),
                sum(wt for _, wt in mine.values()),
            )
            self._sums[worker] = sums
        num, den = sums
        if own is not None:
            num -= (own[0] - self.b[model]) * own[1]
            den -= own[1]
        if den <= 1e-12:
            return None
        return math.exp(num / den + self.b[model]), self.n_worker[worker], self.n_model[model]


def _shrink(cell: _Cell | None, prior: _Prior, k: float, now_ms: int, what: str) -> Field:
    if cell is None:
        return Field(value=prior.value, n=0, source=prior.source, age_s=prior.age_s, prior=prior.value)
    value = (cell.weight * cell.mean + k * prior.value) / (cell.weight + k)
    age = None if cell.updated_at is None else max(0.0, (now_ms - cell.updated_at) / 1000.0)
    prior_kind = prior.source.split(" ", 1)[0]
    return Field(
        value=value,
        n=cell.n,
        source=f"{what} n={cell.n} + prior {prior_kind}",
        age_s=age,
        weight=cell.weight,
        prior=prior.value,
    )


class Estimator:
    """Every estimate of one snapshot at one instant; fits are done once, lookups are cached.

    Build it with `build_estimator`; it never changes afterwards, so a decision can share it.
    """

    def __init__(
        self,
        speed: Iterable[SpeedRow],
        length: Iterable[LengthRow],
        quality: Iterable[QualityRow],
        now_ms: int,
        half_life_s: float,
        params: EstimateParams | None = None,
        embedding: frozenset[str] = frozenset(),
    ) -> None:
        self.now_ms = now_ms
        self.half_life_s = half_life_s
        self.params = params or EstimateParams()
        # Embedding models (dispatch.serving.embedding_only): their tasks read and write nothing.
        self.embedding = embedding
        self._speed_cells: dict[str, dict[tuple[str, str], _Cell]] = {f: {} for f in SPEED_FIELDS}
        speed = list(speed)
        length = list(length)
        # Decode samples whose output tokens the worker counted from the stream: the source says so.
        self._counted = {(row.worker, row.digest): row.counted_n for row in speed if row.counted_n}
        # Fields whose recent samples left the long run (projections.shift): the recent value wins.
        self._shifts: dict[tuple[str, str], dict[str, Shift]] = {}
        for row in speed:
            shifted = row_shifts(row)
            if shifted:
                self._shifts[(row.worker, row.digest)] = shifted
            for f in SPEED_FIELDS:
                c = _cell(getattr(row, f), now_ms, half_life_s)
                if c is not None:
                    self._speed_cells[f][(row.worker, row.digest)] = c
        self._fits = {f: _TwoWay(cells, self.params.fit_iterations) for f, cells in self._speed_cells.items()}
        self._speed_pools: dict[str, dict[str, _Pool]] = {f: {} for f in SPEED_FIELDS}
        for f, cells in self._speed_cells.items():
            for (w, m), c in cells.items():
                self._speed_pools[f].setdefault(m, _Pool()).add(w, c)
        self._length_cells: dict[tuple[str, str], _Cell] = {}
        self._length_pools: dict[str, _Pool] = {}
        # Lifetime (n, sum, sumsq) of output lengths, for their spread (`output_tail`).
        self._length_moments: dict[tuple[str, str], tuple[int, float, float]] = {}
        self._sigma_cache: dict[tuple[str, str], float] = {}
        for lrow in length:
            st = lrow.output_tokens
            self._length_moments[(lrow.digest, lrow.domain)] = (st.n, st.sum, st.sumsq)
            c = _cell(st, now_ms, half_life_s)
            if c is not None:
                self._length_cells[(lrow.digest, lrow.domain)] = c
                self._length_pools.setdefault(lrow.digest, _Pool()).add(lrow.domain, c)
        # Per digest, every domain together: (decayed prompt bytes, decayed prompt tokens, runs,
        # newest run), each row's decayed sums brought to `now_ms`.
        self._prompt_ratio: dict[str, tuple[float, float, int, int | None]] = {}
        for lrow in length:
            pb, pt = lrow.prompt_bytes, lrow.prompt_tokens
            if pt.n == 0 or pt.updated_at is None:
                continue
            k = pt.weight_at(now_ms, half_life_s) / pt.dn if pt.dn > 0 else 0.0
            b, t, n, newest = self._prompt_ratio.get(lrow.digest, (0.0, 0.0, 0, None))
            self._prompt_ratio[lrow.digest] = (
                b + pb.dsum * k,
                t + pt.dsum * k,
                n + pt.n,
                _newest(newest, pt.updated_at),
            )
        self._quality_cells: dict[tuple[str, str], _Cell] = {}
        self._quality_pools: dict[str, _Pool] = {}
        for qrow in quality:
            c = _lifetime_cell(qrow.score)
            if c is not None:
                self._quality_cells[(qrow.digest, qrow.domain)] = c
                self._quality_pools.setdefault(qrow.digest, _Pool()).add(qrow.domain, c)
        self._speed_cache: dict[tuple[str, str], SpeedEstimate] = {}
        self._concurrency_rows: dict[tuple[str, str], tuple[float, float, float, float, int, int | None]] = {}
        noise_w, noise_cv2 = 0.0, 0.0
        for row in speed:
            moments = _concurrency_moments(row, now_ms, half_life_s)
            if moments is None:
                continue
            cv2, k_mean, k_var, weight = moments
            if k_var <= 1e-9:
                # Its in-flight count never varied: all its spread is noise, not sharing.
                noise_w += weight
                noise_cv2 += weight * cv2
            else:
                self._concurrency_rows[(row.worker, row.digest)] = (
                    cv2,
                    k_mean,
                    k_var,
                    weight,
                    row.in_flight.n,
                    row.in_flight.updated_at,
                )
        self._noise_cv2 = noise_cv2 / noise_w if noise_w > 0 else 0.0
        self._concurrency_cache: dict[tuple[str, str], Concurrency] = {}
        # Values other router modules derive from these estimates, cached with them (the plan's
        # per (worker, digest, domain) service coefficients): valid exactly as long as the estimates.
        self.memo: dict[object, object] = {}
        self._length_cache: dict[tuple[str, str], Field] = {}
        self._quality_cache: dict[tuple[str, str], Field] = {}
        self._interval_z = normal_quantile(0.5 + self.params.quality_interval / 2.0)

    def clear_cache(self) -> None:
        """Forget the looked-up estimates (the fits stay): for benchmarks of a cold decision."""
        self._speed_cache.clear()
        self._concurrency_cache.clear()
        self._length_cache.clear()
        self._quality_cache.clear()
        self.memo.clear()

    def _age(self, at: int | None) -> float | None:
        return None if at is None else max(0.0, (self.now_ms - at) / 1000.0)

    def _speed_prior(self, field: str, worker: str, digest: str, last: _Prior | None = None) -> _Prior:
        """The two-way prior, else the model's pooled value, else `last` (the default when None)."""
        fitted = self._fits[field].prior(worker, digest)
        if fitted is not None:
            value, n_worker, n_model = fitted
            age = self._age(
                _newest(self._fits[field].newest_worker[worker], self._fits[field].newest_model[digest])
            )
            return _Prior(
                value=value,
                source=f"two-way worker n={n_worker} x model n={n_model}, age {format_age(age)}",
                age_s=age,
            )
        # The pooled value keeps the cell itself: when it is the model's only measurement, its own
        # mean is a better prior than the default (and a row agreeing with it moves nothing).
        pool = self._speed_pools[field].get(digest)
        pooled = pool.without(None) if pool is not None else None
        if pooled is not None:
            mean, _, n, newest = pooled
            age = self._age(newest)
            return _Prior(value=mean, source=f"model-pooled n={n}, age {format_age(age)}", age_s=age)
        return last or _Prior(value=self.params.default(field), source="default", age_s=None)

    def speed(self, worker: str, digest: str) -> SpeedEstimate:
        """Decode tok/s, prompt tok/s and load seconds of `digest` on `worker`, each shrunk to its prior."""
        key = (worker, digest)
        hit = self._speed_cache.get(key)
        if hit is not None:
            return hit
        p = self.params
        fields: dict[str, Field] = {}
        for f in SPEED_FIELDS:
            last = None
            if f == "embed_tps":
                # Nothing measured of embeddings on this worker and other models or of this model
                # elsewhere: its prompt speed here (reading the input is what an embedding does).
                read = fields["prompt_tps"]
                last = _Prior(value=read.value, source=f"prompt-speed ({read.source})", age_s=read.age_s)
            prior = self._speed_prior(f, worker, digest, last)
            fields[f] = _shrink(self._speed_cells[f].get(key), prior, p.k_speed, self.now_ms, "worker")
        counted = self._counted.get(key)
        if counted:
            d = fields["decode_tps"]
            fields["decode_tps"] = msgspec.structs.replace(
                d, source=f"{d.source}; {counted} of n counted from the stream (no usage reported)"
            )
        for f, shift in self._shifts.get(key, {}).items():
            own = fields[f]
            fields[f] = Field(
                value=shift.recent,
                n=shift.samples,
                source=shift.source(),
                age_s=own.age_s,
                weight=float(shift.samples),
                prior=own.prior,
            )
        if digest in self.embedding:
            # An embedding model's every task only reads its input: the plan charges its prompt
            # tokens at the embedding rate (and `output_tokens` is 0).
            e = fields["embed_tps"]
            fields["prompt_tps"] = msgspec.structs.replace(e, source=f"embedding rate: {e.source}")
        est = SpeedEstimate(**fields)
        self._speed_cache[key] = est
        return est

    def embeds(self, digest: str) -> bool:
        """Whether `digest` is an embedding model (its tasks are embeddings)."""
        return digest in self.embedding

    def unknown_load(self, worker: str, digest: str) -> Field:
        """Expected load seconds of a task on a worker whose backend cannot say what is loaded.

        The load its runs have shown (the `load_s` estimate) times the share of its runs that
        showed one (decayed weights of load samples over decode samples); 0 until a run showed a
        load, so that an always-warm server is never charged a default load for a fact nobody has.
        """
        key = ("#unknown_load", worker, digest)
        hit = self.memo.get(key)
        if isinstance(hit, Field):
            return hit
        cell = self._speed_cells["load_s"].get((worker, digest))
        if cell is None:
            field = Field(value=0.0, n=0, source="loaded state unknown, no load seen", age_s=None, prior=0.0)
        else:
            runs = self._speed_cells["decode_tps"].get((worker, digest))
            share = 1.0 if runs is None or runs.weight <= 0 else min(1.0, cell.weight / runs.weight)
            load = self.speed(worker, digest).load_s
            field = Field(
                value=load.value * share,
                n=load.n,
                source=f"{load.source}, x {share:.2f} of runs loaded (loaded state unknown)",
                age_s=load.age_s,
                weight=load.weight,
                prior=load.prior,
            )
        self.memo[key] = field
        return field

    def shifts(self, worker: str, digest: str) -> dict[str, Shift]:
        """The speed fields of (worker, digest) whose recent samples left the long run."""
        return self._shifts.get((worker, digest), {})

    def concurrency(self, worker: str, digest: str) -> Concurrency:
        """How `worker` slows down running several tasks of `digest` at once (exponent 1: not at all)."""
        key = (worker, digest)
        hit = self._concurrency_cache.get(key)
        if hit is not None:
            return hit
        row = self._concurrency_rows.get(key)
        if row is None:
            hit = Concurrency(
                exponent=Field(value=1.0, n=0, source=_NO_SLOWDOWN_SOURCE, age_s=None, prior=1.0)
            )
        else:
            cv2, k_mean, k_var, weight, n, updated_at = row
            spread = math.sqrt(max(0.0, cv2 - self._noise_cv2))
            elasticity = spread * k_mean / math.sqrt(k_var)
            shrunk = weight * elasticity / (weight + self.params.k_concurrency)
            exponent = min(1.0, max(self.params.min_parallel_exponent, 1.0 - shrunk))
            hit = Concurrency(
                exponent=Field(
                    value=exponent,
                    n=n,
                    source=f"worker n={n} speed spread vs in-flight + prior none",
                    age_s=self._age(updated_at),
                    weight=weight,
                    prior=1.0,
                ),
                mean_in_flight=k_mean,
            )
        self._concurrency_cache[key] = hit
        return hit

    def _by_domain(
        self,
        cells: dict[tuple[str, str], _Cell],
        pools: dict[str, _Pool],
        digest: str,
        domain: str,
        k: float,
        default: float,
    ) -> Field:
        pool = pools.get(digest)
        pooled = pool.without(domain) if pool is not None else None
        if pooled is not None:
            mean, _, n, newest = pooled
            age = self._age(newest)
            prior = _Prior(
                value=mean, source=f"model-pooled n={n} other domains, age {format_age(age)}", age_s=age
            )
        else:
            prior = _Prior(value=default, source="default", age_s=None)
        return _shrink(cells.get((digest, domain)), prior, k, self.now_ms, "model")

    def image_tokens(self) -> Field:
        """Prompt tokens one image adds to a request, before the backend counts them: a default
        for every model (DEFAULT_IMAGE_TOKENS), named as such in the breakdown."""
        value = self.params.default_image_tokens
        return Field(value=value, n=0, source=f"default: {value:g} per image (one CLIP tile)", age_s=None)

    def bytes_per_token(self, digest: str) -> Field | None:
        """The model's prompt bytes per token learned from its runs (their token-weighted,
        time-decayed mean, every domain together, clamped to [min_bytes_per_token,
        max_bytes_per_token]), or None while fewer than `min_prompt_ratio_samples` runs were
        measured (the default `default_bytes_per_token` then stands)."""
        p = self.params
        learned = self._prompt_ratio.get(digest)
        if learned is None:
            return None
        b, t, n, newest = learned
        if n < p.min_prompt_ratio_samples or t <= 0.0:
            return None
        value = min(p.max_bytes_per_token, max(p.min_bytes_per_token, b / t))
        return Field(
            value=value,
            n=n,
            source=f"learned: {value:.2f} chars/token from {n} runs",
            age_s=self._age(newest),
            weight=t,
        )

    def output_tokens(self, digest: str, domain: str) -> Field:
        """Expected output tokens of the model for the domain (a property of the digest, not the worker)."""
        key = (digest, domain)
        hit = self._length_cache.get(key)
        if hit is None and digest in self.embedding:
            hit = Field(value=0.0, n=0, source="embedding model: no output", age_s=None, prior=0.0)
            self._length_cache[key] = hit
        if hit is None:
            p = self.params
            hit = self._by_domain(
                self._length_cells, self._length_pools, digest, domain, p.k_length, p.default_output_tokens
            )
            self._length_cache[key] = hit
        return hit

    def length_sigma(self, digest: str, domain: str) -> float:
        """The spread of the model's output lengths in the domain, as a lognormal's sigma: from the
        measured lengths' mean and variance, or `default_length_cv` while fewer than
        `min_length_samples_for_tail` were measured."""
        key = (digest, domain)
        hit = self._sigma_cache.get(key)
        if hit is not None:
            return hit
        p = self.params
        cv = p.default_length_cv
        n, total, sumsq = self._length_moments.get(key, (0, 0.0, 0.0))
        if n >= p.min_length_samples_for_tail and total > 0.0:
            mean = total / n
            cv = math.sqrt(max(0.0, sumsq / n - mean * mean)) / mean
        sigma = self._sigma_cache[key] = math.sqrt(math.log1p(cv * cv))
        return sigma

    def output_tail(self, digest: str, domain: str) -> float:
        """How many times its mean a task's output plausibly runs to: the 99th percentile (by
        default) of a lognormal with mean 1 and the lengths' spread."""
        sigma = self.length_sigma(digest, domain)
        # ln L ~ N(-sigma^2/2, sigma^2) has E[L] = 1.
        return math.exp(self.params.length_tail_quantile_z * sigma - sigma * sigma / 2)

    def output_left(self, digest: str, domain: str, done: float) -> float:
        """Expected output still to come, as a share of the mean, of a task that has produced
        `done` times the mean and is still running (a censored sample of a lognormal with mean 1
        and the lengths' spread): E[L - done | L > done]."""
        sigma = self.length_sigma(digest, domain)
        if done <= 0.0:
            return 1.0
        if sigma <= 0.0:
            return max(0.0, 1.0 - done)
        z = (math.log(done) + sigma * sigma / 2) / sigma
        survive = _normal_cdf(-z)
        if survive < 1e-12:
            # Far beyond anything seen: the lognormal's tail is then about done * sigma^2 / ln(done).
            return done * sigma * sigma / max(math.log(done), sigma * sigma)
        return _normal_cdf(sigma - z) / survive - done

    def capped_output(self, digest: str, domain: str, max_tokens: int | None) -> Field:
        """Expected output tokens of a request that carries a `max_tokens` cap: E[min(L, cap)] of
        the lengths' law (a lognormal with the `output_tokens` mean and the `length_sigma`
        spread), not min(mean, cap): a cap near the mean cuts the long answers only. Without a
        cap, `output_tokens` itself."""
        out = self.output_tokens(digest, domain)
        if max_tokens is None:
            return out
        key = ("#capped", digest, domain, max_tokens)
        hit = self.memo.get(key)
        if isinstance(hit, Field):
            return hit
        m, cap = out.value, float(max(0, max_tokens))
        sigma = self.length_sigma(digest, domain)
        if m <= 0.0 or cap <= 0.0 or sigma <= 0.0:
            value = max(0.0, min(m, cap))
        else:
            # Lognormal (mu, s) with mean m: E[min(L, c)] = m Phi(z - s) + c (1 - Phi(z)),
            # z = (ln c - mu) / s, mu = ln m - s^2 / 2.
            z = (math.log(cap) - math.log(m) + sigma * sigma / 2.0) / sigma
            value = m * _normal_cdf(z - sigma) + cap * (1.0 - _normal_cdf(z))
        hit = msgspec.structs.replace(
            out,
            value=value,
            source=f"E[min(length, max_tokens {max_tokens})], lognormal sigma {sigma:.2f}: {out.source}",
        )
        self.memo[key] = hit
        return hit

    def quality(self, digest: str, domain: str) -> Field:
        """Quality in [0, 1] of the model for the domain, whichever worker runs it: the Beta
        posterior's mean, with its standard deviation and interval (the module's docstring)."""
        key = (digest, domain)
        hit = self._quality_cache.get(key)
        if hit is None:
            hit = self._quality(digest, domain)
            self._quality_cache[key] = hit
        return hit

    def _quality(self, digest: str, domain: str) -> Field:
        p = self.params
        k = p.k_quality
        pool = self._quality_pools.get(digest)
        pooled = pool.without(domain) if pool is not None else None
        if pooled is not None:
            m0, _, pooled_n, newest = pooled
            prior_kind = "model-pooled"
            prior_text = f"model-pooled n={pooled_n} other domains, age {format_age(self._age(newest))}"
        else:
            m0, prior_kind, prior_text = p.default_quality, "default", "default"
        a0, b0 = k * m0, k * (1.0 - m0)
        cell = self._quality_cells.get((digest, domain))
        n = 0 if cell is None else cell.n
        successes = 0.0 if cell is None else cell.mean * cell.n
        mean, sd = beta_posterior(successes, float(n), m0, k)
        z = self._interval_z
        interval = (max(0.0, mean - z * sd), min(1.0, mean + z * sd))
        if cell is None:
            return Field(
                value=mean,
                n=0,
                source=f"prior {prior_text}, Beta({a0:.2g}, {b0:.2g}), never graded",
                age_s=None,
                prior=m0,
                sd=sd,
                interval=interval,
            )
        return Field(
            value=mean,
            n=n,
            source=f"model n={n} graded + prior {prior_kind} Beta({a0:.2g}, {b0:.2g})",
            age_s=self._age(cell.updated_at),
            weight=cell.weight,
            prior=m0,
            sd=sd,
            interval=interval,
        )


def _concurrency_moments(
    row: SpeedRow, now_ms: int, half_life_s: float
) -> tuple[float, float, float, float] | None:
    """(decode speed's squared coefficient of variation, in-flight mean, in-flight variance, weight)
    from the decayed moments, or None without two samples of both."""
    d, k = row.decode_tps, row.in_flight
    if d.n < 2 or k.n < 2 or d.dn <= 0 or k.dn <= 0:
        return None
    d_mean = d.dsum / d.dn
    k_mean = k.dsum / k.dn
    if d_mean <= 0 or k_mean <= 0:
        return None
    cv2 = max(0.0, d.dsumsq / d.dn - d_mean * d_mean) / (d_mean * d_mean)
    k_var = max(0.0, k.dsumsq / k.dn - k_mean * k_mean)
    return cv2, k_mean, k_var, k.weight_at(now_ms, half_life_s)


def build_estimator(
    snapshot: Snapshot,
    now_ms: int,
    params: EstimateParams | None = None,
    embedding: frozenset[str] = frozenset(),
) -> Estimator:
    """The estimates of `snapshot` as seen at `now_ms` (the caller's clock; nothing here reads one);
    `embedding`: the digests of embedding models."""
    return Estimator(
        snapshot.speed.values(),
        snapshot.length.values(),
        snapshot.quality.values(),
        now_ms,
        snapshot.half_life_s,
        params,
        embedding,
    )
