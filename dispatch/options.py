"""What a request may ask of a backend: its generation options, and the domain it names.

Options go to the backend verbatim, and some of them change how the backend runs the model
rather than what it samples: `num_gpu: 0` runs it on the CPU, a large `num_ctx` reloads it with a
huge context. Such a run is slow for reasons of its own, and folding its timings would teach the
router that the machine is slow. So sampling options pass, runtime options are refused, or, where
the operator allows them, accepted on a task marked `runtime_options`, whose timings are never
folded into the speed statistics (projections/folder.py, replay/fold.py). Anything else is refused:
an unknown option is a typo or an option nobody has judged yet.

The domain is a key of the statistics tables every worker reads: it comes from a configured
vocabulary, not from free text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from dispatch.errors import RequestRefusedError

# Options that change what is sampled, never how the model is loaded or run (Ollama's names).
SAMPLING_OPTIONS: Final = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "typical_p",
        "tfs_z",
        "seed",
        "stop",
        "num_predict",
        "num_keep",
        "repeat_penalty",
        "repeat_last_n",
        "presence_penalty",
        "frequency_penalty",
        "penalize_newline",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
    }
)
# Options that change how the backend loads or runs the model (and so its speed).
RUNTIME_OPTIONS: Final = frozenset(
    {
        "num_ctx",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "num_thread",
        "num_batch",
        "num_gqa",
        "use_mmap",
        "use_mlock",
        "numa",
        "f16_kv",
        "vocab_only",
        "logits_all",
        "embedding_only",
        "rope_frequency_base",
        "rope_frequency_scale",
    }
)
# Ollama's default context; a model whose own default is unknown is taken to have this one.
DEFAULT_MAX_NUM_CTX: Final = 4096
# Every domain the shipped benchmark prompts, the classifier and the simulator use, and a few more.
DEFAULT_DOMAINS: Final = ("general", "code", "japanese", "ja", "math", "writing", "translation")
DOMAIN_RULE: Final = "1-32 characters: lower-case letters, digits, '-', '_' or '.', starting with a letter"
_DOMAIN: Final = re.compile(r"[a-z][a-z0-9_.-]{0,31}")


def valid_domain(name: str) -> bool:
    """Whether `name` can be a domain at all (length and characters), whatever the vocabulary."""
    return _DOMAIN.fullmatch(name) is not None


class OptionsPolicy(msgspec.Struct, kw_only=True, frozen=True):
    """The configured rules: which domains, whether runtime options are accepted, the largest
    num_ctx accepted without them."""

    domains: tuple[str, ...] = DEFAULT_DOMAINS
    allow_runtime_options: bool = False
    max_num_ctx: int = DEFAULT_MAX_NUM_CTX

    def check_domain(self, domain: str | None) -> None:
        """Raises RequestRefusedError unless `domain` is None (classified later) or configured."""
        if domain is None or domain in self.domains:
            return
        shown = domain if len(domain) <= 40 else domain[:40] + "…"
        why = (
            "is not one of the configured domains"
            if valid_domain(domain)
            else f"is not a domain ({DOMAIN_RULE})"
        )
        raise RequestRefusedError(
            f"domain {shown!r} {why}; allowed: {', '.join(self.domains)}",
            param="domain",
            hint="send one of them, or leave domain out to have it classified from the text",
            extra={"allowed": list(self.domains)},
        )

    def check_options(self, options: Mapping[str, Any]) -> bool:
        """Whether the options change the runtime (accepted only with allow_runtime_options; the
        task is then marked); raises RequestRefusedError naming the first option refused."""
        runtime = False
        for name in options:
            if name in SAMPLING_OPTIONS:
                continue
            if name not in RUNTIME_OPTIONS:
                shown = name if len(name) <= 40 else name[:40] + "…"
                raise RequestRefusedError(
                    f"unknown option {shown!r}; allowed: {', '.join(sorted(SAMPLING_OPTIONS))}",
                    param=f"options.{shown}",
                    hint="leave it out, or check its spelling against the backend's documented options",
                    extra={"allowed": sorted(SAMPLING_OPTIONS)},
                )
            if name == "num_ctx" and _within(options[name], self.max_num_ctx):
                continue
            if not self.allow_runtime_options:
                limit = f" above {self.max_num_ctx}" if name == "num_ctx" else ""
                raise RequestRefusedError(
                    f"option {name!r}{limit} changes how the backend runs the model, and is refused here",
                    param=f"options.{name}",
                    hint=(
                        "leave it out (the worker's own settings apply); an operator can accept such "
                        "options with allow_runtime_options (their runs then never count as speed samples)"
                    ),
                )
            runtime = True
        return runtime


def _within(value: Any, limit: int) -> bool:
    # Anything but an integer (131072.0, "131072") is not let through: a backend may read it as one.
    return isinstance(value, int) and not isinstance(value, bool) and value <= limit
