"""The shared-memory socket's file and its sends: create it with exact permission bits, replace
a stale one, send replies with descriptors attached (helpers of :mod:`kvstore.server.shm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import stat

__all__ = ["chmod_socket", "file_id", "listen_unix", "remove_stale_socket", "send_with_fds"]


def listen_unix(path: str, mode: int) -> socket.socket:
    """A listening UNIX socket at ``path`` whose file has exactly the permission bits ``mode``.

    ``bind`` creates the file with the umask applied, and changing the umask is process-wide (so
    racy with other threads). Instead the file's bits are set between ``bind`` and ``listen``:
    until ``listen`` every connect is refused, so no one gets in under the umask's bits. A stale
    socket (a crashed server's: nobody accepts on it) is replaced; a live one, or anything that
    is not a socket, is left alone and the call fails.
    """
    remove_stale_socket(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = False
    try:
        listener.bind(path)
        bound = True
        chmod_socket(path, mode)
        listener.listen(64)
    except BaseException:
        listener.close()
        if bound:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise
    return listener


def remove_stale_socket(path: str) -> None:
    """Unlink the socket at ``path`` if no server accepts on it; refuse anything else there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a socket", path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)  # a live server with a full backlog would block a plain connect
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # stale: left by a server that died without removing it
            return
        except PermissionError:
            raise PermissionError(
                errno.EACCES, "a socket this user may not connect to, live or not", path
            ) from None
        except TimeoutError:
            pass  # a server too busy to accept is still a live one
    raise OSError(errno.EADDRINUSE, "another server is listening on it", path)


def chmod_socket(path: str, mode: int) -> None:
    """``chmod`` the socket just bound at ``path`` without following a symlink put there since
    (in a directory others may write to), where the platform can say so."""
    try:
        os.chmod(path, mode, follow_symlinks=False)
    except NotImplementedError:  # no lchmod here, or ``path`` became a symlink
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(errno.ELOOP, "no longer the socket just bound", path) from None
        os.chmod(path, mode)


def file_id(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of the file at ``path``, or ``None`` if there is none."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


async def send_with_fds(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, data: bytes, fds: list[int]
) -> None:
    """Send ``data`` with ``fds`` attached to its first byte, then the rest as usual."""
    while True:
        try:
            sent = socket.send_fds(conn, [data], fds)
            break
        except BlockingIOError:  # the client has not drained its socket yet; rare and short
            await asyncio.sleep(0.001)
    if sent < len(data):
        await loop.sock_sendall(conn, data[sent:])
