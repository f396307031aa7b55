"""routeledger: the composition root (CLI, configuration, processes, embedded Redis)."""

__version__ = "0.1.0"
