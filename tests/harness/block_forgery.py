"""What an attacker who can write a tier's storage (Redis, the LMDB file) but lacks the integrity
secret can produce: old-format blocks with a correct plain checksum, and version-2 blocks signed
with a secret of their own. Both look perfectly well-formed; neither may ever be served."""

from __future__ import annotations

import struct

import xxhash

from kvstore.block import HEADER_BYTES, Keyring, WireHeader, encode_header

ATTACKER = Keyring([b"not the cluster's secret"])


def v1_value(key: bytes, namespace: bytes, payload: bytes) -> bytes:
    """A version-1 block (``KVB1``, version 1, xxh3-64 over header fields and payload)."""
    prefix = struct.pack("<4sHH16s16sQ", b"KVB1", 1, 0, key, namespace, len(payload))
    return prefix + struct.pack("<Q8x", xxhash.xxh3_64_intdigest(prefix + payload)) + payload


def forged_value(key: bytes, namespace: bytes, payload: bytes) -> bytes:
    """A version-2 block whose MAC is computed with :data:`ATTACKER`'s secret."""
    return encode_header(key, namespace, payload, ATTACKER) + payload


def rewrite_payload(value: bytes, forge: str) -> bytes:
    """``value`` (a genuine stored block) with a different payload and a forged header."""
    header = WireHeader.unpack(value)
    evil = bytes(b ^ 0x5A for b in value[HEADER_BYTES:])
    make = v1_value if forge == "v1" else forged_value
    return make(header.key, header.namespace, evil)
