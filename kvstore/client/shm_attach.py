"""A co-located client's attachment to a server's shared-memory socket: what the calls stand on.

:class:`ShmAttachment` connects to the server's UNIX socket, maps the ``dram`` arena and the
arena's published index (both received as memfds on the first connection) and keeps what every
call of :class:`~kvstore.client.shm.ShmDataPlane` (its subclass, which adds the calls) needs: a
small pool of sockets to the same server process, the socket of the one-way ``TOUCH`` messages
(:mod:`kvstore.client.shm_touch`), and a socket that only says whether the server is alive, which
decides whether the published index may be read at all.

Thread-safe: each call borrows one socket from the pool, so concurrent calls from several
threads proceed in parallel (the copies release the GIL). A socket that fails or times out is
closed, never reused, and the server then gives back whatever that socket held.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import select
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from kvstore.client.arena_registration import ArenaRegistration, Registrar
from kvstore.client.shm_prefault import ArenaPrefaulter
from kvstore.client.shm_socket import ShmConnection, ShmUnavailableError, closed_on_failure
from kvstore.client.shm_touch import TouchSender
from kvstore.client.shm_window import WINDOW_BYTES, ClientWindow
from kvstore.errors import DeadlineExceededError
from kvstore.protocol.dram_index import DIRECT_READS_SUPPORTED, IndexReader
from kvstore.protocol.shm_frames import ABSENT_TIER, Hello, Op, ProtocolError
from kvstore.protocol.shm_messages import pack_touch

__all__ = ["ShmAttachment"]

logger = logging.getLogger(__name__)

_HANGUP = select.POLLHUP | select.POLLERR | select.POLLRDHUP
_SEAL_FUTURE_WRITE = 0x0010  # F_SEAL_FUTURE_WRITE: the server's arena takes no client writes


def _index_reader(fd: int, size: int) -> IndexReader | None:
    """The server's published index, or ``None`` if this client cannot read it (another
    layout): reads then all go through the server, which still serves them over this plane."""
    try:
        return IndexReader(fd, size)
    except ValueError as exc:
        logger.info("not reading the server's dram index directly: %s", exc)
        return None


class ShmAttachment:
    """The sockets to one server process and the arena they share (see the module docstring)."""

    def __init__(
        self,
        path: str,
        namespace: bytes,
        *,
        timeout: float = 5.0,
        direct_reads: bool = True,
        connect_timeout: float | None = None,
        prefault: bool = True,
    ) -> None:
        """Connect to the socket at ``path`` and map the arena.

        ``timeout``: the default of every call, and how long a new socket may take to connect;
        ``connect_timeout`` (default ``timeout``) bounds this first connection instead, so that a
        client can fit it into the deadline of the call that opens the plane.
        ``direct_reads``: read blocks found in the published index without asking the server
        where the CPU allows it (the client's settings turn this off with
        ``KVSTORE_SHM_DIRECT_READS=0``).
        ``prefault``: the first read out of the arena starts faulting the pages of this
        namespace's blocks into this process on a background thread
        (:mod:`kvstore.client.shm_prefault`; ``KVSTORE_SHM_PREFAULT=0`` turns it off).
        """
        self.path = path
        self.namespace = namespace
        self.timeout = timeout
        self._instance: bytes | None = None  # every later connection must reach this process
        self._lock = threading.Lock()
        self._closed = False
        first = self._open(connect_timeout, keep_fds=True)
        self.hello: Hello = first.hello
        self._instance = first.hello.instance_id
        if not first.fds:
            first.sock.close()
            raise ShmUnavailableError("the store sent no arena descriptor")
        self._index: IndexReader | None = None
        try:
            #: Whether the server sealed its arena against writes: then it is mapped read-only
            #: here and blocks are written through :attr:`window` (``COMMIT_FROM``).
            self.sealed = bool(fcntl.fcntl(first.fds[0], fcntl.F_GET_SEALS) & _SEAL_FUTURE_WRITE)
            prot = mmap.PROT_READ if self.sealed else mmap.PROT_READ | mmap.PROT_WRITE
            self._mapping = mmap.mmap(first.fds[0], first.hello.arena_size, prot=prot)
            if direct_reads and DIRECT_READS_SUPPORTED and first.hello.index_size and first.fds[1:]:
                self._index = _index_reader(first.fds[1], first.hello.index_size)
        except (OSError, ValueError) as exc:
            first.sock.close()
            raise ShmUnavailableError(f"cannot map what {path} sent: {exc}") from exc
        finally:
            first.close_fd()
        self._touches: TouchSender | None = None
        # The TOUCH messages' own socket, used under the sender's lock only (replaced after a
        # failure); opened on first use.
        self._touch_conn: ShmConnection | None = None
        # A socket that carries nothing and is closed only by close(): how a reader notices at
        # once that the server died (the kernel hangs it up) without racing a replacement.
        self._liveness: socket.socket | None = None
        if self._index is not None:
            try:
                probe = self._open(connect_timeout)
            except ShmUnavailableError:
                first.sock.close()
                self._index.close()
                raise
            self._liveness = probe.sock
            self._touches = TouchSender(self._send_touch, self._sync, first.hello.max_keys)
        # Tier name by the one-byte code a LOOKUP reply uses ("" for absent).
        self._tier_names = [""] * 256
        self._tier_names[: len(first.hello.tiers)] = first.hello.tiers
        self._tier_names[ABSENT_TIER] = ""
        #: The name of the server's top tier, which the index describes when it is "dram".
        self._arena_tier = first.hello.tiers[0] if first.hello.tiers else ""
        self._arena = np.frombuffer(self._mapping, dtype=np.uint8)
        self._idle: list[ShmConnection] = [first]
        self._reserving: list[ShmConnection] = []  # sockets lent to open reservations
        self._prefault_wanted = prefault
        self._prefaulter: ArenaPrefaulter | None = None  # started by the first read
        #: This mapping page-locked for DMA, once a CUDA caller asked (:meth:`register_with`).
        self.registration: ArenaRegistration | None = None
        self._window: ClientWindow | None = None  # made by the first write (or registration)
        #: The write window page-locked for DMA, where the arena is sealed and CUDA asked.
        self.window_registration: ArenaRegistration | None = None

    @property
    def direct_reads(self) -> bool:
        """Whether reads look in the published index first (see the module docstring)."""
        return self._index is not None

    @property
    def instance_id(self) -> bytes:
        """The server process's identity, to compare with what gRPC's ``DataPlane`` says."""
        return self.hello.instance_id

    def _open(self, timeout: float | None = None, *, keep_fds: bool = False) -> ShmConnection:
        """A new connection to the same server; its greeting's fds closed unless ``keep_fds``
        (only the first connection maps them)."""
        if timeout is not None and timeout <= 0:
            raise DeadlineExceededError("deadline exceeded before connecting to the store")
        try:
            conn = ShmConnection(self.path, self.namespace, timeout or self.timeout)
        except (OSError, ValueError, ProtocolError) as exc:
            raise ShmUnavailableError(f"cannot open {self.path}: {exc}") from exc
        if self._instance is not None and conn.hello.instance_id != self._instance:
            # Another server process on the same path: its arena is not the one mapped here,
            # and nothing it says (lease ranges, reservations) may be applied to that one.
            conn.close_fd()
            conn.sock.close()
            raise ShmUnavailableError(f"the store at {self.path} restarted")
        if not keep_fds:
            conn.close_fd()
        return conn

    def _take(self, deadline: float) -> ShmConnection:
        """An idle socket, or a new one opened before ``deadline`` (a monotonic instant)."""
        with self._lock:
            if self._closed:
                raise ShmUnavailableError("the shared-memory path is closed")
            conn = self._idle.pop() if self._idle else None
        return conn if conn is not None else self._open(deadline - time.monotonic())

    @contextlib.contextmanager
    def _connection(self, deadline: float) -> Iterator[ShmConnection]:
        """An idle socket, or a new one opened before ``deadline`` (a monotonic instant); back
        to the idle ones after the ``with`` block, closed if it fails."""
        conn = self._take(deadline)
        with closed_on_failure(conn):
            yield conn
        self._give_back(conn)

    def _give_back(self, conn: ShmConnection) -> None:
        """Return a healthy socket to the idle ones (closed if :meth:`close` ran meanwhile)."""
        with self._lock:
            if self._closed:
                conn.sock.close()
            else:
                self._idle.append(conn)

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _send_touch(self, keys: Sequence[bytes], calls: int, lookups: int) -> None:
        with self._touch_socket(self._deadline(None)) as conn:
            conn.send(Op.TOUCH, pack_touch(calls, lookups, keys))

    def _sync(self, deadline: float) -> None:
        with self._touch_socket(deadline) as conn:
            conn.call(Op.SYNC, b"", deadline)

    @contextlib.contextmanager
    def _touch_socket(self, deadline: float) -> Iterator[ShmConnection]:
        """The TOUCH socket (opened if there is none); closed if this use fails.

        Runs under the TOUCH sender's lock only, so nothing else ever sees it replaced.
        """
        conn = self._touch_conn
        if conn is None:
            if self._closed:
                raise ShmUnavailableError("the shared-memory path is closed")
            conn = self._open(timeout=deadline - time.monotonic())
            self._touch_conn = conn
        try:
            with closed_on_failure(conn):
                yield conn
        except BaseException:
            self._touch_conn = None  # (a late SYNC reply, say): the next use opens another
            raise

    def flush_reads(self, timeout: float | None = None) -> None:
        """Return once the server has counted every read this client served from the index."""
        if self._touches is not None:
            try:
                self._touches.flush(self._deadline(timeout))
            except TimeoutError as exc:
                raise DeadlineExceededError(str(exc)) from exc

    def _usable_index(self) -> tuple[IndexReader, TouchSender] | None:
        """The index and its TOUCH sender if the index may be used now (else None); raises if
        the server is known to be gone.

        A dead server's arena and index stay mapped here, frozen: the liveness socket is how its
        death shows (the kernel hangs it up), and a failed TOUCH says so too.
        """
        index, touches, liveness = self._index, self._touches, self._liveness
        if index is None or touches is None or liveness is None:
            return None
        if touches.failure is not None:
            raise ShmUnavailableError(f"the store's socket failed: {touches.failure}")
        fd = liveness.fileno()
        if not index.open or fd < 0:  # the server is closing, or close() ran just now
            return None
        hangup = select.poll()  # one per call: a poll object is not for concurrent use
        hangup.register(fd, _HANGUP)
        events = hangup.poll(0)
        if events and events[0][1] & select.POLLNVAL:  # closed between the two lines above
            return None
        if events:
            raise ShmUnavailableError("the store hung up its shared-memory socket")
        return index, touches

    def _reading(self) -> None:
        """Called before every read out of the arena: the first one starts the prefaulter
        (which needs the published index: it lists where this namespace's blocks lie); later
        ones return at the first test, without the lock."""
        if not self._prefault_wanted:
            return
        with self._lock:
            wanted, self._prefault_wanted = self._prefault_wanted, False  # one try only
            index = self._index
            if wanted and not self._closed and index is not None:
                namespace = self.namespace
                self._prefaulter = ArenaPrefaulter(
                    self._mapping, self._arena.ctypes.data, lambda: index.published(namespace)
                )

    def window(self) -> ClientWindow:
        """This client's write window (made on first use; see :mod:`kvstore.client.shm_window`)."""
        with self._lock:
            if self._closed:
                raise ShmUnavailableError("the shared-memory path is closed")
            if self._window is None:
                self._window = ClientWindow(min(self.hello.arena_size, WINDOW_BYTES))
            return self._window

    def _window_on(self, conn: ShmConnection, deadline: float) -> ClientWindow:
        """The write window, sent to ``conn``'s server session first if it has not got it."""
        window = self.window()
        if not conn.window_sent:
            conn.call_with_fd(Op.WINDOW, b"", window.fd, deadline)
            conn.window_sent = True
        return window

    def register_with(self, registrar: Registrar, limit: int | None) -> ArenaRegistration | None:
        """Start page-locking this mapping of the arena for DMA in the background, once (see
        :mod:`kvstore.client.arena_registration`); ``limit`` bytes at most (``None``: all).
        The registration, or ``None`` once closed or where ``limit`` is 0."""
        with self._lock:
            if self._closed or limit == 0 or not len(self._arena):
                return None
            if self.registration is None:
                index, namespace = self._index, self.namespace
                hints = None if index is None else (lambda: index.published(namespace))
                # A sealed arena is mapped read-only: DMA may only read it.
                self.registration = ArenaRegistration(
                    self._arena.ctypes.data,
                    len(self._arena),
                    registrar,
                    limit=limit,
                    hints=hints,
                    read_only=self.sealed,
                )
        if self.sealed and self.window_registration is None:
            window = self.window()  # saves DMA into it, so it is page-locked too (writable)
            with self._lock:
                if self.window_registration is None and not self._closed:
                    self.window_registration = ArenaRegistration(
                        window.bytes.ctypes.data, window.size, registrar, limit=limit
                    )
        return self.registration

    def close(self) -> None:
        """Close the sockets (the server releases what they held) and unmap the arena."""
        if self._touches is not None:
            self._touches.close(timeout=0.2)  # the reads since the last TOUCH still count
        with self._lock:
            self._closed = True
        # The prefaulter reads the index and faults the arena's pages in: neither may go away
        # under it. One that does not stop in time (never seen) keeps both mapped.
        keep_mapped = self._prefaulter is not None and not self._prefaulter.stop()
        if keep_mapped:
            logger.warning("the arena prefault thread did not stop; leaving the arena mapped")
        # Pages a DMA may still read or write stay registered, and so mapped.
        if self.registration is not None and not self.registration.close():
            keep_mapped = True
        window_registered = self.window_registration
        if self._window is not None and (window_registered is None or window_registered.close()):
            self._window.close()
        with self._lock:
            idle, self._idle = self._idle, []
            idle += self._reserving  # a reservation never committed ends with the client
            self._reserving = []
        if self._touch_conn is not None:
            self._touch_conn.sock.close()
        if self._liveness is not None:
            self._liveness.close()
        for conn in idle:
            conn.sock.close()
        self._arena = np.empty(0, dtype=np.uint8)
        if keep_mapped:
            return
        if self._index is not None:
            self._index.close()
            self._index = None
        with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped at exit
            self._mapping.close()
