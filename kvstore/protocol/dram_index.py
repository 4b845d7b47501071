"""The dram tier's published index: where each resident block lies, readable by other processes.

A co-located client that has mapped the arena (``kvstore.server.shm``) can read a resident block
without asking the server: it looks the key up in this index, copies the bytes out of the arena,
and then checks that the index entry did not change while it copied. The server is the only
writer; clients map the index read-only (the memfd is sealed against new writable mappings).

**Layout** (little-endian). A 64-byte header, then ``buckets * ways`` slots of 64 bytes, then,
when ``flags`` has :data:`FLAG_TAGS`, one tag per slot (``buckets * ways`` u64, a bucket's
``ways`` tags side by side in one cache line)::

    header  magic:u64 version:u32 ways:u32 buckets:u64 closed:u64 flags:u64 (padding to 64)
    slot    seq:u64 key[16] namespace[16] offset:u64 length:u64 checksum:u64
    tag     the slot's first 8 key bytes (0 when empty)

The tags came after version 1 without changing it: a reader that knows nothing of them reads the
slots as before (a client and its server may be upgraded at different times), and a reader that
finds no flag (an older server) looks at every way. So did ``checksum`` (the slot's last word,
padding before): with :data:`FLAG_CHECKSUMS` (the server's ``dram.verify_reads``) it is the
payload's unseeded xxh3-64, and readers check every block they copy against it, treating one that
differs as not found (the leased path then asks the server, which verifies it again, drops it
and counts it); without the flag it is 0 and unread.

A key lives in one bucket (a hash of the key picks it) in any of its ``ways`` slots; a slot with
``length == 0`` is empty. The tags are only a hint for looking many keys up at once
(:meth:`IndexReader.present`): one cache line per key says which way to check, instead of all
``ways`` slots, and the slot itself then decides. A bucket that is full, or a block whose pages
are not one contiguous run, is simply not published: readers then take the leased path through
the server, as they do for every key they do not find here.

**Seqlock.** Each slot has a sequence number that only grows. The writer makes it odd, changes the
slot, and makes it even again. A reader takes the sequence (even, or it gives up on that key),
reads the slot, copies the block, then reads the sequence again: equal means the slot did not
change from before the copy started until after it ended. The dram tier withdraws a block from
this index *before* its pages can be freed (:meth:`DramTier._forget`), so an unchanged sequence
proves the pages still held that block during the whole copy, and the bytes are right. A changed
one sends the key down the leased path, which never sees a block change under it.

The argument relies on loads not passing older loads and stores not passing older stores, which
x86-64 guarantees (TSO) and Python cannot enforce with barriers elsewhere; readers therefore use
this index only on x86-64 (:data:`DIRECT_READS_SUPPORTED`) and take the leased path everywhere else.
The one kind of store x86 does reorder, the non-temporal stores a large ``memcpy`` uses, cannot
overtake a withdraw either: between the sequence bump and any rewrite of those pages there is a
locked instruction (numpy's copy releases the GIL; a client writing reserved pages learned of them
through socket system calls), and locked instructions order all stores.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import platform
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvstore.keys import KEY_BYTES, NAMESPACE_BYTES

__all__ = ["DIRECT_READS_SUPPORTED", "IndexReader", "IndexWriter", "SlotHit", "payload_checksum"]

MAGIC = 0x4B56_5354_4958_0001  # "KVSTIX" + 1
VERSION = 1
#: ``flags`` bit: the tags follow the slots.
FLAG_TAGS = 1
#: ``flags`` bit: each slot carries its payload's checksum, and readers must check it.
FLAG_CHECKSUMS = 2
HEADER_BYTES = 64
SLOT_BYTES = 64
WAYS = 8
#: At most this many slots (64 MiB of index); an arena with more pages publishes what fits.
MAX_SLOTS = 1 << 20
MIN_SLOTS = 64

_HEADER = struct.Struct("<QIIQQQ")
_CLOSED_AT = 24  # byte offset of ``closed`` in the header
_FIELDS = struct.Struct(f"<{KEY_BYTES}s{NAMESPACE_BYTES}sQQQ")  # the slot after its seq
# The slot as 8 u64 words for whole-table numpy work: seq, key (2), namespace (2), offset, length,
# checksum.
_WORDS = SLOT_BYTES // 8
_U64 = 8
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E37_79B9_7F4A_7C15
_MIX = 0xC2B2_AE3D_27D4_EB4F

# F_SEAL_FUTURE_WRITE (Linux 5.1): no new writable mapping; the server's own one keeps working.
_SEAL_FUTURE_WRITE = 0x0010

#: Whether this CPU's memory ordering makes the seqlock above sound without explicit barriers.
DIRECT_READS_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")

#: ``(slot, seq, offset, length, checksum)`` of a published block, as :meth:`IndexReader.find`
#: saw it (``checksum`` 0 where the index carries none).
SlotHit = tuple[int, int, int, int, int]


def payload_checksum(parts: Sequence[Any]) -> int:
    """The checksum the index publishes for a block's bytes (``parts``, concatenated): xxh3-64
    with no seed, so that clients can compute it (the server's own seeded checksum stays secret,
    :mod:`kvstore.block`)."""
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest()


def _bucket(key: bytes, buckets: int) -> int:
    """The bucket of ``key``: both halves mixed (keys need not be random), Fibonacci-hashed."""
    low, high = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")
    mixed = (low + high * _MIX) & _MASK64
    return ((mixed * _GOLDEN) & _MASK64) >> (64 - buckets.bit_length() + 1)


def _slot_count(max_blocks: int) -> int:
    wanted = max(MIN_SLOTS, min(MAX_SLOTS, max_blocks))
    return 1 << (wanted - 1).bit_length()


class IndexWriter:
    """The server's side: publishes and withdraws blocks (single-threaded, like the store).

    ``checksums``: publish each block's checksum (:func:`payload_checksum`) for readers to check.
    """

    def __init__(self, max_blocks: int, *, checksums: bool = False) -> None:
        self.checksums = checksums
        slots = _slot_count(max_blocks)
        self.ways = WAYS
        self.buckets = slots // WAYS
        self._tags_at = HEADER_BYTES + slots * SLOT_BYTES
        self.size = self._tags_at + slots * _U64
        self.fd = os.memfd_create("kvstore-dram-index", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self._mapping = mmap.mmap(self.fd, self.size)
            _seal(self.fd)
        except BaseException:
            os.close(self.fd)
            raise
        flags = FLAG_TAGS | (FLAG_CHECKSUMS if checksums else 0)
        _HEADER.pack_into(self._mapping, 0, MAGIC, VERSION, self.ways, self.buckets, 0, flags)
        self._seqs = np.frombuffer(self._mapping, dtype=np.uint64)
        self._slot_of: dict[bytes, int] = {}
        self._used = bytearray(slots)
        self.overflows = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def publish(
        self, key: bytes, namespace: bytes, offset: int, length: int, checksum: int = 0
    ) -> bool:
        """Make ``key``'s single run of arena bytes findable; False if its bucket is full.
        ``checksum``: :func:`payload_checksum` of those bytes, where :attr:`checksums`."""
        if len(key) != KEY_BYTES or len(namespace) != NAMESPACE_BYTES:
            # Checked before a sequence turns odd: a failed write would leave its slot odd.
            raise ValueError("the index holds 16-byte keys under 16-byte namespaces")
        self.withdraw(key)
        first = _bucket(key, self.buckets) * self.ways
        for slot in range(first, first + self.ways):
            if not self._used[slot]:
                break
        else:
            self.overflows += 1
            return False
        self._used[slot] = 1
        self._slot_of[key] = slot
        self._write(slot, key, namespace, offset, length, checksum)
        return True

    def withdraw(self, key: bytes) -> None:
        """Make ``key`` unfindable; call before its pages may be freed or reused."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._write(slot, bytes(KEY_BYTES), bytes(NAMESPACE_BYTES), 0, 0, 0)
            self._used[slot] = 0

    def _write(
        self, slot: int, key: bytes, namespace: bytes, offset: int, length: int, checksum: int
    ) -> None:
        at = HEADER_BYTES + slot * SLOT_BYTES
        seq = at // _U64
        self._seqs[seq] += 1  # odd: readers keep off
        _FIELDS.pack_into(self._mapping, at + _U64, key, namespace, offset, length, checksum)
        self._mapping[self._tags_at + slot * _U64 : self._tags_at + (slot + 1) * _U64] = key[:_U64]
        self._seqs[seq] += 1

    def close(self) -> None:
        """Tell readers the index is gone (they stop reading it), then release it."""
        if self.fd < 0:
            return
        struct.pack_into("<Q", self._mapping, _CLOSED_AT, 1)
        self._slot_of.clear()
        self._seqs = np.empty(0, dtype=np.uint64)
        with contextlib.suppress(BufferError):  # an exported view: unmapped at exit instead
            self._mapping.close()
        os.close(self.fd)
        self.fd = -1


def _seal(fd: int) -> None:
    """Forbid resizing the index, mapping it writable again (clients only ever read it) and
    adding seals later (a client could otherwise seal it against the server)."""
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | _SEAL_FUTURE_WRITE)
    except OSError:  # a kernel before 5.1: still sealed against resizing
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)


class IndexReader:
    """A client's read-only view of a server's :class:`IndexWriter`."""

    def __init__(self, fd: int, size: int) -> None:
        self._mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        magic, version, ways, buckets, _, flags = _HEADER.unpack_from(self._mapping, 0)
        slots = ways * buckets
        tagged = bool(flags & FLAG_TAGS)
        fits = HEADER_BYTES + slots * (SLOT_BYTES + (_U64 if tagged else 0)) <= size
        if magic != MAGIC or version != VERSION or not fits:
            self._mapping.close()
            raise ValueError("not a kvstore dram index of this version")
        self.ways = ways
        self.buckets = buckets
        self.closed = False
        #: Whether every block copied through this index must match its slot's checksum.
        self.checksums = bool(flags & FLAG_CHECKSUMS)
        self._seqs = np.frombuffer(self._mapping, dtype=np.uint64)
        # The slots as 64-bit words, indexed (bucket, way, word), and the tags, indexed (bucket,
        # way), for :meth:`present`.
        self._table = np.frombuffer(
            self._mapping, dtype="<u8", count=slots * _WORDS, offset=HEADER_BYTES
        ).reshape(buckets, ways, _WORDS)
        self._tags = (
            np.frombuffer(
                self._mapping, dtype="<u8", count=slots, offset=HEADER_BYTES + slots * SLOT_BYTES
            ).reshape(buckets, ways)
            if tagged
            else None
        )

    @property
    def open(self) -> bool:
        """False once the server has closed the index (it is shutting down) or this reader was."""
        return not self.closed and not self._seqs[_CLOSED_AT // _U64]

    def find(self, key: bytes, namespace: bytes) -> SlotHit | None:
        """Where ``key`` was published, or ``None`` (absent, mid-update, or another namespace).

        What this returns may be torn or already stale: use it only bounded by the arena's size,
        and trust what was copied only if :meth:`unchanged` says so afterwards.
        """
        first = _bucket(key, self.buckets) * self.ways
        seqs = self._seqs
        for slot in range(first, first + self.ways):
            at = HEADER_BYTES + slot * SLOT_BYTES
            seq = int(seqs[at // _U64])
            if seq & 1:
                continue
            found, namespace_found, offset, length, checksum = _FIELDS.unpack_from(
                self._mapping, at + _U64
            )
            if found == key and length:
                hit = (slot, seq, offset, length, checksum)
                return hit if namespace_found == namespace else None
        return None

    def present(self, keys: Sequence[bytes], namespace: bytes) -> np.ndarray[Any, Any]:
        """Which of ``keys`` are published under ``namespace`` (bools; all keys at once).

        A snapshot that can be stale as soon as it is taken, and a slot in the middle of an
        update counts as absent: good for a lookup, which is a hint anyway, never for a read.
        """
        wanted = np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2)
        mixed = wanted[:, 0] + wanted[:, 1] * np.uint64(_MIX)  # wraps like the & _MASK64
        shift = np.uint64(64 - self.buckets.bit_length() + 1)
        hashed = (mixed * np.uint64(_GOLDEN)) >> shift if shift < 64 else mixed * 0
        buckets = hashed.astype(np.intp)
        if self._tags is None:
            return self._scan(namespace, wanted, buckets)
        # The tags pick each key's way (one cache line per key; reading all of a bucket's slots
        # touches eight), then that slot alone decides, as in find(): the whole key, published,
        # not mid-update, and our namespace. A stale tag can only make a key look absent.
        tagged = self._tags[buckets] == wanted[:, 0, None]  # (keys, ways)
        way = tagged.argmax(axis=1)
        found: np.ndarray[Any, Any] = tagged[np.arange(len(buckets)), way] & self._decides(
            self._table[buckets, way], wanted, namespace
        )
        # A tag shared by two ways (keys alike in their first 8 bytes, or a key starting with 8
        # zero bytes, like every empty slot's tag): the first of them may be the wrong slot.
        for ambiguous in np.flatnonzero(np.count_nonzero(tagged, axis=1) > 1).tolist():
            found[ambiguous] = self.find(keys[ambiguous], namespace) is not None
        return found

    def _scan(
        self, namespace: bytes, wanted: np.ndarray[Any, Any], buckets: np.ndarray[Any, Any]
    ) -> np.ndarray[Any, Any]:
        """:meth:`present` without tags (an older server): every way of each key's bucket."""
        table = self._table
        live = table[buckets, :, 1] == wanted[:, 0, None]
        live &= table[buckets, :, 2] == wanted[:, 1, None]
        live &= table[buckets, :, 6] != 0  # length
        live &= (table[buckets, :, 0] & np.uint64(1)) == 0  # seq: not mid-update
        way = live.argmax(axis=1)
        found: np.ndarray[Any, Any] = live[np.arange(len(buckets)), way] & self._decides(
            table[buckets, way], wanted, namespace
        )
        return found

    @staticmethod
    def _decides(
        slot: np.ndarray[Any, Any], wanted: np.ndarray[Any, Any], namespace: bytes
    ) -> np.ndarray[Any, Any]:
        """Whether each key's deciding slot (``(keys, words)``) holds it as find() would."""
        return (  # type: ignore[no-any-return]
            (slot[:, 1] == wanted[:, 0])
            & (slot[:, 2] == wanted[:, 1])
            & IndexReader._published_in(slot, namespace)
        )

    @staticmethod
    def _published_in(slot: np.ndarray[Any, Any], namespace: bytes) -> np.ndarray[Any, Any]:
        """Whether each slot (``(slots, words)``) holds a block of ``namespace``: not empty,
        not mid-update."""
        ours = np.frombuffer(namespace, dtype="<u8")
        return (  # type: ignore[no-any-return]
            (slot[:, 3] == ours[0])
            & (slot[:, 4] == ours[1])
            & (slot[:, 6] != 0)  # length
            & ((slot[:, 0] & np.uint64(1)) == 0)  # seq: not mid-update
        )

    def published(self, namespace: bytes) -> np.ndarray[Any, Any]:
        """``(offset, length)`` rows (``uint64``) of every block published under ``namespace``.

        A snapshot like :meth:`present`'s, for hints only (a client faulting those pages in
        ahead of its reads): a row can be torn or stale, so bound it by the arena's size.
        """
        table = self._table.reshape(-1, _WORDS)
        rows: np.ndarray[Any, Any] = table[self._published_in(table, namespace)][:, 5:7].copy()
        return rows

    def intact(self, hit: SlotHit, copied: Sequence[Any]) -> bool:
        """Whether ``copied`` (the block's bytes as read, in parts) matches ``hit``'s checksum;
        always True where the index carries none. Check :meth:`unchanged` as well: a slot
        rewritten meanwhile makes any comparison meaningless."""
        return not self.checksums or payload_checksum(copied) == hit[4]

    def unchanged(self, hit: SlotHit) -> bool:
        """Whether the slot ``hit`` came from has not changed since :meth:`find` read it."""
        slot, seq = hit[0], hit[1]
        return int(self._seqs[(HEADER_BYTES + slot * SLOT_BYTES) // _U64]) == seq

    def close(self) -> None:
        """Stop using the index; the mapping goes with the last reference to this reader.

        Not unmapped here: another thread may be in :meth:`find` right now, and reading an
        unmapped page would crash the process.
        """
        self.closed = True
