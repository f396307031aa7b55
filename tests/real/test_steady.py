"""Ten minutes of steady traffic on two real servers: no speed shift is seen where none happened,
and no request fails for a connection a server closed while it was idle."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from events.event import SpeedShiftDetected, TaskCompleted, TaskFailed
from projections.folder import decode_sample
from tests.real.fleet import RealFleet

# The run's length and its requests (the acceptance run: 10 minutes, 500 requests); a developer
# may shorten it with ROUTELEDGER_REAL_STEADY_S.
STEADY_S = float(os.environ.get("ROUTELEDGER_REAL_STEADY_S", "600"))
REQUESTS = 500 if STEADY_S >= 600 else max(20, int(STEADY_S * 500 / 600))
# Longer than llama-server's (cpp-httplib's) 5 s keep-alive: the next request finds the
# connections it kept closed by the server.
IDLE_GAP_S = 6.0


def test_a_steady_run_sees_no_speed_shift_and_loses_no_request_to_a_closed_connection(
    fleet: RealFleet,
) -> None:
    fleet.wait_for(lambda: fleet.measured(3), 180, "the join benchmarks")
    started = time.monotonic()
    statuses: list[int] = []
    limits = httpx.Limits(keepalive_expiry=1.0)
    with httpx.Client(timeout=300.0, limits=limits) as client:
        sent = 0
        while sent < REQUESTS:
            if sent % 50 == 49:
                time.sleep(IDLE_GAP_S)
            if sent % 25 == 12:
                # Three at once: the slow machine gets its share, and its speed is sampled too.
                with ThreadPoolExecutor(3) as pool:
                    answers = list(
                        pool.map(
                            lambda i: fleet.chat(f"Write about the number {i}.", max_tokens=64), range(3)
                        )
                    )
                statuses += [a.status for a in answers]
                sent += 3
                continue
            long = sent % 10 == 0
            answer = fleet.chat(
                f"Describe the number {sent} in a few words.",
                stream=sent % 2 == 1,
                max_tokens=128 if long else 16,
                client=client,
            )
            statuses.append(answer.status)
            sent += 1
            # Spread over the run's length, whatever the machines' speed.
            behind = started + STEADY_S * sent / REQUESTS - time.monotonic()
            if behind > 0:
                time.sleep(behind)
    assert statuses.count(200) == len(statuses), [s for s in statuses if s != 200]
    dropped = [
        e
        for e in fleet.events(TaskFailed)
        if isinstance(e, TaskFailed) and e.kind in ("disconnect", "unreachable", "protocol")
    ]
    assert not dropped, dropped
    shifts = fleet.events(SpeedShiftDetected)
    assert not shifts, (shifts, decode_samples(fleet))
    assert time.monotonic() - started >= STEADY_S * 0.95


def decode_samples(fleet: RealFleet) -> dict[str, list[tuple[int, float]]]:
    """Each worker's decode-speed samples in ledger order (ms, tok/s), for a failure to show what
    the detector saw."""
    out: dict[str, list[tuple[int, float]]] = {}
    for e in fleet.events(TaskCompleted):
        if isinstance(e, TaskCompleted) and not e.duplicate:
            x = decode_sample(e.timings)
            if x is not None:
                out.setdefault(e.worker, []).append((e.at, round(x, 1)))
    return out
