"""A whole routeledger in front of real llama.cpp servers, run as a user runs it.

`RealFleet` starts `routeledger up` (embedded Redis, the API, the projector and the reaper) in a
data directory of its own, one `llama-server` per machine it is given, and one
`routeledger worker --kind openai` beside each, all as separate processes; it then talks to the API
over HTTP as a client would, and reads the ledger from Redis to say what happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import redis

from events.codec import decode_entry
from events.event import Event, TaskClaimed, TaskCompleted, TaskFailed, TaskRouted, TaskSubmitted
from events.keys import Keys
from tests.real.llama import OTHER_CPUS, LlamaServer, free_port, pinned


@dataclass
class Machine:
    """One machine of the fleet: its server and the worker in front of it."""

    name: str
    server: LlamaServer
    worker: subprocess.Popen[bytes] | None = None
    log: Path | None = None


@dataclass
class Answer:
    """What a client got for one request, and who ran it."""

    worker: str
    text: str
    seconds: float
    task_id: str
    status: int = 200


@dataclass
class RealFleet:
    """`routeledger up` plus machines; `start()` waits until every worker is online."""

    data: Path
    machines: list[Machine]
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    up: subprocess.Popen[bytes] | None = None
    true_tps: dict[str, float] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        return {**os.environ, "ROUTELEDGER_LOG_LEVEL": "info", **self.env}

    def start(self, timeout_s: float = 90.0) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        for m in self.machines:
            m.server.start()
        # Each server's own decode speed, measured before any worker talks to it: the truth the
        # learned figures are held to.
        with ThreadPoolExecutor(len(self.machines)) as pool:
            speeds = pool.map(lambda m: m.server.decode_tps(rounds=2), self.machines)
            self.true_tps = {m.name: tps for m, tps in zip(self.machines, speeds, strict=True)}
        up_log = (self.data / "up.log").open("wb")
        self.up = subprocess.Popen(
            pinned(
                [
                    sys.executable,
                    "-m",
                    "routeledger",
                    "up",
                    "--data-dir",
                    str(self.data),
                    "--port",
                    str(self.port),
                ],
                OTHER_CPUS,
            ),
            env=self._env(),
            stdout=up_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait(lambda: self._get("/readyz").status_code == 200, timeout_s, "the API to be ready")
        for m in self.machines:
            self.start_worker(m)
        self.wait_online([m.name for m in self.machines], timeout_s)

    def start_worker(self, m: Machine, *extra: str) -> None:
        m.log = self.data / f"worker-{m.name}.log"
        out = m.log.open("ab")
        m.worker = subprocess.Popen(
            pinned(
                [
                    sys.executable,
                    "-m",
                    "routeledger",
                    "worker",
                    "--backend",
                    m.server.url,
                    "--kind",
                    "openai",
                    "--id",
                    m.name,
                    "--data-dir",
                    str(self.data),
                    *extra,
                ],
                OTHER_CPUS,
            ),
            env=self._env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_online(self, names: list[str], timeout_s: float = 60.0) -> None:
        def online() -> bool:
            workers = {w["id"]: w for w in self._get("/v1/fleet").json().get("workers", [])}
            return all(workers.get(n, {}).get("status") == "online" for n in names)

        self._wait(online, timeout_s, f"workers {names} to be online")

    def stop(self) -> None:
        for m in self.machines:
            _stop(m.worker)
        _stop(self.up)
        for m in self.machines:
            m.server.stop()

    def __enter__(self) -> RealFleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- as a client -------------------------------------------------------------------------
    def _get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(self.base + path, params=params or None, timeout=30.0)

    def _wait(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                last = exc
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last error: {last})")

    def model(self) -> str:
        """The one model the fleet serves, by the name the API lists."""
        names = [
            m["id"] for m in self._get("/v1/models").json()["data"] if m["id"] not in ("auto", "pipeline")
        ]
        assert len(names) == 1, f"expected one model, the API lists {names}"
        return str(names[0])

    def chat(
        self,
        content: str,
        *,
        stream: bool = False,
        max_tokens: int = 128,
        model: str | None = None,
        client: httpx.Client | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Answer:
        """One OpenAI chat completion; streamed ones are read to their end as a reader would."""
        body: dict[str, Any] = {
            "model": model or self.model(),
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
            **(extra or {}),
        }
        own = client is None
        http = client or httpx.Client(timeout=300.0)
        t0 = time.monotonic()
        try:
            if not stream:
                resp = http.post(self.base + "/v1/chat/completions", json=body)
                seconds = time.monotonic() - t0
                task = resp.headers.get("x-routeledger-task", "")
                if resp.status_code != 200:
                    return Answer("", resp.text, seconds, task, resp.status_code)
                text = resp.json()["choices"][0]["message"]["content"] or ""
                return Answer(resp.headers.get("x-routeledger-worker", ""), text, seconds, task)
            parts: list[str] = []
            with http.stream("POST", self.base + "/v1/chat/completions", json=body) as resp:
                task = resp.headers.get("x-routeledger-task", "")
                if resp.status_code != 200:
                    resp.read()
                    return Answer("", resp.text, time.monotonic() - t0, task, resp.status_code)
                for line in resp.iter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        for choice in json.loads(line[5:]).get("choices") or []:
                            parts.append((choice.get("delta") or {}).get("content") or "")
            seconds = time.monotonic() - t0
            return Answer(self.task(task).get("worker") or "", "".join(parts), seconds, task)
        finally:
            if own:
                http.close()

    def task(self, task_id: str) -> dict[str, Any]:
        """The task's record (`GET /v1/tasks/{id}`), once it has a final status."""
        record: dict[str, Any] = {}

        def done() -> bool:
            nonlocal record
            record = self._get(f"/v1/tasks/{task_id}").json()
            return record.get("status") in ("completed", "failed", "cancelled", "dead_lettered")

        self._wait(done, 30.0, f"task {task_id} to end")
        return record

    def preview(self, model: str | None = None) -> dict[str, Any]:
        """`GET /v1/route/preview` for the model: the ranking the router would make now."""
        return dict(self._get("/v1/route/preview", model=model or self.model()).json())

    def server_decode_tps(self) -> dict[str, float]:
        """Machine -> its server's own decode speed (`timings.predicted_per_second` of 128-token
        answers, measured before the workers started)."""
        return dict(self.true_tps)

    def server_decode_tps_now(self) -> dict[str, float]:
        """Machine -> its server's own decode speed measured again now (call it while the fleet is
        idle): a shared machine's speed drifts over minutes, by 20% and more here."""
        with ThreadPoolExecutor(len(self.machines)) as pool:
            speeds = pool.map(lambda m: m.server.decode_tps(rounds=2), self.machines)
            return {m.name: tps for m, tps in zip(self.machines, speeds, strict=True)}

    # 25%: on a 2-core machine the same idle server measured 17-21% faster than what its workers
    # learned while routeledger's processes ran beside it (fast 64.5 learned against 78.0 and 84.5
    # measured; slow, under cpulimit, 22.2 against 26.4 and 28.0), in two runs of one day. The
    # artefact this check is for is several times off (59-99 tok/s learned for a true 23; the
    # story's 7.3x), far outside it.
    def assert_learned_is_the_servers(self, learned: dict[str, float], within: float = 0.25) -> None:
        """Each machine's learned decode speed within `within` of its server's own, as measured
        before the workers started or again now: the figure the router uses is the machine's, not
        an artefact of how it was sampled."""
        before, now = self.server_decode_tps(), self.server_decode_tps_now()
        for name in before:
            ratios = [learned[name] / before[name], learned[name] / now[name]]
            assert any(1 - within <= r <= 1 + within for r in ratios), (name, learned, before, now)

    def decode_samples(self) -> dict[str, int]:
        """Worker -> the decode-speed samples its speed row holds (what `/v1/stats` shows)."""
        out: dict[str, int] = {}
        for row in self._get("/v1/stats").json()["speed"]:
            out[row["worker"]] = out.get(row["worker"], 0) + int(row["decode_tps"]["n"])
        return out

    def measured(self, samples: int) -> bool:
        """Whether every machine's speed row holds at least `samples` decode samples."""
        have = self.decode_samples()
        return all(have.get(m.name, 0) >= samples for m in self.machines)

    def burst(self, count: int, *, max_tokens: int) -> Burst:
        """`count` requests sent at once (half of them streamed), each from its own client."""
        start_ms = time.time() * 1000

        def one(i: int) -> Answer:
            return self.chat(f"{_BURST[i % len(_BURST)]} ({i})", stream=i % 2 == 1, max_tokens=max_tokens)

        with ThreadPoolExecutor(count) as pool:
            answers = list(pool.map(one, range(count)))
        return Burst(self, answers, start_ms)

    def learned_decode_tps(self) -> dict[str, float]:
        """Worker -> the decode speed the router uses for it now (the preview's field)."""
        out: dict[str, float] = {}
        for c in self.preview()["candidates"]:
            out[c["worker"]] = float(c["fields"]["decode_tps"]["value"])
        return out

    # -- the ledger ----------------------------------------------------------------------------
    def redis(self) -> redis.Redis:
        url = (self.data / "redis.url").read_text().strip()
        return redis.Redis.from_url(url)

    def events(self, *kinds: type[Event]) -> list[Event]:
        """Every event of the ledger (of `kinds`, when given), oldest first."""
        keys = Keys()
        client = self.redis()
        try:
            raw: Any = client.xrange(keys.events)
        finally:
            client.close()
        out = [decode_entry(entry_id.decode(), fields) for entry_id, fields in raw]
        return [e for e in out if not kinds or isinstance(e, kinds)]

    def why(self, task_id: str) -> str:
        """The routing record of a task (its TaskRouted breakdown), for a failing test to show."""
        for e in self.events(TaskRouted):
            if isinstance(e, TaskRouted) and e.task_id == task_id:
                return json.dumps(msgspec.to_builtins(e.breakdown))[:4000]
        return f"no TaskRouted for {task_id}"

    def wait_for(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        self._wait(check, timeout_s, what)


_BURST = [
    "Tell me about the history of bread.",
    "Write a limerick about a robot.",
    "What are three uses of copper?",
    "Describe a sunset over the mountains.",
]


class Burst:
    """What happened to a burst of requests, read from the ledger: who ran each, and when."""

    def __init__(self, fleet: RealFleet, answers: list[Answer], start_ms: float) -> None:
        self.answers = answers
        ids = {a.task_id for a in answers}
        events = fleet.events()
        self.submitted_at = min(
            (e.at for e in events if isinstance(e, TaskSubmitted) and e.task_id in ids), default=start_ms
        )
        self.claimed = {e.task_id: e.at for e in events if isinstance(e, TaskClaimed) and e.task_id in ids}
        # Every user task's run on each worker (any task not a benchmark), as (start, end) in ms.
        starts: dict[tuple[str, str, int], int] = {}
        self.runs: dict[str, list[tuple[int, int, str]]] = {}
        self.background: dict[str, list[tuple[int, int]]] = {}
        for e in events:
            if isinstance(e, TaskClaimed):
                starts[(e.worker, e.task_id, e.attempt)] = e.at
            elif isinstance(e, TaskCompleted | TaskFailed):
                began = starts.pop((e.worker, e.task_id, e.attempt), None)
                if began is None:
                    continue
                if e.task_id.startswith("bench-"):
                    self.background.setdefault(e.worker, []).append((began, e.at))
                else:
                    self.runs.setdefault(e.worker, []).append((began, e.at, e.task_id))

    def intervals(self, worker: str) -> list[tuple[int, int, str]]:
        return sorted(self.runs.get(worker, []))

    def idle(self, worker: str, start: float, end: float, slack_s: float) -> list[tuple[float, float]]:
        """Stretches of more than `slack_s` within [start, end] (ms) when `worker` ran no user task."""
        gaps = []
        at = start
        for began, ended, _ in self.intervals(worker):
            if began - at > slack_s * 1000 and began > start:
                gaps.append((at, min(began, end)))
            at = max(at, ended)
            if at >= end:
                break
        if end - at > slack_s * 1000:
            gaps.append((at, end))
        return [g for g in gaps if g[0] < end]

    def describe(self) -> str:
        rel = self.submitted_at
        parts = []
        for worker in sorted(self.runs):
            spans = ", ".join(
                f"{t[-6:]} {(b - rel) / 1000:.1f}-{(e - rel) / 1000:.1f}s"
                for b, e, t in self.intervals(worker)
            )
            parts.append(f"{worker}: {spans}")
        for worker, background in sorted(self.background.items()):
            shown = ", ".join(
                f"{(b - rel) / 1000:.1f}-{(e - rel) / 1000:.1f}s" for b, e in sorted(background)
            )
            parts.append(f"{worker} background: {shown}")
        return "; ".join(parts)


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
