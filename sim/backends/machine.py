"""One simulated machine: the models it holds and has loaded, its slots, its speeds and its faults.

The HTTP layer (sim/backends/host.py) turns requests into `Generation`s and runs them here. Time
is simulated: every duration is computed in simulated seconds from the preset's speeds and reported
as such (so that `eval_count / eval_duration` is the preset's decode speed whatever the time
scale), and the machine really waits that duration multiplied by `time_scale` (0: it does not wait).

State timers — keep_alive expiry and online windows — run on the wall clock multiplied by
`time_scale`, or unscaled when `time_scale` is 0, so that a zero-delay run keeps its models loaded.

Prompt cache: as in Ollama and llama.cpp, each parallel slot of a loaded model keeps the KV cache of
its last prompt and of what it generated, and a request evaluates only the tokens after the prefix
its slot already holds. See `SlotCache`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec

from dispatch.ollama import rfc3339
from projections.benchset import SPEED_MAX_TOKENS
from sim.backends.ask import IMAGE_TOKENS, Answer, Ask
from sim.backends.embedding import embedding_vector
from sim.backends.schema import schema_value
from sim.backends.text import (
    asks_at_length,
    bench_answer,
    bench_prompt,
    count_tokens,
    filler,
    is_japanese,
    json_answer,
    sample_length,
    seed_of,
    split_tokens,
)
from sim.backends.tools import plan_calls, quote_results, tool_names
from sim.errors import BadRequestError, CapabilityError, SimHostError, UnknownModelError
from sim.fleetspec import Fleet, ModelSpec, WorkerModel, WorkerSpec

# Tokens are released to a streaming client at most this late (wall seconds); fewer wake-ups.
STREAM_QUANTUM_S = 0.002
# Without a client watching, the machine may sleep in longer steps.
QUIET_QUANTUM_S = 0.005
# In zero-delay mode a stream goes out in batches of this many chunks (still one token per chunk).
ZERO_DELAY_BATCH = 256

Fault = Literal["error", "hang", "disconnect"]


class Faults(msgspec.Struct, kw_only=True):
    """Per-request fault rates; drawn once per generation request, in this order."""

    error_rate: float = 0.0
    hang_rate: float = 0.0
    disconnect_rate: float = 0.0


class Counters(msgspec.Struct, kw_only=True):
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    not_found: int = 0
    errors: int = 0
    hangs: int = 0
    disconnects: int = 0
    loads: int = 0
    unloads: int = 0
    prompt_tokens: int = 0
    eval_tokens: int = 0
    # Of `prompt_tokens`, those a slot's cache already held (not evaluated again), and the
    # generations that reused any.
    cached_prompt_tokens: int = 0
    cache_hits: int = 0


class LoadedModel(msgspec.Struct, kw_only=True):
    name: str
    digest: str
    # Bytes in memory, and of those in GPU memory; None: the fleet does not say how big the model is.
    size: int | None
    size_vram: int | None
    expires_at: str
    in_use: int


class MachineState(msgspec.Struct, kw_only=True):
    """What GET /sim/state answers."""

    name: str
    online: bool
    slots: int
    running: int
    queued: int
    held: list[str]
    loaded: list[LoadedModel]
    faults: Faults
    counters: Counters
    time_scale: float
    # Decode and prompt speed times this (POST /sim/speed): the fleet's `slowdown` at run time.
    speed_factor: float = 1.0


class Embedded(msgspec.Struct, kw_only=True):
    """The answer to one embedding request: a vector per input, and Ollama's timings in ns."""

    vectors: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class Timings(msgspec.Struct, kw_only=True):
    """Ollama's own timings of one generation, in simulated nanoseconds."""

    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int
    done_reason: str
    # Of `prompt_eval_count` (the whole prompt, as Ollama counts it), the tokens read from a slot's
    # cache; `prompt_eval_duration` is the time of the others alone.
    prompt_eval_cached_count: int = 0


def full_name(name: str) -> str:
    """Ollama's canonical model name: a name without a tag means `:latest`."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def keep_alive_seconds(value: object) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "-1"); None: default."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise SimHostError(f"keep_alive must be a duration, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise SimHostError(f"keep_alive must be a duration, got {value!r}")
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    sign = -1.0 if text.startswith("-") else 1.0
    rest = text.lstrip("+-")
    total = 0.0
    number = ""
    i = 0
    while i < len(rest):
        ch = rest[i]
        if ch.isdigit() or ch == ".":
            number += ch
            i += 1
            continue
        unit = next((u for u in ("ms", "us", "µs", "ns", "h", "m", "s") if rest.startswith(u, i)), None)
        if unit is None or not number:
            raise SimHostError(f"keep_alive {value!r} is not a duration")
        total += float(number) * units[unit]
        number = ""
        i += len(unit)
    if number or not rest:
        raise SimHostError(f"keep_alive {value!r} is not a duration")
    return sign * total


class SlotCache:
    """One parallel slot's KV cache, as Ollama's runner and llama.cpp's server keep it.

    `held` is what the slot last evaluated and generated, as the bytes of rendered text (the
    simulator's tokenizer reads four bytes a token, so a shared prefix of b bytes is b // 4 shared
    tokens): the request's prompt, then "\n" and every token it generated. The simulator renders a
    conversation as its messages' texts joined by "\n" (sim/backends/host.py), so a chat client that
    resends the answer it received as an assistant message, then a new user message, sends a prompt
    that begins with `held`: turn k+1 is turn k + "\n" + answer + "\n" + question. Thinking is
    generated but not resent, so after a thinking answer only the prompt and its "\n" are shared, as
    with real templates that drop earlier thinking.
    """

    __slots__ = ("held", "in_use", "used_at")

    def __init__(self) -> None:
        self.held = b""
        self.in_use = False
        # When the slot was last given a request (a counter, for least recently used).
        self.used_at = 0


def shared_prefix(a: bytes, b: bytes) -> int:
    """Length in bytes of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    # Slice comparisons run in C: halving them beats a byte-by-byte loop on long conversations.
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Model:
    """A held model's run-time state on the machine."""

    __slots__ = (
        "caches",
        "digest",
        "expires",
        "key",
        "load_count",
        "loaded",
        "name",
        "ready",
        "refs",
        "spec",
        "speed",
    )

    def __init__(self, name: str, key: str, digest: str, spec: ModelSpec, speed: WorkerModel) -> None:
        self.name = name
        self.key = key
        self.digest = digest
        self.spec = spec
        self.speed = speed
        self.loaded = False
        self.ready: asyncio.Future[None] | None = None
        self.refs = 0
        # Loop time at which an idle loaded model unloads (inf: never).
        self.expires = math.inf
        self.load_count = 0
        # One per parallel slot while loaded; unloading loses them all.
        self.caches: list[SlotCache] = []


class Generation:
    """One generation request, planned up front so that its output is fixed by its seeds."""

    __slots__ = (
        "answer",
        "cache_key",
        "cached_tokens",
        "disconnect_after",
        "fault",
        "gone",
        "keep_alive",
        "load_only",
        "max_tokens",
        "model",
        "prompt_tokens",
        "tokens",
        "unload",
    )

    def __init__(
        self,
        model: _Model,
        prompt_tokens: int,
        answer: Answer,
        max_tokens: int | None,
        keep_alive: float | None,
        fault: Fault | None,
        disconnect_after: int,
        cache_key: bytes = b"",
    ) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens
        # The prompt as a slot's cache compares it (see SlotCache), and how much of it the slot
        # given to this job already held.
        self.cache_key = cache_key
        self.cached_tokens = 0
        self.answer = answer
        self.tokens = answer.tokens
        self.max_tokens = max_tokens
        self.keep_alive = keep_alive
        self.fault = fault
        self.disconnect_after = disconnect_after
        self.load_only = False
        self.unload = False
        # Set by the HTTP layer: true once the client's connection is gone.
        self.gone: Callable[[], bool] = _never

    @property
    def digest(self) -> str:
        return self.model.digest


def _never() -> bool:
    return False


Emit = Callable[[list[str]], Awaitable[None]]


class SimMachine:
    """One simulated machine. Not thread-safe: everything runs on one event loop."""

    def __init__(self, spec: WorkerSpec, fleet: Fleet, *, time_scale: float = 1.0, seed: int = 0) -> None:
        if time_scale < 0:
            raise SimHostError(f"time_scale must be >= 0, got {time_scale}")
        self.spec = spec
        self.name = spec.name
        self.fleet = fleet
        self.time_scale = time_scale
        # Timers that are state, not work: see the module docstring.
        self.timer_scale = time_scale or 1.0
        self.seed = seed
        self.slots = spec.slots
        self.faults = Faults(
            error_rate=spec.error_rate, hang_rate=spec.hang_rate, disconnect_rate=spec.disconnect_rate
        )
        self.counters = Counters()
        # Every model's decode and prompt speed times this from now on (a game started on it).
        self.speed_factor = 1.0
        self.online = True
        self.running = 0
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._fault_rng = random.Random(seed_of("faults", seed, spec.name))
        self._seq = 0
        self._slot_tick = 0
        self.models: dict[str, _Model] = {}
        self.modified_at: dict[str, str] = {}
        for key, speed in spec.models.items():
            if speed.held:
                self._hold(key, _START_STAMP)

    # -- inventory --------------------------------------------------------------------------------

    def _hold(self, key: str, stamp: str) -> _Model:
        name = full_name(key)
        model = _Model(
            name, key, self.fleet.digest_of(self.spec, key), self.fleet.model_spec(key), self.spec.models[key]
        )
        self.models[name] = model
        self.modified_at[name] = stamp
        return model

    def find(self, name: str) -> _Model:
        model = self.models.get(full_name(name))
        if model is None:
            raise UnknownModelError(f'model "{name}" not found, try pulling it first')
        return model

    def pullable(self, name: str) -> str | None:
        """The preset key of a model this machine may be given, if `name` is one."""
        wanted = full_name(name)
        return next((key for key in self.spec.models if full_name(key) == wanted), None)

    def give_model(self, name: str) -> str:
        """Give the machine a model its preset lists (held or not); returns its full name."""
        key = self.pullable(name)
        if key is None:
            raise UnknownModelError(
                f"pull model manifest: file does not exist ({name} is not in {self.name}'s preset)"
            )
        full = full_name(key)
        if full not in self.models:
            self._hold(key, rfc3339())
        return full

    def take_model(self, name: str) -> None:
        """Remove a model from the machine (Ollama's DELETE /api/delete)."""
        model = self.find(name)
        del self.models[model.name]
        self.modified_at.pop(model.name, None)

    # -- planning ---------------------------------------------------------------------------------

    def plan(self, ask: Ask) -> Generation:
        """A job for `ask`, its output fixed by the machine's seed and the request's.

        What the model answers, in this order: tool calls, when tools are offered and the rule of
        sim.backends.tools calls one; a quote of the tool results that end the conversation; the
        benchmark answer, when the last user message is a benchmark prompt; JSON, when a format is
        asked for and the model follows formats (valid against the schema if one is given, else an
        array of three short pseudo-sentences); pseudo-words otherwise. With `think`, thinking comes
        first: pseudo-words, half as many tokens as the answer and at least 8.
        """
        self.counters.requests += 1
        try:
            model = self.find(ask.model)
        except UnknownModelError:
            self.counters.not_found += 1
            raise
        self._check_capabilities(model, ask)
        ka = keep_alive_seconds(ask.keep_alive)
        self._seq += 1
        salt: object = ask.seed if ask.seed is not None else f"n{self._seq}"
        rng = random.Random(seed_of(self.seed, model.digest, salt, ask.prompt))
        japanese = is_japanese(ask.last_user)
        wants_json = bool(ask.format) and model.spec.follows_format
        answer: Answer | None = None
        if ask.wants_tools and not ask.tool_results:
            calls = plan_calls(ask, rng)
            answer = Answer(tokens=[piece for call in calls for piece in call.pieces], calls=calls)
        if answer is None and ask.tool_results and not wants_json:
            answer = Answer(tokens=quote_results(ask.tool_results))
        if answer is None and asks_at_length(ask.last_user):
            # A speed prompt: answered at length, until the benchmark's cap cuts it.
            answer = Answer(tokens=filler(rng, ask.max_tokens or SPEED_MAX_TOKENS, japanese))
        if answer is None:
            bench = bench_prompt(ask.last_user)
            if bench is not None:
                # A model without a number for the domain answers like a coin toss: the sim needs some value.
                tokens = bench_answer(rng, ask.last_user, model.spec.quality.get(bench.domain, 0.5))
                answer = Answer(tokens=tokens) if tokens is not None else None
        if answer is None and wants_json:
            if isinstance(ask.format, dict):
                text = json.dumps(schema_value(ask.format, rng), ensure_ascii=False)
                answer = Answer(tokens=split_tokens(text))
            else:
                answer = Answer(tokens=json_answer(rng, japanese))
        if answer is None:
            answer = Answer(tokens=filler(rng, sample_length(rng, model.spec.output), japanese))
        if ask.think:
            thought = filler(rng, max(8, len(answer.tokens) // 2), japanese)
            answer = Answer(tokens=thought + answer.tokens, thinking=len(thought), calls=answer.calls)
        fault = self._draw_fault()
        disconnect_after = 0
        if fault == "error":
            self.counters.errors += 1
        elif fault == "hang":
            self.counters.hangs += 1
        elif fault == "disconnect":
            self.counters.disconnects += 1
            disconnect_after = self._fault_rng.randint(0, max(0, len(answer.tokens) // 2))
        prompt_tokens = count_tokens(ask.prompt) + ask.images * IMAGE_TOKENS
        cache_key = ask.prompt.encode()
        if ask.tools:
            # The tool definitions are rendered into the prompt by the model's template, ahead of
            # the conversation (so a conversation that keeps its tools keeps its prefix).
            tools_text = json.dumps(ask.tools)
            prompt_tokens += count_tokens(tools_text)
            cache_key = tools_text.encode() + b"\n" + cache_key
        return Generation(
            model, prompt_tokens, answer, ask.max_tokens, ka, fault, disconnect_after, cache_key
        )

    def _check_capabilities(self, model: _Model, ask: Ask) -> None:
        """Refuse, as Ollama does, what the model cannot do: `"NAME" does not support tools`."""
        caps = model.spec.capabilities
        if "completion" not in caps and not ask.load_only:
            raise CapabilityError(f'"{ask.model}" does not support {ask.surface}')
        if ask.tools:
            tool_names(ask.tools)
            if "tools" not in caps:
                raise CapabilityError(f'"{ask.model}" does not support tools')
        if ask.think and "thinking" not in caps:
            raise CapabilityError(f'"{ask.model}" does not support thinking')
        if ask.images and "vision" not in caps:
            raise CapabilityError(f'"{ask.model}" does not support vision')

    async def embed(
        self,
        model_name: str,
        texts: list[str],
        *,
        truncate: bool = True,
        dimensions: int | None = None,
        keep_alive: object = None,
    ) -> Embedded:
        """Embed `texts` (none: only load the model), taking a slot and the model's embedding time:
        load (if not loaded) plus prompt tokens / `embed_tps`, waited times `time_scale`.

        Inputs longer than the model's `context_length` are cut to it when `truncate` (the
        default), refused otherwise. No faults are drawn for embeddings.
        """
        self.counters.requests += 1
        try:
            model = self.find(model_name)
        except UnknownModelError:
            self.counters.not_found += 1
            raise
        if "embedding" not in model.spec.capabilities:
            raise CapabilityError(f'"{model_name}" does not support embedding')
        dim = model.spec.embedding_dim
        if dimensions is not None and not 0 < dimensions <= dim:
            raise BadRequestError(f"dimensions must be between 1 and the model's {dim}, got {dimensions}")
        ka = keep_alive_seconds(keep_alive)
        context = model.spec.context_length
        counts: list[int] = []
        kept: list[str] = []
        for text in texts:
            n = count_tokens(text)
            if context is not None and n > context:
                if not truncate:
                    raise BadRequestError(
                        f"the input length ({n} tokens) exceeds the context length ({context}); "
                        "shorten it or set truncate to true"
                    )
                # Four bytes a token, as count_tokens reads text.
                text = text.encode()[: context * 4].decode(errors="ignore")
                n = context
            counts.append(n)
            kept.append(text)
        arrived = _loop_time()
        await self.acquire()
        pinned = False
        try:
            queued_s = (_loop_time() - arrived) / self.time_scale if self.time_scale else 0.0
            load_s = await self._use(model)
            pinned = True
            tokens = sum(counts)
            embed_s = tokens * self._share(self.active + 1) / (model.speed.embedding_tps * self.speed_factor)
            if self.time_scale and tokens:
                self.active += 1
                try:
                    await asyncio.sleep(embed_s * self.time_scale)
                finally:
                    self.active -= 1
            vectors = [embedding_vector(model.digest, text, dim, dimensions) for text in kept]
            self.counters.completed += 1
            self.counters.prompt_tokens += tokens
            reported_load_s = load_s if load_s > 0 else self.spec.warm_load_ms / 1000.0
            return Embedded(
                vectors=vectors,
                total_duration=_ns(queued_s + load_s + embed_s),
                load_duration=_ns(reported_load_s),
                prompt_eval_count=tokens,
            )
        finally:
            if pinned:
                self._unpin(model, ka)
            self.release()

    def _draw_fault(self) -> Fault | None:
        f = self.faults
        if f.error_rate <= 0 and f.hang_rate <= 0 and f.disconnect_rate <= 0:
            return None
        u = self._fault_rng.random()
        if u < f.error_rate:
            return "error"
        if u < f.error_rate + f.hang_rate:
            return "hang"
        if u < f.error_rate + f.hang_rate + f.disconnect_rate:
            return "disconnect"
        return None

    # -- slots ------------------------------------------------------------------------------------

    async def acquire(self) -> None:
        """Take a slot, waiting in FIFO order behind earlier requests."""
        if self.running < self.slots and not self._waiters:
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # The slot was handed over just as we were cancelled: pass it on.
                self.release()
            elif fut in self._waiters:
                # A release() between the cancel and this handler has already dropped the
                # cancelled future from the line (a shutdown cancels every request at once).
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                # The slot passes straight to the next in line; `running` stays the same.
                fut.set_result(None)
                return
        self.running -= 1

    @property
    def queued(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    # -- loading ----------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Unload idle models whose keep_alive has run out."""
        now = _loop_time()
        for model in self.models.values():
            if model.loaded and model.refs == 0 and model.expires <= now:
                self._unload(model)

    def _unload(self, model: _Model) -> None:
        model.loaded = False
        model.ready = None
        model.expires = math.inf
        model.caches = []
        self.counters.unloads += 1

    async def _use(self, model: _Model) -> float:
        """Pin the model, loading it first if needed; simulated seconds this request spent on loading."""
        self.sweep()
        model.refs += 1
        if model.loaded:
            return 0.0
        if model.ready is not None:
            # Someone else is loading it: wait for that load, and count the wait as ours.
            started = _loop_time()
            await asyncio.shield(model.ready)
            return (_loop_time() - started) / self.time_scale if self.time_scale else model.speed.load_s
        model.ready = asyncio.get_running_loop().create_future()
        ready = model.ready
        try:
            if self.time_scale:
                await asyncio.sleep(model.speed.load_s * self.time_scale)
        except BaseException:
            model.ready = None
            ready.cancel()
            raise
        model.loaded = True
        model.caches = [SlotCache() for _ in range(self.slots)]
        model.load_count += 1
        self.counters.loads += 1
        ready.set_result(None)
        return model.speed.load_s

    def _unpin(self, model: _Model, keep_alive: float | None) -> None:
        model.refs -= 1
        if model.refs > 0 or not model.loaded:
            return
        seconds = self.spec.keep_alive_s if keep_alive is None else keep_alive
        if seconds < 0:
            model.expires = math.inf
        elif seconds == 0:
            self._unload(model)
        else:
            model.expires = _loop_time() + seconds * self.timer_scale

    # -- running ----------------------------------------------------------------------------------

    def _share(self, k: int) -> float:
        """Seconds-per-token multiplier with k generations at once: each runs at k**e / k of solo speed."""
        return float(k ** (1.0 - self.spec.parallel_exponent)) if k > 1 else 1.0

    async def run(self, job: Generation, emit: Emit | None) -> Timings | None:
        """Run `job` to its end; None when the client went away (or the fault cut it off) first.

        `emit` receives tokens as they are produced (streaming); without it the output is only timed.
        """
        arrived = _loop_time()
        await self.acquire()
        model = job.model
        pinned = False
        try:
            queued_s = (_loop_time() - arrived) / self.time_scale if self.time_scale else 0.0
            if job.gone():
                self.counters.cancelled += 1
                return None
            load_s = await self._use(model)
            pinned = True
            if job.load_only:
                return Timings(
                    total_duration=_ns(queued_s + load_s),
                    load_duration=_ns(load_s),
                    prompt_eval_count=0,
                    prompt_eval_duration=0,
                    eval_count=0,
                    eval_duration=0,
                    done_reason="load",
                )
            slot = self._take_slot(job)
            self.active += 1
            try:
                result = await self._generate(job, emit)
            finally:
                self.active -= 1
                slot.in_use = False
            if result is None:
                return None
            prompt_s, eval_s, n, reason = result
            slot.held = job.cache_key + b"\n" + "".join(job.tokens[:n]).encode()
            # A warm call still reports a few milliseconds of "load", as real Ollama does.
            reported_load_s = load_s if load_s > 0 else self.spec.warm_load_ms / 1000.0
            self.counters.completed += 1
            self.counters.prompt_tokens += job.prompt_tokens
            self.counters.eval_tokens += n
            if job.cached_tokens:
                self.counters.cached_prompt_tokens += job.cached_tokens
                self.counters.cache_hits += 1
            return Timings(
                total_duration=_ns(queued_s + load_s + prompt_s + eval_s),
                load_duration=_ns(reported_load_s),
                prompt_eval_count=job.prompt_tokens,
                prompt_eval_duration=_ns(prompt_s),
                eval_count=n,
                eval_duration=_ns(eval_s),
                done_reason=reason,
                prompt_eval_cached_count=job.cached_tokens,
            )
        finally:
            if pinned:
                self._unpin(model, 0.0 if job.unload else job.keep_alive)
            self.release()

    def _take_slot(self, job: Generation) -> SlotCache:
        """Give `job` the free slot of its model whose cache shares the longest prefix with its
        prompt, or, when none shares a token, the least recently used free slot (Ollama's runner);
        the slot keeps the shared prefix and holds the new prompt from now on.

        A job that holds a machine slot always finds a free cache slot: a model has as many as the
        machine has slots.
        """
        model = job.model
        key = job.cache_key
        free = [
            (shared_prefix(slot.held, key) // 4, -slot.used_at, slot)
            for slot in model.caches
            if not slot.in_use
        ]
        if free:
            best_tokens, _, best = max(free, key=lambda f: (f[0], f[1]))
        else:
            # Only when the model was unloaded under a running generation (power off): no cache.
            best_tokens, best = 0, SlotCache()
        self._slot_tick += 1
        best.in_use = True
        best.used_at = self._slot_tick
        best.held = key
        # At least one token is evaluated, even when the whole prompt is cached: the model needs it
        # to produce the first output token's logits.
        job.cached_tokens = max(0, min(best_tokens, job.prompt_tokens - 1))
        return best

    async def _generate(self, job: Generation, emit: Emit | None) -> tuple[float, float, int, str] | None:
        speed = job.model.speed
        tokens = job.tokens
        reason = "stop"
        if job.max_tokens is not None and 0 < job.max_tokens < len(tokens):
            tokens = tokens[: job.max_tokens]
            reason = "length"
        cut = job.disconnect_after if job.fault == "disconnect" else None
        scale = self.time_scale
        evaluated = job.prompt_tokens - job.cached_tokens
        prompt_s = evaluated * self._share(self.active) / (speed.prompt_tps * self.speed_factor)
        if scale:
            await asyncio.sleep(prompt_s * scale)
            if job.gone():
                self.counters.cancelled += 1
                return None
        limit = len(tokens) if cut is None else min(cut, len(tokens))
        if not scale:
            # Nothing waits, so nothing overlaps: the reported speed is the share at this moment.
            eval_s = len(tokens) * self._share(self.active) / (speed.decode_tps * self.speed_factor)
            if emit is not None:
                for i in range(0, limit, ZERO_DELAY_BATCH):
                    await emit(tokens[i : min(i + ZERO_DELAY_BATCH, limit)])
                    if job.gone():
                        self.counters.cancelled += 1
                        return None
            if cut is not None:
                return None
            return prompt_s, eval_s, len(tokens), reason
        quantum = STREAM_QUANTUM_S if emit is not None else QUIET_QUANTUM_S
        start = _loop_time()
        sim = 0.0
        tps = speed.decode_tps
        i = 0
        while i < limit:
            # The share is read again every quantum, so that a generation that starts or ends beside
            # this one changes its speed from then on.
            dt = self._share(self.active) / (tps * self.speed_factor)
            step = min(limit - i, max(1, int(quantum / (dt * scale))))
            sim += step * dt
            delay = start + sim * scale - _loop_time()
            if delay > 0:
                await asyncio.sleep(delay)
            if job.gone():
                self.counters.cancelled += 1
                return None
            if emit is not None:
                await emit(tokens[i : i + step])
            i += step
        if cut is not None:
            return None
        return prompt_s, sim, len(tokens), reason

    # -- online / offline -------------------------------------------------------------------------

    def power_off(self) -> None:
        """Memory is lost: nothing stays loaded. The HTTP layer closes the port and the connections."""
        self.online = False
        for model in self.models.values():
            if model.loaded:
                self._unload(model)
            model.ready = None

    def power_on(self) -> None:
        self.online = True

    # -- reporting --------------------------------------------------------------------------------

    def loaded(self) -> list[LoadedModel]:
        self.sweep()
        now = _loop_time()
        out: list[LoadedModel] = []
        for model in self.models.values():
            if not model.loaded:
                continue
            # In use: Ollama shows the expiry the model will get once idle.
            left = self.spec.keep_alive_s * self.timer_scale if model.refs > 0 else model.expires - now
            out.append(
                LoadedModel(
                    name=model.name,
                    digest=model.digest,
                    size=model.spec.size,
                    size_vram=(
                        None
                        if model.spec.size is None
                        else min(model.spec.size, self.spec.vram_bytes)
                        if self.spec.vram_bytes is not None
                        else model.spec.size
                    ),
                    expires_at=rfc3339(time.time() + left) if math.isfinite(left) else _FOREVER,
                    in_use=model.refs,
                )
            )
        return out

    def state(self) -> MachineState:
        return MachineState(
            name=self.name,
            online=self.online,
            slots=self.slots,
            running=self.running,
            queued=self.queued,
            held=sorted(self.models),
            loaded=self.loaded(),
            faults=msgspec.structs.replace(self.faults),
            counters=msgspec.structs.replace(self.counters),
            time_scale=self.time_scale,
            speed_factor=self.speed_factor,
        )

    def set_speed(self, factor: float) -> float:
        """Multiply every model's decode and prompt speed by `factor` (1: as the preset says) from
        now on, generations already running included; returns the factor in force."""
        if not (factor > 0 and math.isfinite(factor)):
            raise SimHostError(f"speed factor must be positive, got {factor}")
        self.speed_factor = float(factor)
        return self.speed_factor

    def set_faults(
        self,
        *,
        error_rate: float | None = None,
        hang_rate: float | None = None,
        disconnect_rate: float | None = None,
    ) -> Faults:
        """Change fault rates (None: leave as is); returns the rates now in force."""
        for name, value in (
            ("error_rate", error_rate),
            ("hang_rate", hang_rate),
            ("disconnect_rate", disconnect_rate),
        ):
            if value is None:
                continue
            if not 0.0 <= value <= 1.0:
                raise SimHostError(f"{name} must be within [0, 1], got {value}")
            setattr(self.faults, name, float(value))
        total = self.faults.error_rate + self.faults.hang_rate + self.faults.disconnect_rate
        if total > 1.0 + 1e-9:
            raise SimHostError(f"fault rates add up to {total:.3f}, more than 1")
        return msgspec.structs.replace(self.faults)


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


# What Ollama reports for a model kept loaded forever (keep_alive < 0).
_FOREVER = "2318-01-01T00:00:00Z"
# The sim's models were "pulled" when the process started.
_START_STAMP = rfc3339()
