"""Block headers: an xxh3-64 checksum in server memory, a keyed MAC on shared and persistent tiers.

A block has two headers, for the two kinds of place it lives in:

* in **host and device memory** (``dram``, ``hbm``) the server keeps a :class:`BlockHeader` beside
  the pages, in its own memory: key, namespace fingerprint, length and an xxh3-64 checksum of
  the payload under a seed drawn at random per process, computed at put (tens of GB/s, so a put
  stays a copy). A co-located client that maps the shared arena can change the payload's bytes,
  but never this header, which is not in the arena: ``dram.verify_reads`` compares the bytes
  against the checksum the server recorded, and no secret is needed for that (the attacker
  cannot rewrite the reference value, as it could a checksum stored next to the data). The
  checksum catches rot and any change that is not built to collide with xxh3, a
  non-cryptographic hash: it is not a MAC, but the secret seed leaves an attacker who never sees
  a checksum nothing to aim a collision at.
* on **nvme and redis** (anyone able to write to Redis or to the LMDB file can change bytes, header
  included) a block leaves as one value: a fixed 64-byte :class:`WireHeader` followed by the
  payload. It names the key and the namespace fingerprint and holds a keyed MAC (HMAC-SHA256
  truncated to 128 bits, keyed with the cluster's integrity secret) over the header fields and
  the payload. Without the secret no one can make a header that verifies, so a reader proves that
  the bytes it found are exactly the bytes a node holding the secret stored under that key and
  namespace, and otherwise treats them as a miss.
* **between nodes** (peer fetch: anyone able to write to the cluster index can pose as a node) a
  block travels with the same header, packed beside the payload (*sealed*): the node serving it
  seals it (:meth:`BlockHeader.seal`), the node reading it verifies it
  (:func:`verify_sealed`) before it installs or serves a byte of it.

The MAC (about 0.7 ms per MiB) is computed lazily: only when a block is encoded for nvme or redis
or sealed for a peer (:meth:`BlockHeader.seal`, which first checks the payload against its
checksum, so bytes changed in the arena are refused rather than signed), and verified on every
read from those tiers and from peers (:func:`decode_value`, :func:`verify_sealed`, which compute
the checksum of the block as it comes back into memory). A header read back that way keeps its
verified MAC (:attr:`BlockHeader.mac`), so sealing the same bytes again costs only the checksum.
All of it runs off the event loop (the nvme tier's worker thread; a thread for large redis
batches and for peer reads). A store with only dram never computes a MAC unless a peer reads
from it; one with only nvme signs every put, in the worker.

Wire layout (little-endian), version 2::

    offset size field
         0    4 magic  b"KVB1"
         4    2 header version (2; version 1 carried an unkeyed xxh3-64 and is never accepted)
         6    2 flags (reserved, 0)
         8   16 key
        24   16 namespace fingerprint
        40    8 payload length in bytes
        48   16 HMAC-SHA256/128 of bytes 0..48 of the header followed by the payload

HMAC-SHA256 rather than keyed BLAKE2b: with the SHA extensions of current x86 and Arm server CPUs
it runs at about 1.5 GB/s per core against BLAKE2b's 0.9 (``benchmarks/results/integrity.md``).

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
from dataclasses import dataclass, field

import xxhash

from kvstore.keys import KEY_BYTES, NAMESPACE_BYTES

__all__ = [
    "HEADER_BYTES",
    "MAC_BYTES",
    "BlockHeader",
    "CorruptBlockError",
    "Keyring",
    "WireHeader",
    "block_mac",
    "checksum_of",
    "decode_value",
    "encode_header",
    "install_keyring",
    "installed_keyring",
    "verify_sealed",
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
        self._derived = [_derive(s) for s in secrets]
        # Keyed states, copied per MAC: the key's two padding blocks are hashed once, here.
        self._keys = [hmac.new(key, digestmod=hashlib.sha256) for key in self._derived]

    @classmethod
    def random(cls) -> Keyring:
        """A keyring of one fresh random secret (blocks it signs verify only in this process)."""
        return cls([os.urandom(32)])

    def __len__(self) -> int:
        return len(self._keys)

    def for_tenant(self, tenant: str) -> Keyring:
        """The ring of one tenant: each secret bound to the tenant's name (rotation kept).

        A block one tenant's ring signed fails every other tenant's check, so a value copied
        from one tenant's place in a shared tier to another's is a miss there, never served.
        """
        label = _TENANT_LABEL + tenant.encode()
        return Keyring([hmac.digest(key, label, "sha256") for key in self._derived])

    def fingerprints(self) -> list[str]:
        """Per secret, in ring order (the first signs), a keyed fingerprint that names it without
        revealing it: HMAC of a fixed label under the secret's derived key, 64 bits in hex.

        Nodes publish these (:mod:`kvstore.server.keyring_check`) to find out whether they can
        read each other's blocks. Anyone who reads a stored block can already test guesses of a
        weak secret against its MAC, so a fingerprint tells them nothing more.
        """
        return [hmac.digest(key, _FINGERPRINT_LABEL, "sha256")[:8].hex() for key in self._derived]

    def derive(self, purpose: bytes) -> Keyring:
        """The ring of the same secrets (rotation kept) keyed for another ``purpose`` than block
        MACs (e.g. nodes authenticating each other): a MAC made for one purpose never passes
        as one made for another, and none of them reveals the block keys."""
        return Keyring(
            [hmac.digest(key, _PURPOSE_LABEL + purpose, "sha256") for key in self._derived]
        )

    def sign(self, prefix: bytes, parts: Iterable[Buffer]) -> bytes:
        """The MAC of ``prefix`` followed by ``parts`` under the current (first) secret."""
        return _mac(self._keys[0], prefix, parts)

    def verify(self, prefix: bytes, parts: Sequence[Buffer], mac: bytes) -> bool:
        """Whether ``mac`` is the MAC of ``prefix ‖ parts`` under any secret of the ring."""
        return any(hmac.compare_digest(_mac(key, prefix, parts), mac) for key in self._keys)


_TENANT_LABEL = b"kvstore tenant\x00"
_FINGERPRINT_LABEL = b"kvstore keyring fingerprint v1"
_PURPOSE_LABEL = b"kvstore purpose\x00"


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
class WireHeader:
    """The header of one stored value as it is on nvme and redis: the MAC, no checksum."""

    key: bytes
    namespace: bytes
    length: int
    mac: bytes

    @classmethod
    def for_payload(
        cls, key: bytes, namespace: bytes, payload: Buffer, keyring: Keyring | None = None
    ) -> WireHeader:
        """Sign ``payload`` stored under ``key`` in ``namespace``: the header that goes with it."""
        return cls(key, namespace, len(payload), block_mac(key, namespace, payload, keyring))

    def pack(self) -> bytes:
        """Serialize to exactly :data:`HEADER_BYTES` bytes."""
        if len(self.key) != KEY_BYTES or len(self.namespace) != NAMESPACE_BYTES:
            raise ValueError("a header needs a 16-byte key and a 16-byte namespace fingerprint")
        if len(self.mac) != MAC_BYTES:
            raise ValueError(f"a header needs a {MAC_BYTES}-byte MAC")
        return _LAYOUT.pack(MAGIC, VERSION, 0, self.key, self.namespace, self.length, self.mac)

    @classmethod
    def unpack(cls, data: Buffer) -> WireHeader:
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


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A block's header in server memory: key, namespace, length and an xxh3-64 checksum.

    ``checksum`` is ``None`` only in headers a persistent tier lists at start-up without reading
    the payload (:meth:`kvstore.tiers.base.Tier.scan`), which serve to index and nothing else.
    ``mac`` is the block's keyed MAC where it is known already (a block read from nvme or redis,
    whose MAC was just verified), so that sealing it again costs a checksum, not a MAC.
    """

    key: bytes
    namespace: bytes
    length: int
    checksum: int | None
    #: A cache, not part of what the header says: equal headers may differ in it.
    mac: bytes | None = field(default=None, compare=False)

    @classmethod
    def for_payload(cls, key: bytes, namespace: bytes, payload: Buffer) -> BlockHeader:
        """The header of ``payload`` stored under ``key`` in ``namespace`` (checksum computed)."""
        return cls(key, namespace, len(payload), checksum_of((payload,)))

    def verify(self, payload: Buffer) -> None:
        """Raise :class:`CorruptBlockError` unless ``payload`` is the one this header describes."""
        self.verify_parts([payload])

    def verify_parts(self, parts: Sequence[Buffer]) -> None:
        """:meth:`verify` for a payload held in pieces (the pages of an arena block), in order."""
        length = sum(len(part) for part in parts)
        if length != self.length:
            raise CorruptBlockError(f"payload is {length} bytes, header says {self.length}")
        if self.checksum is None or checksum_of(parts) != self.checksum:
            raise CorruptBlockError(f"checksum mismatch for key {self.key.hex()}")

    def seal(self, payload: Buffer, keyring: Keyring | None = None) -> bytes:
        """The packed, signed header that goes with ``payload`` to nvme or redis.

        Checks the payload against the checksum first, so that bytes changed since the put (by a
        client writing the shared arena, or rot) are refused (:class:`CorruptBlockError`) rather
        than signed. Costs a MAC over the payload (none where :attr:`mac` is known): call it off
        the event loop for large blocks.
        """
        self.verify(payload)
        if self.mac is not None:  # the payload is the one this MAC was verified over
            return WireHeader(self.key, self.namespace, self.length, self.mac).pack()
        return encode_header(self.key, self.namespace, payload, keyring)


#: Seed of every in-memory checksum, drawn once per process: the checksums never leave the server,
#: and a client that writes the shared arena cannot aim for a collision with a seed it never sees.
_CHECKSUM_SEED = int.from_bytes(os.urandom(8), "little")


def checksum_of(parts: Iterable[Buffer]) -> int:
    """The xxh3-64, under this process's secret seed, of the concatenation of ``parts`` (tens of
    GB/s: cheap at put). Valid only inside this process."""
    digest = xxhash.xxh3_64(seed=_CHECKSUM_SEED)
    for part in parts:
        digest.update(part)
    return digest.intdigest()


def encode_header(
    key: bytes, namespace: bytes, payload: Buffer, keyring: Keyring | None = None
) -> bytes:
    """The packed header, MAC computed, of ``payload`` under ``key`` in ``namespace``."""
    return WireHeader.for_payload(key, namespace, payload, keyring).pack()


def decode_value(
    key: bytes, value: Buffer, keyring: Keyring | None = None
) -> tuple[BlockHeader, memoryview]:
    """Split a stored ``header ‖ payload`` value and verify it belongs to ``key``.

    Returns the in-memory header (checksum computed, for the block's life in dram) and a
    zero-copy view of the payload; raises :class:`CorruptBlockError` on any mismatch (wrong key,
    truncated value, old format, bad MAC). Costs a MAC and a checksum over the payload: call it
    off the event loop for large values.
    """
    view = memoryview(value)
    wire = WireHeader.unpack(view)
    if wire.key != key:
        raise CorruptBlockError(f"value under {key.hex()} names key {wire.key.hex()}")
    payload = view[HEADER_BYTES:]
    wire.verify(payload, keyring)
    header = BlockHeader(wire.key, wire.namespace, wire.length, checksum_of((payload,)), wire.mac)
    return header, payload


def verify_sealed(
    key: bytes, namespace: bytes, header: Buffer, payload: Buffer, keyring: Keyring | None = None
) -> BlockHeader:
    """Verify a block that travelled as a packed header beside its payload (a peer's answer).

    Returns the in-memory header (checksum computed, MAC kept); raises :class:`CorruptBlockError`
    unless ``header`` is a version-2 header for exactly ``key`` in ``namespace`` whose MAC, under
    ``keyring``, covers ``payload``. A missing header (empty) fails like a forged one. Costs a MAC
    and a checksum over the payload: call it off the event loop for large payloads.
    """
    if len(header) != HEADER_BYTES:
        raise CorruptBlockError(f"a sealed header is {HEADER_BYTES} bytes, got {len(header)}")
    wire = WireHeader.unpack(header)
    if wire.key != key:
        raise CorruptBlockError(f"block for {key.hex()} is sealed for key {wire.key.hex()}")
    if wire.namespace != namespace:
        raise CorruptBlockError(f"block for {key.hex()} is sealed for another namespace")
    wire.verify(payload, keyring)
    return BlockHeader(key, namespace, wire.length, checksum_of((payload,)), wire.mac)
