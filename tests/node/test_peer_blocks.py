"""The one check every block a node reads from a peer passes (:mod:`kvstore.node.peer_blocks`):
only a block sealed for its key and namespace under the reader's keyring, within the size limit,
is ever used; a missing block is nothing to refuse."""

from __future__ import annotations

from kvstore.block import Keyring, encode_header
from kvstore.node.peer_blocks import SealedBlock, verify_blocks

RING = Keyring([b"cluster"]).for_tenant("")
NS = bytes(range(100, 116))
KEYS = [bytes([n]) * 16 for n in range(6)]
PAYLOAD = b"kv" * 1000


def sealed(key: bytes, payload: bytes = PAYLOAD, ring: Keyring = RING) -> SealedBlock:
    return SealedBlock(encode_header(key, NS, payload, ring), payload)


def test_only_blocks_sealed_for_their_key_under_the_reader_s_keyring_pass() -> None:
    blocks = [
        sealed(KEYS[0]),  # genuine
        None,  # not held: nothing to refuse
        SealedBlock(b"", PAYLOAD),  # no header (a peer that does not seal)
        sealed(KEYS[0]),  # another key's genuine block
        sealed(KEYS[4], ring=Keyring([b"rogue"])),  # a secret of its own
        SealedBlock(
            sealed(KEYS[5]).header, b"forged" * 333 + b"kv"
        ),  # a genuine header, forged bytes
    ]
    assert verify_blocks(KEYS, NS, blocks, RING, 1 << 20) == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]


def test_a_block_over_the_size_limit_or_empty_is_refused_before_its_mac() -> None:
    big = sealed(KEYS[0], bytes(4097))
    empty = sealed(KEYS[1], b"")
    assert verify_blocks(KEYS[:2], NS, [big, empty], RING, 4096) == [False, False]


def test_a_verdict_the_transport_reached_already_is_kept() -> None:
    # UCX verifies in the thread that checks what arrived; the peer source takes that verdict.
    genuine, forged = sealed(KEYS[0]), sealed(KEYS[1], ring=Keyring([b"rogue"]))
    assert verify_blocks(
        KEYS[:2], NS, [genuine._replace(verified=False), forged], RING, 1 << 20
    ) == [
        False,
        False,
    ]
    assert verify_blocks(KEYS[:1], NS, [genuine._replace(verified=True)], RING, 1 << 20) == [True]
