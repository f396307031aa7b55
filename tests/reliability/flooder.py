"""Clients that send as fast as they are answered, in a process of their own (test_fair_share).

    python -m tests.reliability.flooder BASE_URL API_KEY CLIENTS

Each client posts a chat and waits for its answer; a refusal (429) is sent again after 50 ms. The
flood runs until stdin closes; then every request under way is answered, and the status counts are
printed as one JSON line. A process of its own, so that the flood's client-side work does not share
the event loop (and the core) of the API, the workers and the steady client whose latency the test
reads: in one loop, the test measured its own crowding, not the API's fairness.
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "wait": True}


async def flood(base: str, key: str, clients: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    stop = asyncio.Event()

    async def one() -> None:
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as http:
            while not stop.is_set():
                reply = await http.post("/v1/tasks", json=CHAT)
                counts[reply.status_code] = counts.get(reply.status_code, 0) + 1
                if reply.status_code == 429:
                    await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(one()) for _ in range(clients)]
    # stdin closes when the test has measured what it came for.
    await asyncio.to_thread(sys.stdin.read)
    stop.set()
    await asyncio.gather(*tasks)
    return counts


def main() -> None:
    base, key, clients = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(asyncio.run(flood(base, key, clients))), flush=True)


if __name__ == "__main__":
    main()
