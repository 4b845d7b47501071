"""Where the shared-memory sockets go: the path a ``shm.socket`` setting names.

A server without tenants puts its socket where the setting says: a path, or ``auto`` for
``shm.sock`` in a fresh private directory (:func:`shm_socket_path`).

A tenant's socket must not be findable by another tenant: a client learns its own tenant's path
from an authenticated ``DataPlane`` call, and must not be able to derive a neighbour's from it.
So each tenant's socket gets a fresh directory (``mkdtemp``: a name nobody can claim first) that
others may search but never list, and inside it a socket named by 128 random bits
(:func:`tenant_socket_path`). The directory lives in the directory of an explicit setting (e.g.
``/run/kvstore``, the one engines mount), or where ``auto`` puts its own. The socket's mode and,
where the tenant lists them, its ``uids``/``gids`` (``SO_PEERCRED``) still decide who may
connect; the secret name keeps out the processes those admit that were never told the path.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile

__all__ = ["AUTO_SOCKET", "remove_private_dir", "shm_socket_path", "tenant_socket_path"]

logger = logging.getLogger(__name__)

#: The socket's name in the directory ``auto`` makes for a server without tenants.
AUTO_SOCKET = "shm.sock"
# Directories this process made for sockets: the only ones it removes again.
_MADE_DIRS: set[str] = set()


def _private_dir(parent: str, prefix: str, mode: int) -> str:
    """A fresh directory in ``parent``: 0700, plus search (x, not list) permission for group and
    others exactly where the socket's ``mode`` lets them write it, so clients the socket admits
    can reach it and nobody can list it."""
    directory = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(directory, 0o700 | ((mode & 0o022) >> 1))
    _MADE_DIRS.add(directory)
    return directory


def _auto_parent() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    return runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir()


def shm_socket_path(setting: str, mode: int = 0o660) -> str:
    """The socket path a ``shm.socket`` setting names ("" when the data plane is off).

    ``auto`` creates a fresh directory with an unpredictable name (``mkdtemp``) in
    ``$XDG_RUNTIME_DIR`` (private to the user) when there is one, else the temp directory, and
    names the socket :data:`AUTO_SOCKET` inside it: nobody else can create that path first.
    """
    if setting != "auto":
        return setting
    return os.path.join(_private_dir(_auto_parent(), "kvstore-", mode), AUTO_SOCKET)


def tenant_socket_path(setting: str, tenant: str, mode: int = 0o660) -> str:
    """The socket path of ``tenant`` for a ``shm.socket`` setting ("" when off): a random
    name in a fresh unlistable directory, beside the setting's path or where ``auto`` puts its
    own (see the module docstring)."""
    if not setting:
        return ""
    if setting == "auto":
        parent, prefix = _auto_parent(), f"kvstore-{tenant}-"
    else:
        parent, prefix = os.path.dirname(setting) or ".", f"{os.path.basename(setting)}.{tenant}."
    directory = _private_dir(parent, prefix, mode)
    return os.path.join(directory, f"{secrets.token_urlsafe(16)}.sock")


def remove_private_dir(socket_path: str) -> None:
    """Remove the directory :func:`shm_socket_path` or :func:`tenant_socket_path` made for
    ``socket_path``, if it is empty (the socket is removed first); any other is left alone."""
    directory = os.path.dirname(socket_path)
    if directory in _MADE_DIRS:
        _MADE_DIRS.discard(directory)
        try:
            os.rmdir(directory)
        except OSError as exc:
            logger.warning("cannot remove socket directory %s: %s", directory, exc)
