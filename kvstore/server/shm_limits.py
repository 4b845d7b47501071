"""Bounds of the shared-memory socket server: who may connect, and what one frame may cost.

The socket admits co-located processes only, but those are still callers not to trust: a
connection costs a file descriptor and a task, a frame costs its body. So connections are counted
in all and per peer uid (``SO_PEERCRED``, which the kernel fills in and a client cannot forge),
a frame's declared length is checked against the largest its op can legally need before anything
is allocated for it, its body is read in bounded pieces (a client that stalls half-way holds what
it sent, not what it declared), and once its first byte has arrived the rest must arrive within
a time limit. Refusals are logged, at most one line per interval so a flood cannot fill the log.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from dataclasses import dataclass

from kvstore.protocol.shm_frames import frame_length, max_frame_length

__all__ = [
    "ConnectionCounter",
    "FrameRefused",
    "RateLimitedLog",
    "ShmLimits",
    "peer_credentials",
    "peer_uid",
    "read_frame",
]

logger = logging.getLogger(__name__)

#: Bodies are received at most this many bytes at a time.
READ_CHUNK = 64 * 1024

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class ShmLimits:
    """What the socket server admits: connections in all and per peer uid, arena bytes one
    connection may hold leased and reserved (``None``: no quota), and the seconds a frame may take
    to arrive once it has begun."""

    max_connections: int = 256
    max_connections_per_uid: int = 64
    session_bytes: int | None = None
    frame_timeout_s: float = 10.0


class FrameRefused(Exception):
    """A frame the server will not read (the connection is closed)."""


class RateLimitedLog:
    """Warnings at most once per ``interval_s``; the ones held back are counted in the next."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last = -float("inf")
        self._held_back = 0

    def warning(self, message: str, *args: object) -> None:
        """Log ``message % args`` unless a line went out less than ``interval_s`` ago."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._held_back += 1
            return
        if self._held_back:
            message += f" ({self._held_back} similar line(s) held back)"
        self._last, self._held_back = now, 0
        logger.warning(message, *args)


def peer_credentials(conn: socket.socket) -> tuple[int, int] | None:
    """``(uid, gid)`` of the process at the other end of the UNIX socket ``conn``, as the kernel
    recorded them when it connected (``None`` where the platform cannot say)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (AttributeError, OSError):
        return None
    _, uid, gid = _UCRED.unpack(raw)
    return int(uid), int(gid)


def peer_uid(conn: socket.socket) -> int | None:
    """The uid of the process at the other end of the UNIX socket ``conn`` (``None`` where the
    platform cannot say)."""
    credentials = peer_credentials(conn)
    return None if credentials is None else credentials[0]


class ConnectionCounter:
    """Open connections, in all and per peer uid, against :class:`ShmLimits`."""

    def __init__(self, limits: ShmLimits) -> None:
        self.limits = limits
        self.total = 0
        self._per_uid: dict[int | None, int] = {}

    def admit(self, uid: int | None) -> str | None:
        """Count a new connection from ``uid``; or the reason it is refused (nothing counted)."""
        if self.total >= self.limits.max_connections:
            return f"{self.total} connections open, the limit (shm.max_connections)"
        held = self._per_uid.get(uid, 0)
        if held >= self.limits.max_connections_per_uid:
            return f"uid {uid} has {held} connections open, the limit (shm.max_connections_per_uid)"
        self.total += 1
        self._per_uid[uid] = held + 1
        return None

    def leave(self, uid: int | None) -> None:
        """Forget one connection of ``uid`` admitted before."""
        self.total -= 1
        left = self._per_uid[uid] - 1
        if left:
            self._per_uid[uid] = left
        else:
            del self._per_uid[uid]


async def read_frame(
    loop: asyncio.AbstractEventLoop,
    conn: socket.socket,
    max_keys: int,
    timeout_s: float,
    fds: list[int] | None = None,
) -> tuple[int, bytearray] | None:
    """The next request frame on ``conn`` as ``(op, body after the op byte)``; ``None`` if the
    peer closed the connection between frames or mid-frame.

    Raises :class:`FrameRefused` for a length its op cannot legally have (checked before the body
    is read), and :class:`TimeoutError` when the frame, once begun, takes over ``timeout_s``.
    ``fds``: where the descriptor sent along with the frame's first byte goes (at most
    :data:`MAX_FDS_IN`; the caller closes what it does not keep). Without it, or past that many,
    the kernel closes what was sent; descriptors sent with later bytes are dropped the same way.
    """
    # Up to the length and the op in one call (every frame has both, so this never reads into
    # the next one); a connection may idle for as long as it likes between frames.
    if fds is None:
        head = bytearray(await loop.sock_recv(conn, 5))
    else:
        head = bytearray(await _recv_with_fds(loop, conn, 5, fds))
    if not head:
        return None
    async with asyncio.timeout(timeout_s):
        if len(head) < 4:
            rest = await _recv_upto(loop, conn, 4 - len(head))
            if rest is None:
                return None
            head += rest
        length = frame_length(head[:4])
        limit = max_frame_length(None, max_keys)
        if not 1 <= length <= limit:
            raise FrameRefused(f"a {length}-byte frame (no request is over {limit})")
        if len(head) < 5:
            op_byte = await _recv_upto(loop, conn, 1)
            if op_byte is None:
                return None
            head += op_byte
        op = head[4]
        limit = max_frame_length(op, max_keys)
        if length > limit:
            raise FrameRefused(f"a {length}-byte frame for request code {op} (at most {limit})")
        body = await _recv_upto(loop, conn, length - 1)
        if body is None:
            return None
        return op, body


#: Descriptors one frame may carry (a WINDOW's memfd).
MAX_FDS_IN = 1


async def _recv_with_fds(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, size: int, fds: list[int]
) -> bytes:
    """Up to ``size`` bytes of the non-blocking ``conn`` and the descriptors that came with
    them, appended to ``fds`` (what asyncio's ``sock_recv`` would drop)."""
    space = socket.CMSG_SPACE(MAX_FDS_IN * 4)
    while True:
        try:
            data, ancillary, _, _ = conn.recvmsg(size, space)
            break
        except (BlockingIOError, InterruptedError):
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_reader(conn.fileno(), _settle, ready)
            try:
                await ready
            finally:
                loop.remove_reader(conn.fileno())
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            count = len(payload) // 4
            fds.extend(struct.unpack(f"{count}i", payload[: count * 4]))
    return data


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _recv_upto(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, size: int
) -> bytearray | None:
    """Exactly ``size`` bytes, received at most :data:`READ_CHUNK` at a time (so what is held
    grows with what arrived), or ``None`` if the peer closed the connection first."""
    buffer = bytearray()
    while len(buffer) < size:
        chunk = await loop.sock_recv(conn, min(size - len(buffer), READ_CHUNK))
        if not chunk:
            return None
        buffer += chunk
    return buffer
