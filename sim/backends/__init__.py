"""Simulated backends: machines that speak Ollama's (and OpenAI's) HTTP API with preset speeds."""
