"""An exclusive lock on a data directory, held for the life of the tier that uses it.

Two servers on one nvme directory would each count their own capacity against the same LMDB map
and evict each other's blocks unseen. ``kvstore.lock`` in the directory is locked with
``fcntl.flock`` before LMDB opens; the kernel drops the lock when the holder exits, however it
exits, so a crashed server never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from kvstore.errors import ConfigError

__all__ = ["LOCK_NAME", "DirLock"]

LOCK_NAME = "kvstore.lock"


class DirLock:
    """``flock`` on ``<directory>/kvstore.lock``; :meth:`acquire` raises if another holds it."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd = fd

    @classmethod
    def acquire(cls, directory: Path, setting: str = "nvme.path") -> DirLock:
        """Lock ``directory`` (which must exist) or raise :class:`ConfigError` naming
        ``setting`` and the process that holds it."""
        path = directory / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"{setting}={str(directory)!r} is in use by another kvstore server (pid {holder}, "
                f"lock {path}): give this one its own directory (--nvme-path DIR)"
            ) from None
        # The holder's pid, for the message above; a plain file, so a reader never blocks.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(directory, fd)

    def release(self) -> None:
        """Unlock (closing the descriptor drops the lock); idempotent."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
