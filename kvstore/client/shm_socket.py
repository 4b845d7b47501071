"""One UNIX socket of the shared-memory data plane's client: connect, greet, call, fail cleanly.

:class:`~kvstore.client.shm_attach.ShmAttachment` (what :class:`~kvstore.client.shm.ShmDataPlane`
stands on) keeps a small pool of these; each carries one request at a time in the frame format of
:mod:`kvstore.protocol.shm_frames`, and whatever goes wrong mid-request closes it
(:func:`closed_on_failure`), since its stream position is then unknown.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

from kvstore.errors import DeadlineExceededError
from kvstore.protocol.shm_frames import Op, frame, frame_length, unpack_hello
from kvstore.protocol.shm_messages import OK, reply_error

__all__ = ["ShmConnection", "ShmUnavailableError", "closed_on_failure"]

_HELLO_REPLY_LIMIT = 4096
_GREETING_FDS = 2  # the arena and its index


class ShmUnavailableError(ConnectionError):
    """The shared-memory path cannot be used (now); the caller falls back to gRPC."""


class ShmConnection:
    """One UNIX socket to the server, used by one call at a time."""

    def __init__(self, path: str, namespace: bytes, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.deadline: float | None = None
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
            self.sock.sendall(frame(Op.HELLO, namespace))
            data, fds, _, _ = socket.recv_fds(self.sock, _HELLO_REPLY_LIMIT, _GREETING_FDS)
        except OSError:
            self.sock.close()
            raise
        #: The arena's memfd, then the index's (when the server has one).
        self.fds = list(fds)
        #: Whether this socket's server session has the client's write window (``WINDOW``).
        self.window_sent = False
        try:
            body = self._complete(bytearray(data))
            self.hello = unpack_hello(body)
        except BaseException:
            self.close_fd()
            self.sock.close()
            raise

    def _complete(self, data: bytearray) -> memoryview:
        """The body of the reply whose first bytes are ``data`` (reading the rest)."""
        while len(data) < 4:
            data += self._recv(4 - len(data))
        length = frame_length(data[:4])
        while len(data) < 4 + length:
            data += self._recv(4 + length - len(data))
        status = data[4]
        body = memoryview(data)[5 : 4 + length]
        if status != OK:
            raise reply_error(status, body)
        return body

    def _recv(self, size: int) -> bytes:
        if self.deadline is not None:
            self._set_deadline(self.deadline)
        chunk = self.sock.recv(max(size, 65536))
        if not chunk:
            raise ConnectionResetError("the store closed the shared-memory socket")
        return chunk

    def close_fd(self) -> None:
        """Close the fds that came with the greeting (the mappings keep what they map)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def call(self, op: int, body: bytes, deadline: float) -> memoryview:
        """Send a request and return its reply body (raising the error it reports).

        ``deadline`` is a :func:`time.monotonic` instant; past it, DeadlineExceededError.
        """
        self._set_deadline(deadline)
        self.sock.sendall(frame(op, body))
        self.deadline = deadline
        return self._complete(bytearray())

    def call_with_fd(self, op: int, body: bytes, fd: int, deadline: float) -> memoryview:
        """:meth:`call` with the descriptor ``fd`` sent along with the request's first byte."""
        self._set_deadline(deadline)
        data = frame(op, body)
        sent = socket.send_fds(self.sock, [data], [fd])
        if sent < len(data):
            self.sock.sendall(data[sent:])
        self.deadline = deadline
        return self._complete(bytearray())

    def _set_deadline(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError("deadline exceeded before the store answered")
        self.sock.settimeout(remaining)

    def send(self, op: int, body: bytes) -> None:
        """Send a request that has no reply."""
        self.sock.sendall(frame(op, body))


@contextlib.contextmanager
def closed_on_failure(conn: ShmConnection) -> Iterator[None]:
    """Close ``conn`` if the block fails (mid-request the stream position is unknown), and say
    why in the data plane's terms: a timeout is the caller's deadline, a socket error means the
    path is unusable."""
    try:
        yield
    except TimeoutError as exc:
        conn.sock.close()
        raise DeadlineExceededError("deadline exceeded waiting for the store") from exc
    except OSError as exc:
        conn.sock.close()
        raise ShmUnavailableError(f"shared-memory socket failed: {exc}") from exc
    except BaseException:
        conn.sock.close()
        raise
