"""The shared-memory requests' and replies' bodies: packed on one side, read on the other.

:mod:`kvstore.protocol.shm_frames` draws the frame (``length:u32 | code:u8 | body``) and the
table of every op's body; this module holds the codec of each body with more than a list of keys
or ids in it, so that the server and the client write and read one layout each, from here
(``pack_reserve`` / ``read_reserve`` for a request, ``pack_reserve_reply`` /
``read_reserve_reply`` for its reply, and so on):

=============  ===========================================  ========================================
op             request                                      reply
=============  ===========================================  ========================================
LOOKUP         keys                                         hits:u32, tier code:u8 per key
ACQUIRE        keys                                         per key an :class:`AcquireSlot`
RESERVE        keys, lengths:u64*n, retention               per key a :class:`ReserveSlot`
COMMIT         ids, retention                               stored:u32 already_present:u32
                                                            dropped:u32 (:class:`CommitCounts`)
COMMIT_FROM    ids, offsets:u64*n, retention                as COMMIT
TOUCH          calls:u32 lookups:u32 keys                   (none)
=============  ===========================================  ========================================

A per-key slot is ``kind:u8`` then, for a slot that lends pages (a LEASE or a RESERVED one),
``id:u64 ranges`` (:class:`Lent`), for an inline block ``n:u64`` and ``n`` bytes, and nothing
for the other kinds. The two replies number their kinds each from 0, so a kind means something
only beside the op it answers: the two enums say which.

Every ``read_*`` takes a whole body (a request reader also the server's cursor over one) and
raises :class:`~kvstore.protocol.shm_frames.ProtocolError` for one that is cut short, runs on past
its contents or names a kind or a count it may not;
sizes come from the body only after they were checked against what is left of it, so a
garbage frame costs no more than its own bytes.

The reply to a failed request is the status (a gRPC status code, never :data:`OK`) and a UTF-8
message (:func:`error_reply`, :func:`reply_error`).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import NamedTuple

import grpc

from kvstore.errors import KVStoreError, error_from_status, status_of
from kvstore.protocol.shm_frames import (
    MAX_TOUCH_LOOKUPS,
    Cursor,
    ProtocolError,
    frame,
    pack_ids,
    pack_keys,
    pack_ranges,
    pack_retention,
)
from kvstore.retention import Retention

__all__ = [
    "INTERNAL",
    "OK",
    "AcquireSlot",
    "AcquiredItem",
    "Body",
    "CommitCounts",
    "Lent",
    "ReserveRequest",
    "ReserveSlot",
    "ReservedItem",
    "Touch",
    "error_reply",
    "pack_acquire_reply",
    "pack_commit",
    "pack_commit_from",
    "pack_commit_reply",
    "pack_lookup_reply",
    "pack_reserve",
    "pack_reserve_reply",
    "pack_touch",
    "read_acquire_reply",
    "read_commit",
    "read_commit_from",
    "read_commit_reply",
    "read_lookup_reply",
    "read_reserve",
    "read_reserve_reply",
    "read_touch",
    "reply_error",
]

#: The status of a reply that carries a result.
OK = 0
#: The status of a reply to a request the server failed on unexpectedly (gRPC's INTERNAL).
INTERNAL = grpc.StatusCode.INTERNAL.value[0]

_COUNTS = struct.Struct("<III")
_TOUCH_HEAD = struct.Struct("<II")
_SLOT_HEAD = struct.Struct("<BQ")


class AcquireSlot(enum.IntEnum):
    """What an ACQUIRE reply says of one key."""

    #: Not stored (or not in this namespace).
    MISS = 0
    #: Leased in the arena: ``id:u64 ranges``, released by ``id``.
    LEASE = 1
    #: Stored but not brought into the arena: the block itself follows, ``n:u64`` then ``n`` bytes.
    BYTES = 2


class ReserveSlot(enum.IntEnum):
    """What a RESERVE reply says of one key."""

    #: Neither the arena nor the session's quota has room: the client sends it another way.
    NO_ROOM = 0
    #: Already stored: nothing to write.
    PRESENT = 1
    #: Pages reserved: ``id:u64 ranges``, committed or cancelled by ``id``.
    RESERVED = 2


# Plain ints for the readers' loops: comparing with an IntEnum member costs several times more.
_MISS, _LEASE, _BYTES = map(int, AcquireSlot)
_NO_ROOM, _PRESENT, _RESERVED = map(int, ReserveSlot)


class Lent(NamedTuple):
    """Arena pages one slot lends: the ``id`` that gives them back and the ``(offset, length)``
    runs they cover."""

    id: int
    ranges: Sequence[tuple[int, int]]


#: One key of an ACQUIRE reply: leased pages, the block inline, or ``None`` for a miss.
AcquiredItem = Lent | bytes | memoryview | None
#: One key of a RESERVE reply: reserved pages, or ``PRESENT`` / ``NO_ROOM``.
ReservedItem = Lent | ReserveSlot


class CommitCounts(NamedTuple):
    """A COMMIT or COMMIT_FROM reply."""

    stored: int
    already_present: int
    dropped: int


class ReserveRequest(NamedTuple):
    """A RESERVE request: one length per key, and the retention to store them with."""

    keys: list[bytes]
    lengths: list[int]
    retention: Retention


class Touch(NamedTuple):
    """A TOUCH: ``calls`` client calls and ``lookups`` lookups read ``keys`` through the index."""

    calls: int
    lookups: int
    keys: list[bytes]


# -- requests ----------------------------------------------------------------------------------


#: A request body to read: its bytes, or the server's cursor over them (read to the end here).
Body = Cursor | bytes | memoryview


def _cursor(body: Body) -> Cursor:
    return body if isinstance(body, Cursor) else Cursor(body)


def _u64s(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def pack_reserve(keys: Sequence[bytes], lengths: Sequence[int], retention: Retention) -> bytes:
    """A RESERVE body."""
    return pack_keys(keys) + _u64s(lengths) + pack_retention(retention)


def read_reserve(body: Body, max_keys: int) -> ReserveRequest:
    """A RESERVE body (at most ``max_keys`` keys; the retention trailer is optional)."""
    cursor = _cursor(body)
    keys = cursor.keys(max_keys)
    lengths = cursor.u64s(len(keys))
    retention = cursor.retention()
    cursor.done()
    return ReserveRequest(keys, lengths, retention)


def pack_commit(ids: Sequence[int], retention: Retention) -> bytes:
    """A COMMIT body."""
    return pack_ids(ids) + pack_retention(retention)


def read_commit(body: Body) -> tuple[list[int], Retention]:
    """A COMMIT body: the reservation ids and the retention."""
    cursor = _cursor(body)
    ids = cursor.ids()
    retention = cursor.retention()
    cursor.done()
    return ids, retention


def pack_commit_from(ids: Sequence[int], offsets: Sequence[int], retention: Retention) -> bytes:
    """A COMMIT_FROM body: each reservation's block lies at ``offsets[i]`` in the window."""
    if len(offsets) != len(ids):
        raise ValueError(f"{len(offsets)} window offsets for {len(ids)} reservations")
    return pack_ids(ids) + _u64s(offsets) + pack_retention(retention)


def read_commit_from(body: Body) -> tuple[list[int], list[int], Retention]:
    """A COMMIT_FROM body: the reservation ids, their window offsets and the retention."""
    cursor = _cursor(body)
    ids = cursor.ids()
    offsets = cursor.u64s(len(ids))
    retention = cursor.retention()
    cursor.done()
    return ids, offsets, retention


def pack_touch(calls: int, lookups: int, keys: Sequence[bytes]) -> bytes:
    """A TOUCH body."""
    return _TOUCH_HEAD.pack(calls, lookups) + pack_keys(keys)


def read_touch(body: Body, max_keys: int) -> Touch:
    """A TOUCH body; every call read at least one of the keys, and the lookups are capped at
    :data:`~kvstore.protocol.shm_frames.MAX_TOUCH_LOOKUPS` (what a client holds between two)."""
    cursor = _cursor(body)
    calls, lookups = cursor.unpack("II")
    keys = cursor.keys(max_keys)
    cursor.done()
    if calls > len(keys) or lookups > MAX_TOUCH_LOOKUPS:
        raise ProtocolError(f"TOUCH of {len(keys)} keys claims {calls} calls, {lookups} lookups")
    return Touch(calls, lookups, keys)


# -- replies -----------------------------------------------------------------------------------


def pack_lookup_reply(hits: int, tier_codes: Sequence[int]) -> bytes:
    """A LOOKUP reply: the leading hits, then each key's tier code (``ABSENT_TIER``: none)."""
    return struct.pack("<I", hits) + bytes(tier_codes)


def read_lookup_reply(body: bytes | memoryview, count: int) -> tuple[int, bytes]:
    """A LOOKUP reply to ``count`` keys: the leading hits and ``count`` tier codes."""
    cursor = Cursor(body)
    hits = cursor.u32()
    codes = bytes(cursor.take(count))
    cursor.done()
    if hits > count:
        raise ProtocolError(f"a LOOKUP reply claims {hits} hits of {count} keys")
    return hits, codes


def _pack_lent(kind: int, lent: Lent) -> bytes:
    return _SLOT_HEAD.pack(kind, lent.id) + pack_ranges(lent.ranges)


def pack_acquire_reply(items: Sequence[AcquiredItem]) -> bytes:
    """An ACQUIRE reply: per key its lease, its bytes (inline) or a miss (``None``)."""
    parts: list[bytes] = []
    for item in items:
        if item is None:
            parts.append(bytes([AcquireSlot.MISS]))
        elif isinstance(item, Lent):
            parts.append(_pack_lent(AcquireSlot.LEASE, item))
        else:
            parts.append(_SLOT_HEAD.pack(AcquireSlot.BYTES, len(item)) + bytes(item))
    return b"".join(parts)


def read_acquire_reply(body: bytes | memoryview, count: int) -> list[AcquiredItem]:
    """An ACQUIRE reply to ``count`` keys (inline blocks as views of ``body``)."""
    cursor = Cursor(body)
    u8, u64, ranges = cursor.u8, cursor.u64, cursor.ranges  # a get reads one slot per key
    items: list[AcquiredItem] = []
    for _ in range(count):
        kind = u8()
        if kind == _LEASE:
            items.append(Lent(u64(), ranges()))
        elif kind == _BYTES:
            items.append(cursor.take(u64()))
        elif kind == _MISS:
            items.append(None)
        else:
            raise ProtocolError(f"ACQUIRE slot kind {kind} is none of {_kinds(AcquireSlot)}")
    cursor.done()
    return items


def pack_reserve_reply(items: Sequence[ReservedItem]) -> bytes:
    """A RESERVE reply: per key its reserved pages, or ``PRESENT`` / ``NO_ROOM``."""
    parts: list[bytes] = []
    for item in items:
        if isinstance(item, Lent):
            parts.append(_pack_lent(ReserveSlot.RESERVED, item))
        elif item in (ReserveSlot.PRESENT, ReserveSlot.NO_ROOM):
            parts.append(bytes([item]))
        else:
            raise ValueError(f"a RESERVE reply slot is pages or PRESENT or NO_ROOM, not {item!r}")
    return b"".join(parts)


def read_reserve_reply(body: bytes | memoryview, count: int) -> list[ReservedItem]:
    """A RESERVE reply to ``count`` keys."""
    cursor = Cursor(body)
    items: list[ReservedItem] = []
    for _ in range(count):
        kind = cursor.u8()
        if kind == _RESERVED:
            items.append(Lent(cursor.u64(), cursor.ranges()))
        elif kind == _PRESENT:
            items.append(ReserveSlot.PRESENT)
        elif kind == _NO_ROOM:
            items.append(ReserveSlot.NO_ROOM)
        else:
            raise ProtocolError(f"RESERVE slot kind {kind} is none of {_kinds(ReserveSlot)}")
    cursor.done()
    return items


def pack_commit_reply(stored: int, already_present: int, dropped: int) -> bytes:
    """A COMMIT or COMMIT_FROM reply: newly stored, already present, dropped."""
    return _COUNTS.pack(stored, already_present, dropped)


def read_commit_reply(body: bytes | memoryview) -> CommitCounts:
    """A COMMIT or COMMIT_FROM reply."""
    cursor = Cursor(body)
    stored, already_present, dropped = cursor.unpack("III")
    cursor.done()
    return CommitCounts(stored, already_present, dropped)


def _kinds(kinds: type[enum.IntEnum]) -> str:
    return ", ".join(f"{kind.value} ({kind.name})" for kind in kinds)


# -- errors ------------------------------------------------------------------------------------


def error_reply(error: KVStoreError) -> bytes:
    """The reply frame that carries ``error``: its gRPC status code and its message."""
    return frame(status_of(error).value[0], str(error).encode())


def reply_error(status: int, body: bytes | memoryview) -> KVStoreError:
    """The error a reply with ``status`` (not :data:`OK`) and message ``body`` reports."""
    return error_from_status(_grpc_code(status), bytes(body).decode(errors="replace"))


def _grpc_code(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
