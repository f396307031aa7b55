"""The worker agent: consumer groups, backend adapters, heartbeats and benchmarks."""
