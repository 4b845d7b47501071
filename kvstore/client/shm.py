"""The shared-memory data plane, client side: copy blocks straight between the arena and buffers.

:class:`ShmDataPlane` maps the server's ``dram`` arena and the arena's published index (both
received as memfds on the first connection) and talks to the server over its UNIX socket (see
:mod:`kvstore.protocol.shm_frames`). A read first looks every key up in the index and copies
what it finds straight into the caller's buffer, keeping a copy only if the index entry did not
change meanwhile (:mod:`kvstore.protocol.dram_index`); the server hears of those reads a moment
later, in a one-way ``TOUCH`` that a background thread sends (:mod:`kvstore.client.shm_touch`).
The remaining keys take the leased path: acquire leases on their pages (which promotes them from
lower tiers first), copy each block once, release. A write reserves pages, copies each value once
into them and commits. The clients in :mod:`kvstore.client` use it by themselves when the server
is on the same host and fall back to gRPC when it is not.

Thread-safe: each call borrows one socket from a small pool, so concurrent calls from several
threads proceed in parallel (the copies release the GIL). A socket that fails or times out is
closed, never reused, and the server then gives back whatever that socket held.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.buffers import byte_view, writable_byte_view
from kvstore.client.shm_reserve import ShmReservation, SlotState
from kvstore.client.shm_socket import ShmConnection, ShmUnavailableError, closed_on_failure
from kvstore.client.shm_touch import TouchSender
from kvstore.errors import DeadlineExceededError, InvalidRequestError
from kvstore.keys import KEY_BYTES
from kvstore.protocol.checks import check_pairs
from kvstore.protocol.dram_index import DIRECT_READS_SUPPORTED, IndexReader
from kvstore.protocol.shm_frames import (
    ABSENT_TIER,
    Cursor,
    Hello,
    Op,
    ProtocolError,
    Slot,
    pack_ids,
    pack_keys,
)
from kvstore.types import LookupResult, PutResult

__all__ = ["ShmDataPlane", "ShmLease", "ShmReservation", "ShmUnavailableError"]

logger = logging.getLogger(__name__)

_HANGUP = select.POLLHUP | select.POLLERR | select.POLLRDHUP
_Ranges = list[tuple[int, int]]


def _index_reader(fd: int, size: int) -> IndexReader | None:
    """The server's published index, or ``None`` if this client cannot read it (another
    layout): reads then all go through the server, which still serves them over this plane."""
    try:
        return IndexReader(fd, size)
    except ValueError as exc:
        logger.info("not reading the server's dram index directly: %s", exc)
        return None


class ShmLease:
    """Blocks held in the store's arena for reading in place (:meth:`ShmDataPlane.acquire`).

    ``views[i]`` is key ``i``'s block as read-only ``uint8`` (``None``: missing); valid until
    :meth:`release`, after which the server may reuse the pages under them. Thread-safe
    release, once; also a context manager.
    """

    def __init__(
        self,
        views: list[np.ndarray[Any, Any] | None],
        release: Callable[[], None],
        intact: Callable[[], list[bool]] | None = None,
    ) -> None:
        self.views = views
        self._release: Callable[[], None] | None = release
        self._intact = intact
        self._lock = threading.Lock()

    def intact(self) -> list[bool]:
        """Whether each view held its block all along; ask once done reading, before trusting
        what was read. Blocks leased from the server always do; blocks read through the
        published index without asking (no server round trip) do unless the server retired
        them meanwhile, and then what was read may be torn: treat it as missing."""
        if self._intact is not None:
            return self._intact()
        return [view is not None for view in self.views]

    def release(self) -> None:
        """Let the server reuse the blocks' pages (the views must not be read any more)."""
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> ShmLease:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class ShmDataPlane:
    """A co-located client's direct path to a server's arena (see the module docstring)."""

    def __init__(
        self,
        path: str,
        namespace: bytes,
        *,
        timeout: float = 5.0,
        direct_reads: bool = True,
        connect_timeout: float | None = None,
    ) -> None:
        """Connect to the socket at ``path`` and map the arena.

        ``timeout``: the default of every call, and how long a new socket may take to connect;
        ``connect_timeout`` (default ``timeout``) bounds this first connection instead, so that a
        client can fit it into the deadline of the call that opens the plane.
        ``direct_reads``: read blocks found in the published index without asking the server
        where the CPU allows it (the client's settings turn this off with
        ``KVSTORE_SHM_DIRECT_READS=0``).
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
            self._mapping = mmap.mmap(first.fds[0], first.hello.arena_size)
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
        with self._lock:
            if self._closed:
                conn.sock.close()
            else:
                self._idle.append(conn)

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def usable_for(self, keys: Sequence[bytes]) -> bool:
        """Whether this path can carry a request for ``keys`` (else gRPC reports the problem)."""
        return 0 < len(keys) <= self.hello.max_keys and set(map(len, keys)) == {KEY_BYTES}

    # -- calls -------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> LookupResult:
        """How many leading keys are stored, and each key's tier.

        The leading keys published in the index are in ``dram`` without asking; the server is
        asked about the rest only (lower tiers, Redis), if any are left.
        """
        deadline = self._deadline(timeout)
        local = self._leading_in_index(keys)
        if local == len(keys):
            return LookupResult(local, [self._arena_tier] * local)
        rest = keys[local:]
        with self._connection(deadline) as conn:
            reply = Cursor(conn.call(Op.LOOKUP, pack_keys(rest), deadline))
            hits = reply.u32()
            indices = reply.take(len(rest))
        tiers = [self._arena_tier] * local + list(map(self._tier_names.__getitem__, indices))
        return LookupResult(local + hits, tiers)

    def _leading_in_index(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the index shows in the arena (0 without an index).

        Only where the arena is the server's top tier: a server with ``hbm`` above it names
        that tier for blocks held in both, which the index cannot see.
        """
        usable = self._usable_index() if self._arena_tier == "dram" else None
        if usable is None:
            return 0
        index, touches = usable
        present = index.present(keys, self.namespace)
        leading = len(keys) if present.all() else int(present.argmin())
        if leading == len(keys):
            touches.add_lookup()  # answered here entirely: the server counts it from the TOUCH
        return leading

    def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Any], timeout: float | None = None
    ) -> list[bool]:
        """Fill ``buffers`` with the blocks of ``keys``; False where missing or of another size.

        A buffer reported False may have been written to (a block that changed while it was
        copied, then turned out missing); its contents are unspecified.
        """
        check_pairs(keys, buffers, "buffers")
        targets = [np.frombuffer(writable_byte_view(b), dtype=np.uint8) for b in buffers]
        arena = self._arena

        def copy(index: int, source: Any) -> bool:
            target = targets[index]
            if isinstance(source, list):  # arena ranges
                if sum(size for _, size in source) != len(target):
                    return False
                at = 0
                for offset, size in source:
                    target[at : at + size] = arena[offset : offset + size]
                    at += size
            elif len(source) == len(target):
                target[:] = np.frombuffer(source, dtype=np.uint8)
            else:
                return False
            return True

        return self._read(keys, copy, timeout)

    def acquire(self, keys: Sequence[bytes], timeout: float | None = None) -> ShmLease:
        """Hold the blocks of ``keys`` in the arena and hand out read-only views of them.

        Where every key is in the published index, the views come from it without asking the
        server, and the reader must check :meth:`ShmLease.intact` once done. Otherwise the
        server leases the blocks: it keeps their pages as they are (no eviction, no reuse)
        until :meth:`ShmLease.release`, or until the socket that holds them closes. Either way
        the caller reads the blocks in place, with no copy in between. A block that is not one
        contiguous range (or that the server sent inline) is copied once; a missing one is
        ``None``.
        """
        deadline = self._deadline(timeout)
        usable = self._usable_index()
        if usable is not None:
            direct = self._acquire_direct(*usable, keys)
            if direct is not None:
                return direct
        conn = self._take(deadline)
        views: list[np.ndarray[Any, Any] | None] = []
        leases: list[int] = []
        arena = self._arena
        with closed_on_failure(conn):
            reply = Cursor(conn.call(Op.ACQUIRE, pack_keys(keys), deadline))
            for _ in keys:
                kind = reply.u8()
                if kind == Slot.LEASE:
                    leases.append(reply.u64())
                    ranges = reply.ranges()
                    parts = [arena[offset : offset + size] for offset, size in ranges]
                    view = parts[0] if len(parts) == 1 else np.concatenate(parts)
                    view.flags.writeable = False
                    views.append(view)
                elif kind == Slot.BYTES:
                    views.append(np.frombuffer(bytes(reply.take(reply.u64())), dtype=np.uint8))
                else:
                    views.append(None)
        return ShmLease(views, lambda: self._release(conn, leases))

    def _acquire_direct(
        self, index: IndexReader, touches: TouchSender, keys: Sequence[bytes]
    ) -> ShmLease | None:
        """Views of blocks that are all in the published index, with no server round trip;
        ``None`` if any is not (the caller asks the server for leases instead). The server
        hears of the reads in the next TOUCH; :meth:`ShmLease.intact` re-checks the entries."""
        arena = self._arena
        hits = []
        for key in keys:
            hit = index.find(key, self.namespace)
            # A torn entry can hold any offset: stay inside the arena.
            if hit is None or hit[2] + hit[3] > len(arena):
                return None
            hits.append(hit)
        views: list[np.ndarray[Any, Any] | None] = []
        for hit in hits:
            view = arena[hit[2] : hit[2] + hit[3]]
            view.flags.writeable = False
            views.append(view)
        try:
            touches.add(keys)
        except ConnectionError as exc:
            raise ShmUnavailableError(str(exc)) from exc
        return ShmLease(views, lambda: None, lambda: [index.unchanged(hit) for hit in hits])

    def _release(self, conn: ShmConnection, leases: list[int]) -> None:
        """End an :meth:`acquire`'s leases and give its socket back."""
        try:
            with closed_on_failure(conn):
                if leases:
                    conn.send(Op.RELEASE, pack_ids(leases))
        except (ShmUnavailableError, DeadlineExceededError):
            return  # the socket is closed, and the server ends what it held by itself
        with self._lock:
            if self._closed:
                conn.sock.close()
            else:
                self._idle.append(conn)

    def get(self, keys: Sequence[bytes], timeout: float | None = None) -> list[bytes | None]:
        """The payload of each key (a fresh ``bytes``), ``None`` where missing."""
        out: list[bytes | None] = [None] * len(keys)
        arena = self._arena

        def copy(index: int, source: Any) -> bool:
            if isinstance(source, list):
                out[index] = b"".join(arena[o : o + n].tobytes() for o, n in source)
            else:
                out[index] = bytes(source)
            return True

        copied = self._read(keys, copy, timeout)
        return [value if ok else None for value, ok in zip(out, copied, strict=True)]

    def _read(self, keys: Sequence[bytes], copy: Any, timeout: float | None) -> list[bool]:
        """Hand each block's arena ranges (or inline bytes) to ``copy``; which ones it took.

        ``copy(index, source)`` returns False to refuse a block (e.g. of the wrong size). Keys
        found in the index are copied first; the rest, and any whose entry changed during the
        copy, go through ACQUIRE / RELEASE.
        """
        deadline = self._deadline(timeout)
        copied = [False] * len(keys)
        pending = list(range(len(keys)))
        usable = self._usable_index()
        if usable is not None:
            pending = self._read_direct(*usable, keys, copy, copied)
            # Like the leased path and puts: a call that ran past its deadline fails, whatever
            # it managed to copy.
            if time.monotonic() > deadline:
                raise DeadlineExceededError("deadline exceeded while copying blocks")
            if not pending:
                return copied
        wanted = [keys[i] for i in pending]
        with self._connection(deadline) as conn:
            reply = Cursor(conn.call(Op.ACQUIRE, pack_keys(wanted), deadline))
            leases: list[int] = []
            try:
                for i in pending:
                    kind = reply.u8()
                    if kind == Slot.LEASE:
                        leases.append(reply.u64())
                        copied[i] = copy(i, reply.ranges())
                    elif kind == Slot.BYTES:
                        copied[i] = copy(i, reply.take(reply.u64()))
            finally:
                if leases:
                    conn.send(Op.RELEASE, pack_ids(leases))
        return copied

    def _read_direct(
        self,
        index: IndexReader,
        touches: TouchSender,
        keys: Sequence[bytes],
        copy: Any,
        copied: list[bool],
    ) -> list[int]:
        """Copy the keys found in the index, note them for the next TOUCH; the indices left."""
        arena_size = len(self._arena)
        pending: list[int] = []
        for i, key in enumerate(keys):
            hit = index.find(key, self.namespace)
            # A torn entry can hold any offset: stay inside the arena; keep only verified copies.
            if (
                hit is not None
                and hit[2] + hit[3] <= arena_size
                and copy(i, [(hit[2], hit[3])])
                and index.unchanged(hit)
            ):
                copied[i] = True
            else:
                pending.append(i)
        if len(pending) < len(keys):
            served = [key for key, ok in zip(keys, copied, strict=True) if ok]
            try:
                # A call that also leases counts as a get there; count it once.
                touches.add(served, counts_call=not pending)
            except ConnectionError as exc:
                raise ShmUnavailableError(str(exc)) from exc
        return pending

    def put(
        self, keys: Sequence[bytes], values: Sequence[Any], timeout: float | None = None
    ) -> tuple[PutResult, list[int]]:
        """Write blocks through the arena.

        Returns the result and the indices of values the arena had no room for, which the caller
        sends another way.
        """
        check_pairs(keys, values, "values")
        views = [byte_view(value) for value in values]
        lengths = struct.pack(f"<{len(views)}Q", *(len(view) for view in views))
        present = 0
        no_room: list[int] = []
        deadline = self._deadline(timeout)
        with self._connection(deadline) as conn:
            reply = Cursor(conn.call(Op.RESERVE, pack_keys(keys) + lengths, deadline))
            reserved: list[int] = []
            try:
                for index, view in enumerate(views):
                    kind = reply.u8()
                    if kind == Slot.RESERVED:
                        reserved.append(reply.u64())
                        self._write(reply.ranges(), view)
                    elif kind == Slot.PRESENT:
                        present += 1
                    else:
                        no_room.append(index)
            except BaseException:
                if reserved:
                    conn.send(Op.CANCEL, pack_ids(reserved))
                raise
            if not reserved:
                return PutResult(0, present, 0), no_room
            if time.monotonic() > deadline:
                conn.send(Op.CANCEL, pack_ids(reserved))
                raise DeadlineExceededError("deadline exceeded while writing blocks")
            counts = Cursor(conn.call(Op.COMMIT, pack_ids(reserved), deadline)).unpack("III")
        stored, already, dropped = counts
        return PutResult(stored, present + already, dropped), no_room

    def reserve(
        self, keys: Sequence[bytes], sizes: Sequence[int], timeout: float | None = None
    ) -> ShmReservation:
        """Reserve arena pages for blocks of ``sizes`` bytes that the caller writes in place and
        then commits (:class:`~kvstore.client.shm_reserve.ShmReservation`); the socket stays
        with the reservation until then."""
        if len(sizes) != len(keys):
            raise InvalidRequestError(f"got {len(sizes)} sizes for {len(keys)} keys")
        if any(size < 0 for size in sizes):
            raise InvalidRequestError("block sizes must be >= 0")
        deadline = self._deadline(timeout)
        conn = self._take(deadline)
        states: list[SlotState] = []
        ids: list[int | None] = []
        ranges: list[_Ranges] = []
        # A failure closes the socket, and the server then gives back whatever it reserved.
        with closed_on_failure(conn):
            lengths = struct.pack(f"<{len(sizes)}Q", *sizes)
            reply = Cursor(conn.call(Op.RESERVE, pack_keys(keys) + lengths, deadline))
            for _ in keys:
                kind = reply.u8()
                if kind == Slot.RESERVED:
                    ids.append(reply.u64())
                    ranges.append(reply.ranges())
                    states.append("reserved")
                else:
                    ids.append(None)
                    ranges.append([])
                    states.append("present" if kind == Slot.PRESENT else "no_room")
        with self._lock:
            self._reserving.append(conn)

        def finish(commit: list[int], cancel: list[int]) -> PutResult:
            return self._finish_reservation(conn, commit, cancel)

        return ShmReservation(self._arena, states, ids, ranges, finish)

    def _finish_reservation(
        self, conn: ShmConnection, commit: list[int], cancel: list[int]
    ) -> PutResult:
        """Commit and cancel a :meth:`reserve`'s slots, then give its socket back."""
        result = PutResult()
        with self._lock:
            if conn in self._reserving:
                self._reserving.remove(conn)
        with closed_on_failure(conn):
            if cancel:
                conn.send(Op.CANCEL, pack_ids(cancel))
            if commit:
                reply = conn.call(Op.COMMIT, pack_ids(commit), self._deadline(None))
                result = PutResult(*Cursor(reply).unpack("III"))
        with self._lock:
            if self._closed:
                conn.sock.close()
            else:
                self._idle.append(conn)
        return result

    def _write(self, ranges: _Ranges, view: memoryview) -> None:
        source = np.frombuffer(view, dtype=np.uint8)
        at = 0
        for offset, size in ranges:
            self._arena[offset : offset + size] = source[at : at + size]
            at += size

    def _send_touch(self, keys: Sequence[bytes], calls: int, lookups: int) -> None:
        with self._touch_socket(self._deadline(None)) as conn:
            conn.send(Op.TOUCH, struct.pack("<II", calls, lookups) + pack_keys(keys))

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

    def close(self) -> None:
        """Close the sockets (the server releases what they held) and unmap the arena."""
        if self._touches is not None:
            self._touches.close(timeout=0.2)  # the reads since the last TOUCH still count
        with self._lock:
            self._closed = True
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
        if self._index is not None:
            self._index.close()
            self._index = None
        with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped at exit
            self._mapping.close()
