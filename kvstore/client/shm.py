"""The shared-memory data plane, client side: copy blocks straight between the arena and buffers.

:class:`ShmDataPlane` maps the server's ``dram`` arena and the arena's published index (both
received as memfds on the first connection) and talks to the server over its UNIX socket (see
:mod:`kvstore.protocol.shm_frames`; the bodies are packed and read by
:mod:`kvstore.protocol.shm_messages`). A read first looks every key up in the index and copies what
it finds straight into the caller's buffer, keeping a copy only if the index entry did not
change meanwhile (:mod:`kvstore.protocol.dram_index`); the server hears of those reads a moment
later, in a one-way ``TOUCH`` that a background thread sends (:mod:`kvstore.client.shm_touch`).
The remaining keys take the leased path: acquire leases on their pages (which promotes them from
lower tiers first), copy each block once, release. A write reserves pages, copies each value once
into this client's write window and commits, and the server copies it into the pages
(:mod:`kvstore.client.shm_writes`: the arena is mapped read-only); :meth:`ShmDataPlane.reserve`
lets a caller that produces the bytes write them into the window itself
(:mod:`kvstore.client.shm_reserve`). The clients in
:mod:`kvstore.client` use it by themselves when the server is on the same host and fall back to
gRPC when it is not.

The sockets, the mapped arena and index and the liveness check under these calls live in
:class:`~kvstore.client.shm_attach.ShmAttachment`, which :class:`ShmDataPlane` extends;
thread-safe like it (each call borrows one socket of its pool).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.buffers import writable_byte_view
from kvstore.client.arena_registration import ArenaRegistration
from kvstore.client.shm_reserve import ShmReservation
from kvstore.client.shm_socket import ShmConnection, ShmUnavailableError, closed_on_failure
from kvstore.client.shm_touch import TouchSender
from kvstore.client.shm_writes import ShmWrites
from kvstore.errors import DeadlineExceededError
from kvstore.keys import KEY_BYTES
from kvstore.protocol.checks import check_pairs
from kvstore.protocol.dram_index import IndexReader
from kvstore.protocol.shm_frames import Op, pack_ids, pack_keys
from kvstore.protocol.shm_messages import Lent, read_acquire_reply, read_lookup_reply
from kvstore.types import LookupResult

__all__ = ["ShmDataPlane", "ShmLease", "ShmReservation", "ShmUnavailableError"]

_Ranges = list[tuple[int, int]]


class ShmLease:
    """Blocks held in the store's arena for reading in place (:meth:`ShmDataPlane.acquire`).

    ``views[i]`` is key ``i``'s block as read-only ``uint8`` (``None``: missing); valid until
    :meth:`release`, after which the server may reuse the pages under them. ``registration``
    is the client's mapping of the arena as page-locked for DMA so far (``None`` where nobody
    asked: :meth:`kvstore.KVStoreClient.register_arena_with`). Thread-safe release, once; also
    a context manager.
    """

    def __init__(
        self,
        views: list[np.ndarray[Any, Any] | None],
        release: Callable[[], None],
        intact: Callable[[], list[bool]] | None = None,
        registration: ArenaRegistration | None = None,
    ) -> None:
        self.views = views
        self.registration = registration
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


class ShmDataPlane(ShmWrites):
    """A co-located client's direct path to a server's arena (see the module docstring).

    Construct it as :class:`~kvstore.client.shm_attach.ShmAttachment` (the socket's path, the
    namespace, timeouts); that part holds the sockets and the mapped arena, this one the calls.
    """

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
            reply = conn.call(Op.LOOKUP, pack_keys(rest), deadline)
            hits, indices = read_lookup_reply(reply, len(rest))
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
        self._reading()
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
            reply = conn.call(Op.ACQUIRE, pack_keys(keys), deadline)
            for item in read_acquire_reply(reply, len(keys)):
                if isinstance(item, Lent):
                    leases.append(item.id)
                    parts = [arena[offset : offset + size] for offset, size in item.ranges]
                    view = parts[0] if len(parts) == 1 else np.concatenate(parts)
                    view.flags.writeable = False
                    views.append(view)
                elif item is not None:  # inline: a copy, not a view pinning the whole reply
                    views.append(np.frombuffer(bytes(item), dtype=np.uint8))
                else:
                    views.append(None)
        return ShmLease(views, lambda: self._release(conn, leases), None, self.registration)

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
            if not index.intact(hit, [view]):  # verified reads: the server decides on this one
                return None
            views.append(view)
        try:
            touches.add(keys)
        except ConnectionError as exc:
            raise ShmUnavailableError(str(exc)) from exc
        return ShmLease(
            views, lambda: None, lambda: [index.unchanged(hit) for hit in hits], self.registration
        )

    def _release(self, conn: ShmConnection, leases: list[int]) -> None:
        """End an :meth:`acquire`'s leases and give its socket back."""
        try:
            with closed_on_failure(conn):
                if leases:
                    conn.send(Op.RELEASE, pack_ids(leases))
        except (ShmUnavailableError, DeadlineExceededError):
            return  # the socket is closed, and the server ends what it held by itself
        self._give_back(conn)

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
        self._reading()
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
            reply = conn.call(Op.ACQUIRE, pack_keys(wanted), deadline)
            items = read_acquire_reply(reply, len(wanted))
            leases = [item.id for item in items if isinstance(item, Lent)]
            try:
                for i, item in zip(pending, items, strict=True):
                    if isinstance(item, Lent):
                        copied[i] = copy(i, list(item.ranges))
                    elif item is not None:
                        copied[i] = copy(i, item)
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
        arena = self._arena
        pending: list[int] = []
        for i, key in enumerate(keys):
            hit = index.find(key, self.namespace)
            # A torn entry can hold any offset: stay inside the arena; keep only copies of an
            # entry that did not change (so the pages held its block throughout) and, where the
            # server verifies reads, whose bytes match its checksum. Any other goes the leased
            # way, where the server checks the block itself (and drops and counts a bad one).
            if (
                hit is not None
                and hit[2] + hit[3] <= len(arena)
                and copy(i, [(hit[2], hit[3])])
                and index.intact(hit, [arena[hit[2] : hit[2] + hit[3]]])
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
