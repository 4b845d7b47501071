"""The shared-memory bodies (:mod:`kvstore.protocol.shm_messages`): what one end packs the other
reads back, in the very bytes the hand-packed format had (the previous release speaks it), and a
body cut short, run long or made of garbage is refused with a message that says which."""

from __future__ import annotations

import contextlib
import random
import struct
import warnings
from collections.abc import Callable

import pytest

from kvstore.errors import (
    CapacityError,
    InternalStoreError,
    InvalidRequestError,
    KVStoreError,
    NamespaceMismatchError,
)
from kvstore.formats import SHM_FRAMES
from kvstore.keys import KEY_BYTES
from kvstore.protocol.shm_frames import (
    MAX_TOUCH_LOOKUPS,
    PROTOCOL_VERSION,
    Cursor,
    Hello,
    Op,
    ProtocolError,
    frame_length,
    max_frame_length,
    pack_keys,
    unpack_hello,
)
from kvstore.protocol.shm_messages import (
    INTERNAL,
    OK,
    AcquireSlot,
    CommitCounts,
    Lent,
    ReservedItem,
    ReserveSlot,
    error_reply,
    pack_acquire_reply,
    pack_commit,
    pack_commit_from,
    pack_commit_reply,
    pack_lookup_reply,
    pack_reserve,
    pack_reserve_reply,
    pack_touch,
    read_acquire_reply,
    read_commit,
    read_commit_from,
    read_commit_reply,
    read_lookup_reply,
    read_reserve,
    read_reserve_reply,
    read_touch,
    reply_error,
)
from kvstore.retention import KEEP, RETENTION_TIERS, Retention

KEYS = [bytes([i]) * KEY_BYTES for i in range(3)]
RETAINED = Retention(60.0, RETENTION_TIERS[-1])
MAX_KEYS = 8


def _ranges(*pairs: tuple[int, int]) -> bytes:
    """The ranges layout written out by hand: ``count:u16``, then ``offset:u64 length:u64``."""
    return struct.pack("<H", len(pairs)) + b"".join(struct.pack("<QQ", *p) for p in pairs)


def _retention(retention: Retention) -> bytes:
    return struct.pack("<dB", retention.seconds, RETENTION_TIERS.index(retention.tiers))


def test_the_two_slot_enums_keep_the_numbers_on_the_wire() -> None:
    assert [(k.name, k.value) for k in AcquireSlot] == [("MISS", 0), ("LEASE", 1), ("BYTES", 2)]
    assert [(k.name, k.value) for k in ReserveSlot] == [
        ("NO_ROOM", 0),
        ("PRESENT", 1),
        ("RESERVED", 2),
    ]


def test_acquire_reply_bytes_and_round_trip() -> None:
    items = [None, Lent(7, [(4096, 100), (0, 28)]), b"inline"]
    body = pack_acquire_reply(items)
    assert body == (
        b"\x00"
        + struct.pack("<BQ", 1, 7)
        + _ranges((4096, 100), (0, 28))
        + struct.pack("<BQ", 2, 6)
        + b"inline"
    )
    read = read_acquire_reply(body, 3)
    assert read[0] is None and read[1] == Lent(7, [(4096, 100), (0, 28)])
    assert bytes(read[2]) == b"inline"  # type: ignore[arg-type]


def test_reserve_reply_bytes_and_round_trip() -> None:
    items: list[ReservedItem] = [ReserveSlot.NO_ROOM, Lent(9, [(8192, 64)]), ReserveSlot.PRESENT]
    body = pack_reserve_reply(items)
    assert body == b"\x00" + struct.pack("<BQ", 2, 9) + _ranges((8192, 64)) + b"\x01"
    assert read_reserve_reply(body, 3) == items
    with pytest.raises(ValueError, match="PRESENT or NO_ROOM"):
        pack_reserve_reply([ReserveSlot.RESERVED])  # a reserved slot carries its pages


def test_lookup_and_commit_replies() -> None:
    assert pack_lookup_reply(2, [0, 1, 255]) == struct.pack("<I", 2) + bytes([0, 1, 255])
    assert read_lookup_reply(pack_lookup_reply(2, [0, 1, 255]), 3) == (2, bytes([0, 1, 255]))
    assert pack_commit_reply(3, 1, 0) == struct.pack("<III", 3, 1, 0)
    assert read_commit_reply(pack_commit_reply(3, 1, 0)) == CommitCounts(3, 1, 0)


@pytest.mark.parametrize("retention", [KEEP, RETAINED])
def test_requests_bytes_and_round_trip(retention: Retention) -> None:
    lengths = [10, 20, 30]
    reserve = pack_reserve(KEYS, lengths, retention)
    assert reserve == pack_keys(KEYS) + struct.pack("<3Q", *lengths) + _retention(retention)
    assert read_reserve(reserve, MAX_KEYS) == (KEYS, lengths, retention)
    commit = pack_commit([5, 6], retention)
    assert commit == struct.pack("<I2Q", 2, 5, 6) + _retention(retention)
    assert read_commit(commit) == ([5, 6], retention)
    moved = pack_commit_from([5, 6], [0, 4096], retention)
    assert moved == struct.pack("<I2Q2Q", 2, 5, 6, 0, 4096) + _retention(retention)
    assert read_commit_from(moved) == ([5, 6], [0, 4096], retention)
    touch = pack_touch(1, 4, KEYS)
    assert touch == struct.pack("<II", 1, 4) + pack_keys(KEYS)
    assert read_touch(Cursor(touch), MAX_KEYS) == (1, 4, KEYS)  # the server hands its cursor


def test_a_reserve_without_its_retention_trailer_is_a_plain_put() -> None:
    # What a client older than the trailer sends.
    older = pack_keys(KEYS[:1]) + struct.pack("<Q", 10)
    assert read_reserve(older, MAX_KEYS).retention == KEEP
    assert read_commit(struct.pack("<IQ", 1, 5)) == ([5], KEEP)


def _valid_bodies() -> dict[str, tuple[bytes, Callable[[bytes], object]]]:
    """Each codec's valid body and its reader (a function of the body alone)."""
    acquire = pack_acquire_reply([None, Lent(7, [(0, 4)]), b"abc"])
    reserve = pack_reserve_reply([Lent(9, [(0, 4)]), ReserveSlot.PRESENT])
    return {
        "acquire reply": (acquire, lambda b: read_acquire_reply(b, 3)),
        "reserve reply": (reserve, lambda b: read_reserve_reply(b, 2)),
        "lookup reply": (pack_lookup_reply(1, [0, 255]), lambda b: read_lookup_reply(b, 2)),
        "commit reply": (pack_commit_reply(1, 0, 0), read_commit_reply),
        "reserve": (pack_reserve(KEYS, [1, 2, 3], RETAINED), lambda b: read_reserve(b, MAX_KEYS)),
        "commit": (pack_commit([1, 2], RETAINED), read_commit),
        "commit from": (pack_commit_from([1], [0], RETAINED), read_commit_from),
        "touch": (pack_touch(1, 1, KEYS), lambda b: read_touch(b, MAX_KEYS)),
    }


@pytest.mark.parametrize("name", sorted(_valid_bodies()))
def test_a_truncated_body_is_refused_and_says_so(name: str) -> None:
    body, read = _valid_bodies()[name]
    for cut in range(len(body)):
        prefix = body[:cut]
        if name in ("reserve", "commit", "commit from") and cut == len(body) - 9:
            continue  # cut exactly before the optional retention trailer: a plain put
        with pytest.raises(ProtocolError, match="truncated frame"):
            read(prefix)


@pytest.mark.parametrize("name", sorted(_valid_bodies()))
def test_a_body_with_bytes_past_its_end_is_refused(name: str) -> None:
    body, read = _valid_bodies()[name]
    with pytest.raises(ProtocolError, match="trailing bytes"):
        read(body + b"\x00" * 9 + b"!")


def test_unknown_slot_kinds_are_named_with_the_ones_allowed() -> None:
    with pytest.raises(ProtocolError, match=r"ACQUIRE slot kind 3 is none of 0 \(MISS\)"):
        read_acquire_reply(b"\x03", 1)
    with pytest.raises(ProtocolError, match=r"RESERVE slot kind 7 .*2 \(RESERVED\)"):
        read_reserve_reply(b"\x07", 1)


def test_counts_and_sizes_are_checked_before_anything_is_built() -> None:
    # An inline block, a range list or an id list that claims more than the body holds.
    with pytest.raises(ProtocolError, match="truncated"):
        read_acquire_reply(struct.pack("<BQ", AcquireSlot.BYTES, 2**63), 1)
    with pytest.raises(ProtocolError, match="truncated"):
        read_acquire_reply(struct.pack("<BQH", AcquireSlot.LEASE, 1, 65535), 1)
    with pytest.raises(ProtocolError, match="truncated"):
        read_commit(struct.pack("<I", 2**32 - 1))
    with pytest.raises(InvalidRequestError, match="the limit is 8"):
        read_reserve(struct.pack("<I", MAX_KEYS + 1), MAX_KEYS)
    with pytest.raises(ProtocolError, match="claims 5 hits of 2 keys"):
        read_lookup_reply(pack_lookup_reply(5, [0, 0]), 2)
    with pytest.raises(ProtocolError, match="claims 4 calls"):
        read_touch(pack_touch(4, 0, KEYS), MAX_KEYS)
    with pytest.raises(ProtocolError, match="lookups"):
        read_touch(pack_touch(1, MAX_TOUCH_LOOKUPS + 1, KEYS), MAX_KEYS)
    with pytest.raises(ProtocolError, match="retention tiers 9"):
        read_commit(struct.pack("<IQdB", 1, 5, 1.0, 9))


def test_the_largest_legal_requests_fit_their_frame_limit() -> None:
    """What a client may send for ``max_keys`` keys is never over what the server reads."""
    keys = [b"k" * KEY_BYTES] * MAX_KEYS
    ids = list(range(MAX_KEYS))
    largest = {
        Op.RESERVE: pack_reserve(keys, [2**40] * MAX_KEYS, RETAINED),
        Op.COMMIT: pack_commit(ids, RETAINED),
        Op.COMMIT_FROM: pack_commit_from(ids, ids, RETAINED),
        Op.TOUCH: pack_touch(MAX_KEYS, MAX_TOUCH_LOOKUPS, keys),
    }
    for op, body in largest.items():
        assert 1 + len(body) == max_frame_length(op, MAX_KEYS), op
    assert frame_length(struct.pack("<I", 5)) == 5
    with pytest.raises(ValueError, match="2 window offsets for 1"):
        pack_commit_from([1], [0, 0], KEEP)


def test_garbage_is_refused_with_a_protocol_error_and_nothing_else() -> None:
    rng = random.Random(39)
    readers = [read for _, read in _valid_bodies().values()]
    for _ in range(2000):
        body = rng.randbytes(rng.randrange(0, 48))
        read = rng.choice(readers)
        with contextlib.suppress(ProtocolError, InvalidRequestError):
            read(body)


def test_errors_travel_as_their_status_and_come_back_as_their_class() -> None:
    cases = [
        (CapacityError("full"), CapacityError),
        (NamespaceMismatchError("other"), NamespaceMismatchError),
        (KVStoreError("x"), InternalStoreError),  # no status of its own: INTERNAL
    ]
    for error, expected in cases:
        reply = error_reply(error)
        status, body = reply[4], reply[5:]
        assert status != OK and struct.unpack("<I", reply[:4])[0] == len(reply) - 4
        back = reply_error(status, body)
        assert type(back) is expected and str(error) in str(back)
    assert "INTERNAL" in str(reply_error(INTERNAL, b"internal error: KeyError"))
    assert "UNKNOWN" in str(reply_error(200, b"\xff"))  # no such code, undecodable text


def test_the_old_slot_class_still_imports_with_a_warning() -> None:
    from kvstore.protocol import shm_frames

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slot = shm_frames.Slot
    assert slot.LEASE == AcquireSlot.LEASE and slot.RESERVED == ReserveSlot.RESERVED
    assert slot.NO_ROOM == ReserveSlot.NO_ROOM and slot.BYTES == AcquireSlot.BYTES
    [warning] = caught
    assert warning.category is DeprecationWarning
    assert "AcquireSlot or ReserveSlot" in str(warning.message) and "removed in" in str(
        warning.message
    )


def test_the_hello_carries_the_version_declared_with_the_other_formats() -> None:
    hello = Hello(1 << 20, 4096, MAX_KEYS, b"i" * 16, ["dram", "nvme"])
    body = hello.pack()
    assert body[:4] == struct.pack("<I", SHM_FRAMES.latest) and PROTOCOL_VERSION == 3
    assert unpack_hello(body) == hello
    other = struct.pack("<I", SHM_FRAMES.latest + 1) + body[4:]
    with pytest.raises(ProtocolError, match="shared-memory protocol 4, this client 3"):
        unpack_hello(other)
    with pytest.raises(ProtocolError, match="truncated"):
        unpack_hello(body[:20])
