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
  payload. It names the key and the namespace fingerprint and holds a keyed MAC (keyed BLAKE3
  truncated to 128 bits, keyed with the cluster's integrity secret) over the header fields and
  the payload. Without the secret no one can make a header that verifies, so a reader proves that
  the bytes it found are exactly the bytes a node holding the secret stored under that key and
  namespace, and otherwise treats them as a miss.
* **between nodes** (peer fetch: anyone able to write to the cluster index can pose as a node) a
  block travels with the same header, packed beside the payload (*sealed*): the node serving it
  seals it (:meth:`BlockHeader.seal`), the node reading it verifies it
  (:func:`verify_sealed`) before it installs or serves a byte of it.

The MAC (about 0.2 ms per MiB; HMAC-SHA256 took 0.65) is computed lazily: only when a block is
encoded for nvme or redis or sealed for a peer (:meth:`BlockHeader.seal`, which first checks the
payload against its checksum, so bytes changed in the arena are refused rather than signed), and
verified on every read from those tiers and from peers (:func:`decode_value`,
:func:`verify_sealed`, which compute the checksum of the block as it comes back into memory). A
header read back that way keeps its verified MAC (:attr:`BlockHeader.mac`), and the keyring
remembers the sealed header of every block it signed or verified, by the block's in-memory header
(key, namespace, length, checksum; the last :data:`MEMO_ENTRIES`; :meth:`Keyring.remembered`):
so a block is signed once in a
process (at its write-through, or at its first serve to a peer), and sealing the same bytes again
costs only the checksum that proves they are the same bytes.
All of it runs off the event loop (the nvme tier's worker thread; a thread for large redis
batches and for peer reads). A store with only dram never computes a MAC unless a peer reads
from it; one with only nvme signs every put, in the worker.

Wire layout (little-endian), version 3::

    offset size field
         0    4 magic  b"KVB1"
         4    2 header version (3; 2 is still read, 1 never)
         6    2 flags (reserved, 0)
         8   16 key
        24   16 namespace fingerprint
        40    8 payload length in bytes
        48   16 MAC/128 of bytes 0..48 of the header followed by the payload

Version 3 MACs are keyed BLAKE3 (the ``blake3`` package, SIMD): 0.21 ms per MiB against 0.65 for
HMAC-SHA256 with the SHA extensions and 1.07 for keyed BLAKE2b, one run at load 10
(``benchmarks/results/integrity.md``).
Version 2 blocks (HMAC-SHA256/128) written before still verify, under the same secrets; version 1
carried an unkeyed xxh3-64 and is never accepted. The version is inside what the MAC covers, so a
header cannot be relabelled without the secret. A header of a later version (above 3, with the
right magic) is neither: :func:`decode_value` and :func:`verify_sealed` raise
:class:`~kvstore.formats.NewerFormatError`, which every tier and the peer read treat as a miss
they leave in place (:mod:`kvstore.formats`: the N-1 promise). A keyring signs in its
:attr:`~Keyring.sign_version` (setting ``integrity.mac``: ``hmac-sha256`` keeps signing version 2
while older nodes still share the Redis or read from this one, as they refuse version 3). A process
without ``blake3`` signs version 2 and treats version-3 blocks as corrupt misses (never an error).

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
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvstore.formats import BLOCK, NewerFormatError
from kvstore.keys import KEY_BYTES, NAMESPACE_BYTES

_blake3: Any
try:
    import blake3 as _blake3
except ImportError:  # pragma: no cover - a dependency; without it blocks are signed version 2
    _blake3 = None

__all__ = [
    "HEADER_BYTES",
    "MAC_BYTES",
    "BlockHeader",
    "CorruptBlockError",
    "Keyring",
    "NewerFormatError",
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
#: Versions read: 2 (HMAC-SHA256/128), 3 (keyed BLAKE3/128).
HMAC_VERSION = 2
BLAKE3_VERSION = 3
#: The version new blocks are signed with.
VERSION = BLAKE3_VERSION if _blake3 is not None else HMAC_VERSION
HEADER_BYTES = 64
MAC_BYTES = 16
_PREFIX = struct.Struct("<4sHH16s16sQ")  # everything the MAC covers, before the payload
_LAYOUT = struct.Struct("<4sHH16s16sQ16s")
assert _LAYOUT.size == HEADER_BYTES
# Domain separation: a key derived for block MACs is never the raw configured secret, and each
# MAC version has a key of its own.
_LABEL = b"kvstore block MAC v2"
_BLAKE3_LABEL = b"kvstore block MAC v3 (keyed BLAKE3)"
#: Sealed headers a keyring remembers (about 200 bytes each: 64k entries are about 13 MiB).
MEMO_ENTRIES = 65536

Buffer = bytes | bytearray | memoryview


class CorruptBlockError(Exception):
    """A stored value failed header or MAC verification (internal; never reaches clients)."""


class Keyring:
    """The integrity secrets of a cluster: the first signs new blocks, any verifies.

    Secrets of any length are accepted; each is turned into a 32-byte key per MAC version
    (HMAC-SHA256 of a fixed label per version), so a configured secret is never used raw.

    A keyring also remembers, for the last :data:`MEMO_ENTRIES` blocks it signed or verified,
    the sealed header by the block's in-memory header (:meth:`remember`, :meth:`remembered`),
    so that a block served to several peers, or written through and then served, is signed once.
    """

    def __init__(self, secrets: Sequence[bytes], sign_version: int = VERSION) -> None:
        if sign_version not in (HMAC_VERSION, BLAKE3_VERSION):
            raise ValueError(f"no header version {sign_version}; allowed: 2, 3")
        if sign_version == BLAKE3_VERSION and _blake3 is None:
            raise ValueError("BLAKE3 MACs need the blake3 package")
        #: The header version (MAC) new blocks are signed with; both verify.
        self.sign_version = sign_version
        if not secrets:
            raise ValueError("a keyring needs at least one secret")
        if any(not secret for secret in secrets):
            raise ValueError("an integrity secret must not be empty")
        self._derived = [_derive(s) for s in secrets]
        # Keyed states, copied per MAC: the key's two padding blocks are hashed once, here.
        self._keys = [hmac.new(key, digestmod=hashlib.sha256) for key in self._derived]
        self._blake3_keys = [hmac.digest(s, _BLAKE3_LABEL, "sha256") for s in secrets]
        self._memo: OrderedDict[tuple[bytes, bytes, int, int], bytes] = OrderedDict()
        self._memo_lock = threading.Lock()  # seals run on worker threads

    @classmethod
    def random(cls, sign_version: int = VERSION) -> Keyring:
        """A keyring of one fresh random secret (blocks it signs verify only in this process)."""
        return cls([os.urandom(32)], sign_version)

    def __len__(self) -> int:
        return len(self._keys)

    def for_tenant(self, tenant: str) -> Keyring:
        """The ring of one tenant: each secret bound to the tenant's name (rotation kept).

        A block one tenant's ring signed fails every other tenant's check, so a value copied
        from one tenant's place in a shared tier to another's is a miss there, never served.
        """
        label = _TENANT_LABEL + tenant.encode()
        secrets = [hmac.digest(key, label, "sha256") for key in self._derived]
        return Keyring(secrets, self.sign_version)

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
        as one made for another, and none of them reveals the block keys. Always HMAC-SHA256,
        whatever ``integrity.mac`` signs blocks with, so nodes configured either way (a rolling
        switch) still authenticate each other."""
        secrets = [hmac.digest(key, _PURPOSE_LABEL + purpose, "sha256") for key in self._derived]
        return Keyring(secrets, HMAC_VERSION)

    def sign(self, prefix: bytes, parts: Iterable[Buffer], version: int | None = None) -> bytes:
        """The MAC of ``prefix`` followed by ``parts`` under the current (first) secret, as
        header ``version`` (default: :attr:`sign_version`) computes it."""
        return self._mac(self.sign_version if version is None else version, 0, prefix, parts)

    def verify(
        self, prefix: bytes, parts: Sequence[Buffer], mac: bytes, version: int | None = None
    ) -> bool:
        """Whether ``mac`` is the MAC of ``prefix ‖ parts`` (header ``version``, default:
        :attr:`sign_version`) under any secret of the ring."""
        version = self.sign_version if version is None else version
        return any(
            hmac.compare_digest(self._mac(version, i, prefix, parts), mac)
            for i in range(len(self._keys))
        )

    def _mac(self, version: int, index: int, prefix: bytes, parts: Iterable[Buffer]) -> bytes:
        digest: Any
        if version == BLAKE3_VERSION:
            if _blake3 is None:
                raise CorruptBlockError("a version-3 (BLAKE3) block, and blake3 is not installed")
            digest = _blake3.blake3(key=self._blake3_keys[index])
        elif version == HMAC_VERSION:
            digest = self._keys[index].copy()
        else:
            raise CorruptBlockError(f"no MAC for header version {version}")
        digest.update(prefix)
        for part in parts:
            digest.update(part)
        return bytes(digest.digest()[:MAC_BYTES])

    def remember(self, header: BlockHeader, sealed: bytes) -> None:
        """Keep ``sealed`` (a packed wire header this ring signed or verified) as the seal of the
        block ``header`` describes. Only for a payload just checked against ``header``'s
        checksum and covered by ``sealed``'s MAC."""
        if header.checksum is None:
            return
        entry = (header.key, header.namespace, header.length, header.checksum)
        with self._memo_lock:
            self._memo[entry] = sealed
            self._memo.move_to_end(entry)
            while len(self._memo) > MEMO_ENTRIES:
                self._memo.popitem(last=False)

    @property
    def remembered_count(self) -> int:
        """Sealed headers remembered now (at most :data:`MEMO_ENTRIES`)."""
        return len(self._memo)

    def remembered(self, header: BlockHeader) -> bytes | None:
        """The sealed header remembered for the block ``header`` describes, or ``None``: valid
        for a payload that matches ``header``'s checksum (check it first)."""
        if header.checksum is None:
            return None
        entry = (header.key, header.namespace, header.length, header.checksum)
        with self._memo_lock:
            sealed = self._memo.get(entry)
            if sealed is not None:
                self._memo.move_to_end(entry)
            return sealed


_TENANT_LABEL = b"kvstore tenant\x00"
_FINGERPRINT_LABEL = b"kvstore keyring fingerprint v1"
_PURPOSE_LABEL = b"kvstore purpose\x00"


def _derive(secret: bytes) -> bytes:
    return hmac.digest(secret, _LABEL, "sha256")


_installed = Keyring.random()


def install_keyring(keyring: Keyring) -> None:
    """Make ``keyring`` the one this process signs and verifies blocks with."""
    global _installed
    _installed = keyring


def installed_keyring() -> Keyring:
    """The keyring this process signs and verifies blocks with."""
    return _installed


def _prefix(key: bytes, namespace: bytes, length: int, version: int = VERSION) -> bytes:
    return _PREFIX.pack(MAGIC, version, 0, key, namespace, length)


def block_mac(
    key: bytes, namespace: bytes, payload: Buffer, keyring: Keyring | None = None
) -> bytes:
    """The MAC a block header carries: key, namespace, length and payload, current secret, in
    the keyring's :attr:`~Keyring.sign_version`."""
    ring = keyring or _installed
    version = ring.sign_version
    return ring.sign(_prefix(key, namespace, len(payload), version), (payload,), version)


@dataclass(frozen=True, slots=True)
class WireHeader:
    """The header of one stored value as it is on nvme and redis: the MAC, no checksum."""

    key: bytes
    namespace: bytes
    length: int
    mac: bytes
    version: int = VERSION

    @classmethod
    def for_payload(
        cls, key: bytes, namespace: bytes, payload: Buffer, keyring: Keyring | None = None
    ) -> WireHeader:
        """Sign ``payload`` stored under ``key`` in ``namespace``: the header that goes with it."""
        version = (keyring or _installed).sign_version
        mac = block_mac(key, namespace, payload, keyring)
        return cls(key, namespace, len(payload), mac, version)

    def pack(self) -> bytes:
        """Serialize to exactly :data:`HEADER_BYTES` bytes."""
        if len(self.key) != KEY_BYTES or len(self.namespace) != NAMESPACE_BYTES:
            raise ValueError("a header needs a 16-byte key and a 16-byte namespace fingerprint")
        if len(self.mac) != MAC_BYTES:
            raise ValueError(f"a header needs a {MAC_BYTES}-byte MAC")
        return _LAYOUT.pack(MAGIC, self.version, 0, self.key, self.namespace, self.length, self.mac)

    @classmethod
    def unpack(cls, data: Buffer) -> WireHeader:
        """Parse a header; raises :class:`CorruptBlockError` if it is not one (old versions too),
        :class:`~kvstore.formats.NewerFormatError` if a later release wrote it."""
        if len(data) < HEADER_BYTES:
            raise CorruptBlockError(f"value of {len(data)} bytes is shorter than a header")
        magic, version, flags, key, namespace, length, mac = _LAYOUT.unpack_from(data)
        if magic == MAGIC and BLOCK.is_newer(version):
            raise NewerFormatError(BLOCK, version)
        if magic != MAGIC or version not in (HMAC_VERSION, BLAKE3_VERSION):
            # Version 1 blocks carry an unkeyed checksum anyone could recompute: never trusted.
            raise CorruptBlockError(f"bad magic {magic!r} or version {version}")
        if flags != 0:  # no flag is defined in versions 2, 3; a set bit means the header rotted
            raise CorruptBlockError(f"unknown header flags {flags:#x}")
        return cls(bytes(key), bytes(namespace), length, bytes(mac), version)

    def verify(self, payload: Buffer, keyring: Keyring | None = None) -> None:
        """Raise :class:`CorruptBlockError` unless ``payload`` matches this header exactly."""
        self.verify_parts([payload], keyring)

    def verify_parts(self, parts: Sequence[Buffer], keyring: Keyring | None = None) -> None:
        """:meth:`verify` for a payload held in pieces (the pages of an arena block), in order."""
        length = sum(len(part) for part in parts)
        if length != self.length:
            raise CorruptBlockError(f"payload is {length} bytes, header says {self.length}")
        ring = keyring or _installed
        prefix = _prefix(self.key, self.namespace, length, self.version)
        if not ring.verify(prefix, parts, self.mac, self.version):
            raise CorruptBlockError(f"MAC mismatch for key {self.key.hex()}")


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A block's header in server memory: key, namespace, length and an xxh3-64 checksum.

    ``checksum`` is ``None`` only in headers a persistent tier lists at start-up without reading
    the payload (:meth:`kvstore.tiers.base.Tier.scan`), which serve to index and nothing else.
    ``mac`` is the block's keyed MAC where it is known already (a block read from nvme or redis,
    whose MAC was just verified), so that sealing it again costs a checksum, not a MAC;
    ``mac_version`` the header version it was computed for.
    """

    key: bytes
    namespace: bytes
    length: int
    checksum: int | None
    #: A cache, not part of what the header says: equal headers may differ in it.
    mac: bytes | None = field(default=None, compare=False)
    mac_version: int = field(default=VERSION, compare=False)

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
        than signed. Costs a MAC over the payload, except where :attr:`mac` is known or
        ``keyring`` remembers this block's seal (:meth:`Keyring.remembered`; a seal computed
        here is remembered): call it off the event loop for large blocks.
        """
        self.verify(payload)
        if self.mac is not None:  # the payload is the one this MAC was verified over
            return WireHeader(
                self.key, self.namespace, self.length, self.mac, self.mac_version
            ).pack()
        ring = keyring or _installed
        sealed = ring.remembered(self)
        if sealed is None:  # signed once per block and keyring, however often it is served
            sealed = encode_header(self.key, self.namespace, payload, ring)
            ring.remember(self, sealed)
        return sealed


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
    checksum = checksum_of((payload,))
    header = BlockHeader(wire.key, wire.namespace, wire.length, checksum, wire.mac, wire.version)
    return header, payload


def verify_sealed(
    key: bytes, namespace: bytes, header: Buffer, payload: Buffer, keyring: Keyring | None = None
) -> BlockHeader:
    """Verify a block that travelled as a packed header beside its payload (a peer's answer).

    Returns the in-memory header (checksum computed, MAC kept); raises :class:`CorruptBlockError`
    unless ``header`` is a version-2 or -3 header for exactly ``key`` in ``namespace`` whose MAC,
    under ``keyring``, covers ``payload``. A missing header (empty) fails like a forged one. The
    keyring remembers the seal (:meth:`Keyring.remember`): serving the block on from here signs
    nothing. Costs a MAC and a checksum over the payload: call it off the event loop for large
    payloads.
    """
    if len(header) != HEADER_BYTES:
        raise CorruptBlockError(f"a sealed header is {HEADER_BYTES} bytes, got {len(header)}")
    wire = WireHeader.unpack(header)
    if wire.key != key:
        raise CorruptBlockError(f"block for {key.hex()} is sealed for key {wire.key.hex()}")
    if wire.namespace != namespace:
        raise CorruptBlockError(f"block for {key.hex()} is sealed for another namespace")
    wire.verify(payload, keyring)
    checksum = checksum_of((payload,))
    verified = BlockHeader(key, namespace, wire.length, checksum, wire.mac, wire.version)
    (keyring or _installed).remember(verified, wire.pack())
    return verified
