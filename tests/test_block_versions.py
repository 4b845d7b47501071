"""Header versions and the keyring's memory of seals (:mod:`kvstore.block`).

Version 3 headers carry a keyed BLAKE3 MAC; version 2 blocks (HMAC-SHA256), written before the
change into nvme or redis, still verify under the same secrets, and a header cannot be moved from
one version to the other without the secret. A keyring remembers each block's seal by its
in-memory header, so serving a block again signs nothing, but only for bytes that still match
the checksum: a changed payload is refused, never sent with a remembered MAC.
"""

from __future__ import annotations

import hmac
import struct

import pytest

from kvstore import block
from kvstore.block import (
    HEADER_BYTES,
    BlockHeader,
    CorruptBlockError,
    Keyring,
    NewerFormatError,
    decode_value,
    encode_header,
    verify_sealed,
)

KEY = bytes(range(16))
NS = bytes(range(100, 116))
PAYLOAD = bytes((i * 53 + 7) % 256 for i in range(10_000))
SECRET = b"cluster secret"


def v2_header(payload: bytes = PAYLOAD, secret: bytes = SECRET) -> bytes:
    """A version-2 header as the code before BLAKE3 wrote it (HMAC-SHA256/128), written out
    independently of the module."""
    derived = hmac.digest(secret, b"kvstore block MAC v2", "sha256")
    prefix = struct.pack("<4sHH16s16sQ", b"KVB1", 2, 0, KEY, NS, len(payload))
    return prefix + hmac.digest(derived, prefix + payload, "sha256")[:16]


def flip(value: bytes, byte: int) -> bytes:
    mutable = bytearray(value)
    mutable[byte] ^= 1
    return bytes(mutable)


def test_new_blocks_are_version_3() -> None:
    assert block.VERSION == 3
    assert struct.unpack_from("<H", encode_header(KEY, NS, PAYLOAD), 4)[0] == 3


def test_a_version_2_block_still_verifies_from_a_tier_and_from_a_peer() -> None:
    ring = Keyring([SECRET])
    header, view = decode_value(KEY, v2_header() + PAYLOAD, ring)
    assert bytes(view) == PAYLOAD
    # Sealed again as it was read: still version 2, still verifying.
    resealed = header.seal(view, Keyring([b"unused"]))
    assert resealed == v2_header()
    got = verify_sealed(KEY, NS, resealed, PAYLOAD, ring)
    assert got.mac_version == 2


def test_a_version_2_block_is_refused_when_changed_or_under_another_secret() -> None:
    ring = Keyring([SECRET])
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(KEY, v2_header() + flip(PAYLOAD, 9), ring)
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(KEY, v2_header(secret=b"attacker") + PAYLOAD, ring)


@pytest.mark.parametrize("to_version", [2, 4, 1])
def test_a_header_relabelled_to_another_version_is_refused(to_version: int) -> None:
    ring = Keyring([SECRET])
    raw = bytearray(encode_header(KEY, NS, PAYLOAD, ring))
    struct.pack_into("<H", raw, 4, to_version)
    # A version past those read is a later release's (a miss left in place, tests/test_formats.py).
    refused = NewerFormatError if to_version > 3 else CorruptBlockError
    with pytest.raises(refused):
        verify_sealed(KEY, NS, bytes(raw), PAYLOAD, ring)
    with pytest.raises(refused):
        decode_value(KEY, bytes(raw) + PAYLOAD, ring)


def test_a_version_2_mac_relabelled_as_3_is_refused() -> None:
    raw = bytearray(v2_header())
    struct.pack_into("<H", raw, 4, 3)
    with pytest.raises(CorruptBlockError, match="MAC"):
        verify_sealed(KEY, NS, bytes(raw), PAYLOAD, Keyring([SECRET]))


# --- the keyring's memory of seals ----------------------------------------------------------------


def counting(ring: Keyring) -> list[int]:
    """Count the MACs ``ring`` computes (one entry per MAC)."""
    calls: list[int] = []
    original = ring._mac

    def spy(*args: object) -> bytes:
        calls.append(1)
        return original(*args)  # type: ignore[arg-type]

    ring._mac = spy  # type: ignore[method-assign]
    return calls


def test_a_block_is_signed_once_however_often_it_is_sealed() -> None:
    ring = Keyring([SECRET])
    calls = counting(ring)
    header = BlockHeader.for_payload(KEY, NS, PAYLOAD)
    first = header.seal(PAYLOAD, ring)
    # Another header object for the same block (as the write-through and the dram tier hold).
    again = BlockHeader.for_payload(KEY, NS, PAYLOAD).seal(memoryview(PAYLOAD), ring)
    assert first == again == encode_header(KEY, NS, PAYLOAD, Keyring([SECRET]))
    assert len(calls) == 1


def test_a_remembered_seal_never_covers_changed_bytes() -> None:
    ring = Keyring([SECRET])
    header = BlockHeader.for_payload(KEY, NS, PAYLOAD)
    header.seal(PAYLOAD, ring)
    with pytest.raises(CorruptBlockError, match="checksum"):
        header.seal(flip(PAYLOAD, 100), ring)
    # Other bytes under the same key are another block: signed for what they are.
    other = flip(PAYLOAD, 100)
    sealed = BlockHeader.for_payload(KEY, NS, other).seal(other, ring)
    verify_sealed(KEY, NS, sealed, other, Keyring([SECRET]))
    with pytest.raises(CorruptBlockError, match="MAC"):
        verify_sealed(KEY, NS, sealed, PAYLOAD, Keyring([SECRET]))


def test_seals_are_remembered_per_keyring() -> None:
    ring, tenant = Keyring([SECRET]), Keyring([SECRET]).for_tenant("a")
    header = BlockHeader.for_payload(KEY, NS, PAYLOAD)
    header.seal(PAYLOAD, ring)
    sealed = header.seal(PAYLOAD, tenant)
    verify_sealed(KEY, NS, sealed, PAYLOAD, Keyring([SECRET]).for_tenant("a"))
    with pytest.raises(CorruptBlockError, match="MAC"):
        verify_sealed(KEY, NS, sealed, PAYLOAD, Keyring([SECRET]))


def test_a_verified_peer_block_is_served_on_without_signing() -> None:
    holder, reader = Keyring([SECRET]), Keyring([SECRET])
    sealed = encode_header(KEY, NS, PAYLOAD, holder)
    verify_sealed(KEY, NS, sealed, PAYLOAD, reader)
    calls = counting(reader)
    # The reader stores the block under a header of its own, then a third node reads it.
    assert BlockHeader.for_payload(KEY, NS, PAYLOAD).seal(PAYLOAD, reader) == sealed
    assert calls == []


def test_a_failed_verification_is_not_remembered() -> None:
    reader = Keyring([SECRET])
    forged = encode_header(KEY, NS, PAYLOAD, Keyring([b"attacker"]))
    with pytest.raises(CorruptBlockError):
        verify_sealed(KEY, NS, forged, PAYLOAD, reader)
    assert reader.remembered(BlockHeader.for_payload(KEY, NS, PAYLOAD)) is None


def test_the_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block, "MEMO_ENTRIES", 4)
    ring = Keyring([SECRET])
    headers = []
    for n in range(10):
        payload = PAYLOAD + bytes([n])
        header = BlockHeader.for_payload(KEY, NS, payload)
        header.seal(payload, ring)
        headers.append(header)
    assert len(ring._memo) == 4
    assert ring.remembered(headers[0]) is None
    assert ring.remembered(headers[9]) is not None
    assert len(ring.remembered(headers[9]) or b"") == HEADER_BYTES


def test_headers_listed_without_a_checksum_are_never_remembered() -> None:
    ring = Keyring([SECRET])
    listed = BlockHeader(KEY, NS, len(PAYLOAD), None)
    ring.remember(listed, encode_header(KEY, NS, PAYLOAD, ring))
    assert ring.remembered(listed) is None


def test_a_keyring_signing_version_2_writes_what_older_nodes_read() -> None:
    ring = Keyring([SECRET], sign_version=2)
    assert encode_header(KEY, NS, PAYLOAD, ring) == v2_header()
    header = BlockHeader.for_payload(KEY, NS, PAYLOAD)
    assert header.seal(PAYLOAD, ring) == v2_header()
    with pytest.raises(ValueError, match="allowed: 2, 3"):
        Keyring([SECRET], sign_version=1)
