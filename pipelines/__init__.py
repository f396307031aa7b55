"""Pipelines: decompose one request, run the parts in parallel on the fleet, integrate the answers."""
