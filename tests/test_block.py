"""Tests of the self-describing block header in :mod:`kvstore.block`.

A stored value is ``header ‖ payload``; anything that is not exactly what was put under a key
(bit flips, truncation, another key's value, a header forged without the secret, an old-format
block) must raise :class:`CorruptBlockError`.
"""

from __future__ import annotations

import hmac
import struct

import blake3
import pytest
import xxhash

from kvstore.block import (
    HEADER_BYTES,
    MAGIC,
    BlockHeader,
    CorruptBlockError,
    Keyring,
    WireHeader,
    block_mac,
    decode_value,
    encode_header,
    verify_sealed,
)
from kvstore.formats import NewerFormatError
from kvstore.keys import ChunkHasher, Namespace

KEY = bytes(range(16))
OTHER_KEY = bytes(range(16, 32))
NS = bytes(range(100, 116))
OTHER_NS = bytes(range(200, 216))
PAYLOAD = bytes((i * 37 + 11) % 256 for i in range(4096 + 3))


def stored(key: bytes = KEY, namespace: bytes = NS, payload: bytes = PAYLOAD) -> bytes:
    return encode_header(key, namespace, payload) + payload


def flip(value: bytes, byte: int, bit: int = 0) -> bytes:
    mutable = bytearray(value)
    mutable[byte] ^= 1 << bit
    return bytes(mutable)


# --- header layout --------------------------------------------------------------------------------


def test_header_is_exactly_64_bytes() -> None:
    assert HEADER_BYTES == 64
    assert len(encode_header(KEY, NS, PAYLOAD)) == 64
    assert len(encode_header(KEY, NS, b"")) == 64
    assert len(WireHeader(KEY, NS, 2**64 - 1, bytes(16)).pack()) == 64


def test_header_layout_matches_documentation() -> None:
    raw = encode_header(KEY, NS, PAYLOAD)
    assert raw[0:4] == MAGIC == b"KVB1"
    assert struct.unpack_from("<HH", raw, 4) == (3, 0)
    assert raw[8:24] == KEY
    assert raw[24:40] == NS
    assert struct.unpack_from("<Q", raw, 40)[0] == len(PAYLOAD)
    assert raw[48:64] == block_mac(KEY, NS, PAYLOAD)


def test_mac_is_truncated_keyed_blake3_of_header_prefix_and_payload() -> None:
    # Written out independently of the module: the key is HMAC-SHA256(secret, label).
    secret = b"cluster secret"
    derived = hmac.digest(secret, b"kvstore block MAC v3 (keyed BLAKE3)", "sha256")
    raw = encode_header(KEY, NS, PAYLOAD, Keyring([secret]))
    expected = blake3.blake3(raw[:48] + PAYLOAD, key=derived).digest()[:16]
    assert raw[48:64] == expected


def test_pack_unpack_round_trip() -> None:
    header = WireHeader.for_payload(KEY, NS, PAYLOAD)
    assert header.key == KEY and header.namespace == NS and header.length == len(PAYLOAD)
    assert header.mac == block_mac(KEY, NS, PAYLOAD)
    assert WireHeader.unpack(header.pack()) == header
    assert WireHeader.unpack(memoryview(header.pack() + PAYLOAD)) == header
    arbitrary = WireHeader(OTHER_KEY, OTHER_NS, 12345, bytes(range(16)))
    assert WireHeader.unpack(arbitrary.pack()) == arbitrary


def test_unpack_returns_bytes_not_views() -> None:
    header = WireHeader.unpack(memoryview(bytearray(stored())))
    assert type(header.key) is bytes and type(header.namespace) is bytes


def test_encode_header_rejects_wrong_key_or_namespace_length() -> None:
    with pytest.raises(ValueError, match="16-byte"):
        encode_header(KEY[:15], NS, PAYLOAD)
    with pytest.raises(ValueError, match="16-byte"):
        encode_header(KEY, NS + b"x", PAYLOAD)


# --- decode_value ---------------------------------------------------------------------------------


@pytest.mark.parametrize("payload", [b"", b"x", PAYLOAD, bytes(1 << 20)])
def test_decode_round_trip(payload: bytes) -> None:
    header, view = decode_value(KEY, stored(payload=payload))
    assert bytes(view) == payload
    assert header == BlockHeader.for_payload(KEY, NS, payload)


def test_decode_accepts_memoryview_and_bytearray() -> None:
    value = bytearray(stored())
    _, view = decode_value(KEY, memoryview(value))
    assert bytes(view) == PAYLOAD
    _, view = decode_value(KEY, value)
    assert bytes(view) == PAYLOAD


def test_decode_payload_is_zero_copy() -> None:
    value = bytearray(stored())
    _, view = decode_value(KEY, value)
    assert isinstance(view, memoryview)
    value[HEADER_BYTES] ^= 0xFF
    assert view[0] == PAYLOAD[0] ^ 0xFF


def test_real_keys_and_fingerprint_round_trip() -> None:
    namespace = Namespace(model="m", dtype="float16")
    key = ChunkHasher(4, namespace).keys(range(4))[0]
    value = encode_header(key, namespace.fingerprint(), PAYLOAD) + PAYLOAD
    header, view = decode_value(key, value)
    assert header.namespace == namespace.fingerprint()
    assert bytes(view) == PAYLOAD


@pytest.mark.parametrize("byte", [0, 1, len(PAYLOAD) // 2, len(PAYLOAD) - 1])
@pytest.mark.parametrize("bit", [0, 7])
def test_flipped_payload_bit_is_detected(byte: int, bit: int) -> None:
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(KEY, flip(stored(), HEADER_BYTES + byte, bit))


@pytest.mark.parametrize("byte", range(8, 24))
def test_flipped_key_bit_in_header_is_detected(byte: int) -> None:
    value = flip(stored(), byte, byte % 8)
    with pytest.raises(CorruptBlockError):
        decode_value(KEY, value)
    # Even a reader asking for the corrupted key is refused: the MAC covers the key.
    corrupted_key = value[8:24]
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(corrupted_key, value)


@pytest.mark.parametrize("byte", [24, 31, 39])
def test_flipped_namespace_bit_is_detected(byte: int) -> None:
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(KEY, flip(stored(), byte, 3))


@pytest.mark.parametrize("byte", [40, 41, 47])
def test_flipped_length_bit_is_detected(byte: int) -> None:
    with pytest.raises(CorruptBlockError):
        decode_value(KEY, flip(stored(), byte))


@pytest.mark.parametrize("byte", [48, 52, 55, 56, 63])
def test_flipped_mac_bit_is_detected(byte: int) -> None:
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(KEY, flip(stored(), byte, 5))


@pytest.mark.parametrize("byte", [0, 1, 2, 3])
def test_wrong_magic_is_detected(byte: int) -> None:
    with pytest.raises(CorruptBlockError, match="magic"):
        decode_value(KEY, flip(stored(), byte, 1))


def test_a_version_older_than_any_read_is_corrupt() -> None:
    value = bytearray(stored())
    struct.pack_into("<H", value, 4, 1)
    with pytest.raises(CorruptBlockError, match="version"):
        decode_value(KEY, bytes(value))


def test_a_newer_version_is_left_to_a_later_release() -> None:
    # A block a later release wrote is not corrupt: a miss that leaves it in place (issue 41).
    value = bytearray(stored())
    struct.pack_into("<H", value, 4, 4)
    with pytest.raises(NewerFormatError, match="newer"):
        decode_value(KEY, bytes(value))


@pytest.mark.parametrize("byte", [6, 7])
def test_flipped_flags_bit_is_detected(byte: int) -> None:
    with pytest.raises(CorruptBlockError):
        decode_value(KEY, flip(stored(), byte))


@pytest.mark.parametrize("cut", [1, 7, len(PAYLOAD)])
def test_truncated_payload_is_detected(cut: int) -> None:
    with pytest.raises(CorruptBlockError, match="header says"):
        decode_value(KEY, stored()[:-cut])


@pytest.mark.parametrize("length", [0, 1, 40, HEADER_BYTES - 1])
def test_truncated_header_is_detected(length: int) -> None:
    with pytest.raises(CorruptBlockError, match="shorter than a header"):
        decode_value(KEY, stored()[:length])


def test_trailing_bytes_are_detected() -> None:
    with pytest.raises(CorruptBlockError, match="header says"):
        decode_value(KEY, stored() + b"\x00")


def test_value_stored_under_another_key_is_detected() -> None:
    with pytest.raises(CorruptBlockError, match=OTHER_KEY.hex()):
        decode_value(KEY, stored(key=OTHER_KEY))


def test_header_from_one_payload_does_not_verify_another() -> None:
    other = bytes(reversed(PAYLOAD))
    value = encode_header(KEY, NS, PAYLOAD) + other
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(KEY, value)


def test_verify_checks_length_then_mac() -> None:
    header = WireHeader.for_payload(KEY, NS, PAYLOAD)
    header.verify(PAYLOAD)
    with pytest.raises(CorruptBlockError, match="header says"):
        header.verify(PAYLOAD[:-1])
    with pytest.raises(CorruptBlockError, match="MAC"):
        header.verify(flip(PAYLOAD, 0))


# --- MAC -----------------------------------------------------------------------------------------


def test_mac_covers_key_namespace_and_payload() -> None:
    base = block_mac(KEY, NS, PAYLOAD)
    assert block_mac(KEY, NS, PAYLOAD) == base
    assert block_mac(OTHER_KEY, NS, PAYLOAD) != base
    assert block_mac(KEY, OTHER_NS, PAYLOAD) != base
    assert block_mac(KEY, NS, flip(PAYLOAD, 100)) != base
    assert block_mac(KEY, NS, PAYLOAD + b"\x00") != base


def test_mac_covers_namespace_in_stored_values() -> None:
    # A header rewritten to claim another namespace (same key, same payload) is refused.
    value = bytearray(stored())
    value[24:40] = OTHER_NS
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(KEY, bytes(value))
    # A genuine value under the other namespace has a different header.
    assert stored(namespace=OTHER_NS)[:HEADER_BYTES] != stored()[:HEADER_BYTES]


def test_mac_accepts_memoryview() -> None:
    assert block_mac(KEY, NS, memoryview(PAYLOAD)) == block_mac(KEY, NS, PAYLOAD)


def test_verify_parts_matches_whole_payload() -> None:
    header = WireHeader.for_payload(KEY, NS, PAYLOAD)
    header.verify_parts([PAYLOAD[:100], memoryview(PAYLOAD)[100:4000], PAYLOAD[4000:]])
    with pytest.raises(CorruptBlockError, match="MAC"):
        header.verify_parts([PAYLOAD[:100], flip(PAYLOAD[100:], 0)])


# --- forgery, old format, rotation ----------------------------------------------------------------


def v1_value(key: bytes = KEY, namespace: bytes = NS, payload: bytes = PAYLOAD) -> bytes:
    """A version-1 block: its plain xxh3-64 checksum is what anyone can recompute."""
    prefix = struct.pack("<4sHH16s16sQ", b"KVB1", 1, 0, key, namespace, len(payload))
    digest = xxhash.xxh3_64_intdigest(prefix + payload)
    return prefix + struct.pack("<Q8x", digest) + payload


def test_old_format_block_is_refused() -> None:
    with pytest.raises(CorruptBlockError, match="version 1"):
        decode_value(KEY, v1_value())


def test_header_forged_without_the_secret_is_refused() -> None:
    # An attacker recomputes a complete, well-formed header with a secret of their own.
    forged_payload = b"attacker bytes" * 100
    forged = encode_header(KEY, NS, forged_payload, Keyring([b"attacker"])) + forged_payload
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(KEY, forged, Keyring([b"cluster"]))


def test_rotation_old_secret_verifies_while_listed() -> None:
    old, new = Keyring([b"old"]), Keyring([b"new", b"old"])
    value = encode_header(KEY, NS, PAYLOAD, old) + PAYLOAD
    _, view = decode_value(KEY, value, new)
    assert bytes(view) == PAYLOAD
    # New blocks are signed with the first secret: a ring of only the old one refuses them.
    fresh = encode_header(KEY, NS, PAYLOAD, new) + PAYLOAD
    assert fresh[48:64] != value[48:64]
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(KEY, fresh, old)
    with pytest.raises(CorruptBlockError, match="MAC"):
        decode_value(KEY, value, Keyring([b"new"]))


def test_keyring_rejects_empty() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Keyring([])
    with pytest.raises(ValueError, match="empty"):
        Keyring([b"a", b""])


# --- sealed blocks (a peer's answer: header beside the payload) -----------------------------------

CLUSTER = Keyring([b"cluster"])


def test_a_sealed_block_verifies_and_keeps_its_mac() -> None:
    header = encode_header(KEY, NS, PAYLOAD, CLUSTER)
    got = verify_sealed(KEY, NS, header, memoryview(PAYLOAD), CLUSTER)
    assert got == BlockHeader.for_payload(KEY, NS, PAYLOAD)
    assert got.mac == header[48:64]


@pytest.mark.parametrize(
    "case", ["no header", "short header", "other key", "other namespace", "attacker", "tenant"]
)
def test_a_sealed_block_that_is_not_exactly_this_key_s_is_refused(case: str) -> None:
    header = encode_header(KEY, NS, PAYLOAD, CLUSTER)
    ring = CLUSTER
    if case == "no header":
        header = b""
    elif case == "short header":
        header = header[:63]
    elif case == "other key":
        header = encode_header(OTHER_KEY, NS, PAYLOAD, CLUSTER)
    elif case == "other namespace":
        header = encode_header(KEY, OTHER_NS, PAYLOAD, CLUSTER)
    elif case == "attacker":
        header = encode_header(KEY, NS, PAYLOAD, Keyring([b"attacker"]))
    else:  # sealed by tenant a, read by tenant b of the same cluster
        header = encode_header(KEY, NS, PAYLOAD, CLUSTER.for_tenant("a"))
        ring = CLUSTER.for_tenant("b")
    with pytest.raises(CorruptBlockError):
        verify_sealed(KEY, NS, header, PAYLOAD, ring)


def test_a_genuine_header_beside_other_bytes_is_refused() -> None:
    header = encode_header(KEY, NS, PAYLOAD, CLUSTER)
    with pytest.raises(CorruptBlockError, match="MAC"):
        verify_sealed(KEY, NS, header, flip(PAYLOAD, 7), CLUSTER)
    with pytest.raises(CorruptBlockError, match="bytes"):
        verify_sealed(KEY, NS, header, PAYLOAD[:-1], CLUSTER)


def test_sealing_a_header_read_back_reuses_its_mac_but_still_checks_the_payload() -> None:
    value = encode_header(KEY, NS, PAYLOAD, CLUSTER) + PAYLOAD
    header, view = decode_value(KEY, value, CLUSTER)
    # No MAC is computed: the one verified on the way in goes out again (another ring's
    # MAC would differ, so this shows the cached one is used).
    assert header.seal(view, Keyring([b"unused"])) == value[:HEADER_BYTES]
    with pytest.raises(CorruptBlockError, match="checksum"):
        header.seal(flip(PAYLOAD, 3), CLUSTER)
