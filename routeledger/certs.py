"""The certificates `up --tls` gives embedded Redis: a CA of this installation and a server
certificate it signs, made with the `openssl` command and kept in `<data_dir>/tls`.

They are made once and reused on the next `up` while they stay valid: the CA, so that a worker
that copied `ca.crt` keeps trusting the server; the server certificate, as long as the CA signed
it, it has a month left, and its names still cover every address Redis answers on (a machine that
moved to another network gets a new one, signed by the same CA). `openssl` rather than a Python
package: it is on every Linux and macOS machine, and the config files below use only what both
OpenSSL and LibreSSL's `openssl` accept.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

import msgspec

from routeledger.errors import CertificateError

TLS_DIR: Final = "tls"
LOOPBACK_NAMES: Final = ("localhost", "127.0.0.1", "::1")
# Addresses that mean "every interface": the certificate then names each of this machine's.
WILDCARD_BINDS: Final = ("0.0.0.0", "::", "*")
CA_DAYS: Final = 3650
# 825 days: the longest a server certificate may live for the stricter TLS clients (Apple's).
LEAF_DAYS: Final = 825
# A certificate with less than this left is made anew before Redis starts with it.
RENEW_BEFORE_S: Final = 30 * 86_400
_HOSTNAME: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*$")


class ServerTls(msgspec.Struct, frozen=True, kw_only=True):
    """The files a TLS Redis server needs: the CA that signed its certificate, the certificate
    and its key. `ca` is also what a client copies to trust the server."""

    ca: Path
    cert: Path
    key: Path


class ClientCertificate(msgspec.Struct, frozen=True, kw_only=True):
    """A client certificate and its key, for a Redis that asks clients for one (`tls-auth-clients yes`)."""

    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> str:
    binary = shutil.which("openssl")
    if binary is None:
        raise CertificateError(
            "making the TLS certificates needs the `openssl` command: install it "
            "(apt install openssl; on macOS it is there already), or run without --tls"
        )
    try:
        done = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CertificateError(f"openssl {args[0]} could not run: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CertificateError(f"openssl {args[0]} failed making the TLS certificates: {last}")
    return done.stdout


def _passes(*args: str, cwd: Path) -> bool:
    """True when an `openssl` check exits 0 (a missing or unreadable file does not pass)."""
    try:
        _openssl(*args, cwd=cwd)
    except CertificateError:
        return False
    return True


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _normal(name: str) -> str:
    """A name as a certificate compares it: an IP address in its canonical form, a host name in lower case."""
    if _is_ip(name):
        return str(ipaddress.ip_address(name))
    return name.lower().rstrip(".")


def interface_addresses() -> list[str]:
    """This machine's IP addresses (loopback and IPv6 link-local ones left out: no worker dials those)."""
    import psutil

    found: list[str] = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            text = addr.address.split("%", 1)[0]
            try:
                ip = ipaddress.ip_address(text)
            except ValueError:
                continue
            if not (ip.is_loopback or ip.is_link_local):
                found.append(str(ip))
    return found


def server_names(bind: str) -> list[str]:
    """The names a worker may dial Redis by, bound to `bind`: loopback, this machine's host name,
    and the bound address (each of the machine's addresses when it binds them all)."""
    host = socket.gethostname()
    # The host name as the LAN's multicast DNS answers it (macOS, Avahi) and as DNS knows it.
    names: list[str] = [*LOOPBACK_NAMES, host, f"{host.split('.')[0]}.local", socket.getfqdn()]
    for part in bind.split():
        names += interface_addresses() if part in WILDCARD_BINDS else [part]
    seen: dict[str, None] = {}
    for name in names:
        # Only what can be written into the certificate's config as it is; anything else is skipped.
        if name and (_is_ip(name) or _HOSTNAME.match(name)):
            seen.setdefault(_normal(name), None)
    return list(seen)


def _san(names: Iterable[str]) -> str:
    return ", ".join(f"IP:{n}" if _is_ip(n) else f"DNS:{n}" for n in names)


def certificate_names(cert: Path) -> set[str]:
    """The DNS names and IP addresses a certificate's subjectAltName holds."""
    text = _openssl("x509", "-noout", "-text", "-in", str(cert), cwd=cert.parent)
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "X509v3 Subject Alternative Name" in line and i + 1 < len(lines):
            names = set()
            for entry in lines[i + 1].split(","):
                kind, _, value = entry.strip().partition(":")
                if kind in ("DNS", "IP Address") and value:
                    names.add(_normal(value.strip()))
            return names
    return set()


def _valid_for_a_while(cert: Path) -> bool:
    return _passes("x509", "-checkend", str(RENEW_BEFORE_S), "-noout", "-in", str(cert), cwd=cert.parent)


def _write_config(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def _new_key(directory: Path, name: str) -> Path:
    path = directory / name
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", name, cwd=directory)
    os.chmod(path, 0o600)
    return path


def _serial() -> str:
    return "0x" + secrets.token_hex(16)


def _make_ca(work: Path, common_name: str) -> None:
    key = _new_key(work, "ca.key")
    conf = _write_config(
        work,
        "ca.cnf",
        "[req]\nprompt = no\ndistinguished_name = dn\nx509_extensions = v3_ca\n"
        f"[dn]\nCN = {common_name}\n"
        "[v3_ca]\nbasicConstraints = critical, CA:TRUE, pathlen:0\n"
        "keyUsage = critical, keyCertSign, cRLSign\nsubjectKeyIdentifier = hash\n",
    )
    _openssl(
        "req",
        "-new",
        "-x509",
        "-sha256",
        "-key",
        key.name,
        "-config",
        conf.name,
        "-days",
        str(CA_DAYS),
        "-set_serial",
        _serial(),
        "-out",
        "ca.crt",
        cwd=work,
    )


def _sign(work: Path, ca_dir: Path, stem: str, common_name: str, extensions: str) -> tuple[Path, Path]:
    """A key `stem`.key and a certificate `stem`.crt for it, signed by the CA in `ca_dir`."""
    key = _new_key(work, f"{stem}.key")
    req = _write_config(
        work, f"{stem}.cnf", f"[req]\nprompt = no\ndistinguished_name = dn\n[dn]\nCN = {common_name}\n"
    )
    ext = _write_config(
        work,
        f"{stem}.ext",
        "basicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature\n"
        "subjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid:always\n" + extensions,
    )
    _openssl("req", "-new", "-key", key.name, "-config", req.name, "-out", f"{stem}.csr", cwd=work)
    _openssl(
        "x509",
        "-req",
        "-sha256",
        "-in",
        f"{stem}.csr",
        "-CA",
        str(ca_dir / "ca.crt"),
        "-CAkey",
        str(ca_dir / "ca.key"),
        "-set_serial",
        _serial(),
        "-days",
        str(LEAF_DAYS),
        "-extfile",
        ext.name,
        "-out",
        f"{stem}.crt",
        cwd=work,
    )
    return work / f"{stem}.crt", key


def _tls_dir(data_dir: Path) -> Path:
    directory = data_dir / TLS_DIR
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    return directory


def _install(made: Sequence[Path], directory: Path) -> None:
    """Move finished files into place, one rename each: an interrupted run leaves old or new, never half."""
    for path in made:
        os.replace(path, directory / path.name)


def ensure_server_tls(data_dir: Path, names: Sequence[str]) -> ServerTls:
    """The CA and server certificate in `data_dir`/tls, made or renewed as needed (see the module's
    docstring); the server certificate names each of `names`."""
    directory = _tls_dir(data_dir)
    files = ServerTls(ca=directory / "ca.crt", cert=directory / "server.crt", key=directory / "server.key")
    wanted = {_normal(n) for n in names}
    ca_ok = files.ca.is_file() and (directory / "ca.key").is_file() and _valid_for_a_while(files.ca)
    server_ok = (
        ca_ok
        and files.key.is_file()
        and files.cert.is_file()
        and _valid_for_a_while(files.cert)
        and _passes("verify", "-CAfile", str(files.ca), str(files.cert), cwd=directory)
        and wanted <= certificate_names(files.cert)
    )
    if server_ok:
        return files
    with tempfile.TemporaryDirectory(dir=directory, prefix=".new-") as tmp:
        work = Path(tmp)
        made: list[Path] = []
        if not ca_ok:
            _make_ca(work, f"routeledger CA {socket.gethostname()}"[:64])
            made += [work / "ca.key", work / "ca.crt"]
        cert, key = _sign(
            work,
            work if not ca_ok else directory,
            "server",
            "routeledger redis",
            f"extendedKeyUsage = serverAuth\nsubjectAltName = {_san(names)}\n",
        )
        # The key before the certificate: a reader never finds a certificate without its key.
        _install([*made, key, cert], directory)
    os.chmod(files.ca, 0o644)
    return files


def issue_client_certificate(data_dir: Path, name: str) -> ClientCertificate:
    """A client certificate for `name`, signed by the CA in `data_dir`/tls (made first if missing),
    for a Redis that verifies clients' certificates."""
    if not _HOSTNAME.match(name):
        raise CertificateError(f"a client certificate's name must be letters, digits, '-' and '.': {name!r}")
    directory = _tls_dir(data_dir)
    ca_ok = (directory / "ca.crt").is_file() and (directory / "ca.key").is_file()
    with tempfile.TemporaryDirectory(dir=directory, prefix=".new-") as tmp:
        work = Path(tmp)
        made: list[Path] = []
        if not ca_ok:
            _make_ca(work, f"routeledger CA {socket.gethostname()}"[:64])
            made += [work / "ca.key", work / "ca.crt"]
        cert, key = _sign(
            work, work if not ca_ok else directory, f"client-{name}", name, "extendedKeyUsage = clientAuth\n"
        )
        _install([*made, key, cert], directory)
    return ClientCertificate(cert=directory / cert.name, key=directory / key.name)
