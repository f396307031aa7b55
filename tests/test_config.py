"""Configuration precedence and provenance."""

from __future__ import annotations

from pathlib import Path

import pytest

from routeledger.config import redis_url_for, resolve
from routeledger.errors import ConfigError, NotRunningError


def test_each_value_says_where_it_came_from_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('port = 9000\nprefix = "file:"\nlease_ms = 5000\n')
    env = {"ROUTELEDGER_PORT": "9100", "ROUTELEDGER_API_KEYS": "a, b", "ROUTELEDGER_LEASE_MS": "6000"}
    r = resolve({"lease_ms": 7000, "host": None}, config_file=conf, environ=env)
    assert r.settings.port == 9100 and r.sources["port"] == "env ROUTELEDGER_PORT"
    assert r.settings.prefix == "file:" and r.sources["prefix"] == f"file {conf}"
    assert r.settings.lease_ms == 7000 and r.sources["lease_ms"] == "flag"
    assert r.settings.api_keys == ["a", "b"]
    assert r.settings.host == "127.0.0.1" and r.sources["host"] == "default"


def test_redis_url_comes_from_the_common_env_var_too() -> None:
    r = resolve({}, environ={"REDIS_URL": "redis://x:1/0"})
    assert r.settings.redis_url == "redis://x:1/0" and r.sources["redis_url"] == "env REDIS_URL"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port = 'abc'", "invalid configuration"),
        ("nosuch = 1", "unknown settings"),
        ("port = ", "not valid TOML"),
    ],
)
def test_a_bad_config_file_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(text)
    with pytest.raises(ConfigError, match=message):
        resolve({}, config_file=conf, environ={})


def test_inconsistent_values_are_rejected() -> None:
    with pytest.raises(ConfigError, match="heartbeat_ms"):
        resolve({"lease_ms": 1000, "heartbeat_ms": 2000}, environ={})


def test_without_a_running_instance_commands_say_how_to_start_one(tmp_path: Path) -> None:
    r = resolve({"data_dir": str(tmp_path)}, environ={})
    with pytest.raises(NotRunningError, match="routeledger up"):
        redis_url_for(r.settings)


def test_named_keys_with_limits_come_from_toml_tables_or_a_json_list_in_the_environment(
    tmp_path: Path,
) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(
        'api_keys = ["plain"]\nmax_queue_depth = 50\n'
        '[[keys]]\nname = "alice"\nkey = "secret-a"\nrpm = 60\ntokens_per_day = 200000\n'
        "max_queued = 20\nmax_priority = 5\n"
    )
    r = resolve({}, config_file=conf, environ={})
    (alice,) = r.settings.keys
    assert (alice.name, alice.rpm, alice.tokens_per_day, alice.max_queued, alice.max_priority) == (
        "alice",
        60,
        200000,
        20,
        5,
    )
    assert r.settings.api_keys == ["plain"] and r.settings.max_queue_depth == 50
    env = {"ROUTELEDGER_KEYS": '[{"name": "bob", "key": "secret-b", "max_queued": 3}]'}
    assert resolve({}, environ=env).settings.keys[0].max_queued == 3


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ('[{"name": "a", "key": "1"}, {"name": "a", "key": "2"}]', "repeated"),
        ('[{"name": "a", "key": "1", "rpm": 0}]', "at least 1"),
        ('[{"name": "a", "key": "1", "burst": 3}]', "invalid configuration"),
        ("[{", "not valid JSON"),
    ],
)
def test_a_bad_key_table_is_a_clear_error(keys: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve({}, environ={"ROUTELEDGER_KEYS": keys})
