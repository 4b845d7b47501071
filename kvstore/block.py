"""The self-describing header every stored block carries.

A block leaves host memory (for ``nvme`` and ``redis``) as one value: a fixed 64-byte header
followed by the payload. The header names the key and the namespace fingerprint the block was
stored under and holds an xxh3-64 checksum over header fields and payload, so a reader can prove
that the bytes it found are exactly the bytes that were put under that key, and otherwise treat
them as a miss.

Layout (little-endian)::

    offset size field
         0    4 magic  b"KVB1"
         4    2 header version (1)
         6    2 flags (reserved, 0)
         8   16 key
        24   16 namespace fingerprint
        40    8 payload length in bytes
        48    8 xxh3-64 of bytes 0..48 of the header followed by the payload
        56    8 reserved, 0
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvstore.keys import KEY_BYTES, NAMESPACE_BYTES

__all__ = ["HEADER_BYTES", "BlockHeader", "CorruptBlockError", "checksum", "encode_header"]

MAGIC = b"KVB1"
VERSION = 1
HEADER_BYTES = 64
_PREFIX = struct.Struct("<4sHH16s16sQ")  # everything the checksum covers
_LAYOUT = struct.Struct("<4sHH16s16sQQ8x")
assert _LAYOUT.size == HEADER_BYTES


class CorruptBlockError(Exception):
    """A stored value failed header or checksum verification (internal; never reaches clients)."""


def checksum(key: bytes, namespace: bytes, payload: bytes | memoryview) -> int:
    """The xxh3-64 checksum of a block's identifying header fields followed by its payload."""
    digest = xxhash.xxh3_64()
    digest.update(_PREFIX.pack(MAGIC, VERSION, 0, key, namespace, len(payload)))
    digest.update(payload)
    return digest.intdigest()


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The decoded header of one stored block."""

    key: bytes
    namespace: bytes
    length: int
    checksum: int

    @classmethod
    def for_payload(cls, key: bytes, namespace: bytes, payload: bytes | memoryview) -> BlockHeader:
        """Build the header of ``payload`` stored under ``key`` in ``namespace``."""
        return cls(key, namespace, len(payload), checksum(key, namespace, payload))

    def pack(self) -> bytes:
        """Serialize to exactly :data:`HEADER_BYTES` bytes."""
        if len(self.key) != KEY_BYTES or len(self.namespace) != NAMESPACE_BYTES:
            raise ValueError("a header needs a 16-byte key and a 16-byte namespace fingerprint")
        return _LAYOUT.pack(MAGIC, VERSION, 0, self.key, self.namespace, self.length, self.checksum)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> BlockHeader:
        """Parse a header; raises :class:`CorruptBlockError` if it is not one."""
        if len(data) < HEADER_BYTES:
            raise CorruptBlockError(f"value of {len(data)} bytes is shorter than a header")
        magic, version, flags, key, namespace, length, digest = _LAYOUT.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise CorruptBlockError(f"bad magic {magic!r} or version {version}")
        if flags != 0:  # no flag is defined in version 1; a set bit means the header rotted
            raise CorruptBlockError(f"unknown header flags {flags:#x}")
        return cls(bytes(key), bytes(namespace), length, digest)

    def verify(self, payload: bytes | memoryview) -> None:
        """Raise :class:`CorruptBlockError` unless ``payload`` matches this header exactly."""
        if len(payload) != self.length:
            raise CorruptBlockError(f"payload is {len(payload)} bytes, header says {self.length}")
        if checksum(self.key, self.namespace, payload) != self.checksum:
            raise CorruptBlockError(f"checksum mismatch for key {self.key.hex()}")


def encode_header(key: bytes, namespace: bytes, payload: bytes | memoryview) -> bytes:
    """Shorthand for ``BlockHeader.for_payload(...).pack()``."""
    return BlockHeader.for_payload(key, namespace, payload).pack()


def decode_value(key: bytes, value: bytes | memoryview) -> tuple[BlockHeader, memoryview]:
    """Split a stored ``header ‖ payload`` value and verify it belongs to ``key``.

    Returns the header and a zero-copy view of the payload; raises :class:`CorruptBlockError` on any
    mismatch (wrong key, truncated value, bad checksum).
    """
    view = memoryview(value)
    header = BlockHeader.unpack(view)
    if header.key != key:
        raise CorruptBlockError(f"value under {key.hex()} names key {header.key.hex()}")
    payload = view[HEADER_BYTES:]
    header.verify(payload)
    return header, payload
