"""Fleet presets: the seed fleet says what the story measured, and a bad file fails with one clear line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sim.errors import FleetError
from sim.fleetspec import default_digest, load_fleet, parse_fleet, preset_names

HEX64 = re.compile(r"^[0-9a-f]{64}$")


def test_the_seed_preset_is_shipped_and_listed() -> None:
    assert "seed" in preset_names()


def test_the_seed_fleet_has_the_story_machines_and_speeds() -> None:
    fleet = load_fleet("seed")
    by_name = {w.name: w for w in fleet.workers}
    assert set(by_name) == {"macbookair", "rtx3070ti", "ai-core"}
    air, gpu = by_name["macbookair"], by_name["rtx3070ti"]
    assert air.models["qwen3:8b"].decode_tps == pytest.approx(11.4)
    assert gpu.models["qwen3:8b"].decode_tps == pytest.approx(83.0)
    ratio = gpu.models["qwen3:8b"].decode_tps / air.models["qwen3:8b"].decode_tps
    assert ratio == pytest.approx(7.3, abs=0.05)
    assert air.slots == 1
    assert gpu.slots == 1


def test_the_retired_server_is_registered_but_serves_nothing() -> None:
    core = next(w for w in load_fleet("seed").workers if w.name == "ai-core")
    assert core.serves == []
    assert core.models


def test_elyza_on_the_gpu_pc_is_not_held_at_start_but_has_the_same_digest() -> None:
    fleet = load_fleet("seed")
    air = next(w for w in fleet.workers if w.name == "macbookair")
    gpu = next(w for w in fleet.workers if w.name == "rtx3070ti")
    assert gpu.models["elyza-jp-8b"].held is False
    assert air.models["elyza-jp-8b"].held is True
    assert fleet.digest_of(gpu, "elyza-jp-8b") == fleet.digest_of(air, "elyza-jp-8b")


def test_every_digest_of_the_seed_fleet_is_sha256_hex() -> None:
    fleet = load_fleet("seed")
    for worker in fleet.workers:
        for name in worker.models:
            assert HEX64.match(fleet.digest_of(worker, name)), (worker.name, name)


def test_the_seed_models_have_quality_for_every_benchmark_domain() -> None:
    fleet = load_fleet("seed")
    for name, spec in fleet.model.items():
        assert set(spec.quality) >= {"general", "code", "japanese"}, name
        assert all(0.0 <= q <= 1.0 for q in spec.quality.values())


def test_a_model_without_a_model_table_gets_a_stable_derived_digest() -> None:
    fleet = parse_fleet(
        """
        [[worker]]
        name = "box"
        [worker.models."tiny:1b"]
        decode_tps = 50.0
        """
    )
    worker = fleet.workers[0]
    assert fleet.digest_of(worker, "tiny:1b") == default_digest("tiny:1b")
    assert HEX64.match(default_digest("tiny:1b"))
    assert fleet.model_spec("tiny:1b").quality == {}


def test_a_worker_model_digest_override_wins() -> None:
    fleet = parse_fleet(
        """
        [model."a"]
        digest = "11"
        [[worker]]
        name = "box"
        [worker.models."a"]
        decode_tps = 5.0
        digest = "22"
        """
    )
    assert fleet.digest_of(fleet.workers[0], "a") == "22"


def test_an_unknown_preset_name_fails_naming_the_presets() -> None:
    with pytest.raises(FleetError, match=r"no fleet preset 'nope'; presets: .*seed"):
        load_fleet("nope")


def test_a_fleet_file_is_loaded_by_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('[[worker]]\nname = "only"\n[worker.models."m"]\ndecode_tps = 9.0\n')
    fleet = load_fleet(path)
    assert fleet.name == "mine"
    assert [w.name for w in fleet.workers] == ["only"]


def test_a_missing_fleet_file_fails_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(FleetError, match="cannot read fleet file"):
        load_fleet(tmp_path / "absent.toml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[worker]\nname=", "not valid TOML"),
        ('[[worker]]\nname = "a"\ncolour = "red"', "colour"),
        ('[[worker]]\nname = "a"\n[[worker]]\nname = "a"', "unique"),
        ('[[worker]]\nname = "a"\nslots = 0', "at least one slot"),
        ('[[worker]]\nname = "a"\n[worker.models."m"]\ndecode_tps = -1.0', "positive speeds"),
        ('[[worker]]\nname = "a"\n[worker.models."m"]\nprompt_tps = 5.0', "decode_tps"),
    ],
)
def test_a_malformed_fleet_fails_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(FleetError, match=message):
        parse_fleet(text, "bad.toml")
