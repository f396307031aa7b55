"""The litellm SDK against routeledger as each of its providers: `ollama/` (Ollama's /api/generate),
`ollama_chat/` (/api/chat), both sent without a Content-Type header, and `openai/` (the OpenAI
surface under /v1, any key); streamed and not, and embeddings through `ollama/` and `openai/`."""

from __future__ import annotations

import litellm
import pytest
from litellm.types.utils import EmbeddingResponse, ModelResponse

from tests.clients.fleet import Routeledger

# litellm's own types warn as pydantic builds them, the first time each is used.
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning")

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
PROVIDERS = pytest.mark.parametrize("provider", ["ollama", "ollama_chat", "openai"])


def base(instance: Routeledger, provider: str) -> str:
    """litellm's api_base for the provider: the server itself, or its OpenAI surface."""
    return instance.url + "/v1" if provider == "openai" else instance.url


def cut_short(provider: str) -> str:
    """The finish reason litellm gives an answer cut at max_tokens: its `ollama/` provider says
    "stop" whatever /api/generate's done_reason ("length" here) says."""
    return "stop" if provider == "ollama" else "length"


@PROVIDERS
def test_litellm_answers_a_chat_through_each_provider(routeledger: Routeledger, provider: str) -> None:
    answer = litellm.completion(
        model=f"{provider}/qwen3:8b",
        api_base=base(routeledger, provider),
        api_key="any",
        messages=MESSAGES,
        max_tokens=8,
    )
    assert isinstance(answer, ModelResponse)
    choice = answer.choices[0]
    assert isinstance(choice, litellm.Choices)
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert choice.finish_reason == cut_short(provider)
    assert answer.usage.completion_tokens == 8  # type: ignore[attr-defined]


@PROVIDERS
def test_litellm_streams_a_chat_through_each_provider(routeledger: Routeledger, provider: str) -> None:
    stream = litellm.completion(
        model=f"{provider}/qwen3:8b",
        api_base=base(routeledger, provider),
        api_key="any",
        messages=MESSAGES,
        max_tokens=8,
        stream=True,
    )
    pieces = []
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert len(pieces) >= 2
    assert "".join(pieces).strip()
    assert [r for r in reasons if r] == [cut_short(provider)]


@pytest.mark.parametrize("provider", ["ollama", "openai"])
def test_litellm_embeds_through_the_ollama_and_openai_providers(
    routeledger: Routeledger, provider: str
) -> None:
    embedded = litellm.embedding(
        model=f"{provider}/nomic-embed-text",
        api_base=base(routeledger, provider),
        api_key="any",
        input=["Why is the sky blue?", "Why is the grass green?"],
    )
    assert isinstance(embedded, EmbeddingResponse)
    vectors = [item["embedding"] for item in embedded.data]
    assert [len(v) for v in vectors] == [768, 768]
    assert vectors[0] != vectors[1]
    assert embedded.usage is not None and embedded.usage.prompt_tokens > 0
