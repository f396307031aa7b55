"""The task store: what a task is while it waits and runs, in Redis.

Queues and their entries (`queues`), task payloads, results and outputs (`payload`), worker leases
(`lease`) and API keys' quotas (`quota`), with the Lua that changes them in one step. It depends
only on `events`; `dispatch`, the workers, the projector and the API use it, each through the
same operations.
"""
