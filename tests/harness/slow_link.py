"""A slow network link for tests: a TCP proxy on a free loopback port that forwards each
direction of each connection at a bounded rate (bytes per second), to a real server behind it.

``SlowLink(("127.0.0.1", redis.port), rate=2 * MiB)`` then ``redis://127.0.0.1:{link.port}/0``:
what a client sends and receives crawls at ``rate``, as over a thin WAN link, while the server
itself is unchanged. Threads, not asyncio, so it runs beside any test's event loop. The pacing
is the link's (a token bucket with a small burst), not a wait of the test's.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType

from harness.ports import free_port

__all__ = ["SlowLink"]

_CHUNK = 16 * 1024


class SlowLink:
    """Forwards connections to ``target`` at ``rate`` bytes per second per direction."""

    def __init__(self, target: tuple[str, int], rate: float) -> None:
        self.target = target
        self.rate = rate
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        #: Bytes forwarded from the server to clients (what a read brought back).
        self.downstream = 0

    def __enter__(self) -> SlowLink:
        self._spawn(self._accept)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            self._spawn(self._pump, client, server, False)
            self._spawn(self._pump, server, client, True)

    def _pump(self, source: socket.socket, sink: socket.socket, down: bool) -> None:
        free_at = time.monotonic()  # when the link has sent everything handed to it so far
        burst = _CHUNK / self.rate
        try:
            while not self._closed.is_set():
                data = source.recv(_CHUNK)
                if not data:
                    break
                # A token bucket of one chunk: an idle link saves up no more than that.
                now = time.monotonic()
                free_at = max(free_at, now) + len(data) / self.rate
                if free_at - now > burst:
                    time.sleep(free_at - now - burst)
                sink.sendall(data)
                if down:
                    self.downstream += len(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop accepting and cut every connection."""
        self._closed.set()
        self._listener.close()
        for sock in self._sockets:
            sock.close()
        for thread in self._threads:
            thread.join(timeout=2.0)
