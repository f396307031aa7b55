"""Fleet presets: simulated machines and models, from TOML.

One format serves both simulators: `routeledger sim hosts` (Ollama-compatible HTTP backends) and
`routeledger sim schedule` (the discrete-event scheduling simulator). The documented shape, which
other people's fleet files use, is

    [[worker]]
    name = "macbookair"
    slots = 1
    online = [[0, 1e9]]          # optional windows in simulated seconds; default: always on
    [[worker.slowdown]]          # optional, repeatable: speeds multiplied by `factor` meanwhile
    from_s = 3600
    until_s = 7200
    factor = 0.06
    [worker.models."qwen3:8b"]
    decode_tps = 11.4
    prompt_tps = 90.0
    load_s = 8.0

and more keys may be added: per worker `parallel_exponent`, `keep_alive_s`, `serves` and the fault
rates; per worker model an optional `digest` override and `embed_tps`; and a top-level
`[model."NAME"]` table with what belongs to the model itself (digest, family, size, quality per
domain, output length, capabilities):

    [model."qwen3:8b"]
    capabilities = ["completion", "tools", "thinking"]   # default ["completion"]
    family = "qwen3"               # optional facts: absent from /api/show, /api/tags, /api/ps if unset
    parameter_size = "8.2B"
    quantization = "Q4_K_M"
    size = 5225376047              # bytes on disk and in memory
    context_length = 40960
    [model."nomic-embed-text"]
    capabilities = ["embedding"]
    embedding_dim = 768
"""

from __future__ import annotations

import hashlib
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Final

import msgspec

from sim.errors import FleetError

# What a model can do, in Ollama's words (`/api/show` `capabilities`): `completion` answers chat and
# generate, `tools` answers with tool calls, `vision` reads images, `embedding` answers embeddings,
# `thinking` thinks aloud when asked (`think`), `insert` fills in the middle (`suffix`).
# (`insert` is reported by /api/show only: the simulator does not read `suffix`.)
CAPABILITIES: Final = ("completion", "tools", "vision", "embedding", "thinking", "insert")


class OutputLength(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Distribution of output tokens: `exp`, `lognormal` (with `sigma`) or `fixed`."""

    dist: str = "lognormal"
    mean: float = 256.0
    sigma: float = 0.6


class ModelSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What belongs to the model itself, whichever machine holds it."""

    digest: str = ""
    # Facts a real backend reports; "" / None: nobody knows, and the sim's API leaves them out.
    family: str = ""
    parameter_size: str = ""
    # Every simulated model is a Q4_K_M gguf unless its table says otherwise ("" for unknown).
    quantization: str = "Q4_K_M"
    # Bytes of the weights, on disk (`/api/tags`) and in memory once loaded (`/api/ps`).
    size: int | None = None
    context_length: int | None = None
    capabilities: list[str] = msgspec.field(default_factory=lambda: ["completion"])
    # Length of the vectors an `embedding` model answers (a request's `dimensions` may shorten them).
    embedding_dim: int = 768
    # Ollama's prompt template and Modelfile parameters, as `/api/show` reports them; None: a
    # template made from the capabilities (sim.backends.host) and Qwen-like parameters.
    template: str | None = None
    parameters: str | None = None
    # Chance that an answer to a benchmark prompt of the domain contains its reference answer.
    quality: dict[str, float] = msgspec.field(default_factory=dict)
    output: OutputLength = OutputLength()
    # Whether the model honours Ollama's `format` (JSON mode, or a schema): True answers a request
    # that sets it with JSON (valid against the schema: sim.backends.schema; else
    # sim.backends.text.json_answer); False ignores it and answers prose, as a model without JSON
    # mode would (the pipeline tests use it for a decomposer that answers garbage).
    follows_format: bool = True


class WorkerModel(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One model on one machine: its speeds there."""

    decode_tps: float
    prompt_tps: float = 200.0
    load_s: float = 5.0
    # Another name can carry the same weights: give it the digest of the model it copies.
    digest: str | None = None
    # False: the machine can be given the model at run time (the sim's POST /api/pull), not at start.
    held: bool = True
    # Prompt tokens per second of an embedding request; None: as fast as prompt evaluation.
    embed_tps: float | None = None

    @property
    def embedding_tps(self) -> float:
        return self.embed_tps if self.embed_tps is not None else self.prompt_tps


class Slowdown(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A stretch of simulated time in which the machine runs slower (someone games on the GPU PC).

    Written in a fleet file as a repeatable table of its worker:

        [[worker.slowdown]]
        from_s = 3600
        until_s = 7200
        factor = 0.06                # decode and prompt speed multiplied by this
    """

    from_s: float
    until_s: float
    factor: float


class WorkerSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One simulated machine."""

    name: str
    slots: int = 1
    online: list[tuple[float, float]] | None = None
    models: dict[str, WorkerModel] = msgspec.field(default_factory=dict)
    # With k generations at once each runs at k ** exponent / k of its solo speed (sublinear sharing).
    parallel_exponent: float = 0.7
    # Seconds a loaded model stays loaded with nothing to do (Ollama's keep_alive).
    keep_alive_s: float = 300.0
    # Which held models its worker serves; None: all of them; []: registered, serving nothing.
    serves: list[str] | None = None
    # Faults of the HTTP simulator, per request.
    error_rate: float = 0.0
    hang_rate: float = 0.0
    disconnect_rate: float = 0.0
    # Preferred port for `sim hosts` (0: a free one).
    port: int = 0
    # False: the machine reports no CPU/GPU/VRAM (the story's laptop); only the story-original
    # policy of `sim schedule` reads it, to show what a missing metric did to that router.
    reports_resources: bool = True
    # What a call to an already loaded model reports as `load_duration`, in ms: real Ollama reports
    # a few milliseconds on warm calls, which are not loads.
    warm_load_ms: float = 0.0
    # False: the OpenAI-compatible API sends no `usage` in a stream even when asked (some servers
    # do not), so a client must count the output itself.
    openai_usage: bool = True
    # False: the OpenAI-compatible API answers every /v1/embeddings request 501 Not Implemented,
    # as llama-server started without --embeddings does.
    openai_embeddings: bool = True
    # Stretches of time with speed multiplied by a factor (overlapping ones multiply).
    slowdown: list[Slowdown] = msgspec.field(default_factory=list)
    # Bytes of GPU memory: a loaded model larger than this reports only this much as `size_vram` in
    # /api/ps (the rest runs on the CPU). None: every model fits.
    vram_bytes: int | None = None
    # The machine sleeps at start (`sim hosts`): its HTTP port is closed until its magic packet (for
    # `mac`) arrives on its UDP `wake_port` (0: a free one), then it powers on `wake_s` later
    # (simulated seconds, times the time scale).
    asleep: bool = False
    mac: str | None = None
    wake_s: float = 90.0
    wake_port: int = 0

    def speed_factor(self, t: float) -> float:
        """What its speeds are multiplied by at simulated second `t`."""
        k = 1.0
        for s in self.slowdown:
            if s.from_s <= t < s.until_s:
                k *= s.factor
        return k


class Fleet(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A named set of machines and the models they hold."""

    name: str = ""
    description: str = ""
    worker: list[WorkerSpec] = msgspec.field(default_factory=list)
    model: dict[str, ModelSpec] = msgspec.field(default_factory=dict)

    def model_spec(self, name: str) -> ModelSpec:
        """The model's own properties; a model without a `[model]` table gets defaults."""
        return self.model.get(name, ModelSpec())

    def digest_of(self, worker: WorkerSpec, name: str) -> str:
        """The digest `worker` reports for model `name` (its override, the model's, or derived)."""
        held = worker.models[name]
        if held.digest:
            return held.digest
        return self.model_spec(name).digest or default_digest(name)

    @property
    def workers(self) -> list[WorkerSpec]:
        return self.worker


def default_digest(name: str) -> str:
    """A stable sha256 hex digest for a model that does not give one."""
    return hashlib.sha256(f"routeledger-sim:{name}".encode()).hexdigest()


def preset_names() -> list[str]:
    """Names of the presets shipped in sim/presets."""
    folder = resources.files("sim") / "presets"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def parse_fleet(text: str, source: str = "<string>") -> Fleet:
    """A Fleet from TOML text (or JSON, for a file ending in .json); errors name the source."""
    try:
        data: dict[str, Any] = msgspec.json.decode(text) if source.endswith(".json") else tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FleetError(f"{source} is not valid TOML: {exc}") from None
    except msgspec.DecodeError as exc:
        raise FleetError(f"{source} is not valid JSON: {exc}") from None
    return fleet_from_dict(data, source)


def preset_data(name: str) -> dict[str, Any]:
    """The raw tables of a shipped preset, for callers that adjust it (ports for a demo)."""
    resource = resources.files("sim") / "presets" / f"{name}.toml"
    if not resource.is_file():
        raise FleetError(f"no fleet preset {name!r}; presets: {', '.join(preset_names()) or 'none'}")
    return tomllib.loads(resource.read_text())


def fleet_from_dict(data: dict[str, Any], source: str = "<dict>") -> Fleet:
    """A Fleet from already-parsed tables; errors name the source and what is wrong."""
    data.setdefault("name", Path(source).stem if source != "<string>" else "")
    try:
        fleet = msgspec.convert(data, Fleet)
    except msgspec.ValidationError as exc:
        raise FleetError(f"{source}: {exc}") from None
    for name, model_spec in fleet.model.items():
        unknown = [c for c in model_spec.capabilities if c not in CAPABILITIES]
        if unknown:
            raise FleetError(
                f"{source}: model {name} has unknown capabilities {unknown}; "
                f"known ones are {', '.join(CAPABILITIES)}"
            )
        if not model_spec.capabilities:
            raise FleetError(
                f"{source}: model {name} has no capabilities; "
                f"give it at least one of {', '.join(CAPABILITIES)}"
            )
        if model_spec.embedding_dim < 1:
            raise FleetError(f"{source}: model {name} needs a positive embedding_dim")
        if model_spec.size is not None and model_spec.size < 0:
            raise FleetError(f"{source}: model {name} has a negative size")
    names = [w.name for w in fleet.worker]
    if len(set(names)) != len(names):
        raise FleetError(f"{source}: worker names must be unique, got {names}")
    for w in fleet.worker:
        if w.slots < 1:
            raise FleetError(f"{source}: worker {w.name} needs at least one slot")
        if w.asleep and (w.mac is None or w.wake_s < 0):
            raise FleetError(f"{source}: worker {w.name} is asleep: it needs a mac and a wake_s of 0 or more")
        for slow in w.slowdown:
            if not (slow.factor > 0) or not (slow.until_s > slow.from_s >= 0):
                raise FleetError(
                    f"{source}: {w.name} has a slowdown with a factor that is not positive or an "
                    f"empty window ({slow.from_s} to {slow.until_s} s)"
                )
        for model, spec in w.models.items():
            if (
                spec.decode_tps <= 0
                or spec.prompt_tps <= 0
                or spec.load_s < 0
                or (spec.embed_tps is not None and spec.embed_tps <= 0)
            ):
                raise FleetError(
                    f"{source}: {w.name}/{model} needs positive speeds and a non-negative load time"
                )
    return fleet


def load_fleet(name_or_path: str | Path) -> Fleet:
    """A shipped preset by name (`seed`, `trio`, `lab`, …) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".toml", ".json") or path.exists():
        try:
            return parse_fleet(path.read_text(), str(path))
        except OSError as exc:
            raise FleetError(f"cannot read fleet file {path}: {exc.strerror}") from None
    resource = resources.files("sim") / "presets" / f"{name_or_path}.toml"
    if not resource.is_file():
        raise FleetError(
            f"no fleet preset {str(name_or_path)!r}; presets: {', '.join(preset_names()) or 'none'}"
        )
    return parse_fleet(resource.read_text(), f"{name_or_path}.toml")
