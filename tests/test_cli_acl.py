"""The worker ACL lets a worker append only to its own inbox and run only the routeledger functions."""

from __future__ import annotations

import shlex

import pytest

from events.keys import Keys
from routeledger.cli_acl import WORKER_COMMANDS, worker_acl_rules, worker_command, worker_url


def test_a_worker_appends_only_to_its_own_inbox_and_the_dead_letters_and_reads_the_ledger() -> None:
    keys = Keys()
    rules = worker_acl_rules("a", "pw", keys)
    assert rules[-1] == f"(~{keys.inbox('a')} ~{keys.dead} +xadd +fcall)"
    assert f"%R~{keys.events}" in rules
    assert not any(r in (f"~{keys.events}", f"~{keys.inbox('*')}", "~*") for r in rules)


def test_a_worker_may_run_no_lua_of_its_own_and_scan_nothing() -> None:
    rules = worker_acl_rules("a", "pw")
    forbidden = {"eval", "evalsha", "eval_ro", "script|load", "function|load", "scan", "keys", "sscan"}
    assert "fcall" in WORKER_COMMANDS
    assert not forbidden & set(WORKER_COMMANDS)
    assert not [r for r in rules if r.startswith("+") and r[1:] in forbidden]


def test_a_worker_may_take_keep_and_requeue_queue_entries_but_never_remove_one() -> None:
    keys = Keys()
    rules = worker_acl_rules("a", "pw", keys)
    removers = {"xack", "xdel", "xtrim", "del", "unlink", "pexpire", "expire", "xautoclaim", "xgroup|destroy"}
    (queues,) = [r for r in rules if r.startswith("(") and f"~{keys.pinned('a')}" in r and "+fcall" in r]
    granted = {part[1:] for part in queues.strip("()").split() if part.startswith("+")}
    assert {"fcall", "xreadgroup", "xclaim", "xgroup|create"} <= granted
    assert not removers & granted
    assert not {"xack", "xdel", "xtrim", "xautoclaim"} & set(WORKER_COMMANDS)
    # Outside that selector the queues are read-only (DEL and PEXPIRE there are for its lease and
    # outputs); only its own background queue takes an XADD (its benchmark and grading requests).
    assert f"%R~{keys.prefix}q:{'[0-9a-f]' * 12}" in rules
    assert f"~{keys.prefix}q:{'[0-9a-f]' * 12}" not in rules
    assert f"(~{keys.background('a')} +xadd)" in rules
    assert f"(~{keys.pinned('a')} +xadd)" not in rules
    assert f"~{keys.background('a')}" in queues


def test_a_worker_writes_only_its_own_output_keys_and_its_name_cannot_reach_another_s() -> None:
    keys = Keys()
    rules = worker_acl_rules("a", "pw", keys)
    assert f"~{keys.run_out('a', '*')}" in rules and f"~{keys.run_result('a', '*')}" in rules
    assert not [r for r in rules if r.startswith(("~rl:out:*", "~rl:result:*", "%R~rl:out", "%R~rl:result"))]
    # A name with a colon or a brace could match another worker's keys ("a" and "a:{x}").
    for name in ("a:b", "a{b}", "a*"):
        with pytest.raises(ValueError, match="no spaces, glob characters, braces or colons"):
            worker_acl_rules(name, "pw", keys)


def test_a_worker_writes_only_its_own_sleeper_record_and_may_only_list_it() -> None:
    keys = Keys()
    rules = worker_acl_rules("a", "pw", keys)
    assert f"~{keys.sleeper('a')}" in rules
    assert not [r for r in rules if r.startswith(("~rl:sleeper:*", "%R~rl:sleeper:*", "~rl:sleepers"))]
    assert f"(~{keys.sleepers} +sadd)" in rules
    # Nobody's rate limit or pending wakes: only the waker and an operator send a packet.
    assert not [r for r in rules if "woken" in r or "waking" in r]


def test_a_worker_s_url_carries_its_own_user_password_and_ca_and_never_the_admin_s() -> None:
    admin = "rediss://:admin-secret@127.0.0.1:6390/0?ssl_ca_certs=%2Fd%2Ftls%2Fca.crt&ssl_certfile=%2Fx"
    url = worker_url(admin, "gpu", "p@ss", host="10.0.0.5")
    assert url == "rediss://gpu:p%40ss@10.0.0.5:6390/0?ssl_ca_certs=%2Fd%2Ftls%2Fca.crt"
    assert worker_url("redis://:admin@h:1/0", "gpu", "pw") == "redis://gpu:pw@h:1/0"
    line = worker_command("gpu", url, backend="http://127.0.0.1:11434")
    assert shlex.split(line) == [
        *("routeledger", "worker", "--id", "gpu", "--inbox", "--backend", "http://127.0.0.1:11434"),
        *("--redis-url", url),
    ]
