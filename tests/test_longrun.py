"""A year of history squeezed into a minute: 200,000 tasks through the projector and the archive.

The ledger's ids are spread over the year, as a ledger that lived it would hold them; the archiver
runs as `up` would, with a one-day hot window. Afterwards nothing is lost or counted twice, the live
tables equal a rebuild from archive + stream, and what a projector's start and Redis's memory cost
did not grow with history.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from events.keys import Keys
from replay.history import History
from replay.longrun import LongRun

# A tenth of bench/longrun.py's year (2,000,000 tasks, about 10^7 events): the properties below do
# not depend on the count, and the full year's figures live in the benchmark, not in every test run.
TASKS = 200_000
MARKS = (20_000, 100_000, TASKS)


@pytest.mark.slow
async def test_a_year_of_two_hundred_thousand_tasks_folds_archives_and_rebuilds_to_the_live_tables(
    redis_url: str, redis_client: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    archive_dir = tmp_path / "archive"
    run = LongRun(
        redis_client,
        keys,
        archive_dir,
        tasks=TASKS,
        hot_window_s=86_400.0,
        batch_tasks=20_000,
        archive_every_tasks=25_000,
        projector_batch=10_000,
    )
    small, middle, full = await run.run(MARKS)

    # Nothing lost, nothing twice: archive + stream hold every appended entry once.
    history = History(redis_client, keys, archive_dir)
    assert await history.count() == run.appended == full.events
    assert full.archived_events + full.stream_length == run.appended
    # The hot window (one day of a year) is all Redis keeps of the ledger.
    assert full.stream_length < 2 * run.appended / 365

    # Flat in history: a projector starts as fast after 2,000,000 tasks as after 100,000 (a few
    # milliseconds of slack: at a millisecond, scheduling noise alone is of that size), and Redis
    # holds as much after a year as after half of one (task rows are kept for 30 days).
    assert full.projector_start_s <= 2 * small.projector_start_s + 0.005, (small, full)
    assert full.used_memory <= 1.25 * middle.used_memory, (middle, full)

    # The live projector folded it all, and a rebuild from archive + stream equals it field by field.
    done = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "routeledger",
            "replay",
            "verify",
            "--redis-url",
            redis_url,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200", "ROUTELEDGER_ARCHIVE_DIR": str(archive_dir)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "match" in done.stdout
