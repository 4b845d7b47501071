"""The backend's calls on the store, without SGLang: look up, load and store pages of a host pool.

:class:`PageStore` is what :class:`~kvstore.integrations.sglang.backend.KVStoreHiCacheStorage`
does with each of SGLang's calls, over any :class:`~kvstore.integrations.store_client.StoreClient`:

- :meth:`PageStore.exists`: the leading pages the store holds (``lookup``; over shared memory
  the published dram index answers without a round trip where it holds them all);
- :meth:`PageStore.load`: over shared memory a *lease* of the pages' blocks in the arena, then
  one copy per run of pages straight into the host pool (:mod:`~kvstore.integrations.sglang.pages`)
  and the lease's check that no block changed meanwhile; elsewhere (UCX, gRPC: a store on
  another host) a get into a staging buffer and the same copies from it;
- :meth:`PageStore.store`: over shared memory a *reservation* of arena pages, one copy per run
  out of the host pool into them, and a commit (pages the store holds already are not copied);
  elsewhere, or for pages the arena had no room for, a put of the gathered pages.

Each call has a deadline; a store that fails or outlives it costs SGLang misses, and the breaker
(:class:`~kvstore.integrations.breaker.Breaker`) keeps the next calls from waiting on it again
for a while. No call raises: failures are counted (:mod:`~kvstore.integrations.sglang.metrics`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from kvstore.errors import DeadlineExceededError, KVStoreError, StoreUnavailableError
from kvstore.integrations.breaker import Breaker
from kvstore.integrations.sglang.identity import PageKeys, PoolShape
from kvstore.integrations.sglang.metrics import Metrics
from kvstore.integrations.sglang.pages import coalesce, copy_runs, host_pages
from kvstore.integrations.store_client import StoreClient

__all__ = ["PageStore"]

logger = logging.getLogger("kvstore.integrations.sglang")

T = TypeVar("T")
_Block = np.ndarray[Any, Any] | None

#: The most bytes of pages a get or put off shared memory stages at once: a call of SGLang's 128
#: pages of a large model can be gigabytes, so it goes in parts of this size, under one deadline.
MAX_STAGING_BYTES = 64 << 20


class PageStore:
    """One rank's pages in the store (see the module docstring).

    ``pool_pages`` is the host pool as ``[pages, *shape.page_shape]``
    (:func:`~kvstore.integrations.sglang.pages.page_view`). ``writer`` is False on the ranks of an
    MLA model but the first: MLA KV is the same on every rank, and rank 0 alone stores it.
    """

    def __init__(
        self,
        client: StoreClient,
        breaker: Breaker,
        metrics: Metrics,
        keys: PageKeys,
        shape: PoolShape,
        pool_pages: torch.Tensor,
        *,
        timeout_s: float,
        lookup_timeout_s: float,
        writer: bool = True,
    ) -> None:
        self._client = client
        self._breaker = breaker
        self._metrics = metrics
        self.keys = keys
        self.shape = shape
        self._pool = pool_pages
        self._timeout_s = timeout_s
        self._lookup_timeout_s = lookup_timeout_s
        self.writer = writer

    # -- lookups ---------------------------------------------------------------------------

    def exists(self, hashes: Sequence[str]) -> int:
        """How many leading pages of ``hashes`` the store holds (0 where it fails)."""
        if not hashes:
            return 0
        keys = self.keys.of(hashes)
        hits = self._guarded(
            "lookup",
            len(keys),
            lambda: self._client.lookup(keys, timeout=self._lookup_timeout_s),
            0,
        )
        self._metrics.looked_up(len(keys), hits)
        return hits

    # -- loads -----------------------------------------------------------------------------

    def load(self, hashes: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Copy the pages of ``hashes`` into the host pool at ``host_indices``; which came."""
        count = len(hashes)
        pages = host_pages(host_indices, self.shape.page_size, count)
        if pages is None:
            return self._refused("load", count, host_indices)
        keys = self.keys.of(hashes)
        outcome = self._guarded("load", count, lambda: self._load(keys, pages), None)
        if outcome is None:
            return [False] * count
        done, corrupt = outcome
        loaded = sum(done)
        self._metrics.loaded(loaded)
        self._metrics.failed("load", "corrupt", corrupt)
        self._metrics.failed("load", "missing", count - loaded - corrupt)
        return done

    def _load(self, keys: list[bytes], pages: list[int]) -> tuple[list[bool], int]:
        """The pages that came whole, and how many blocks were torn or of the wrong size."""
        lease = self._client.lease(keys, timeout=self._timeout_s)
        if lease is None:  # not over shared memory: through a staging buffer, part by part
            done: list[bool] = []
            wrong = 0
            deadline = time.monotonic() + self._timeout_s
            for part in self._parts(len(keys)):
                staging = np.empty((len(part), self.shape.page_nbytes), dtype=np.uint8)
                part_keys = [keys[i] for i in part]
                found = self._client.get_into(part_keys, list(staging), timeout=_left(deadline))
                rows: list[_Block] = [
                    r if hit else None for r, hit in zip(staging, found, strict=True)
                ]
                copied, torn = self._into_pool([pages[i] for i in part], rows)
                done += copied
                wrong += torn
            return done, wrong
        try:
            copied, wrong = self._into_pool(pages, lease.views)
            intact = lease.intact()  # a block retired under the copy may be torn: a miss
        finally:
            lease.release()
        torn = sum(c and not i for c, i in zip(copied, intact, strict=True))
        return [c and i for c, i in zip(copied, intact, strict=True)], wrong + torn

    def _into_pool(self, pages: list[int], blocks: Sequence[_Block]) -> tuple[list[bool], int]:
        nbytes = self.shape.page_nbytes
        usable = [b if b is not None and b.nbytes == nbytes else None for b in blocks]
        wrong = sum(b is not None and u is None for b, u in zip(blocks, usable, strict=True))
        addresses = [None if b is None else int(b.ctypes.data) for b in usable]
        runs = coalesce(pages, addresses, nbytes)
        copy_runs(runs, usable, self._pool, self.shape, into_pool=True)
        return [b is not None for b in usable], wrong

    # -- stores ----------------------------------------------------------------------------

    def store(self, hashes: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``hashes``; which the store
        holds now."""
        count = len(hashes)
        if not self.writer:
            return [True] * count  # rank 0 stores this MLA page for every rank
        pages = host_pages(host_indices, self.shape.page_size, count)
        if pages is None:
            return self._refused("store", count, host_indices)
        keys = self.keys.of(hashes)
        done = self._guarded("store", count, lambda: self._store(keys, pages), [False] * count)
        self._metrics.stored(sum(done))
        return done

    def _store(self, keys: list[bytes], pages: list[int]) -> list[bool]:
        size = self.shape.page_nbytes
        reservation = self._client.reserve(keys, [size] * len(keys), timeout=self._timeout_s)
        if reservation is None:  # not over shared memory
            return self._put(keys, pages, list(range(len(keys))))
        done = [state == "present" for state in reservation.states]
        with reservation:  # cancelled on the way out unless committed
            reserved = [i for i, state in enumerate(reservation.states) if state == "reserved"]
            whole = {i for i in reserved if reservation.views[i] is not None}
            blocks: list[_Block] = [
                reservation.views[i] if i in whole else None for i in range(len(keys))
            ]
            addresses = [None if b is None else int(b.ctypes.data) for b in blocks]
            copy_runs(
                coalesce(pages, addresses, size), blocks, self._pool, self.shape, into_pool=False
            )
            for i in sorted(set(reserved) - whole):  # pages in several pieces of the arena
                reservation.write(i, self._gather([pages[i]])[0])
            if reserved:
                reservation.commit(reserved)
        for i in reserved:
            done[i] = True
        no_room = [i for i, state in enumerate(reservation.states) if state == "no_room"]
        if no_room:  # the arena is full: the store may still take them in another tier
            for i, ok in zip(no_room, self._put(keys, pages, no_room), strict=True):
                done[i] = ok
        return done

    def _put(self, keys: list[bytes], pages: list[int], which: list[int]) -> list[bool]:
        """Put pages ``which`` of a call, gathered out of the host pool part by part."""
        deadline = time.monotonic() + self._timeout_s
        for part in self._parts(len(which)):
            chosen = [which[i] for i in part]
            values = self._gather([pages[i] for i in chosen])
            part_keys = [keys[i] for i in chosen]
            result = self._client.put(part_keys, list(values), timeout=_left(deadline))
            if result.dropped:
                self._metrics.failed("store", "no_room", len(which))
                return [False] * len(which)
        return [True] * len(which)

    def _parts(self, count: int) -> list[range]:
        """``range(count)`` cut into parts of at most :data:`MAX_STAGING_BYTES` of pages."""
        per = max(1, MAX_STAGING_BYTES // self.shape.page_nbytes)
        return [range(start, min(start + per, count)) for start in range(0, count, per)]

    def _gather(self, pages: list[int]) -> np.ndarray[Any, Any]:
        """Host pages as contiguous stored pages, ``uint8`` rows (one indexing copy)."""
        picked = self._pool[torch.tensor(pages, dtype=torch.int64)].contiguous()
        return picked.view(torch.uint8).reshape(len(pages), -1).numpy()

    # -- the legacy calls' pages -----------------------------------------------------------

    def get_pages(self, hashes: Sequence[str]) -> list[torch.Tensor | None]:
        """The stored pages of ``hashes`` (``shape.page_shape`` tensors), ``None`` where missing."""
        count = len(hashes)
        if not count:
            return []
        keys = self.keys.of(hashes)
        size = self.shape.page_nbytes
        staging = torch.empty((count, size), dtype=torch.uint8)
        found = self._guarded(
            "load",
            count,
            lambda: self._client.get_into(keys, list(staging.numpy()), timeout=self._timeout_s),
            None,
        )
        if found is None:
            return [None] * count
        dtype = getattr(torch, self.shape.dtype)
        out = [
            staging[i].view(dtype).view(self.shape.page_shape) if hit else None
            for i, hit in enumerate(found)
        ]
        loaded = sum(found)
        self._metrics.loaded(loaded)
        self._metrics.failed("load", "missing", count - loaded)
        return out

    def put_pages(self, hashes: Sequence[str], pages: Sequence[torch.Tensor]) -> bool:
        """Store contiguous stored pages under ``hashes``; whether the store holds them all."""
        if not self.writer or not hashes:
            return True
        keys = self.keys.of(hashes)
        values = [page.contiguous().view(torch.uint8).reshape(-1).numpy() for page in pages]

        def put() -> bool:
            return self._client.put(keys, values, timeout=self._timeout_s).dropped == 0

        ok = self._guarded("store", len(keys), put, False)
        if ok:
            self._metrics.stored(len(keys))
        return ok

    def close(self) -> None:
        """Close the client (the backend is done)."""
        self._client.close()

    # -- failures --------------------------------------------------------------------------

    def _guarded(self, op: str, count: int, call: Callable[[], T], failed: T) -> T:
        """``call()``, or ``failed`` where the breaker is open or the store fails (counted)."""
        if self._breaker.is_open():
            reason = "stopped" if self._breaker.held else "store_down"
            self._metrics.failed(op, reason, count)
            return failed
        try:
            return call()
        except (StoreUnavailableError, DeadlineExceededError) as exc:
            self._breaker.trip(exc)
            reason = "deadline" if isinstance(exc, DeadlineExceededError) else "unavailable"
        except KVStoreError as exc:
            logger.warning("kvstore HiCache backend: %s of %d pages failed: %s", op, count, exc)
            reason = "error"
        self._metrics.failed(op, reason, count)
        return failed

    def _refused(self, op: str, count: int, host_indices: torch.Tensor) -> list[bool]:
        logger.warning(
            "kvstore HiCache backend: %s of %d pages got %d host indices that are not whole "
            "pages of %d tokens; nothing copied",
            op,
            count,
            host_indices.numel(),
            self.shape.page_size,
        )
        self._metrics.failed(op, "bad_indices", count)
        return [False] * count


def _left(deadline: float) -> float:
    """The time left until ``deadline``; :class:`DeadlineExceededError` once there is none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError("the call's deadline passed between its parts")
    return left
