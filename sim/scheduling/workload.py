"""Workloads of the scheduling simulator: Poisson arrivals at a target load, output lengths per
domain, bursts (pipelines of k children), multi-turn chats, and workers joining or leaving mid-run.

Load = arrival rate x mean work / total fleet speed, for the requested model: the fleet's
capacity is the sum over the workers that serve the model of slots**parallel_exponent / (mean
service time there), so load 1.0 is what the whole fleet can just keep up with.

A chat (`kind="chat"`, `generate_chat`) is a conversation of `turns_min`..`turns_max` turns (drawn
uniformly: 2..8, mean 5, by default). Each turn's prompt is the conversation so far (every earlier
user message and answer) plus a new user message (exponential, mean `prompt_tokens`); its answer
has the model's output law. The next turn is sent `think_s` (exponential, mean 30 s) after the
answer finished, so only the first turn's arrival is known in advance: the simulator schedules each
later one when its previous turn completes (`Job.next`, `Job.think_s`). Conversations start as a
Poisson process; its load counts every turn's prompt as if nothing were cached (the work a fleet
without caches would do): conversation rate = load x capacity at the mean turn / mean turns.

A mix (`WorkloadSpec.mix`, `routeledger sim schedule --mix FILE`) is traffic of several classes,
each with its domain, share of arrivals, prompt length law (lognormal around its mean), output
length law and optional `max_tokens` cap (`Mix`, `parse_mix`). Each arrival draws its class, then
its prompt and its output (capped by `max_tokens`, as a backend stops there). Load keeps its
meaning: the fleet's capacity is taken at the mix's mean task (its classes' mean prompt and mean
capped output, weighted by share; service time is linear in tokens, so that is the mean service
time on each worker), and arrival rate = load x that capacity. A one-class mix draws no class and,
with `prompt_sigma = 0`, no prompt either, so it gives exactly the jobs of the same single-domain
workload.
"""

from __future__ import annotations

import hashlib
import math
import random
import tomllib
from importlib import resources
from pathlib import Path

import msgspec

from router.prefix import BLOCK_CHARS, MAX_BLOCKS, PromptChain
from sim.errors import FleetError, MixError
from sim.fleetspec import Fleet, WorkerSpec

# A chat prompt's characters per token: the chain of a prompt of n tokens covers 4n characters,
# so a block of the chain (BLOCK_CHARS = 256 characters) is 64 tokens.
CHARS_PER_TOKEN = 4
WORKLOADS = ("poisson", "chat")
OUTPUT_DISTS = ("exp", "lognormal", "fixed")
# How far a mix's shares may sum from 1.
SHARE_TOLERANCE = 1e-6


class MixClass(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One class of a mix: its share of arrivals and the laws of its prompt and output lengths."""

    domain: str
    share: float
    # Mean prompt tokens; lognormal with `prompt_sigma` (0: every prompt has the mean).
    prompt_tokens: float
    prompt_sigma: float = 0.0
    # Mean output tokens, under `output_dist` (exp, lognormal with `output_sigma`, or fixed).
    output_tokens: float
    output_dist: str
    output_sigma: float = 0.0
    # The cap the request carries: no output runs longer.
    max_tokens: int | None = None


class Mix(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A workload mix: `[[class]]` tables (module docstring)."""

    name: str = ""
    classes: tuple[MixClass, ...] = msgspec.field(name="class")


class WorkloadSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What to submit: how many tasks, how fast, how long."""

    load: float = 0.6
    tasks: int = 10_000
    seed: int = 1
    # None: the model's own output distribution from the fleet file.
    dist: str | None = None
    mean_tokens: float | None = None
    sigma: float | None = None
    prompt_tokens: int = 64
    domain: str = "general"
    # Each arrival is a pipeline of `burst` children submitted at once.
    burst: int = 1
    # (worker, simulated second): offline until then / offline from then.
    joins: tuple[tuple[str, float], ...] = ()
    leaves: tuple[tuple[str, float], ...] = ()
    # "poisson": independent tasks (in bursts of `burst`); "chat": conversations (module docstring).
    kind: str = "poisson"
    turns_min: int = 2
    turns_max: int = 8
    # Mean seconds between a turn's answer and the next turn.
    think_s: float = 30.0
    # Chat turns are paced (placed where their reader finishes reading: the API's `paced_streams`,
    # off by default as in production); other tasks never are.
    paced: bool = False
    # Several classes of traffic (module docstring); None: one domain with the fields above.
    mix: Mix | None = None


class Job(msgspec.Struct, kw_only=True, gc=False):
    """One simulated task: what it asks for (the truth the router does not see)."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    domain: str = "general"
    burst_id: int = 0
    bench: bool = False
    # A chat turn: its conversation (-1: not a chat), the index of the conversation's next turn
    # (-1: none), the think time before this turn is sent (after the previous one finished; its
    # `arrival` is then unknown, inf, until the simulator sets it), and its prompt's chain.
    conv: int = -1
    next: int = -1
    think_s: float = 0.0
    chain: PromptChain | None = None
    # The cap the request carries (None: none); `output_tokens` is already within it.
    max_tokens: int | None = None
    # Placed where its reader finishes reading (WorkloadSpec.paced: chat turns only).
    paced: bool = False


class ModelSpeeds(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """The true speeds of the requested model on one worker."""

    decode_tps: float
    prompt_tps: float
    load_s: float

    def seconds(self, prompt_tokens: float, output_tokens: float, loaded: bool) -> float:
        """Solo service time of a task on this worker."""
        return (
            (0.0 if loaded else self.load_s)
            + prompt_tokens / self.prompt_tps
            + output_tokens / self.decode_tps
        )


def serving(fleet: Fleet, model: str) -> list[WorkerSpec]:
    """Workers that hold and serve `model`, in registration order."""
    out = []
    for w in fleet.worker:
        held = w.models.get(model)
        if held is None or not held.held:
            continue
        if w.serves is not None and model not in w.serves:
            continue
        out.append(w)
    return out


def default_model(fleet: Fleet) -> str:
    """The model served by the most workers (first declared on a tie)."""
    counts: dict[str, int] = {}
    for w in fleet.worker:
        for m in w.models:
            counts.setdefault(m, 0)
    for m in counts:
        counts[m] = len(serving(fleet, m))
    if not counts or max(counts.values()) == 0:
        raise FleetError(f"fleet {fleet.name!r} has no model that any worker serves")
    return max(counts, key=lambda m: counts[m])


def speeds(worker: WorkerSpec, model: str) -> ModelSpeeds:
    m = worker.models[model]
    return ModelSpeeds(decode_tps=m.decode_tps, prompt_tps=m.prompt_tps, load_s=m.load_s)


def output_law(fleet: Fleet, model: str, spec: WorkloadSpec) -> tuple[str, float, float]:
    """(dist, mean, sigma) of output tokens: the flags, else the model's own law."""
    own = fleet.model_spec(model).output
    dist = spec.dist or own.dist
    if dist not in ("exp", "lognormal", "fixed"):
        raise FleetError(f"unknown output distribution {dist!r}; use exp, lognormal or fixed")
    return dist, spec.mean_tokens or own.mean, own.sigma if spec.sigma is None else spec.sigma


def capacity(fleet: Fleet, model: str, spec: WorkloadSpec) -> float:
    """Tasks per second the fleet can serve for `model` (all serving workers, models loaded); a
    mix's at its mean task (module docstring)."""
    _, mean, _ = output_law(fleet, model, spec)
    total = 0.0
    for w in serving(fleet, model):
        true = speeds(w, model)
        if spec.mix is not None:
            s = sum(c.share * true.seconds(c.prompt_tokens, capped_mean(c), True) for c in spec.mix.classes)
        else:
            s = true.seconds(spec.prompt_tokens, mean, True)
        total += w.slots**w.parallel_exponent / s
    if total <= 0:
        raise FleetError(f"no worker of fleet {fleet.name!r} serves {model!r}")
    return total


def draw_tokens(rng: random.Random, dist: str, mean: float, sigma: float) -> int:
    """One output length; at least one token."""
    if dist == "fixed":
        x = mean
    elif dist == "exp":
        x = rng.expovariate(1.0 / mean)
    else:
        # A lognormal with the given mean: mu = ln(mean) - sigma^2 / 2.
        x = rng.lognormvariate(math.log(mean) - sigma * sigma / 2.0, sigma)
    return max(1, round(x))


def capped_mean(c: MixClass) -> float:
    """The mean output of class `c` once its `max_tokens` cap is applied: E[min(X, cap)]."""
    cap = c.max_tokens
    m = c.output_tokens
    if cap is None:
        return m
    if c.output_dist == "fixed":
        return min(m, float(cap))
    if c.output_dist == "exp":
        return m * (1.0 - math.exp(-cap / m))
    if c.output_sigma <= 0:
        return min(m, float(cap))
    # Lognormal (mu, s): E[min(X, c)] = e^(mu + s^2/2) Phi((ln c - mu - s^2)/s) + c (1 - Phi((ln c - mu)/s)).
    s = c.output_sigma
    mu = math.log(m) - s * s / 2.0

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    z = (math.log(cap) - mu) / s
    return m * phi(z - s) + cap * (1.0 - phi(z))


def _check_mix(mix: Mix, source: str) -> Mix:
    if not mix.classes:
        raise MixError(f"{source}: a mix needs at least one [[class]] table")
    domains = [c.domain for c in mix.classes]
    if len(set(domains)) != len(domains):
        raise MixError(f"{source}: class domains must be unique, got {domains}")
    for i, c in enumerate(mix.classes):
        at = f"{source}: class[{i}] ({c.domain})"
        if c.output_dist not in OUTPUT_DISTS:
            raise MixError(f"{at}: output_dist {c.output_dist!r} is not one of {', '.join(OUTPUT_DISTS)}")
        for field in ("share", "prompt_tokens", "output_tokens"):
            if not getattr(c, field) > 0:
                raise MixError(f"{at}: {field} must be positive, got {getattr(c, field)}")
        for field in ("prompt_sigma", "output_sigma"):
            if not getattr(c, field) >= 0:
                raise MixError(f"{at}: {field} must be 0 or more, got {getattr(c, field)}")
        if c.max_tokens is not None and c.max_tokens < 1:
            raise MixError(f"{at}: max_tokens must be at least 1, got {c.max_tokens}")
    total = sum(c.share for c in mix.classes)
    if abs(total - 1.0) > SHARE_TOLERANCE:
        raise MixError(f"{source}: the classes' share values sum to {total:g}, not 1")
    return mix


def parse_mix(text: str, source: str = "<string>") -> Mix:
    """A Mix from TOML text in the `[[class]]` shape; errors name the source and the field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MixError(f"{source} is not valid TOML: {exc}") from None
    data.setdefault("name", Path(source).stem if source != "<string>" else "")
    try:
        mix = msgspec.convert(data, Mix)
    except msgspec.ValidationError as exc:
        raise MixError(f"{source}: {exc}") from None
    return _check_mix(mix, source)


def mix_names() -> list[str]:
    """Names of the mixes shipped in sim/presets/mixes."""
    folder = resources.files("sim") / "presets" / "mixes"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def load_mix(name_or_path: str | Path) -> Mix:
    """A shipped mix by name (`chat-code`, `rag`) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            return parse_mix(path.read_text(), str(path))
        except OSError as exc:
            raise MixError(f"cannot read mix file {path}: {exc.strerror}") from None
    resource = resources.files("sim") / "presets" / "mixes" / f"{name_or_path}.toml"
    if not resource.is_file():
        raise MixError(f"no mix {str(name_or_path)!r}; shipped mixes: {', '.join(mix_names())}")
    return parse_mix(resource.read_text(), f"{name_or_path}.toml")


def _draw_class(rng: random.Random, mix: Mix) -> MixClass:
    classes = mix.classes
    if len(classes) == 1:
        # No draw: a one-class mix consumes the generator as the single-domain workload does.
        return classes[0]
    u = rng.random()
    for c in classes[:-1]:
        u -= c.share
        if u < 0:
            return c
    return classes[-1]


def _mix_job(rng: random.Random, mix: Mix, index: int, t: float, burst_id: int) -> Job:
    c = _draw_class(rng, mix)
    if c.prompt_sigma > 0:
        prompt = draw_tokens(rng, "lognormal", c.prompt_tokens, c.prompt_sigma)
    else:
        prompt = max(1, round(c.prompt_tokens))
    out = draw_tokens(rng, c.output_dist, c.output_tokens, c.output_sigma)
    if c.max_tokens is not None:
        out = min(out, c.max_tokens)
    return Job(
        index=index,
        arrival=t,
        prompt_tokens=prompt,
        output_tokens=out,
        domain=c.domain,
        burst_id=burst_id,
        max_tokens=c.max_tokens,
    )


def generate(fleet: Fleet, model: str, spec: WorkloadSpec) -> list[Job]:
    """The jobs of one run, in arrival order (a chat's: conversation by conversation); the same
    for the same seed."""
    if spec.kind == "chat":
        if spec.mix is not None:
            raise MixError("a mix runs with the poisson workload, not chat")
        return generate_chat(fleet, model, spec)
    if spec.kind != "poisson":
        raise FleetError(f"unknown workload {spec.kind!r}; workloads: {', '.join(WORKLOADS)}")
    if spec.load <= 0 or spec.tasks < 1 or spec.burst < 1:
        raise FleetError("load must be positive, tasks and burst at least 1")
    rng = random.Random(spec.seed)
    dist, mean, sigma = output_law(fleet, model, spec)
    rate = spec.load * capacity(fleet, model, spec) / spec.burst
    jobs: list[Job] = []
    t = 0.0
    burst_id = 0
    while len(jobs) < spec.tasks:
        t += rng.expovariate(rate)
        burst_id += 1
        for _ in range(min(spec.burst, spec.tasks - len(jobs))):
            if spec.mix is not None:
                jobs.append(_mix_job(rng, spec.mix, len(jobs), t, burst_id))
                continue
            jobs.append(
                Job(
                    index=len(jobs),
                    arrival=t,
                    prompt_tokens=spec.prompt_tokens,
                    output_tokens=draw_tokens(rng, dist, mean, sigma),
                    domain=spec.domain,
                    burst_id=burst_id,
                )
            )
    return jobs


def conversation_hashes(conv: int, blocks: int) -> tuple[int, ...]:
    """The chain hashes of the first `blocks` blocks of conversation `conv`'s text: block j's hash
    stands for the conversation's text up to the end of block j, so two prompts of one
    conversation share exactly their common blocks, and no two conversations share any."""
    out = []
    for j in range(min(blocks, MAX_BLOCKS)):
        digest = hashlib.blake2b(f"{conv}:{j}".encode(), digest_size=6).digest()
        out.append(int.from_bytes(digest, "big"))
    return tuple(out)


def tokens_blocks(tokens: int) -> int:
    """Full chain blocks of a chat text of `tokens` tokens."""
    return tokens * CHARS_PER_TOKEN // BLOCK_CHARS


def chat_turn_mean(spec: WorkloadSpec, out_mean: float) -> tuple[float, float]:
    """(mean turns per conversation, mean prompt tokens per turn) of `spec`'s chats: turn k of a
    conversation (from 1) sends k user messages and k - 1 answers."""
    turns = range(spec.turns_min, spec.turns_max + 1)
    mean_turns = sum(turns) / len(turns)
    # Over a conversation of t turns the prompts hold t user messages and t(t - 1)/2 earlier parts
    # (each a message and its answer) in all.
    pairs = sum(t * (t - 1) / 2 for t in turns) / len(turns)
    prompt = (mean_turns * spec.prompt_tokens + pairs * (spec.prompt_tokens + out_mean)) / mean_turns
    return mean_turns, prompt


def generate_chat(fleet: Fleet, model: str, spec: WorkloadSpec) -> list[Job]:
    """The turns of `spec.tasks` chat turns' conversations (module docstring), conversation by
    conversation; later turns' arrivals are inf until the simulator sends them."""
    if spec.load <= 0 or spec.tasks < 1 or not 1 <= spec.turns_min <= spec.turns_max:
        raise FleetError("load must be positive, tasks at least 1, and 1 <= turns_min <= turns_max")
    rng = random.Random(spec.seed)
    dist, mean, sigma = output_law(fleet, model, spec)
    mean_turns, mean_prompt = chat_turn_mean(spec, mean)
    # The fleet's turns per second at the mean turn, every prompt evaluated whole.
    cap = capacity(fleet, model, msgspec.structs.replace(spec, prompt_tokens=round(mean_prompt)))
    rate = spec.load * cap / mean_turns
    jobs: list[Job] = []
    t = 0.0
    conv = 0
    while len(jobs) < spec.tasks:
        t += rng.expovariate(rate)
        turns = rng.randint(spec.turns_min, spec.turns_max)
        turns = min(turns, spec.tasks - len(jobs))
        drawn = []
        for k in range(turns):
            message = draw_tokens(rng, "exp", float(spec.prompt_tokens), 0.0)
            answer = draw_tokens(rng, dist, mean, sigma)
            think = rng.expovariate(1.0 / spec.think_s) if k and spec.think_s > 0 else 0.0
            drawn.append((message, answer, think))
        total = sum(m + a for m, a, _ in drawn)
        hashes = conversation_hashes(conv, tokens_blocks(total))
        history = 0
        first = len(jobs)
        for k, (message, answer, think) in enumerate(drawn):
            prompt = history + message
            jobs.append(
                Job(
                    index=len(jobs),
                    arrival=t if k == 0 else math.inf,
                    prompt_tokens=prompt,
                    output_tokens=answer,
                    domain=spec.domain,
                    burst_id=conv + 1,
                    conv=conv,
                    next=first + k + 1 if k + 1 < turns else -1,
                    think_s=think,
                    chain=PromptChain(hashes=hashes[: tokens_blocks(prompt)], chars=prompt * CHARS_PER_TOKEN),
                    paced=spec.paced,
                )
            )
            history = prompt + answer
        conv += 1
    return jobs
