"""The ``nvme`` tier: an LMDB environment on local disk that survives restarts.

Each block is one LMDB value, ``header ‖ payload`` (see :mod:`kvstore.block`), under its 16-byte
key. Every read verifies the header and its keyed MAC; a value that fails (rotted on disk, written
into the file by someone without the integrity secret, or in the old unkeyed format) is deleted,
counted in ``corrupt_blocks`` and reported as a miss, so such bytes are never returned. A value in
a header version newer than this release reads (left by a later release before a downgrade:
:mod:`kvstore.formats`) is neither indexed nor deleted, counted in ``newer_format_blocks``: the
upgrade back finds it where it was. The
directory is created private (0700) and LMDB's files 0600: other users of the machine can neither
read cached payloads nor write blocks.

The MAC is computed here, in the tier's worker thread, when a block is written (after checking the
payload against the checksum it was put with), and verified there on reads: an LMDB-only store
signs every put, off the event loop.

Capacity is enforced twice: the tier counts the pages its values occupy against ``capacity`` (so
the store evicts before LMDB fills up), and an LMDB ``MapFullError`` (B-tree pages, free pages held
by readers) makes :meth:`write` return False so that the store evicts more, never an error to the
client. Other disk errors (a full file system, I/O errors) are counted in ``write_errors`` and the
block is simply not kept here.

LMDB calls block, so they run on a small thread pool; bookkeeping stays on the event loop thread.
Commits are not fsynced (``sync=False``): a killed process loses nothing that was committed, and a
power loss can lose recent blocks, which for a cache is a miss, not an error.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lmdb

from kvstore.block import HEADER_BYTES, BlockHeader, CorruptBlockError, WireHeader, decode_value
from kvstore.buffers import byte_view
from kvstore.formats import NewerFormatError
from kvstore.keys import KEY_BYTES
from kvstore.tiers.base import Buffer, RetentionKeeper, SizeLedger, StoredBlock, Tier
from kvstore.tiers.dir_lock import DirLock
from kvstore.tiers.nvme_retention import RetentionRecords

__all__ = ["NvmeTier", "private_directory"]

logger = logging.getLogger(__name__)

_LMDB_PAGE = 4096
# Head-room kept free of blocks for LMDB's own pages: B-tree and free-list pages, and pages freed
# by recent transactions, which LMDB reuses only once no reader can still see them. Deletes need
# pages too, so a map filled to the brim could not even free space.
_HEADROOM_FRACTION = 0.2
_MIN_HEADROOM = 256 * 1024


def private_directory(path: Path) -> None:
    """Create ``path`` with mode 0700, and each missing parent with it too (``mkdir -p`` would
    give parents the umask's mode: a tenants' root listable by all), or make an existing
    ``path`` 0700. Parents that already exist are left as they are."""
    missing = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        # Another process may make it meanwhile; what matters is the mode it ends up with.
        directory.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_mode & 0o077:
        logger.warning("making nvme directory %s private (mode 0700)", path)
        path.chmod(0o700)


class NvmeTier(Tier):
    """Blocks as authenticated (MAC-carrying) values in an LMDB environment."""

    name = "nvme"
    persistent = True

    def __init__(self, path: str | Path, capacity: int, io_threads: int = 2) -> None:
        self.path = Path(path)
        self.map_size = capacity
        headroom = max(int(capacity * _HEADROOM_FRACTION), min(_MIN_HEADROOM, capacity // 2))
        self.capacity = capacity - headroom
        self._ledger = SizeLedger(self.footprint)
        self.corrupt_blocks = 0
        #: Values in a header version newer than this release reads, found and left in place.
        self.newer_format_blocks = 0
        self.write_errors = 0
        self.read_errors = 0
        self.delete_errors = 0
        self._executor = ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix="kvstore-nvme"
        )
        self._env = self._open()
        # Beside the blocks, under the same directory lock (kvstore.tiers.nvme_retention).
        self._retention = RetentionRecords(self.path / "retention")

    def _open(self) -> Any:
        private_directory(self.path)
        # Before LMDB opens: a directory another live server uses is refused, not shared.
        self._lock = DirLock.acquire(self.path)
        try:
            return self._open_env()
        except lmdb.Error as exc:
            # An unreadable environment must not stop the node from serving: keep it for
            # inspection and start empty.
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            logger.error("cannot open LMDB at %s (%s); moving it to %s", self.path, exc, aside)
            self._lock.release()
            shutil.move(str(self.path), str(aside))
            private_directory(self.path)
            self._lock = DirLock.acquire(self.path)
            return self._open_env()

    def _open_env(self) -> Any:
        return lmdb.open(
            str(self.path),
            map_size=self.map_size,
            sync=False,
            metasync=False,
            readahead=False,
            # meminit stays on: without it LMDB writes uninitialised heap (other tenants'
            # payloads) into the slack of pages on disk.
            max_readers=256,
            mode=0o600,  # data.mdb and lock.mdb: cached payloads are private to this user
        )

    def footprint(self, length: int) -> int:
        """LMDB overflow pages for ``header ‖ payload`` plus the leaf entry."""
        return -(-(HEADER_BYTES + length + KEY_BYTES + 16) // _LMDB_PAGE) * _LMDB_PAGE

    @property
    def used(self) -> int:
        """Bytes of LMDB pages the stored values occupy (estimated from their sizes)."""
        return self._ledger.used

    def __contains__(self, key: bytes) -> bool:
        return key in self._ledger

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def write(self, header: BlockHeader, payload: Buffer) -> bool:
        """Commit one block; False when LMDB's map is full or the disk refuses the write.

        Also False, counted in ``corrupt_blocks``, when the payload no longer matches the
        checksum it was put with: such bytes are never signed.
        """
        try:
            await self._run(self._put, header, payload)
        except lmdb.MapFullError:
            return False
        except CorruptBlockError as exc:
            self.corrupt_blocks += 1
            logger.error("refusing to store block %s on nvme: %s", header.key.hex(), exc)
            return False
        except lmdb.Error as exc:
            self.write_errors += 1
            logger.warning("nvme write of %s failed: %s", header.key.hex(), exc)
            return False
        self._ledger.add(header.key, header.length)
        return True

    def _put(self, header: BlockHeader, payload: Buffer) -> None:
        # In the worker thread: the MAC (the costly part of a write) stays off the event loop.
        # The copy is what gets checked and signed, so bytes changing meanwhile (a shared
        # buffer) cannot slip between the check and the write.
        data = bytes(byte_view(payload))
        value = header.seal(data, self.keyring) + data
        with self._env.begin(write=True) as txn:
            txn.put(header.key, value)

    async def read(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        """Read and verify a batch in one read transaction; corrupt values become misses."""
        try:
            blocks, corrupt, newer = await self._run(self._get_many, list(keys))
        except lmdb.Error as exc:
            self.read_errors += 1
            logger.warning("nvme read failed: %s", exc)
            return [None] * len(keys)
        self.newer_format_blocks += newer
        if corrupt:
            corrupt = sorted(set(corrupt))  # a key asked for twice is still one bad block
            self.corrupt_blocks += len(corrupt)
            logger.error("dropping %d corrupt nvme block(s): %s", len(corrupt), corrupt)
            await self.remove([bytes.fromhex(key) for key in corrupt])
        return blocks  # type: ignore[no-any-return]

    def _get_many(self, keys: list[bytes]) -> tuple[list[StoredBlock | None], list[str], int]:
        blocks: list[StoredBlock | None] = []
        corrupt: list[str] = []
        newer = 0
        with self._env.begin(buffers=True) as txn:
            for key in keys:
                value = txn.get(key)
                if value is None:
                    blocks.append(None)
                    continue
                try:
                    header, payload = decode_value(key, value, self.keyring)
                except NewerFormatError:
                    newer += 1  # a later release's block: a miss, kept for it
                    blocks.append(None)
                    continue
                except CorruptBlockError:
                    corrupt.append(key.hex())
                    blocks.append(None)
                    continue
                blocks.append(StoredBlock(header, bytes(payload)))
        return blocks, corrupt, newer

    async def remove(self, keys: Sequence[bytes]) -> bool:
        """Delete values; keys that are absent are ignored."""
        try:
            await self._run(self._delete_many, list(keys))
        except lmdb.Error as exc:
            # The values are still on disk: keep counting their space, and say so.
            self.delete_errors += 1
            logger.warning("nvme delete of %d block(s) failed: %s", len(keys), exc)
            return False
        for key in keys:
            self._ledger.discard(key)
        return True

    def _delete_many(self, keys: list[bytes]) -> None:
        with self._env.begin(write=True) as txn:
            for key in keys:
                txn.delete(key)

    def scan(self) -> Iterator[BlockHeader]:
        """Headers of the blocks on disk; values with a broken header are deleted on the way,
        values in a newer header version skipped (left on disk, not indexed)."""
        broken: list[bytes] = []
        newer = 0
        headers: list[BlockHeader] = []
        started = time.monotonic()
        # A big directory takes a while to read: say so before, and how long it took after.
        logger.info(
            "reading the block index of %s (%d entries)...", self.path, self._env.stat()["entries"]
        )
        with self._env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                key = bytes(key)
                try:
                    wire = WireHeader.unpack(value[:HEADER_BYTES])
                    if wire.key != key or len(value) != HEADER_BYTES + wire.length:
                        raise CorruptBlockError("header does not match the stored value")
                except NewerFormatError:
                    newer += 1
                    continue
                except CorruptBlockError:
                    broken.append(key)
                    continue
                # Only indexed: the payload (and its MAC) is read, and checked, on first read.
                headers.append(BlockHeader(wire.key, wire.namespace, wire.length, None))
        if broken:
            self.corrupt_blocks += len(broken)
            logger.error("dropping %d nvme value(s) with a broken header", len(broken))
            self._delete_many(broken)
        if newer:
            self.newer_format_blocks += newer
            logger.warning(
                "leaving %d nvme value(s) written by a later release in place (not indexed)", newer
            )
        for header in headers:
            self._ledger.add(header.key, header.length)
        logger.info(
            "read the index of %d block(s) in %.1fs from %s",
            len(headers),
            time.monotonic() - started,
            self.path,
        )
        return iter(headers)

    def retention_records(self) -> RetentionKeeper:
        """The retention records kept beside the blocks (:mod:`kvstore.tiers.nvme_retention`)."""
        return self._retention

    def stats(self) -> dict[str, int]:
        """Capacity, usage, blocks and error counters."""
        return {
            "capacity": self.capacity,
            "used": self._ledger.used,
            "blocks": len(self._ledger),
            "corrupt_blocks": self.corrupt_blocks,
            "newer_format_blocks": self.newer_format_blocks,
            "write_errors": self.write_errors,
            "read_errors": self.read_errors,
            "delete_errors": self.delete_errors,
            "map_size": self.map_size,
        }

    async def close(self) -> None:
        """Wait for pending LMDB calls, then close the environment."""
        self._executor.shutdown(wait=True)
        self._env.close()
        self._retention.close()
        self._lock.release()
