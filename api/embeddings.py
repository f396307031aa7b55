"""Embeddings on both surfaces: OpenAI's /v1/embeddings, Ollama's /api/embed and its older
/api/embeddings.

An embedding request is a task like any other (kind `embed`): submitted through the one
submission path, so it is ledgered, routed by the plan and measured, and only models whose live
holders may embed take it (a model whose holders all report capabilities without `embedding` is
a 400 in the surface's error shape that names the models that can). A large batch may run as
several tasks on several holders when the plan finishes it sooner that way (router.split); the
answer puts the parts' vectors back in input order. The worker stores the vectors as float32s
(tasks.payload.pack_vector): OpenAI's `encoding_format: "base64"` is those bytes as they are.

OpenAI's `input` may also be token arrays (a list of integers, or a list of them): LangChain's
`OpenAIEmbeddings` sends them by default, tokenized with tiktoken's `cl100k_base` for a model name
it does not know. The backends take text, so the arrays are decoded with `cl100k_base` first, as
litellm's proxy does for backends that are not OpenAI's; then the request is one of texts.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import threading
import time
from typing import Any, Final

import tiktoken
from fastapi import APIRouter, Request

from api.common import JSON, gateway, submit, task_headers
from api.errors import (
    OLLAMA,
    OPENAI,
    SUBMITS,
    BadRequestError,
    ClientGoneError,
    GenerationError,
    PayloadTooLargeError,
    documented,
)
from api.schemas import EmbeddingsCreate, OllamaEmbed, OllamaEmbeddings
from dispatch.errors import TaskTimeoutError
from dispatch.gateway import Gateway
from dispatch.submit import Submitted, embedding_parts
from tasks.payload import EMBED, Result, TaskMessage, unpack_vector

router = APIRouter(tags=["embeddings"])

# Most inputs one request may carry (OpenAI's own limit), texts or token arrays alike.
MAX_INPUTS: Final = 2048
_INPUT_HINT: Final = "send a string or a list of strings"
# OpenAI's surface takes token arrays too.
_OPENAI_INPUT_HINT: Final = (
    "send a string, a list of strings, or token arrays of cl100k_base ids (a list of integers, or a "
    "list of such lists)"
)
# The encoding OpenAI's embedding models use, which clients tokenize with when they send token arrays.
ENCODING: Final = "cl100k_base"
# How long a request waits for the encoding to load: tiktoken downloads it once into its cache
# (TIKTOKEN_CACHE_DIR) when the cache lacks it, without a timeout of its own.
ENCODING_WAIT_S: Final = 15.0
_DECODE_HINT: Final = (
    "send the inputs as text; or give the API a TIKTOKEN_CACHE_DIR that holds cl100k_base (tiktoken "
    "fills it from openaipublic.blob.core.windows.net on first use); LangChain's OpenAIEmbeddings "
    "sends text with check_embedding_ctx_length=False"
)


class Embedded:
    """The outcome of one embedding request, however many tasks it ran as."""

    def __init__(self, subs: list[Submitted], results: list[Result]) -> None:
        self.subs = subs
        self.results = results

    @property
    def vectors(self) -> list[bytes]:
        return [v for r in self.results for v in r.embeddings or []]

    @property
    def prompt_tokens(self) -> int:
        """The backend's counts, summed over the parts; a part whose backend counted nothing
        counts as the estimate it was routed with (OpenAI clients read an integer here)."""
        return sum(
            r.timings.prompt_eval_count
            if r.timings.prompt_eval_count is not None
            else s.task.prompt_tokens or 0
            for s, r in zip(self.subs, self.results, strict=True)
        )

    def headers(self) -> dict[str, str]:
        headers = task_headers(self.subs[0], self.results[0])
        if len(self.subs) > 1:
            headers["X-Routeledger-Task"] = ",".join(s.task_id for s in self.subs)
            workers = [r.worker for r in self.results if r.worker]
            headers["X-Routeledger-Worker"] = ",".join(dict.fromkeys(workers))
        return headers


def _texts(value: Any, param: str, hint: str = _INPUT_HINT) -> list[str]:
    """A request's input as a list of strings: a string, or a list of strings, none of them empty."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadRequestError(f"{param} must be a string or a list of strings", param=param, hint=hint)
    if len(texts) > MAX_INPUTS:
        raise PayloadTooLargeError(
            f"{len(texts)} inputs is over the limit of {MAX_INPUTS}", param=param, hint="send fewer at a time"
        )
    return texts


class _Encoding:
    """cl100k_base, loaded once per process in a thread of its own (tiktoken reads a 1.7 MB file,
    or downloads it): every request waits for the one load under way, none holds a thread while it
    waits, and a load that failed is tried again by the next request (its cache may have been
    filled, its network may be back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._load: concurrent.futures.Future[tiktoken.Encoding] | None = None

    def _started(self) -> concurrent.futures.Future[tiktoken.Encoding]:
        with self._lock:
            load = self._load
            if load is None or (load.done() and load.exception() is not None):
                load = self._load = concurrent.futures.Future()
                load.set_running_or_notify_cancel()  # never cancelled: later requests wait on it too
                threading.Thread(target=self._run, args=(load,), name="load-cl100k_base", daemon=True).start()
            return load

    @staticmethod
    def _run(load: concurrent.futures.Future[tiktoken.Encoding]) -> None:
        try:
            load.set_result(tiktoken.get_encoding(ENCODING))
        except Exception as exc:  # whatever went wrong is the reason the client is told
            load.set_exception(exc)

    async def get(self) -> tiktoken.Encoding:
        """The encoding; BadRequestError saying why and what to do when it cannot be loaded."""
        load = self._started()
        try:
            # Shielded: a request that gives up leaves the load running for the next one.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(load)), ENCODING_WAIT_S)
        except TimeoutError:
            reason = f"loading it took over {ENCODING_WAIT_S:.0f} s (a download that does not answer?)"
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        raise BadRequestError(
            f"the token arrays in input could not be decoded to text: the {ENCODING} encoding could "
            f"not be loaded ({reason[:300]})",
            param="input",
            hint=_DECODE_HINT,
        )


_ENCODING = _Encoding()


def _is_token_input(value: Any) -> bool:
    """Whether `input` is token arrays: a list of integers, or a list whose first item is a list."""
    if not isinstance(value, list) or not value:
        return False
    first = value[0]
    return isinstance(first, list) or (isinstance(first, int) and not isinstance(first, bool))


async def _token_texts(value: list[Any]) -> list[str]:
    """Token arrays decoded to texts with cl100k_base, under the limits texts have."""
    arrays: list[Any] = value if isinstance(value[0], list) else [value]
    if len(arrays) > MAX_INPUTS:
        raise PayloadTooLargeError(
            f"{len(arrays)} inputs is over the limit of {MAX_INPUTS}",
            param="input",
            hint="send fewer at a time",
        )
    for i, array in enumerate(arrays):
        if not isinstance(array, list):
            raise BadRequestError(
                f"input {i} is not a token array: input must be all texts or all token arrays",
                param="input",
                hint=_OPENAI_INPUT_HINT,
            )
        if not array:
            raise BadRequestError(
                f"input {i} is an empty token array",
                param="input",
                hint="leave out the empty arrays: each input gets one vector, in order",
            )
    encoding = await _ENCODING.get()
    # Off the event loop: a body at its size limit holds about a million ids.
    return await asyncio.to_thread(_decoded, encoding, arrays)


def _decoded(encoding: tiktoken.Encoding, arrays: list[list[Any]]) -> list[str]:
    """Each array's text; BadRequestError naming the first input with an id that is not a token."""
    texts: list[str] = []
    top = encoding.max_token_value
    for i, array in enumerate(arrays):
        wrong = next((j for j, t in enumerate(array) if type(t) is not int or not 0 <= t <= top), None)
        if wrong is None:
            try:
                texts.append(encoding.decode(array))
                continue
            except KeyError:
                # An id in a gap of the vocabulary (cl100k_base has a few below its special tokens).
                wrong = next((j for j, t in enumerate(array) if not _decodes(encoding, t)), 0)
        raise BadRequestError(
            f"input {i} holds {array[wrong]!r} at position {wrong}, which is not a {ENCODING} token id "
            f"(ids are integers from 0 to {top}, a few of them unused)",
            param="input",
            hint=f"send token ids made with tiktoken's {ENCODING}, or the text itself",
        )
    return texts


def _decodes(encoding: tiktoken.Encoding, token: int) -> bool:
    try:
        encoding.decode_single_token_bytes(token)
    except KeyError:
        return False
    return True


def _none_empty(texts: list[str]) -> None:
    """One vector answers each input, so an empty one is refused rather than dropped."""
    empty = [i for i, t in enumerate(texts) if not t]
    if empty:
        raise BadRequestError(
            f"input {empty[0]} is an empty string ({len(empty)} of {len(texts)} are)",
            param="input",
            hint="leave out the empty strings: each input gets one vector, in order",
        )


async def _embed(request: Request, req: TaskMessage) -> Embedded:
    """Submit the request (whole, or as the parts the plan splits it into) and wait for every
    part: a client that leaves, or a wait that times out, cancels every part still open."""
    gw = gateway(request)
    parts = await gw.retrying(lambda: embedding_parts(gw.fleet, req))
    subs: list[Submitted] = []
    try:
        for part in parts:
            subs.append(await submit(request, part))
    except BaseException:
        # A part was refused (a full queue, a quota): the parts queued already would run for nobody.
        await asyncio.gather(*(gw.cancel_quietly(s.task_id) for s in subs))
        raise
    results = await _waited(request, gw, subs)
    for r in results:
        if r.refused:
            raise BadRequestError(f"the backend refused task {r.task_id}: {r.error}")
        if r.status != "completed":
            raise GenerationError(f"task {r.task_id} {r.status}: {r.error or 'no answer'}")
        if r.embeddings is None:
            raise GenerationError(f"task {r.task_id} completed without embeddings")
    return Embedded(subs, results)


async def _waited(request: Request, gw: Gateway, subs: list[Submitted]) -> list[Result]:
    """Every part's result, waited for while the client waits (as api.common.waited does for one)."""

    async def every() -> list[Result]:
        return list(await asyncio.gather(*(gw.wait(s.task_id, None) for s in subs)))

    waiting = asyncio.ensure_future(every())
    watching: asyncio.Future[None] = asyncio.ensure_future(_disconnected(request))
    try:
        both: list[asyncio.Future[Any]] = [waiting, watching]
        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not waiting.done():
            waiting.cancel()
    if not waiting.cancelled() and waiting.done():
        try:
            return waiting.result()
        except TaskTimeoutError:
            await asyncio.gather(*(gw.cancel_quietly(s.task_id) for s in subs))
            raise
    await asyncio.gather(*(gw.cancel_quietly(s.task_id) for s in subs))
    raise ClientGoneError(f"the client of task {subs[0].task_id} disconnected before it finished")


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _duration_ns(done: Embedded, started_ns: int) -> tuple[int, int]:
    """(total, load) in ns as Ollama answers them: the request's own wall time (its parts ran side
    by side), and the longest load any part reported."""
    loads = [r.timings.load_duration for r in done.results if r.timings.load_duration is not None]
    return time.perf_counter_ns() - started_ns, max(loads, default=0)


@router.post("/v1/embeddings", responses=documented(OPENAI, *SUBMITS))
async def create_embeddings(body: EmbeddingsCreate, request: Request) -> JSON:
    """OpenAI's embeddings: one vector per input, as floats or (`encoding_format: "base64"`, what
    the `openai` client asks for by default) base64 of little-endian float32s."""
    if _is_token_input(body.input):
        texts = await _token_texts(body.input)
    else:
        texts = _texts(body.input, "input", _OPENAI_INPUT_HINT)
    if not texts:
        raise BadRequestError("input must not be empty", param="input", hint=_OPENAI_INPUT_HINT)
    _none_empty(texts)
    encoding = body.encoding_format or "float"
    if encoding not in ("float", "base64"):
        raise BadRequestError(
            f"encoding_format must be float or base64, got {encoding!r}", param="encoding_format"
        )
    req = TaskMessage(
        model=body.model,
        kind=EMBED,
        inputs=texts,
        dimensions=body.dimensions,
        client=request.headers.get("user-agent"),
        stream=False,
    )
    done = await _embed(request, req)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(v).decode() if encoding == "base64" else unpack_vector(v),
        }
        for i, v in enumerate(done.vectors)
    ]
    tokens = done.prompt_tokens
    return JSON(
        {
            "object": "list",
            "data": data,
            "model": done.subs[0].task.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
        headers=done.headers(),
    )


@router.post("/api/embed", responses=documented(OLLAMA, *SUBMITS))
async def embed(body: OllamaEmbed, request: Request) -> JSON:
    """Ollama's embeddings: `embeddings` (one per input), `total_duration`, `load_duration` and
    `prompt_eval_count`. No input only loads the model, as Ollama does (here: checks it is served)."""
    texts = _texts(body.input, "input") if body.input not in (None, "") else []
    if not texts:
        return await _loaded(request, body.model)
    _none_empty(texts)
    started = time.perf_counter_ns()
    req = TaskMessage(
        model=body.model,
        kind=EMBED,
        inputs=texts,
        options=body.options or {},
        truncate=body.truncate,
        dimensions=body.dimensions,
        keep_alive=body.keep_alive,
        client=request.headers.get("user-agent"),
        stream=False,
    )
    done = await _embed(request, req)
    total, load = _duration_ns(done, started)
    return JSON(
        {
            "model": done.subs[0].task.model,
            "embeddings": [unpack_vector(v) for v in done.vectors],
            "total_duration": total,
            "load_duration": load,
            "prompt_eval_count": done.prompt_tokens,
        },
        headers=done.headers(),
    )


@router.post("/api/embeddings", responses=documented(OLLAMA, *SUBMITS))
async def embeddings(body: OllamaEmbeddings, request: Request) -> JSON:
    """Ollama's older endpoint: one `prompt`, one `embedding` (empty for no prompt)."""
    if not body.prompt:
        await _loaded(request, body.model)
        return JSON({"embedding": []})
    req = TaskMessage(
        model=body.model,
        kind=EMBED,
        inputs=[body.prompt],
        options=body.options or {},
        keep_alive=body.keep_alive,
        client=request.headers.get("user-agent"),
        stream=False,
    )
    done = await _embed(request, req)
    return JSON({"embedding": unpack_vector(done.vectors[0])}, headers=done.headers())


async def _loaded(request: Request, model: str) -> JSON:
    """What Ollama answers for no input: the model is there (404 if nobody serves it)."""
    gw = gateway(request)
    await gw.retrying(lambda: gw.resolve(model))
    return JSON({"model": model, "embeddings": []})
