"""The one small interface every storage tier implements.

A tier holds bytes and nothing else: it does not decide what to evict, where a block goes next or
when to promote it. :class:`kvstore.store.TieredStore` makes those decisions and calls::

    footprint(length) -> int       bytes a block of ``length`` payload bytes would occupy here
    used                           bytes occupied now (never more than ``capacity``)
    await write(header, payload)   store one block; False when there is no room right now
    await read(keys)               verified blocks (or None) for a batch of keys
    await remove(keys)             delete blocks; False if the medium refused (they remain)
    scan()                         headers of blocks that survived a restart (persistent tiers)
    retention_records()            where retention deadlines survive a restart (nvme), or None
    stats()                        counters for ``Stats``
    await close()

Reads never return unverified bytes from a medium that can rot or that others can write (disk,
network): such a tier signs blocks with the keyed MAC of :mod:`kvstore.block` when it writes them
and checks the header and MAC when it reads them, and a block that fails is deleted, counted in
``corrupt_blocks`` and reported as ``None``. Memory tiers keep the header (with the payload's
checksum) the store gives them and hand it back with the block.
"""

from __future__ import annotations

import heapq
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.block import BlockHeader, Keyring

__all__ = ["Buffer", "RetentionKeeper", "SizeLedger", "StoredBlock", "Tier"]

Buffer = bytes | bytearray | memoryview
"""A contiguous, byte-addressed payload (``memoryview(x).cast("B")`` works on it)."""


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block read back from a tier: its header and its verified payload."""

    header: BlockHeader
    payload: bytes | memoryview


class RetentionKeeper(Protocol):
    """Where a persistent tier keeps retention deadlines across restarts (blocking calls, made
    from a worker thread one at a time; see :mod:`kvstore.tiers.nvme_retention`)."""

    def write(self, changes: Mapping[bytes, tuple[float, float] | None]) -> bool:
        """Save key → (deadline in Unix seconds, window in seconds), ``None`` forgets."""
        ...

    def load(self) -> dict[bytes, tuple[float, float]]:
        """Every record saved."""
        ...


class Tier(ABC):
    """A place that holds blocks: ``dram``, ``nvme``, ``redis``, ``hbm``."""

    #: The tier's name as reported by ``Lookup`` and ``Stats``.
    name: str
    #: Bytes this tier may occupy.
    capacity: int
    #: Whether blocks survive a restart of the process (and :meth:`scan` finds them again).
    persistent: bool = False
    #: Whether every node of a cluster sees this tier (``redis``): the store writes new blocks
    #: through to it in the background, reads it for keys it does not index, and never places or
    #: evicts blocks there itself.
    shared: bool = False
    #: Whether the tier is accelerator memory (``hbm``): it comes first, the store never places a
    #: new block in it, and only promotions (blocks read again) move blocks up into it.
    device: bool = False
    #: The keyring that signs and verifies this tier's blocks where it signs them (nvme, redis);
    #: ``None`` is the process's installed one. A tenant's tiers carry the tenant's own ring.
    keyring: Keyring | None = None
    #: Blocks the tier found altered (MAC or checksum mismatch) and refused to serve, so far.
    #: The store compares it around a read to tell a corrupt block from an absent one.
    corrupt_blocks: int = 0

    @property
    def up(self) -> bool:
        """Whether the medium answers now. A remote tier between an outage and its reconnect is
        down, and its misses count as ``tier_down`` rather than absent; local tiers always are."""
        return True

    @abstractmethod
    def footprint(self, length: int) -> int:
        """Bytes a block with ``length`` payload bytes occupies in this tier."""

    @property
    @abstractmethod
    def used(self) -> int:
        """Bytes occupied now, by the same measure as :meth:`footprint`."""

    @abstractmethod
    async def write(self, header: BlockHeader, payload: Buffer) -> bool:
        """Store a block, replacing any block under the same key.

        Returns False, having changed nothing, when the tier has no room for it right now; the
        caller evicts and tries again, or places the block elsewhere.
        """

    @abstractmethod
    async def read(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        """Read a batch of blocks; ``None`` for a key that is absent or failed verification."""

    @abstractmethod
    async def remove(self, keys: Sequence[bytes]) -> bool:
        """Delete blocks; keys that are not present are ignored.

        Returns False if the medium refused the delete, in which case the blocks are still held
        (and still counted in :attr:`used`).
        """

    def scan(self) -> Iterator[BlockHeader]:
        """Headers of the blocks already present when the tier opened (none for volatile tiers).

        Their payloads are not read, so their ``checksum`` is ``None``: they are for the index.
        """
        return iter(())

    def retention_records(self) -> RetentionKeeper | None:
        """Where this tier keeps the retention of its blocks across restarts (``None``: it
        does not; only persistent tiers can)."""
        return None

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters of this tier (``capacity``, ``used``, ``blocks`` and tier-specific ones)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, most tiers need nothing
        """Release resources; the tier is unusable afterwards."""


class SharedTier(Tier):
    """A tier every node of a cluster sees (:attr:`Tier.shared`): besides what every tier does,
    the batch calls that lookups and write-through need, and the bounds of the store's re-send
    queue for copies it refused. The store finds its shared tier by this capability, whatever
    the backend."""

    shared = True
    #: Blocks written through to it that it dropped (down, or refused), so far.
    writes_dropped: int = 0
    #: Most blocks / payload bytes of refused copies the store keeps to send again.
    resend_queue_blocks: int = 0
    resend_queue_bytes: int = 0
    #: (first, longest) wait in seconds between attempts to reach it again.
    reconnect_backoff_s: tuple[float, float] = (0.1, 5.0)

    @property
    def reconnects(self) -> int:
        """Times its connection was re-established after an outage."""
        return 0

    @abstractmethod
    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the tier holds a block under it (without reading the payload)."""

    @abstractmethod
    async def write_outcomes(
        self, items: Sequence[tuple[BlockHeader, Buffer]], ttl_s: float | None = None
    ) -> list[bool | None]:
        """Store several blocks in one round trip; per block ``True`` (stored), ``False``
        (refused or down: worth sending again) or ``None`` (never storable). ``ttl_s``: keep
        them at least that long (a retention a request asked for), else the tier's own."""

    @abstractmethod
    async def extend(self, keys: Sequence[bytes], ttl_s: float) -> int:
        """Keep the blocks it holds under ``keys`` at least ``ttl_s`` from now (a retained put
        of blocks already stored), never shortening a longer life; returns how many it
        lengthened."""

    async def write_many(
        self, items: Sequence[tuple[BlockHeader, Buffer]], ttl_s: float | None = None
    ) -> list[bool]:
        """Per block of :meth:`write_outcomes`, whether it was stored."""
        return [outcome is True for outcome in await self.write_outcomes(items, ttl_s)]


class SizeLedger:
    """The payload length of every block a tier holds, and the bytes they occupy together.

    For tiers that cannot ask their medium how full it is (LMDB, Redis) and count it themselves.
    A block recorded with a time to live (Redis expires it by itself, and nobody tells this node)
    is forgotten once that has passed: without it a node writing through to Redis for months
    would keep a record of every block it ever wrote (issue 41's soak).
    """

    def __init__(self, footprint: Callable[[int], int]) -> None:
        self._footprint = footprint
        self._lengths: dict[bytes, int] = {}
        # (deadline, key) of records with a time to live, soonest first; a key recorded again
        # since leaves a stale entry here, recognised by its deadline (see _expire).
        self._deadlines: list[tuple[float, bytes]] = []
        self._deadline_of: dict[bytes, float] = {}
        self._used = 0

    @property
    def used(self) -> int:
        """Bytes the recorded blocks occupy (the tier's footprint of each)."""
        self._expire()
        return self._used

    def __contains__(self, key: object) -> bool:
        return key in self._lengths

    def __len__(self) -> int:
        self._expire()
        return len(self._lengths)

    def add(self, key: bytes, length: int, ttl_s: float | None = None) -> None:
        """Record ``key`` with ``length`` payload bytes, replacing any earlier record; with
        ``ttl_s``, only for that long."""
        self._expire()
        self.discard(key)
        self._lengths[key] = length
        self._used += self._footprint(length)
        if ttl_s is not None:
            deadline = time.monotonic() + ttl_s
            self._deadline_of[key] = deadline
            heapq.heappush(self._deadlines, (deadline, key))

    def lengthen(self, key: bytes, ttl_s: float) -> None:
        """Keep ``key``'s record (if it has a time to live) at least ``ttl_s`` from now."""
        deadline = time.monotonic() + ttl_s
        if self._deadline_of.get(key, deadline) < deadline:
            self._deadline_of[key] = deadline
            heapq.heappush(self._deadlines, (deadline, key))

    def discard(self, key: bytes) -> None:
        """Forget ``key`` if recorded."""
        length = self._lengths.pop(key, None)
        if length is not None:
            self._used -= self._footprint(length)
            self._deadline_of.pop(key, None)

    def _expire(self) -> None:
        """Forget the records whose time to live has passed."""
        now = time.monotonic()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            deadline, key = heapq.heappop(deadlines)
            if self._deadline_of.get(key) == deadline:
                self.discard(key)
        if len(deadlines) > 2 * len(self._deadline_of) + 1024:
            # Keys recorded again and again (a retained prompt) leave one stale entry each.
            self._deadlines = [(d, k) for k, d in self._deadline_of.items()]
            heapq.heapify(self._deadlines)
