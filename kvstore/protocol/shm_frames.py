"""The shared-memory data plane's wire format: small binary frames over a UNIX stream socket.

gRPC stays the control plane and the fallback. This socket carries metadata only (keys, lengths,
page ranges, lease ids); payload bytes move by one memcpy through the ``dram`` arena, which the
server hands to the client once, as a memfd, in the reply to ``HELLO`` (``SCM_RIGHTS``), together
with the memfd of the arena's published index (:mod:`kvstore.protocol.dram_index`) when it has one.

A request is ``length:u32 | op:u8 | body`` (``length`` counts op and body). Every request but
``RELEASE``, ``CANCEL`` and ``TOUCH`` gets one reply, in order: ``length:u32 | status:u8 |
body``, where status 0 is OK and anything else is a gRPC status code with a UTF-8 message as the
body. All integers are little-endian. Bodies (``keys`` = ``n:u32`` then ``n`` 16-byte keys)::

    HELLO    namespace[16]            -> version:u32 arena_size:u64 index_size:u64
                                         max_keys:u32 instance_id[16] tiers
    LOOKUP   keys                     -> hits:u32, then per key: tier index:u8 (255 absent)
    ACQUIRE  keys                     -> per key: MISS | LEASE id:u64 ranges | BYTES n:u64 data
    RELEASE  n:u32 ids:u64*n             (no reply)
    RESERVE  keys, then lengths:u64*n, retention
                                      -> per key: NO_ROOM | PRESENT | RESERVED id:u64 ranges
    COMMIT   n:u32 ids:u64*n, retention
                                      -> stored:u32 already_present:u32 dropped:u32
    CANCEL   n:u32 ids:u64*n             (no reply)
    TOUCH    calls:u32 lookups:u32 keys  (no reply; blocks read through the index by ``calls``
                                         client calls, calls <= keys, and lookups answered
                                         from it, at most MAX_TOUCH_LOOKUPS)
    SYNC     (empty)                  -> (empty), once every earlier request was handled
    WINDOW   (empty; the client's write window memfd rides along, SCM_RIGHTS)
                                      -> (empty)
    COMMIT_FROM n:u32 ids:u64*n, offsets:u64*n, retention
                                      -> as COMMIT; the server first copies each block from
                                         ``offset`` in this connection's window into its pages

``ranges`` is ``count:u16`` then ``count`` pairs ``offset:u64 length:u64`` into the arena; ``tiers``
is the tier names joined by newlines; ``retention`` is ``seconds:f64 tiers:u8`` (an index into
:data:`~kvstore.retention.RETENTION_TIERS`; :mod:`kvstore.retention`), optional (absent: a plain
put): RESERVE applies it to keys already present, COMMIT to the blocks it stores.
``index_size`` is 0 when no index fd came along.
``version`` is :data:`PROTOCOL_VERSION`; a client refuses any other (and falls back to gRPC).

Each body with more than keys or ids in it (the per-key slots of ACQUIRE and RESERVE replies,
:class:`~kvstore.protocol.shm_messages.AcquireSlot` and
:class:`~kvstore.protocol.shm_messages.ReserveSlot`, each numbered from 0; LOOKUP and COMMIT
replies; RESERVE, COMMIT, COMMIT_FROM and TOUCH requests) is packed and read by one pair of
functions in :mod:`kvstore.protocol.shm_messages`, which both endpoints call; this module holds
the frame, the ops, the limits and the primitives those functions are made of.

Where the server sealed its arena against writes (``F_SEAL_FUTURE_WRITE``, which the client reads
off the memfd), a client maps it read-only and writes through a window: a memfd of its own, sent
once per connection with ``WINDOW``, into which it copies each reserved block before
``COMMIT_FROM`` names where (:mod:`kvstore.server.shm_window`); such a server refuses a plain
``COMMIT``. A server that did not seal it (an older one) takes ``COMMIT`` of blocks the client
wrote into the reserved pages themselves, as before.
"""

from __future__ import annotations

import functools
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.deprecation import deprecated
from kvstore.errors import InvalidRequestError
from kvstore.formats import SHM_FRAMES
from kvstore.keys import KEY_BYTES
from kvstore.retention import KEEP, RETENTION_TIERS, Retention

__all__ = [
    "ABSENT_TIER",
    "MAX_REQUEST_BYTES",
    "MAX_TOUCH_LOOKUPS",
    "PROTOCOL_VERSION",
    "Cursor",
    "Hello",
    "Op",
    "ProtocolError",
    "frame",
    "max_frame_length",
    "pack_ids",
    "pack_keys",
    "pack_ranges",
    "pack_retention",
    "unpack_hello",
]

#: Bumped whenever a frame's layout changes; declared with the other versioned formats
#: (:data:`kvstore.formats.SHM_FRAMES`).
PROTOCOL_VERSION = SHM_FRAMES.latest

#: The most lookups one TOUCH may report (a client holds no more between two TOUCHes).
MAX_TOUCH_LOOKUPS = 1 << 16

#: Requests carry keys and ids only; anything longer is not a kvstore client.
MAX_REQUEST_BYTES = 16 * 1024**2

#: Tier index meaning "not stored" in a LOOKUP reply.
ABSENT_TIER = 255

_LENGTH = struct.Struct("<I")
# Parsed formats, by format string: building a Struct per field would dominate small replies.
_STRUCTS: dict[str, struct.Struct] = {}
_HEAD = struct.Struct("<IB")
_RETENTION = struct.Struct("<dB")


class Op:
    """Request codes."""

    HELLO = 1
    LOOKUP = 2
    ACQUIRE = 3
    RELEASE = 4
    RESERVE = 5
    COMMIT = 6
    CANCEL = 7
    TOUCH = 8
    SYNC = 9
    WINDOW = 10
    COMMIT_FROM = 11

    #: Requests the server does not answer.
    ONE_WAY = frozenset({RELEASE, CANCEL, TOUCH})


#: The longest namespace a HELLO may carry and still get an answer (16 is the only valid length;
#: a little more lets a wrong one hear why instead of being hung up on).
_MAX_HELLO_BODY = 64


@functools.lru_cache(maxsize=64)  # asked once per frame, with a handful of distinct arguments
def max_frame_length(op: int | None, max_keys: int) -> int:
    """The largest legal ``length`` field of a request ``op`` (op byte included) for a server
    that takes at most ``max_keys`` keys per request; ``op`` ``None``: of any request. An unknown
    op may have a short body (it is answered with an error).

    A server checks a declared length against this before allocating anything for the body, so
    a frame costs what its op can legally need, never the 16 MiB the length field can name.
    Id lists (RELEASE, CANCEL, COMMIT) name what one ACQUIRE or RESERVE handed out, so they
    hold at most ``max_keys`` ids too.
    """
    keys = 4 + max_keys * KEY_BYTES
    ids = 4 + 8 * max_keys
    limits = {
        Op.HELLO: _MAX_HELLO_BODY,
        Op.LOOKUP: keys,
        Op.ACQUIRE: keys,
        Op.RESERVE: keys + 8 * max_keys + _RETENTION.size,
        Op.RELEASE: ids,
        Op.COMMIT: ids + _RETENTION.size,
        Op.CANCEL: ids,
        Op.TOUCH: 8 + keys,
        Op.SYNC: 0,
        Op.WINDOW: 0,
        Op.COMMIT_FROM: ids + 8 * max_keys + _RETENTION.size,
    }
    body = max(limits.values()) if op is None else limits.get(op, _MAX_HELLO_BODY)
    return 1 + min(body, MAX_REQUEST_BYTES - 1)


class ProtocolError(InvalidRequestError):
    """A frame that does not parse."""


def frame(code: int, body: bytes | bytearray | memoryview = b"") -> bytes:
    """One frame: a request (``code`` = op) or a reply (``code`` = status)."""
    return _HEAD.pack(len(body) + 1, code) + bytes(body)


def frame_length(prefix: bytes | bytearray) -> int:
    """The length field of a frame's first four bytes."""
    (length,) = _LENGTH.unpack(prefix)
    return int(length)


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """``n:u32`` then the keys (each exactly :data:`KEY_BYTES`)."""
    return struct.pack("<I", len(keys)) + b"".join(keys)


def pack_ids(ids: Sequence[int]) -> bytes:
    """``n:u32`` then ``n`` u64 ids."""
    return struct.pack(f"<I{len(ids)}Q", len(ids), *ids)


def pack_retention(retention: Retention) -> bytes:
    """``seconds:f64 tiers:u8``."""
    return _RETENTION.pack(retention.seconds, RETENTION_TIERS.index(retention.tiers))


def pack_ranges(ranges: Sequence[tuple[int, int]]) -> bytes:
    """``count:u16`` then ``(offset:u64, length:u64)`` pairs."""
    flat = [value for pair in ranges for value in pair]
    return struct.pack(f"<H{len(flat)}Q", len(ranges), *flat)


class Cursor:
    """Reads a frame body front to back; running off the end raises :class:`ProtocolError`."""

    def __init__(self, body: bytes | memoryview) -> None:
        self._body = memoryview(body)
        self._at = 0

    def take(self, size: int) -> memoryview:
        """The next ``size`` bytes."""
        if size < 0 or self._at + size > len(self._body):
            raise ProtocolError(f"truncated frame: wanted {size} bytes at offset {self._at}")
        chunk = self._body[self._at : self._at + size]
        self._at += size
        return chunk

    def rest(self) -> memoryview:
        """Everything not read yet (without consuming it)."""
        return self._body[self._at :]

    def unpack(self, fmt: str) -> tuple[int, ...]:
        """The next values of the fixed ``struct`` format ``fmt`` (little-endian is implied).

        Formats are cached, so ``fmt`` must come from the code, never from a count the peer sent
        (that is :meth:`u64s`).
        """
        layout = _STRUCTS.get(fmt)
        if layout is None:
            layout = _STRUCTS.setdefault(fmt, struct.Struct("<" + fmt))
        if self._at + layout.size > len(self._body):
            raise ProtocolError(f"truncated frame: wanted {layout.size} bytes at {self._at}")
        values = layout.unpack_from(self._body, self._at)
        self._at += layout.size
        return values

    def u8(self) -> int:
        """One unsigned byte."""
        if self._at >= len(self._body):
            raise ProtocolError(f"truncated frame: wanted 1 byte at {self._at}")
        self._at += 1
        return self._body[self._at - 1]

    def u32(self) -> int:
        """One u32."""
        return self.unpack("I")[0]

    def u64(self) -> int:
        """One u64."""
        return self.unpack("Q")[0]

    def keys(self, limit: int) -> list[bytes]:
        """A ``pack_keys`` list, at most ``limit`` keys."""
        count = self.u32()
        if count > limit:
            raise InvalidRequestError(f"{count} keys in one request; the limit is {limit}")
        data = bytes(self.take(count * KEY_BYTES))  # slicing bytes is cheaper than a view
        return [data[at : at + KEY_BYTES] for at in range(0, len(data), KEY_BYTES)]

    def u64s(self, count: int) -> list[int]:
        """The next ``count`` u64s (checked against the bytes left before anything is built)."""
        if count < 0 or self._at + 8 * count > len(self._body):
            raise ProtocolError(f"truncated frame: wanted {count} u64s at offset {self._at}")
        values = struct.unpack_from(f"<{count}Q", self._body, self._at)
        self._at += 8 * count
        return list(values)

    def ids(self) -> list[int]:
        """A ``pack_ids`` list."""
        return self.u64s(self.u32())

    def ranges(self) -> list[tuple[int, int]]:
        """A ``pack_ranges`` list."""
        count = self.unpack("H")[0]
        flat = self.u64s(2 * count)
        return [(flat[2 * i], flat[2 * i + 1]) for i in range(count)]

    def retention(self) -> Retention:
        """A ``pack_retention`` value, or the plain put's where the frame ends here (the
        trailer is optional); InvalidRequestError if it asks for something unknown."""
        if self._at == len(self._body):
            return KEEP
        seconds, tiers = self.unpack("dB")
        if tiers >= len(RETENTION_TIERS):
            raise ProtocolError(
                f"retention tiers {tiers} is not one of 0-{len(RETENTION_TIERS) - 1}"
            )
        return Retention(float(seconds), RETENTION_TIERS[tiers])

    def done(self) -> None:
        """Fail if bytes are left over (a frame longer than its contents)."""
        if self._at != len(self._body):
            raise ProtocolError(f"{len(self._body) - self._at} unexpected trailing bytes")


@dataclass(frozen=True, slots=True)
class Hello:
    """The server's greeting: the sizes of the arena and of its index, the request limit, the
    server's identity, its tiers."""

    arena_size: int
    index_size: int
    max_keys: int
    instance_id: bytes
    tiers: list[str]

    def pack(self) -> bytes:
        """The HELLO reply body."""
        head = struct.pack(
            "<IQQI16s",
            PROTOCOL_VERSION,
            self.arena_size,
            self.index_size,
            self.max_keys,
            self.instance_id,
        )
        return head + "\n".join(self.tiers).encode()


def unpack_hello(body: bytes | memoryview) -> Hello:
    """Parse a HELLO reply body; ProtocolError if the server speaks another version."""
    cursor = Cursor(body)
    (version,) = cursor.unpack("I")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"the store speaks shared-memory protocol {version}, this client {PROTOCOL_VERSION}"
        )
    arena_size, index_size, max_keys = cursor.unpack("QQI")
    instance_id = bytes(cursor.take(16))
    rest = bytes(cursor.take(len(cursor.rest())))
    tiers = rest.decode().split("\n") if rest else []
    return Hello(arena_size, index_size, max_keys, instance_id, tiers)


class _Slot:
    """The slot kinds of both replies in one class, as they were (ACQUIRE: MISS, LEASE, BYTES;
    RESERVE: NO_ROOM, PRESENT, RESERVED, numbered from 0 alike)."""

    MISS = NO_ROOM = 0
    LEASE = PRESENT = 1
    BYTES = RESERVED = 2


def __getattr__(name: str) -> Any:
    # ``Slot`` held both replies' kinds, equal numbers meaning different things; each reply has
    # its own enum now, and the old name still works for a release.
    if name == "Slot":
        warnings.warn(
            deprecated(
                "kvstore.protocol.shm_frames.Slot",
                "use AcquireSlot or ReserveSlot from kvstore.protocol.shm_messages",
            ),
            DeprecationWarning,
            stacklevel=2,
        )
        return _Slot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
