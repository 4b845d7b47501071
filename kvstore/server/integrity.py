"""The integrity keyring a server signs and verifies blocks with, from its configuration.

Where the secrets come from, first match wins:

1. ``integrity.secrets`` (env ``KVSTORE_INTEGRITY_SECRETS``): comma-separated, first signs;
2. ``integrity.secret_file``: an existing private file (not readable by group or others) with one
   secret per line, first signs; a missing or group/world-readable file is an error;
3. ``integrity.key`` inside the nvme directory, created with a random secret (mode 0600) on first
   start, so that a single node works, warm restarts included, with no configuration;
4. no nvme tier: a random secret for this process only (a warning when Redis is shared).

New blocks are signed with ``integrity.mac`` (``blake3``, header version 3, or ``hmac-sha256``,
version 2, for a cluster whose older nodes verify only that); both are verified.

A public or placeholder secret is refused (:mod:`kvstore.server.placeholders`). Every node
sharing a Redis must have the same secrets, or they reject each other's blocks (as misses,
counted in the redis tier's ``corrupt_blocks``); :mod:`kvstore.server.keyring_check` finds that
out at start and keeps a node that shares no secret with the others off the shared tier.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from kvstore.block import Keyring
from kvstore.config import Config
from kvstore.config.store import INTEGRITY_MACS
from kvstore.errors import ConfigError
from kvstore.server.placeholders import check_secret
from kvstore.tiers.nvme import private_directory

__all__ = ["DEFAULT_KEY_FILE", "load_keyring"]

logger = logging.getLogger(__name__)

#: Name of the generated secret file inside the nvme directory.
DEFAULT_KEY_FILE = "integrity.key"
# A secret file larger than this is not a secret file (bounded read).
_MAX_FILE_BYTES = 64 * 1024


def load_keyring(config: Config) -> Keyring:
    """The :class:`Keyring` ``config`` describes (see the module docstring)."""
    version = INTEGRITY_MACS[config.integrity.mac]
    try:
        Keyring.random(version)
    except ValueError as exc:
        raise ConfigError(
            f"integrity.mac = {config.integrity.mac}: {exc} (install it, or set "
            "integrity.mac = hmac-sha256)"
        ) from exc
    return _keyring(config, version)


def _keyring(config: Config, version: int) -> Keyring:
    integrity = config.integrity
    if integrity.secrets:
        parts = [part.strip().encode() for part in integrity.secrets.split(",")]
        for number, part in enumerate(parts, 1):
            check_secret(part, f"integrity.secrets (KVSTORE_INTEGRITY_SECRETS), secret {number}")
        return Keyring(parts, version)
    if integrity.secret_file:
        return _read(Path(integrity.secret_file), "integrity.secret_file", version)
    if config.nvme.path:
        directory = Path(config.nvme.path)
        private_directory(directory)
        path = directory / DEFAULT_KEY_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            return _read(path, "the generated integrity key", version)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")
        logger.info("generated integrity secret %s (copy it to every node sharing a Redis)", path)
        return _read(path, "the generated integrity key", version)
    if config.redis.url:
        logger.warning(
            "no integrity secret configured and no nvme directory to keep one: using a random "
            "secret for this process; other nodes (and this one after a restart) will treat its "
            "redis blocks as corrupt. Set integrity.secret_file on every node."
        )
    return Keyring.random(version)


def _read(path: Path, what: str, version: int) -> Keyring:
    """Secrets from a private file, one per line; a ConfigError that names ``what`` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot open {path}: {exc}") from exc
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if mode & 0o077:
            raise ConfigError(
                f"{what}: {path} has mode {oct(mode & 0o777)}; "
                "a secret file must not be readable by group or others (chmod 600)"
            )
        data = handle.read(_MAX_FILE_BYTES + 1)
    if len(data) > _MAX_FILE_BYTES:
        raise ConfigError(f"{what}: {path} is larger than {_MAX_FILE_BYTES} bytes")
    lines = [line.strip() for line in data.splitlines() if line.strip()]
    if not lines:
        raise ConfigError(f"{what}: {path} holds no secret (one per line, the first signs)")
    for number, line in enumerate(lines, 1):
        check_secret(line, f"{what}: {path}, secret {number}")
    return Keyring(lines, version)
