"""The CA and server certificate `up --tls` makes: what they name, when they are made anew, who reads them."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from routeledger.certs import (
    certificate_names,
    ensure_server_tls,
    interface_addresses,
    issue_client_certificate,
    server_names,
)
from routeledger.errors import CertificateError


def test_the_server_certificate_names_loopback_and_the_bound_address_and_is_signed_by_the_ca(
    tmp_path: Path,
) -> None:
    files = ensure_server_tls(tmp_path, server_names("192.0.2.7"))
    names = certificate_names(files.cert)
    assert {"localhost", "127.0.0.1", "::1", "192.0.2.7"} <= names
    verified = subprocess.run(
        ["openssl", "verify", "-CAfile", str(files.ca), str(files.cert)], capture_output=True, text=True
    )
    assert verified.returncode == 0, verified.stderr


def test_binding_every_interface_names_each_of_the_machines_addresses() -> None:
    names = server_names("0.0.0.0")
    assert set(interface_addresses()) <= set(names)
    assert "0.0.0.0" not in names


def test_the_next_start_reuses_the_certificates_while_they_stay_valid(tmp_path: Path) -> None:
    first = ensure_server_tls(tmp_path, server_names("127.0.0.1"))
    before = {p: p.read_bytes() for p in (first.ca, first.cert, first.key)}
    again = ensure_server_tls(tmp_path, server_names("127.0.0.1"))
    assert again == first
    assert {p: p.read_bytes() for p in (again.ca, again.cert, again.key)} == before


def test_a_new_address_gets_a_new_server_certificate_from_the_same_ca(tmp_path: Path) -> None:
    first = ensure_server_tls(tmp_path, server_names("127.0.0.1"))
    ca, cert = first.ca.read_bytes(), first.cert.read_bytes()
    moved = ensure_server_tls(tmp_path, server_names("198.51.100.4"))
    assert moved.ca.read_bytes() == ca, "workers that copied the CA must keep trusting the server"
    assert moved.cert.read_bytes() != cert
    assert "198.51.100.4" in certificate_names(moved.cert)


def test_a_server_certificate_from_another_ca_is_made_anew(tmp_path: Path) -> None:
    ours = ensure_server_tls(tmp_path / "a", ["localhost"])
    theirs = ensure_server_tls(tmp_path / "b", ["localhost"])
    ours.cert.write_bytes(theirs.cert.read_bytes())
    ours.key.write_bytes(theirs.key.read_bytes())
    fixed = ensure_server_tls(tmp_path / "a", ["localhost"])
    check = subprocess.run(
        ["openssl", "verify", "-CAfile", str(fixed.ca), str(fixed.cert)], capture_output=True
    )
    assert check.returncode == 0


def test_keys_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    files = ensure_server_tls(tmp_path, ["localhost"])
    client = issue_client_certificate(tmp_path, "laptop")
    for key in (files.key, files.ca.with_suffix(".key"), client.key):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600, key
    assert stat.S_IMODE(os.stat(files.ca.parent).st_mode) == 0o700


def test_without_openssl_the_error_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(CertificateError, match="needs the `openssl` command"):
        ensure_server_tls(tmp_path, ["localhost"])
