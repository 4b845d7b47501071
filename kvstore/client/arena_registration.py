"""The client's mapping of the store's arena, page-locked for DMA piece by piece in the background.

A GPU copies host memory at the link's speed only from page-locked pages; from pageable ones the
driver copies through a bounce buffer of its own, at a fraction of it. ``kvstore serve``
page-locks the arena in its own process, but that holds for the server's mapping only: an engine
that maps the same memfd sees pageable memory. :class:`ArenaRegistration` page-locks the
engine's own mapping (``cudaHostRegister``), so that its loads DMA straight out of leased blocks
and its saves DMA straight into reserved pages, with no host copy on either side.

Registration is slow and per process: every page is pinned again in each process that maps it
(measured on an H100: about 0.23 s per GiB where the server already holds the pages locked, 0.7 s
otherwise; a TP rank is a process of its own, so a 100 GiB arena costs each rank tens of
seconds). So it never runs on the engine's critical path: a background thread registers the arena
in pieces of :data:`PIECE_BYTES`, first the pieces a load or save asked for (:meth:`want`), then
those holding this namespace's published blocks, then the rest in order, up to an optional
``limit`` of bytes (``KVSTORE_SHM_CUDA_REGISTER``). Until the pieces a transfer needs are covered
(:meth:`covers`), the caller takes its page-locked-staging path. A copy never spans two pieces
(:meth:`cut`): each registration is its own pinned range to the driver.

A failed registration (the driver refuses, or the system's locked-memory limit is reached) stops
the thread with one logged reason (:attr:`failure`); the pieces already registered stay in use.
:meth:`close` unregisters everything once no transfer is in flight (:meth:`enter` /
:meth:`leave`); the mapping must stay mapped until then.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from kvstore.client.cuda_runtime import PORTABLE, READ_ONLY, CudaRuntime, cuda_runtime

__all__ = ["PIECE_BYTES", "ArenaRegistration", "CudaRegistrar", "Registrar"]

logger = logging.getLogger(__name__)

#: Bytes page-locked per registration call: small enough that the pieces a first load needs are
#: ready in a fraction of a second, large enough that a step's chunks rarely straddle two.
PIECE_BYTES = 256 << 20


class Registrar(Protocol):
    """What page-locks host memory for a device: the CUDA runtime, or a test's stand-in."""

    def register(self, address: int, nbytes: int, read_only: bool = False) -> int:
        """Page-lock the range (``read_only``: for DMA out of it only, as a read-only mapping
        allows); 0 when done, else an error code for :meth:`describe`."""
        ...

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` of the range that starts at ``address``."""
        ...

    def describe(self, code: int) -> str:
        """Words for an error code of :meth:`register`."""
        ...


class CudaRegistrar:
    """:class:`Registrar` through the CUDA runtime torch loaded (``cudaHostRegisterPortable``).

    Raises :class:`~kvstore.client.cuda_runtime.CudaRuntimeUnavailable` where there is none.
    """

    def __init__(self, runtime: CudaRuntime | None = None) -> None:
        self._runtime = runtime if runtime is not None else cuda_runtime()

    def register(self, address: int, nbytes: int, read_only: bool = False) -> int:
        """Page-lock the range; the CUDA error code."""
        flags = PORTABLE | (READ_ONLY if read_only else 0)
        return self._runtime.host_register(address, nbytes, flags)

    def unregister(self, address: int) -> None:
        """Unlock the range registered at ``address``."""
        self._runtime.host_unregister(address)

    def describe(self, code: int) -> str:
        """The runtime's name of the error."""
        return self._runtime.describe(code)


class ArenaRegistration:
    """Pieces of one mapping page-locked on a background thread (see the module docstring)."""

    def __init__(
        self,
        base: int,
        size: int,
        registrar: Registrar,
        *,
        limit: int | None = None,
        piece_bytes: int = PIECE_BYTES,
        hints: Callable[[], Iterable[tuple[int, int]]] | None = None,
        read_only: bool = False,
    ) -> None:
        """Register ``[base, base + size)``; ``limit``: at most that many bytes (None: all);
        ``hints``: ``(offset, length)`` of blocks to cover first, read once on the thread;
        ``read_only``: a mapping the device only reads (loads), registered as such."""
        self.read_only = read_only
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
        self.base, self.size, self.piece_bytes = base, size, piece_bytes
        self.limit = size if limit is None else min(limit, size)
        self._registrar = registrar
        self._hints = hints
        count = -(-size // piece_bytes)
        self._done = bytearray(count)  # 1: registered (only ever set, until close)
        self._queued: collections.deque[int] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._users = 0
        #: Why registration stopped early (a refused call), if it did.
        self.failure: str | None = None
        #: Bytes registered so far, and the seconds the registration calls took.
        self.registered_bytes = 0
        self.register_s = 0.0
        self._thread = threading.Thread(target=self._run, name="kvstore-cuda-register", daemon=True)
        self._thread.start()

    # -- asked by transfers -----------------------------------------------------------------

    def _pieces(self, address: int, nbytes: int) -> range | None:
        start = address - self.base
        if nbytes <= 0 or start < 0 or start + nbytes > self.size:
            return None
        return range(start // self.piece_bytes, (start + nbytes - 1) // self.piece_bytes + 1)

    def covers(self, address: int, nbytes: int) -> bool:
        """Whether every byte of the range lies in registered pieces of this mapping."""
        pieces = self._pieces(address, nbytes)
        return pieces is not None and not self._closing and all(self._done[p] for p in pieces)

    def cut(self, address: int, nbytes: int) -> list[tuple[int, int, int]]:
        """The range as ``(address, nbytes, piece)`` parts, each inside one piece."""
        parts = []
        end = address + nbytes
        while address < end:
            piece = (address - self.base) // self.piece_bytes
            stop = min(end, self.base + (piece + 1) * self.piece_bytes)
            parts.append((address, stop - address, piece))
            address = stop
        return parts

    def want(self, address: int, nbytes: int) -> None:
        """Register the pieces under this range next (a transfer needed them and went without)."""
        pieces = self._pieces(address, nbytes)
        if pieces is None:
            return
        with self._cond:
            fresh = [p for p in pieces if not self._done[p] and p not in self._queued]
            self._queued.extendleft(reversed(fresh))
            if fresh:
                self._cond.notify_all()

    def wait_covered(self, address: int, nbytes: int, timeout: float) -> bool:
        """Block until :meth:`covers` holds for the range (asking for it first); False after
        ``timeout`` seconds or once registration has stopped short of it."""
        self.want(address, nbytes)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.covers(address, nbytes):
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    # The thread may have registered the last piece just before it ended.
                    return self.covers(address, nbytes)
                self._cond.wait(min(left, 0.05))
        return True

    def enter_blocks(self, views: Sequence[Any], sizes: Sequence[int]) -> list[int | None] | None:
        """Begin a transfer out of or into blocks of this mapping (``uint8`` views, ``None``:
        missing): each view's address where it is a whole block of ``sizes[i]`` bytes, else
        ``None``, with the transfer entered (:meth:`enter`; :meth:`leave` once the device is
        done). ``None`` where some block's pages are not registered yet (they are asked for, so
        a later transfer finds them) or the registration is closing: use another path."""
        addresses: list[int | None] = []
        covered = True
        for view, size in zip(views, sizes, strict=True):
            if view is None or view.nbytes != size:
                addresses.append(None)
                continue
            address = int(view.ctypes.data)
            addresses.append(address)
            if not self.covers(address, size):
                self.want(address, size)
                covered = False
        if not covered or not self.enter():
            return None
        return addresses

    def enter(self) -> bool:
        """Mark a transfer from or into registered pieces in flight; False if closing (then
        use another path). Pair with :meth:`leave` once the device is done with the pages."""
        with self._cond:
            if self._closing:
                return False
            self._users += 1
            return True

    def leave(self) -> None:
        """End a transfer begun with :meth:`enter`."""
        with self._cond:
            self._users -= 1
            self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """Registered bytes and pieces, the seconds it took, and why it stopped, if it did."""
        return {
            "registered_bytes": self.registered_bytes,
            "pieces": sum(self._done),
            "register_s": self.register_s,
            "failure": self.failure,
        }

    # -- the thread -------------------------------------------------------------------------

    def _order(self) -> list[int]:
        """Pieces to register when none is asked for: those with published blocks first."""
        hinted: dict[int, None] = {}
        if self._hints is not None:
            try:
                for offset, length in self._hints():
                    pieces = self._pieces(self.base + int(offset), int(length))
                    hinted.update(dict.fromkeys(pieces or ()))
            except Exception:  # hints only: a torn index row must not stop registration
                logger.debug("arena registration hints unreadable", exc_info=True)
        return [*hinted, *(p for p in range(len(self._done)) if p not in hinted)]

    def _next(self, order: collections.deque[int]) -> int | None:
        """The next piece to register: one asked for, else the next in ``order`` (which holds
        every piece, so once it is empty everything is registered)."""
        with self._cond:
            if self._closing:
                return None
            for queue in (self._queued, order):
                while queue and self._done[queue[0]]:
                    queue.popleft()
                if queue:
                    return queue.popleft()
        return None

    def _run(self) -> None:
        order = collections.deque(self._order())
        while (piece := self._next(order)) is not None:
            start = self.base + piece * self.piece_bytes
            nbytes = min(self.piece_bytes, self.base + self.size - start)
            if self.registered_bytes + nbytes > self.limit:
                self._stop(f"the limit of {self.limit} bytes is reached")
                return
            began = time.perf_counter()
            try:
                code = (
                    self._registrar.register(start, nbytes, read_only=True)
                    if self.read_only
                    else self._registrar.register(start, nbytes)
                )
                reason = "" if code == 0 else self._registrar.describe(code)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
            spent = time.perf_counter() - began
            if reason:
                self._stop(f"registering {nbytes} bytes failed: {reason}")
                return
            with self._cond:
                self._done[piece] = 1
                self.registered_bytes += nbytes
                self.register_s += spent
                self._cond.notify_all()
        logger.debug(
            "arena registered for DMA: %d bytes in %.2f s", self.registered_bytes, self.register_s
        )

    def _stop(self, reason: str) -> None:
        with self._cond:
            self.failure = reason
            self._cond.notify_all()
        logger.warning(
            "kvstore: stopped page-locking the store's arena for DMA (%s); %d bytes are "
            "registered, transfers outside them go through page-locked staging",
            reason,
            self.registered_bytes,
        )

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the thread and unregister every piece once no transfer is in flight; False
        if that did not happen within ``timeout`` (then the mapping must stay mapped)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._users and time.monotonic() < deadline:
                self._cond.wait(0.05)
            busy = self._users > 0
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if busy or self._thread.is_alive():
            logger.warning("kvstore: arena registration still in use at close; leaving it")
            return False
        for piece, done in enumerate(self._done):
            if done:
                try:
                    self._registrar.unregister(self.base + piece * self.piece_bytes)
                except Exception:
                    logger.warning("kvstore: unregistering an arena piece failed", exc_info=True)
                self._done[piece] = 0
        return True
