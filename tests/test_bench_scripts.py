"""Every benchmark script starts as `make bench` runs it (`python -m bench.NAME` from the project's
root), and `make bench` runs every script: it is not run by CI, so a broken import would go unseen."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


def run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m bench.SCRIPT ARGS` from the project's root, as `make bench` runs it."""
    return subprocess.run(
        [sys.executable, "-m", f"bench.{script}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_benchmark_script_imports_what_it_measures_and_shows_its_options(script: str) -> None:
    done = run(script, "--help", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_make_bench_runs_every_script_as_a_module_of_the_bench_package() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    ran = re.findall(r"^\t\$\(BIN\)/python -m bench\.(\w+)$", recipe, re.MULTILINE)
    assert sorted(ran) == SCRIPTS
    assert len(ran) == len(recipe.strip().splitlines()) - 1, recipe


def test_no_benchmark_script_edits_the_import_path_or_loads_a_sibling_by_its_file() -> None:
    # The bug this replaces: `python bench/ledger.py` put bench/ first on the path, where
    # bench/dispatch.py shadowed the dispatch package ("'dispatch' is not a package").
    for script in SCRIPTS:
        text = (BENCH / f"{script}.py").read_text()
        edits = ("sys.path.insert", "sys.path.append", "sys.path =", "spec_from_file_location")
        assert not [edit for edit in edits if edit in text], script


def test_the_scale_benchmark_times_decisions_at_each_size_and_ends_with_its_json_line() -> None:
    done = run(
        "scale",
        *[
            "--sizes",
            "6x10,12x30",
            "--models",
            "4",
            "--decisions",
            "5,3",
            "--rounds",
            "3",
            "--idle",
            "2",
            "--idle-seconds",
            "2",
            "--result-keys",
            "100",
        ],
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("6 workers x 4 models, backlog 10: decision p50")
    figures = json.loads(lines[-1])
    sizes = ("6x10", "12x30")
    decision_keys = [f"decision_{q}_us_{s}" for q in ("p99", "p50") for s in sizes]
    round_keys = [f"decision_{q}_us_{s}_rounds" for s in sizes for q in ("p99", "p50")]
    idle_keys = ["idle_worker_redis_cmds_per_s_2", "idle_worker_scripts_per_s_2"]
    assert list(figures) == [
        "bench",
        "idle_worker_redis_cmds_per_s",
        *decision_keys,
        *round_keys,
        "gate",
        *idle_keys,
    ]
    # The gate check timed is the one a worker's RouterGate makes.
    assert figures["gate"] == "aware"
    # Each figure is the median of its three rounds' figures.
    for key in decision_keys:
        assert len(figures[f"{key}_rounds"]) == 3
        assert figures[key] == sorted(figures[f"{key}_rounds"])[1]
    assert figures["bench"] == "scale"
    # Two idle workers renew their leases and look at their queues: a few commands a second each.
    assert 0 < figures["idle_worker_scripts_per_s_2"] <= figures["idle_worker_redis_cmds_per_s_2"]
    assert figures["idle_worker_redis_cmds_per_s"] == figures["idle_worker_redis_cmds_per_s_2"]
    for s in sizes:
        assert 0 < figures[f"decision_p50_us_{s}"] <= figures[f"decision_p99_us_{s}"]


def test_the_cluster_benchmark_measures_one_redis_and_a_cluster_side_by_side_in_its_json_line() -> None:
    # About 30 s: it starts one Redis, a 3-master cluster and a small fleet on each.
    done = run(
        "cluster",
        *[
            "--events",
            "1000",
            "--singles",
            "50",
            "--fold",
            "500",
            "--tasks",
            "10",
            "--rounds",
            "1",
            "--dispatch-limit-s",
            "30",
        ],
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "cluster"
    for what in ("append", "single_append", "projector"):
        assert figures[f"{what}_ratio_cluster_vs_single"] > 0
        assert figures[f"{what}_ratio_cluster_vs_single"] == pytest.approx(
            figures[f"{what}_eps_cluster"] / figures[f"{what}_eps_single"], rel=0.01
        )
    # Worker processes ran the fleet's tasks on both (a round that does not finish has no figure:
    # null, not zero), and the ratio is theirs.
    single, cluster = figures["dispatch_tasks_per_s_single"], figures["dispatch_tasks_per_s_cluster"]
    assert single is not None and cluster is not None and single > 0 and cluster > 0
    assert figures["dispatch_ratio_cluster_vs_single"] == pytest.approx(cluster / single, rel=0.02)


def test_the_roundtrip_benchmark_prints_each_clients_cpu_per_round_trip_in_its_json_line() -> None:
    done = run("roundtrip", "--commands", "200", "--rounds", "2", "--json", timeout=120)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    clients = ("routeledger_us", "redis_py_us", "floor_us", "floor_no_deadline_us")
    assert list(figures) == ["bench", *clients] and figures["bench"] == "roundtrip"
    assert all(figures[name] > 0 for name in clients)


def test_the_router_benchmark_times_a_named_models_decision_and_both_its_encodings_apart() -> None:
    done = run(
        "router",
        *[
            "--workers",
            "3",
            "--models",
            "2",
            "--backlog",
            "4",
            "--decisions",
            "200",
        ],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert any(line.strip().startswith("a request naming its model, p50: decision") for line in lines)
    figures = json.loads(lines[-1])
    named = ("named_p50_us", "record_p50_us", "breakdown_p50_us")
    assert figures["bench"] == "router" and all(figures[name] > 0 for name in named)
    # The named model's decision ranks one model's holders; `auto` ranks every model's, and adds
    # a gate check.
    assert figures["named_p50_us"] < figures["decision_p50_us"]
