"""Simulated Ollama-compatible backends and the discrete-event scheduling simulator."""
