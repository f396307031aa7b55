"""Configuration precedence and provenance."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, quote, urlsplit

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


def test_tls_file_settings_from_the_environment_join_the_redis_url(tmp_path: Path) -> None:
    env = {
        "ROUTELEDGER_REDIS_URL": "rediss://:pw@redis.lan:6380/0",
        "ROUTELEDGER_REDIS_CA": str(tmp_path / "ca.crt"),
        "ROUTELEDGER_REDIS_CERT": str(tmp_path / "me.crt"),
        "ROUTELEDGER_REDIS_KEY": str(tmp_path / "me.key"),
    }
    r = resolve({}, environ=env)
    assert r.sources["redis_ca"] == "env ROUTELEDGER_REDIS_CA"
    url = urlsplit(redis_url_for(r.settings))
    assert (url.scheme, url.netloc, url.path) == ("rediss", ":pw@redis.lan:6380", "/0")
    assert dict(parse_qsl(url.query)) == {
        "ssl_ca_certs": str(tmp_path / "ca.crt"),
        "ssl_certfile": str(tmp_path / "me.crt"),
        "ssl_keyfile": str(tmp_path / "me.key"),
    }


def test_the_url_up_recorded_gets_the_tls_settings_too(tmp_path: Path) -> None:
    (tmp_path / "redis.url").write_text("rediss://:pw@127.0.0.1:7000/0\n")
    r = resolve({"data_dir": str(tmp_path)}, environ={"ROUTELEDGER_REDIS_CA": str(tmp_path / "ca.crt")})
    assert (
        redis_url_for(r.settings)
        == f"rediss://:pw@127.0.0.1:7000/0?ssl_ca_certs={quote(str(tmp_path / 'ca.crt'), safe='')}"
    )


def test_the_browser_and_options_settings_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('allowed_hosts = ["router.lan"]\ndomains = ["general", "legal"]\nmax_num_ctx = 8192\n')
    env = {
        "ROUTELEDGER_ALLOWED_ORIGINS": "https://chat.example:3000, http://localhost:3000",
        "ROUTELEDGER_ALLOW_RUNTIME_OPTIONS": "true",
    }
    s = resolve({}, config_file=conf, environ=env).settings
    assert s.allowed_hosts == ["router.lan"] and s.domains == ["general", "legal"] and s.max_num_ctx == 8192
    assert s.allowed_origins == ["https://chat.example:3000", "http://localhost:3000"]
    assert s.allow_runtime_options is True
    default = resolve({}, environ={}).settings
    assert default.allowed_hosts == [] and default.allow_runtime_options is False
    assert {"general", "code", "japanese"} <= set(default.domains)


@pytest.mark.parametrize("domains", ["General", "a b", "x" * 40, ""])
def test_a_domain_that_could_not_be_a_table_key_is_a_config_error(domains: str) -> None:
    with pytest.raises(ConfigError, match="domain"):
        resolve({}, environ={"ROUTELEDGER_DOMAINS": domains})


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
