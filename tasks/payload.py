"""What travels on the task queues: the task itself (prompt included), its output chunks and result.

Unlike ledger events, these carry text, so they live in `rl:q:*`, `rl:out:*` and `rl:result:*`
with retention; the ledger records only sizes, token counts and digests.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any, Final, Literal, TypeAlias

import msgspec

from events.event import Timings, now_ms
from tasks.prefix import PromptChain

# Fields of a queue entry. `attempt` sits outside the payload so that the reclaim script can raise
# it without decoding the task.
F_TASK: Final = b"task"
F_ATTEMPT: Final = b"attempt"
F_ID: Final = b"id"

# The kind of a task that asks for embeddings rather than a generation (others: chat, generate).
EMBED: Final = "embed"

# What a task's stored outcome (its result) can say: the terminal statuses (projections.status).
Outcome = Literal["completed", "failed", "dead", "cancelled"]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A function call a model made, in neither surface's shape: each surface and each backend
    spells it its own way (api.tools, workers.backend)."""

    name: str
    # The arguments' JSON text, as OpenAI spells them (Ollama's object is its decoding): text a
    # model wrote that is not valid JSON still travels unchanged.
    arguments: str = "{}"
    # The call's id, which a `tool` message answering it names (OpenAI's `tool_call_id`); the
    # worker draws one where the backend gave none (Ollama's own API).
    id: str = ""

    def arguments_object(self) -> dict[str, Any]:
        """The arguments as an object (Ollama's spelling); text that is not a JSON object reads as
        none, as Ollama's own parser drops such a call's arguments."""
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One chat message, as Ollama and OpenAI take it."""

    role: str
    content: str = ""
    images: list[str] | None = None
    # An assistant's calls, and which call a `tool` message answers: OpenAI names its id, Ollama
    # the function (each backend gets what it reads: workers.backend).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None


class TaskMessage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A task: as a client's request for one generation, whichever surface or command it came
    through, it is the one value passed down the submission path (dispatch.submit); as submission
    queues it, with its id, digest, domain and planned size filled in, it is what a worker receives.

    Its fields only ever grow, each with a default that reads an entry queued by an earlier version
    as that version meant it (entries leave out their defaults)."""

    # "": a new id, drawn at submission (dispatch.submit.submit_task).
    task_id: str = ""
    model: str
    # "": the model's, found at submission (routing, or the live workers' leases).
    digest: str = ""
    kind: str = "chat"  # chat | generate | embed
    messages: list[Message] = msgspec.field(default_factory=list)
    prompt: str | None = None
    system: str | None = None
    # None in a request: classified from the text at submission (router.choose.classify_domain),
    # and a queued task always carries the domain it was routed under. Not "general" by default:
    # an explicit "general" must be kept, not classified. An entry queued before this default
    # changed left out "general" (then the default) and decodes as None: read a queued task's
    # domain through `domain_or_general`.
    domain: str | None = None
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    max_tokens: int | None = None
    format: Any = None
    priority: int = 0
    submitted_at: int = msgspec.field(default_factory=now_ms)
    prompt_tokens: int | None = None
    bench_id: str | None = None
    bench_prompt: str | None = None
    pipeline_id: str | None = None
    # False when the submitter only waits for the result: the worker then writes the output once,
    # with the result, instead of streaming it piece by piece.
    stream: bool = True
    # A person reads the answer as it streams: the plan places it where its reader would finish
    # reading first (router.plan.BacklogEntry.paced), not where it would finish.
    paced: bool = False
    # Epoch ms after which nobody waits for the task (its client gave up, or the longest a task
    # may queue passed): a worker that takes it later records TaskExpired and never runs it.
    deadline_ms: int | None = None
    # Function tools offered to the model, in OpenAI's shape (Ollama takes the same), checked by
    # api.tools; None: no tools. `tool_choice` and `parallel_tool_calls` are OpenAI's, passed to an
    # OpenAI-compatible backend (an Ollama backend reads only what it can: workers.backend).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # A completion's images (base64, as Ollama's /api/generate takes them); a chat's ride on its messages.
    images: list[str] | None = None
    # OpenAI's `response_format` as the client sent it, for an OpenAI-compatible backend (`format`
    # is the same request in Ollama's terms, which an Ollama backend reads).
    response_format: dict[str, Any] | None = None
    # Ollama's `think`: true/false or a level ("low", "medium", "high"); None: the model's default.
    think: bool | str | None = None
    # An `embed` task's texts, one vector each, in order (the backend's embedding endpoint: Ollama's
    # /api/embed, or /v1/embeddings); `truncate` (Ollama's: cut an input longer than the context
    # instead of failing; None: the backend's default, true), `dimensions` (a shorter vector, where
    # the model supports it) and Ollama's `keep_alive` go with them.
    inputs: list[str] | None = None
    truncate: bool | None = None
    dimensions: int | None = None
    keep_alive: str | float | None = None
    # Its prompt's chain (router.prefix, dispatch.prefix), computed once at submission: the plan
    # prices a holder whose idle slot holds part of it. None: under a block, or not a prompt.
    prefix: PromptChain | None = None
    # What only the submission path reads, recorded on TaskSubmitted or read by routing; submission
    # clears them in the copy it queues (dispatch.submit.submit_task), so a worker never sees them.
    # Who asked (a user agent, `cli`, `judge`…), recorded on TaskSubmitted.
    client: str | None = None
    # Its options change how the backend runs the model (dispatch/options.py): recorded on
    # TaskSubmitted, so that its run is never a speed sample.
    runtime_options: bool = False
    # The name of the API key it came with (recorded, never the key itself).
    key: str | None = None
    # Its fair-share round within its priority band (tasks.quota.round_of): which of the model's
    # band queues it joins.
    share_round: int = 0
    # One part of a split request (see TaskSubmitted.split_of): recorded on TaskSubmitted.
    split_of: str | None = None
    part: int = 0
    parts: int = 1
    # Its model's learned prompt bytes per token (router.estimate.Estimator.bytes_per_token), where
    # routing found one: its text is counted at that ratio instead of about 4 bytes a token.
    bytes_per_token: float | None = None

    def prompt_text(self) -> str:
        """All the text the model reads, for its size, its domain and digests (never for the ledger
        itself)."""
        return prompt_text(self.kind, self.messages, self.prompt, self.system, self.inputs)

    def image_count(self) -> int:
        """How many images the model reads (the prompt's and its messages')."""
        return len(self.images or []) + sum(len(m.images or []) for m in self.messages)

    def domain_or_general(self) -> str:
        """The domain a queued task was routed under: None (an entry queued while "general" was the
        default, and left out as such) reads as "general"."""
        return "general" if self.domain is None else self.domain


def prompt_text(
    kind: str,
    messages: Sequence[Message],
    prompt: str | None,
    system: str | None,
    inputs: Sequence[str] | None = None,
) -> str:
    """The text a model reads for a task: a completion's system and prompt, a chat's messages, an
    embedding's inputs."""
    if kind == "generate":
        return (system or "") + (prompt or "")
    if kind == EMBED:
        return "".join(inputs or ())
    return "".join(m.content for m in messages)


def pack_vector(vector: Sequence[float]) -> bytes:
    """An embedding as little-endian float32s: 4 bytes a dimension (JSON text takes about 10),
    the precision embedding models compute in, and exactly what OpenAI's `encoding_format:
    "base64"` encodes."""
    return struct.pack(f"<{len(vector)}f", *vector)


def unpack_vector(packed: bytes) -> list[float]:
    """The floats of a `pack_vector` value."""
    return list(struct.unpack(f"<{len(packed) // 4}f", packed))


_task_encoder: Final = msgspec.msgpack.Encoder()
_task_decoder: Final = msgspec.msgpack.Decoder(TaskMessage)


def encode_task(task: TaskMessage) -> bytes:
    return _task_encoder.encode(task)


def decode_task(data: bytes) -> TaskMessage:
    """A queued task; msgspec.ValidationError for one without an id: a request may lack it, but
    submission fills it in, so a queue entry without one is malformed (as it was when the id had no
    default) and is dead-lettered, not run. An empty digest is a model its server reports none for,
    and runs."""
    task = _task_decoder.decode(data)
    if not task.task_id:
        raise msgspec.ValidationError("a queued task has no `task_id`")
    return task


def queue_fields(task: TaskMessage, attempt: int = 1) -> dict[bytes, bytes]:
    """The fields of the queue entry that carries `task` for its `attempt`."""
    return {F_TASK: encode_task(task), F_ATTEMPT: str(attempt).encode(), F_ID: task.task_id.encode()}


def estimate_tokens(text: str) -> int:
    """A rough token count (about four characters a token) for planning before the backend counts."""
    return max(1, (len(text.encode()) + 3) // 4)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Thought(msgspec.Struct, frozen=True):
    """A piece of a model's thinking (Ollama's `message.thinking`, OpenAI-compatible servers'
    `reasoning_content`), relayed apart from its answer."""

    text: str


class Chunk(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One piece of output in `rl:out:{task}`; `attempt` and `run` tell a relay which run it
    belongs to (two runs of one attempt, which should never happen, still differ in `run`)."""

    attempt: int
    text: str = ""
    done: bool = False
    error: str | None = None
    # A nonce per run, drawn by the worker when it starts the run ('' for outcomes no run wrote).
    run: str = ""
    # Tool calls the model completed in this piece (after its `text`).
    tool_calls: list[ToolCall] | None = None
    # Thinking the model wrote in this piece (before its `text`).
    thinking: str = ""


class Result(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The final outcome of a task, written once to `rl:result:{task}` by the first completion."""

    task_id: str
    status: Outcome
    worker: str | None = None
    attempt: int = 0
    text: str = ""
    timings: Timings = Timings()
    ttft_ms: float | None = None
    wall_ms: float | None = None
    done_reason: str | None = None
    error: str | None = None
    finished_at: int = msgspec.field(default_factory=now_ms)
    # The nonce of the run that wrote it (see Chunk.run).
    run: str = ""
    # Every tool call the model made, in order (also streamed in the output's chunks).
    tool_calls: list[ToolCall] | None = None
    # All the model's thinking, when it thought (also streamed in the output's chunks).
    thinking: str = ""
    # An `embed` task's vectors, one per input in order, each packed by `pack_vector`.
    embeddings: list[bytes] | None = None
    # The backend refused the request itself (a 4xx, or a 501 for what its server cannot do): no
    # rerun could answer it, and the API answers the client with its own error (a 400).
    refused: bool = False


# What a relay yields of a task's output, in order: thinking, text pieces and tool calls as they
# arrive, then the Result.
Relayed: TypeAlias = str | list[ToolCall] | Thought | Result

_chunk_encoder: Final = msgspec.msgpack.Encoder()
chunk_decoder: Final = msgspec.msgpack.Decoder(Chunk)
result_decoder: Final = msgspec.msgpack.Decoder(Result)


def encode_chunk(chunk: Chunk) -> bytes:
    return _chunk_encoder.encode(chunk)


def encode_result(result: Result) -> bytes:
    return _chunk_encoder.encode(result)
