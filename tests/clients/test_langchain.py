"""LangChain's chat models and embeddings against routeledger with their default settings:
ChatOllama bound to a tool, OllamaEmbeddings (which sends `"options": {"num_ctx": null}`),
ChatOpenAI's structured output in JSON mode and with a JSON schema, and OpenAIEmbeddings (which
tokenizes its inputs with tiktoken's cl100k_base and sends token arrays)."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_ollama import ChatOllama, OllamaEmbeddings
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel

from tests.clients.fleet import Routeledger

DOCUMENTS = ["Why is the sky blue?", "Why is the grass green?"]


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


class Weather(BaseModel):
    """The weather in a city."""

    city: str
    degrees: int


# A JSON schema, as a JSON-mode caller writes one (JSON mode sends none: the prompt asks for JSON).
FORECAST: dict[str, Any] = {
    "title": "forecast",
    "description": "A forecast of several days.",
    "type": "object",
    "properties": {"days": {"type": "array", "items": {"type": "string"}}},
}


def chat_openai(instance: Routeledger) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=instance.url + "/v1",
        api_key="any",  # type: ignore[arg-type]
        model="qwen3:8b",
        max_tokens=64,  # type: ignore[call-arg]
        max_retries=0,
    )


def test_chat_ollama_bound_to_a_tool_gets_a_tool_call_back(routeledger: Routeledger) -> None:
    # A call costs its name and arguments in tokens: 64 leaves room for it.
    llm = ChatOllama(base_url=routeledger.url, model="qwen3:8b", num_predict=64)
    asked = llm.bind_tools([get_weather]).invoke("What is the weather in Paris? Use get_weather.")
    assert isinstance(asked, AIMessage)
    assert [call["name"] for call in asked.tool_calls] == ["get_weather"]
    assert isinstance(asked.tool_calls[0]["args"]["city"], str)


def test_ollama_embeddings_embed_documents_and_a_query(routeledger: Routeledger) -> None:
    embeddings = OllamaEmbeddings(base_url=routeledger.url, model="nomic-embed-text")
    documents = embeddings.embed_documents(DOCUMENTS)
    query = embeddings.embed_query("Why is the sky blue?")
    assert [len(v) for v in documents] == [768, 768]
    assert documents[0] != documents[1]
    assert len(query) == 768


def test_chat_openai_structured_output_in_json_mode_parses_the_json_it_gets(
    routeledger: Routeledger,
) -> None:
    structured = chat_openai(routeledger).with_structured_output(FORECAST, method="json_mode")
    parsed = structured.invoke("Give me a forecast of three days, as JSON.")
    # JSON mode (`response_format: json_object`) answers a JSON object, whatever its keys.
    assert isinstance(parsed, dict) and parsed


def test_chat_openai_structured_output_with_a_json_schema_fills_the_model(routeledger: Routeledger) -> None:
    structured = chat_openai(routeledger).with_structured_output(Weather, method="json_schema")
    weather = structured.invoke("What is the weather in Paris?")
    assert isinstance(weather, Weather)
    assert isinstance(weather.city, str) and isinstance(weather.degrees, int)


def test_openai_embeddings_with_default_settings_send_token_arrays_and_get_vectors(
    routeledger: Routeledger,
) -> None:
    embeddings = OpenAIEmbeddings(
        base_url=routeledger.url + "/v1",
        api_key="any",  # type: ignore[arg-type]
        model="nomic-embed-text",
        max_retries=0,
    )
    documents = embeddings.embed_documents(DOCUMENTS)
    query = embeddings.embed_query("Why is the sky blue?")
    assert [len(v) for v in documents] == [768, 768]
    assert documents[0] != documents[1]
    assert len(query) == 768
