"""The HTTP API: native, OpenAI-compatible and Ollama-compatible endpoints."""
