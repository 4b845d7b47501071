"""The self-describing, authenticated header every stored block carries.

A block leaves host memory (for ``nvme`` and ``redis``) as one value: a fixed 64-byte header
followed by the payload. The header names the key and the namespace fingerprint the block was
stored under and holds a keyed MAC (HMAC-SHA256 truncated to 128 bits, keyed with the cluster's
integrity secret) over the header fields and the payload. Anyone able to write to Redis or to the
LMDB file can change bytes, but without the secret cannot make a header that verifies, so a reader
proves that the bytes it found are exactly the bytes a node holding the secret put under that key
and namespace, and otherwise treats them as a miss.

Layout (little-endian), version 2::

    offset size field
         0    4 magic  b"KVB1"
         4    2 header version (2; version 1 carried an unkeyed xxh3-64 and is never accepted)
         6    2 flags (reserved, 0)
         8   16 key
        24   16 namespace fingerprint
        40    8 payload length in bytes
        48   16 HMAC-SHA256/128 of bytes 0..48 of the header followed by the payload

HMAC-SHA256 rather than keyed BLAKE2b: with the SHA extensions of current x86 and Arm server CPUs
it runs at about 1.5 GB/s per core against BLAKE2b's 0.9 (``benchmarks/results/integrity.md``);
the MAC is computed once per block at put and on every read from nvme and redis.

The secrets live in a :class:`Keyring`: new blocks are signed with its first secret, reads accept
any of them (rotation: list the new secret first and keep the old ones until their blocks are
gone). The process has one installed keyring (:func:`install_keyring`; the server installs the
configured one at start); until then a random one, which is enough for a store that lives and dies
with its process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstore.keys import KEY_BYTES, NAMESPACE_BYTES

__all__ = [
    "HEADER_BYTES",
    "MAC_BYTES",
    "BlockHeader",
    "CorruptBlockError",
    "Keyring",
    "block_mac",
    "decode_value",
    "encode_header",
    "install_keyring",
    "installed_keyring",
]

MAGIC = b"KVB1"
VERSION = 2
HEADER_BYTES = 64
MAC_BYTES = 16
_PREFIX = struct.Struct("<4sHH16s16sQ")  # everything the MAC covers, before the payload
_LAYOUT = struct.Struct("<4sHH16s16sQ16s")
assert _LAYOUT.size == HEADER_BYTES
# Domain separation: a key derived for block MACs is never the raw configured secret.
_LABEL = b"kvstore block MAC v2"

Buffer = bytes | bytearray | memoryview


class CorruptBlockError(Exception):
    """A stored value failed header or MAC verification (internal; never reaches clients)."""


class Keyring:
    """The integrity secrets of a cluster: the first signs new blocks, any verifies.

    Secrets of any length are accepted; each is turned into a 32-byte HMAC key of its own
    (HMAC-SHA256 of a fixed label), so a configured secret is never used raw.
    """

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not secrets:
            raise ValueError("a keyring needs at least one secret")
        if any(not secret for secret in secrets):
            raise ValueError("an integrity secret must not be empty")
        # Keyed states, copied per MAC: the key's two padding blocks are hashed once, here.
        self._keys = [hmac.new(_derive(s), digestmod=hashlib.sha256) for s in secrets]

    @classmethod
    def random(cls) -> Keyring:
        """A keyring of one fresh random secret (blocks it signs verify only in this process)."""
        return cls([os.urandom(32)])

    def __len__(self) -> int:
        return len(self._keys)

    def sign(self, prefix: bytes, parts: Iterable[Buffer]) -> bytes:
        """The MAC of ``prefix`` followed by ``parts`` under the current (first) secret."""
        return _mac(self._keys[0], prefix, parts)

    def verify(self, prefix: bytes, parts: Sequence[Buffer], mac: bytes) -> bool:
        """Whether ``mac`` is the MAC of ``prefix ‖ parts`` under any secret of the ring."""
        return any(hmac.compare_digest(_mac(key, prefix, parts), mac) for key in self._keys)


def _derive(secret: bytes) -> bytes:
    return hmac.digest(secret, _LABEL, "sha256")


def _mac(key: hmac.HMAC, prefix: bytes, parts: Iterable[Buffer]) -> bytes:
    digest = key.copy()
    digest.update(prefix)
    for part in parts:
        digest.update(part)
    return digest.digest()[:MAC_BYTES]


_installed = Keyring.random()


def install_keyring(keyring: Keyring) -> None:
    """Make ``keyring`` the one this process signs and verifies blocks with."""
    global _installed
    _installed = keyring


def installed_keyring() -> Keyring:
    """The keyring this process signs and verifies blocks with."""
    return _installed


def _prefix(key: bytes, namespace: bytes, length: int) -> bytes:
    return _PREFIX.pack(MAGIC, VERSION, 0, key, namespace, length)


def block_mac(
    key: bytes, namespace: bytes, payload: Buffer, keyring: Keyring | None = None
) -> bytes:
    """The MAC a block header carries: key, namespace, length and payload, current secret."""
    ring = keyring or _installed
    return ring.sign(_prefix(key, namespace, len(payload)), (payload,))


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The decoded header of one stored block."""

    key: bytes
    namespace: bytes
    length: int
    mac: bytes

    @classmethod
    def for_payload(
        cls, key: bytes, namespace: bytes, payload: Buffer, keyring: Keyring | None = None
    ) -> BlockHeader:
        """Build (and sign) the header of ``payload`` stored under ``key`` in ``namespace``."""
        return cls(key, namespace, len(payload), block_mac(key, namespace, payload, keyring))

    def pack(self) -> bytes:
        """Serialize to exactly :data:`HEADER_BYTES` bytes."""
        if len(self.key) != KEY_BYTES or len(self.namespace) != NAMESPACE_BYTES:
            raise ValueError("a header needs a 16-byte key and a 16-byte namespace fingerprint")
        if len(self.mac) != MAC_BYTES:
            raise ValueError(f"a header needs a {MAC_BYTES}-byte MAC")
        return _LAYOUT.pack(MAGIC, VERSION, 0, self.key, self.namespace, self.length, self.mac)

    @classmethod
    def unpack(cls, data: Buffer) -> BlockHeader:
        """Parse a header; raises :class:`CorruptBlockError` if it is not one (old versions too)."""
        if len(data) < HEADER_BYTES:
            raise CorruptBlockError(f"value of {len(data)} bytes is shorter than a header")
        magic, version, flags, key, namespace, length, mac = _LAYOUT.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            # Version 1 blocks carry an unkeyed checksum anyone could recompute: never trusted.
            raise CorruptBlockError(f"bad magic {magic!r} or version {version}")
        if flags != 0:  # no flag is defined in version 2; a set bit means the header rotted
            raise CorruptBlockError(f"unknown header flags {flags:#x}")
        return cls(bytes(key), bytes(namespace), length, bytes(mac))

    def verify(self, payload: Buffer, keyring: Keyring | None = None) -> None:
        """Raise :class:`CorruptBlockError` unless ``payload`` matches this header exactly."""
        self.verify_parts([payload], keyring)

    def verify_parts(self, parts: Sequence[Buffer], keyring: Keyring | None = None) -> None:
        """:meth:`verify` for a payload held in pieces (the pages of an arena block), in order."""
        length = sum(len(part) for part in parts)
        if length != self.length:
            raise CorruptBlockError(f"payload is {length} bytes, header says {self.length}")
        ring = keyring or _installed
        if not ring.verify(_prefix(self.key, self.namespace, length), parts, self.mac):
            raise CorruptBlockError(f"MAC mismatch for key {self.key.hex()}")


def encode_header(
    key: bytes, namespace: bytes, payload: Buffer, keyring: Keyring | None = None
) -> bytes:
    """Shorthand for ``BlockHeader.for_payload(...).pack()``."""
    return BlockHeader.for_payload(key, namespace, payload, keyring).pack()


def decode_value(
    key: bytes, value: Buffer, keyring: Keyring | None = None
) -> tuple[BlockHeader, memoryview]:
    """Split a stored ``header ‖ payload`` value and verify it belongs to ``key``.

    Returns the header and a zero-copy view of the payload; raises :class:`CorruptBlockError` on any
    mismatch (wrong key, truncated value, old format, bad MAC).
    """
    view = memoryview(value)
    header = BlockHeader.unpack(view)
    if header.key != key:
        raise CorruptBlockError(f"value under {key.hex()} names key {header.key.hex()}")
    payload = view[HEADER_BYTES:]
    header.verify(payload, keyring)
    return header, payload
