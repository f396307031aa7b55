"""Between the router and its users: the live view the router reads, the one submission path, the
one rule of who serves a model, the task queues and their payloads, worker leases, benchmarks.

`api/`, `workers/`, `pipelines/` and `sim/` import from here and never from one another.
"""
