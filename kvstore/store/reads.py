"""``BlockReader``: reads that serve blocks (``get``) or bring them into the arena (``promote``).

Both find each key in the fastest tier holding it, read one batch per tier, fastest first, and
ask the shared tier (one batched read) for keys this node does not index; :meth:`_read_found`
is that common walk. They differ in what they do with a block found below: a get returns it at
once and promotes it upward in the background; a promote copies it into the arena and waits.

With a remote source (:mod:`.remote`, the cluster's peers), keys this node does not index are
asked of it first, and what it does not serve goes on to the shared tier; a block it serves is
placed here like a promotion (checksummed anew on the way into the host tier). A promotion lets
the source receive blocks straight into reserved host-tier pages (:mod:`.landing`), which then
become blocks where they lie, with no copy.

**Sealed gets.** A get for another node (peer fetch) asks for each block *sealed*: its packed wire
header with the keyed MAC beside the payload (:meth:`~kvstore.block.BlockHeader.seal`, which
checks the payload against the checksum recorded at put first, so bytes changed in the arena are
never signed; a block that fails is a ``corrupt`` miss). The payloads of a get are copies, so the
seal covers exactly the bytes that are sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal

from kvstore.block import BlockHeader, CorruptBlockError, Keyring
from kvstore.store.background import BackgroundTasks
from kvstore.store.counters import StoreCounters
from kvstore.store.index import BlockIndex, Whereabouts
from kvstore.store.landing import ArenaLanding
from kvstore.store.layout import TierStack
from kvstore.store.mover import BlockMover
from kvstore.store.remote import RemoteSource
from kvstore.tiers.base import Buffer, StoredBlock, Tier
from kvstore.tiers.dram import DramTier

__all__ = ["BlockReader", "GetResult", "Promotion"]

logger = logging.getLogger(__name__)

Promotion = Literal["ready", "missing", "failed"]
"""What :meth:`TieredStore.promote` did with one key."""


@dataclass(frozen=True, slots=True)
class GetResult:
    """One key's answer to a get: the payload and the tier it came from, or a miss; for a sealed
    get, the packed wire header (keyed MAC) that goes with the payload."""

    payload: bytes | memoryview | None
    tier: str = ""
    sealed_header: bytes | None = None

    @property
    def found(self) -> bool:
        """True for a hit."""
        return self.payload is not None


class BlockReader:
    """Serves gets and promotions into the arena tier from the tiers, via the index."""

    def __init__(
        self,
        stack: TierStack,
        index: BlockIndex,
        counters: StoreCounters,
        mover: BlockMover,
        tasks: BackgroundTasks,
    ) -> None:
        self._stack = stack
        self._index = index
        self._counters = counters
        self._mover = mover
        self._tasks = tasks
        #: Where keys this node does not index are read first (``None``: nowhere but Redis).
        self.remote: RemoteSource | None = None

    async def get(
        self, keys: Sequence[bytes], namespace: bytes, seal_with: Keyring | None = None
    ) -> list[GetResult]:
        """Each key's payload and the tier that served it (see :meth:`TieredStore.get`); with
        ``seal_with``, each hit sealed under that keyring."""
        results = [GetResult(None)] * len(keys)
        headers: dict[int, BlockHeader] = {}
        where = self._index.locate(keys, namespace)
        if where.mismatched:
            self._counters.add("namespace_mismatches", where.mismatched)
        shared_level = self._stack.shared_level
        reasons: dict[int, str] = {}
        counters = self._counters
        where, remote_found = await self._read_remote(keys, namespace, where, reasons)
        for index, payload in remote_found:
            name = self.remote.name if self.remote is not None else ""
            results[index] = GetResult(payload, name)
            counters.tier_hits[name] += 1
            counters.read_bytes[name] += len(payload)
            self._tasks.spawn(self._place_remote(keys[index], namespace, payload))
        async for index, level, block, epoch in self._read_found(keys, namespace, where, reasons):
            tier = self._stack[level].name
            results[index] = GetResult(block.payload, tier)
            headers[index] = block.header
            counters.tier_hits[tier] += 1
            counters.read_bytes[tier] += block.header.length
            if level != shared_level:
                self._index.count_hit(keys[index])
            if level > 0:  # returned now, promoted in the background
                self._tasks.spawn(
                    self._mover.promote_hit(block.header, block.payload, level, epoch)
                )
        if seal_with is not None:
            await self._seal(keys, namespace, results, headers, seal_with, reasons)
        self._index.age_chain(
            [key for key, result in zip(keys, results, strict=True) if result.found]
        )
        missed = [index for index, result in enumerate(results) if not result.found]
        found = len(keys) - len(missed)
        if missed:
            counters.count_misses(keys, missed, reasons, self._index)
        self._counters.add("gets")
        self._counters.add("hits", found)
        self._counters.add("misses", len(keys) - found)
        return results

    async def _seal(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        results: list[GetResult],
        headers: dict[int, BlockHeader],
        keyring: Keyring,
        reasons: dict[int, str],
    ) -> None:
        """Seal each hit of ``results`` in place (off the event loop: a MAC per block not read
        with one); a payload that no longer matches its checksum becomes a ``corrupt`` miss."""
        found = [index for index, result in enumerate(results) if result.payload is not None]
        if not found:
            return
        items = [(keys[i], headers.get(i), results[i].payload) for i in found]
        sealed = await asyncio.to_thread(_seal_all, items, namespace, keyring)
        for index, header in zip(found, sealed, strict=True):
            result = results[index]
            if header is not None:
                results[index] = dataclasses.replace(result, sealed_header=header)
                continue
            logger.error("refusing to seal block %s: changed since its put", keys[index].hex())
            assert result.payload is not None
            self._counters.tier_hits[result.tier] -= 1
            self._counters.read_bytes[result.tier] -= len(result.payload)
            results[index] = GetResult(None)
            reasons[index] = "corrupt"

    async def promote(
        self, keys: Sequence[bytes], namespace: bytes, reasons: dict[int, str] | None = None
    ) -> list[Promotion]:
        """Bring each key into the arena tier now (see :meth:`TieredStore.promote`); ``reasons``
        gets why a key read below was not found (see :meth:`_read_found`)."""
        host = self._stack.host_level
        outcomes: list[Promotion] = ["missing"] * len(keys)
        where = self._index.locate(keys, namespace, resident=host)
        for index in where.resident:
            outcomes[index] = "ready"
            self._index.levels[host].touch(keys[index])
        landing = self._landing()
        try:
            where, remote_found = await self._read_remote(keys, namespace, where, reasons, landing)
            for index, payload in remote_found:
                if landing is not None and landing.holds(keys[index], payload):
                    placed = await landing.install(keys[index], namespace)  # received in place
                else:
                    placed = await self._place_remote(keys[index], namespace, payload)
                outcomes[index] = "ready" if placed else "failed"
        finally:
            if landing is not None:
                landing.close()
        async for index, level, block, epoch in self._read_found(keys, namespace, where, reasons):
            promoted = await self._mover.copy_into(block.header, block.payload, level, host, epoch)
            outcomes[index] = "ready" if promoted else "failed"
        return outcomes

    async def _read_remote(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        where: Whereabouts,
        reasons: dict[int, str] | None,
        landing: ArenaLanding | None = None,
    ) -> tuple[Whereabouts, list[tuple[int, bytes]]]:
        """Ask the remote source for the keys of ``where`` not indexed here: ``where`` less the
        keys it served (the shared tier is asked for the rest), and ``(index, payload)`` per key
        served. Without a source (or nothing unindexed) ``where`` is returned as it is."""
        remote, unindexed = self.remote, where.unindexed
        if remote is None or not unindexed:
            return where, []
        wanted = [keys[index] for index in unindexed]
        started = time.perf_counter()
        payloads, why = await remote.read(wanted, namespace, landing)
        size = sum(len(payload) for payload in payloads if payload is not None)
        self._counters.time_read(remote.name, size, time.perf_counter() - started)
        found: list[tuple[int, bytes]] = []
        left: list[int] = []
        for position, (index, payload) in enumerate(zip(unindexed, payloads, strict=True)):
            if payload is None:
                left.append(index)
                if reasons is not None and position in why:
                    reasons[index] = why[position]
            else:
                found.append((index, payload))
        return dataclasses.replace(where, unindexed=left), found

    def _landing(self) -> ArenaLanding | None:
        """Host-tier pages for a remote source to receive into, if the host tier is an arena."""
        top = self._stack[self._stack.host_level]
        if self.remote is None or not isinstance(top, DramTier) or not top.capacity:
            return None
        return ArenaLanding(top, self._stack, self._index, self._counters, self._mover)

    async def _place_remote(self, key: bytes, namespace: bytes, payload: bytes) -> bool:
        """Store a block a remote source served into the host tier (or below), like a
        promotion; True if it is held here now."""
        mover, index, stack = self._mover, self._index, self._stack
        async with mover.lock:
            if key in index:  # stored or fetched meanwhile
                return index.meta[key].namespace == namespace
            header = BlockHeader.for_payload(key, namespace, payload)
            placed = await mover.place_promotion(
                header, memoryview(payload), stack.host_level, stack.local_levels
            )
            return placed is not None

    async def _read_found(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        where: Whereabouts,
        reasons: dict[int, str] | None = None,
    ) -> AsyncIterator[tuple[int, int, StoredBlock, int]]:
        """Read the keys of ``where`` one batch per tier, fastest first, then the unindexed ones
        from the shared tier; yield ``(index, level, block, epoch)`` per block found under
        ``namespace`` (``epoch``: the mover's delete epoch when that batch was read).

        A block a local tier no longer has (vanished, or failed verification and was dropped) is
        forgotten there. ``reasons`` (when given) gets, by index, why a key read was not found:
        ``corrupt`` (as many as the tier's ``corrupt_blocks`` rose by in that read), ``tier_down``
        (the shared tier is down), ``evicted`` (a local tier no longer had it), ``namespace``.
        """
        by_level = where.by_level
        shared_level = self._stack.shared_level
        if where.unindexed and shared_level is not None:
            by_level = {**by_level, shared_level: where.unindexed}
        for level in sorted(by_level):
            indices = by_level[level]
            epoch = self._mover.delete_epoch
            tier = self._stack[level]
            corrupt_before = tier.corrupt_blocks
            started = time.perf_counter()
            blocks = await tier.read([keys[index] for index in indices])
            # Measured for the connector's load-or-recompute decision (kvstore.client.cost_model).
            size = sum(block.header.length for block in blocks if block is not None)
            self._counters.time_read(tier.name, size, time.perf_counter() - started)
            corrupt = tier.corrupt_blocks - corrupt_before
            for index, block in zip(indices, blocks, strict=True):
                if block is None:
                    if level != shared_level:
                        self._index.forget_in(level, keys[index])
                    why = _why_missing(level != shared_level, tier, corrupt > 0)
                    corrupt -= 1
                    if reasons is not None and why is not None:
                        reasons[index] = why
                    continue
                if block.header.namespace != namespace:
                    self._counters.add("namespace_mismatches")
                    if reasons is not None:
                        reasons[index] = "namespace"
                    continue
                yield index, level, block, epoch


def _seal_all(
    items: Sequence[tuple[bytes, BlockHeader | None, Buffer | None]],
    namespace: bytes,
    keyring: Keyring,
) -> list[bytes | None]:
    """The sealed header of each ``(key, header, payload)``, ``None`` where the payload fails
    its header's checksum. A payload without a header (a peer's, verified by its MAC on arrival
    and never in the arena since) is sealed as it is: with the seal the keyring remembers from
    that verification, found by a fresh checksum, or signed anew."""
    sealed: list[bytes | None] = []
    for key, header, payload in items:
        assert payload is not None
        if header is None:
            header = BlockHeader.for_payload(key, namespace, payload)
        try:
            sealed.append(header.seal(payload, keyring))
        except CorruptBlockError:
            sealed.append(None)
    return sealed


def _why_missing(local: bool, tier: Tier, corrupt: bool) -> str | None:
    """Why a tier read found nothing; ``None`` (decided by the caller: absent or evicted) for a
    shared tier that is up and simply lacks the key."""
    if corrupt:
        return "corrupt"
    if local:
        return "evicted"  # indexed here, gone from the medium
    return None if tier.up else "tier_down"
