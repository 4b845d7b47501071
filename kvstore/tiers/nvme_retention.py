"""Retention deadlines kept beside the nvme tier's blocks, so that a restart restores them.

The store retains blocks a put asked to keep (:mod:`kvstore.retention`); its index holds the
deadlines in memory, so on their own they would end with the process. :class:`RetentionRecords`
keeps them in a small LMDB environment of its own, ``retention/`` inside the nvme directory
(private like the blocks: 0700, files 0600), one record per retained key::

    key (16 bytes) -> version (u16, 1) | deadline (f64, Unix seconds) | window (f64, seconds)

A separate environment rather than a sub-database of the blocks' one: a release that reads the
blocks' environment entry by entry (every release up to this one does, at start) never meets a
record it would take for a broken block. A record in a later version (:mod:`kvstore.formats`) is
skipped and left in place; a record that does not parse is deleted. The records say nothing the
store trusts beyond eviction order: a restored deadline is capped by the store's own
``max_retention_s`` (:mod:`kvstore.store.retention_journal`), and the blocks themselves are
verified against their MAC on every read as always.
"""

from __future__ import annotations

import logging
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lmdb

from kvstore.formats import RETENTION

__all__ = ["RETENTION_MAP_BYTES", "RetentionRecords"]

logger = logging.getLogger(__name__)

#: The records' LMDB map: about 100 bytes a record in leaf pages, so some 600k retained keys.
RETENTION_MAP_BYTES = 64 * 1024**2
_RECORD = struct.Struct("<Hdd")
_VERSION = struct.Struct("<H")


class RetentionRecords:
    """The retention records of one nvme directory (see the module docstring).

    Calls block (LMDB): the store makes them from a worker thread, one at a time.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(mode=0o700, exist_ok=True)
        path.chmod(0o700)
        try:
            self._env: Any = self._open()
        except lmdb.Error as exc:
            # Deadlines are worth a restart's hits, not a node that does not start.
            logger.error("cannot open retention records at %s (%s); starting without", path, exc)
            shutil.rmtree(path)
            path.mkdir(mode=0o700)
            self._env = self._open()
        #: Records in a later version found and left in place at the last :meth:`load`.
        self.newer = 0

    def _open(self) -> Any:
        return lmdb.open(
            str(self.path),
            map_size=RETENTION_MAP_BYTES,
            subdir=True,
            sync=False,  # a power loss forgets recent deadlines: plain LRU for those blocks
            metasync=False,
            readahead=False,
            max_dbs=0,
            mode=0o600,
        )

    def write(self, changes: Mapping[bytes, tuple[float, float] | None]) -> bool:
        """Apply ``changes`` in one transaction: key → (deadline in Unix seconds, window in
        seconds), or ``None`` to forget the key. False (logged) when LMDB refuses: the
        deadlines stay in memory and a later write may succeed."""
        try:
            with self._env.begin(write=True) as txn:
                for key, record in changes.items():
                    if record is None:
                        txn.delete(key)
                    else:
                        txn.put(key, _RECORD.pack(1, *record))
        except lmdb.Error as exc:
            logger.warning("cannot save %d retention record(s): %s", len(changes), exc)
            return False
        return True

    def load(self) -> dict[bytes, tuple[float, float]]:
        """Every record this release reads: key → (deadline, window). Records that do not parse
        are deleted; records of a later version are counted in :attr:`newer` and kept."""
        found: dict[bytes, tuple[float, float]] = {}
        broken: list[bytes] = []
        self.newer = 0
        with self._env.begin(buffers=True) as txn:
            for raw_key, value in txn.cursor():
                key = bytes(raw_key)
                if len(value) >= _VERSION.size:
                    (version,) = _VERSION.unpack_from(value)
                    if RETENTION.is_newer(version):
                        self.newer += 1
                        continue
                if len(key) != 16 or len(value) != _RECORD.size:
                    broken.append(key)
                    continue
                version, deadline, window = _RECORD.unpack(value)
                if version != 1 or not (window >= 0 and deadline == deadline):  # NaN: broken
                    broken.append(key)
                    continue
                found[key] = (deadline, window)
        if broken:
            logger.warning("dropping %d unreadable retention record(s)", len(broken))
            self.write(dict.fromkeys(broken))
        return found

    def close(self) -> None:
        """Close the environment."""
        self._env.close()
