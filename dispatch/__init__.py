"""Between the router and its users: the live view the router reads, the one submission path (the
gateway, with every check), the one rule of who serves a model, benchmarks. The task store it
queues into is `tasks`.

`api/`, `workers/`, `pipelines/` and `sim/` import from here and never from one another.
"""
