"""``RetentionJournal``: the store's retained blocks and their deadlines, kept on disk so that a
restart restores them (a pinned system prompt stays pinned, not plain LRU again).

The index holds each retained key's deadline in ``time.monotonic()`` seconds
(:attr:`BlockIndex.retained`); the journal mirrors it, as Unix time, into the records of the
first persistent tier that keeps them (:meth:`Tier.retention_records`: the nvme tier's
``retention/`` environment). Every change the index reports (:attr:`BlockIndex.on_retention`: a
retained put, a read that restarts a window, a block that left the store) marks its key; one
write at a time, in a worker thread, saves every key marked since the last one, so a burst of
changes is one LMDB transaction and the event loop never waits on the disk. A read that moves a
deadline by less than :data:`RESOLUTION_S` is not written again.

:meth:`RetentionJournal.restore`, at start after the index is rebuilt from the tiers, gives each
indexed key its saved deadline back (a block not on disk any more, or whose time ran out, loses
its record), capped by the store's ``max_retention_s`` from now. :meth:`RetentionJournal.close`
waits for the write under way and saves what is left, so a graceful stop loses nothing; a kill
loses at most the changes of the write then under way. A retained put copies its blocks to that
tier at once (:meth:`BlockMover.persist_keys`), so they are on disk beside their deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvstore.store.index import BlockIndex
from kvstore.tiers.base import RetentionKeeper

__all__ = ["RESOLUTION_S", "RetentionJournal"]

logger = logging.getLogger(__name__)

#: A deadline moved by less than this (a read of a retained block) is not saved again.
RESOLUTION_S = 1.0


class RetentionJournal:
    """Saves ``index``'s retention to ``records`` and restores it from them."""

    def __init__(self, index: BlockIndex, records: RetentionKeeper, max_seconds: float) -> None:
        self._index = index
        self._records = records
        self._max_seconds = max_seconds
        self._dirty: set[bytes] = set()
        #: Per key, the deadline (Unix seconds) last saved.
        self._saved: dict[bytes, float] = {}
        self._writing: asyncio.Task[None] | None = None
        self._closed = False
        #: Deadlines restored at the last :meth:`restore` (tests and the start-up log read it).
        self.restored = 0
        index.on_retention = self.changed

    def restore(self) -> int:
        """Give every indexed key its saved deadline back; returns how many (see the module
        docstring). Call once, after the index is rebuilt and before serving."""
        saved = self._records.load()
        now_wall, now_mono = time.time(), time.monotonic()
        index = self._index
        gone: list[bytes] = []
        for key, (deadline, window) in saved.items():
            left = min(deadline - now_wall, self._max_seconds)
            if key not in index.meta or left <= 0:
                gone.append(key)
                continue
            window = min(window, self._max_seconds)
            index.retained[key] = (now_mono + left, window)
            self._saved[key] = deadline
        if gone:
            self._records.write(dict.fromkeys(gone))
        self.restored = len(saved) - len(gone)
        if self.restored:
            logger.info("retention restored for %d block(s)", self.restored)
        return self.restored

    def changed(self, key: bytes) -> None:
        """The index's listener: ``key``'s retention changed (never awaits)."""
        if self._closed:
            return
        self._dirty.add(key)
        if self._writing is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # outside the loop (a synchronous test): saved at close
                return
            self._writing = loop.create_task(self._write_all(), name="retention-journal")

    def _changes(self) -> dict[bytes, tuple[float, float] | None]:
        """What the keys marked since the last write now say (``None``: forget it)."""
        dirty, self._dirty = self._dirty, set()
        offset = time.time() - time.monotonic()
        changes: dict[bytes, tuple[float, float] | None] = {}
        for key in dirty:
            window = self._index.retained.get(key)
            if window is None:
                if self._saved.pop(key, None) is not None:
                    changes[key] = None
                continue
            deadline = window[0] + offset
            saved = self._saved.get(key)
            if saved is not None and abs(deadline - saved) < RESOLUTION_S:
                continue
            self._saved[key] = deadline
            changes[key] = (deadline, window[1])
        return changes

    async def _write_all(self) -> None:
        try:
            while self._dirty:
                changes = self._changes()
                if changes and not await asyncio.to_thread(self._records.write, changes):
                    for key in changes:  # not saved: written again at its next change
                        self._saved.pop(key, None)
        except Exception:  # the deadlines stay in memory; the next change tries again
            logger.exception("saving retention records failed")
        finally:
            self._writing = None

    async def close(self) -> None:
        """Wait for the write under way, then save what is left (before the tier closes)."""
        self._closed = True
        if self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
        changes = self._changes()
        if changes:
            self._records.write(changes)
