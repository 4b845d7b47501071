"""Tests of the dram tier's published index (:mod:`kvstore.protocol.dram_index`).

The writer and a reader live in one process here but share nothing except the memfd, which the
reader maps read-only, exactly as a co-located client does. The seqlock's promise is checked the
way a client relies on it: after a block is removed and its pages are reused for another block,
an entry read before the change no longer validates, and the bytes really did change.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from harness.store_blocks import PAGE, key, payload

from kvstore.block import BlockHeader
from kvstore.buffers import byte_view
from kvstore.protocol.dram_index import (
    FLAG_TAGS,
    HEADER_BYTES,
    MAGIC,
    SLOT_BYTES,
    WAYS,
    IndexReader,
    IndexWriter,
    _bucket,
)
from kvstore.tiers.dram import DramTier

NS = bytes(range(16))
OTHER_NS = bytes(range(16, 32))


def index_reader(writer: IndexWriter, tags: bool = True) -> IndexReader:
    """A reader of ``writer``'s index; without ``tags`` as if an older server had written it
    (the flag cleared: the tags go unread)."""
    if not tags:
        flags_at = 32  # after magic, version, ways, buckets, closed
        struct.pack_into("<Q", writer._mapping, flags_at, 0)
    return IndexReader(writer.fd, writer.size)


@pytest.fixture
def index() -> Iterator[tuple[IndexWriter, IndexReader]]:
    writer = IndexWriter(max_blocks=256)
    reader = IndexReader(writer.fd, writer.size)
    yield writer, reader
    reader.close()
    writer.close()


def test_published_blocks_are_found_withdrawn_ones_are_not(
    index: tuple[IndexWriter, IndexReader],
) -> None:
    writer, reader = index
    for n in range(100):
        assert writer.publish(key(n), NS, n * PAGE, 1000 + n)
    assert len(writer) == 100
    for n in range(100):
        hit = reader.find(key(n), NS)
        assert hit is not None and hit[2:4] == (n * PAGE, 1000 + n)
        assert reader.unchanged(hit)
    assert reader.find(key(500), NS) is None
    writer.withdraw(key(7))
    writer.withdraw(key(500))  # not published: nothing happens
    assert reader.find(key(7), NS) is None
    assert reader.find(key(8), NS) is not None
    assert len(writer) == 99


def test_published_lists_the_namespaces_blocks_only(
    index: tuple[IndexWriter, IndexReader],
) -> None:
    writer, reader = index
    for n in range(10):
        writer.publish(key(n), NS if n % 2 else OTHER_NS, n * PAGE, 1000 + n)
    writer.withdraw(key(3))
    rows = reader.published(NS)
    assert sorted(map(tuple, rows.tolist())) == [(n * PAGE, 1000 + n) for n in (1, 5, 7, 9)]
    assert len(reader.published(bytes(16))) == 0


def test_another_namespace_is_not_found(index: tuple[IndexWriter, IndexReader]) -> None:
    writer, reader = index
    writer.publish(key(1), NS, 0, 10)
    assert reader.find(key(1), OTHER_NS) is None
    assert reader.find(key(1), NS) is not None


def test_any_change_to_a_slot_invalidates_what_was_read(
    index: tuple[IndexWriter, IndexReader],
) -> None:
    writer, reader = index
    writer.publish(key(1), NS, 0, 10)
    hit = reader.find(key(1), NS)
    assert hit is not None
    # Withdrawn and published again at the very same place: still a change (no ABA).
    writer.withdraw(key(1))
    writer.publish(key(1), NS, 0, 10)
    again = reader.find(key(1), NS)
    assert again is not None and again[0] == hit[0] and again[2:] == hit[2:]
    assert not reader.unchanged(hit)
    assert reader.unchanged(again)
    # Publishing an already published key moves it: the old entry is invalid too.
    writer.publish(key(1), NS, PAGE, 10)
    assert not reader.unchanged(again)


@pytest.mark.parametrize("tags", [True, False], ids=["tagged", "untagged"])
def test_present_agrees_with_find_for_every_key(tags: bool) -> None:
    """The vectorized lookup hashes keys into buckets exactly as the per-key one does, through
    the tags and, on an index an older server wrote, through every way."""
    writer = IndexWriter(max_blocks=4096)
    reader = index_reader(writer, tags)
    try:
        rng = np.random.default_rng(5)
        keys = [rng.bytes(16) for _ in range(3000)] + [key(n) for n in range(500)]
        for n, k in enumerate(keys):
            if n % 3:
                writer.publish(k, NS if n % 5 else OTHER_NS, n * PAGE, 100)
        writer.withdraw(keys[1])
        expected = [reader.find(k, NS) is not None for k in keys]
        assert 1000 < sum(expected) < 3000
        assert reader.present(keys, NS).tolist() == expected
        # A slot in the middle of an update is absent for both.
        slot = writer._slot_of[keys[2]]
        writer._seqs[(64 + slot * 64) // 8] += 1
        assert reader.find(keys[2], NS) is None
        assert not reader.present(keys[2:3], NS)[0]
    finally:
        reader.close()
        writer.close()


def test_a_full_bucket_refuses_more_and_counts_it(index: tuple[IndexWriter, IndexReader]) -> None:
    writer, reader = index
    same_bucket = [k for k in map(key, range(5000)) if _bucket(k, writer.buckets) == 0]
    assert len(same_bucket) > WAYS
    for n, k in enumerate(same_bucket[:WAYS]):
        assert writer.publish(k, NS, n * PAGE, 10)
    assert not writer.publish(same_bucket[WAYS], NS, 0, 10)
    assert writer.overflows == 1
    assert reader.find(same_bucket[WAYS], NS) is None
    assert all(reader.find(k, NS) is not None for k in same_bucket[:WAYS])
    writer.withdraw(same_bucket[0])  # frees a way
    assert writer.publish(same_bucket[WAYS], NS, 0, 10)
    assert reader.find(same_bucket[WAYS], NS) is not None


def test_keys_that_share_a_prefix_still_spread_over_buckets() -> None:
    buckets = 1 << 12
    keys = [bytes(8) + n.to_bytes(8, "little") for n in range(1000)]
    assert len({_bucket(k, buckets) for k in keys}) > 900


def test_readers_cannot_write_or_resize_the_index(index: tuple[IndexWriter, IndexReader]) -> None:
    writer, reader = index
    with pytest.raises(TypeError):
        reader._mapping[0:8] = bytes(8)
    with pytest.raises(PermissionError):  # sealed: no new writable mapping
        mmap.mmap(writer.fd, writer.size)
    with pytest.raises(PermissionError):
        os.ftruncate(writer.fd, 0)
    writer.publish(key(1), NS, 0, 10)  # the server's own mapping still writes
    assert reader.find(key(1), NS) is not None


def test_closing_the_writer_tells_readers(index: tuple[IndexWriter, IndexReader]) -> None:
    writer, reader = index
    assert reader.open
    writer.close()
    assert not reader.open


def test_a_reader_refuses_a_file_that_is_not_an_index() -> None:
    fd = os.memfd_create("not-an-index")
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(ValueError, match="not a kvstore dram index"):
            IndexReader(fd, 4096)
    finally:
        os.close(fd)


# -- wired into the dram tier ---------------------------------------------------------------


def write(tier: DramTier, n: int, length: int = PAGE) -> bytes:
    data = payload(n, length)
    assert tier.write_sync(BlockHeader.for_payload(key(n), NS, byte_view(data)), data)
    return data


@pytest.fixture
def tier() -> Iterator[DramTier]:
    tier = DramTier(8 * PAGE, page_size=PAGE)
    yield tier
    tier.remove_sync(list(map(key, range(100))))


def reader_of(tier: DramTier) -> IndexReader:
    assert tier.index is not None
    return IndexReader(tier.index.fd, tier.index.size)


def test_the_tier_publishes_what_it_holds_and_withdraws_what_it_drops(tier: DramTier) -> None:
    reader = reader_of(tier)
    data = write(tier, 1, 3 * PAGE)
    hit = reader.find(key(1), NS)
    assert hit is not None
    assert os.pread(tier.fd, hit[3], hit[2]) == data
    tier.remove_sync([key(1)])
    assert reader.find(key(1), NS) is None
    assert not reader.unchanged(hit)
    assert tier.stats()["published"] == 0


def test_reused_pages_never_validate_an_old_entry(tier: DramTier) -> None:
    """The race a direct read has to survive: removal and reuse of the pages mid-copy."""
    reader = reader_of(tier)
    old = write(tier, 1, 8 * PAGE)  # the whole arena
    hit = reader.find(key(1), NS)
    assert hit is not None
    tier.remove_sync([key(1)])
    new = write(tier, 2, 8 * PAGE)  # the same pages, other bytes
    copied = os.pread(tier.fd, hit[3], hit[2])  # what a slow reader's copy would see
    assert copied == new != old
    assert not reader.unchanged(hit)


def test_a_leased_block_is_withdrawn_at_once(tier: DramTier) -> None:
    reader = reader_of(tier)
    write(tier, 1)
    lease = tier.lease(key(1))
    assert lease is not None
    tier.remove_sync([key(1)])
    assert reader.find(key(1), NS) is None  # only the leaseholder may still read it
    tier.release(lease)


def test_installed_reservations_are_published(tier: DramTier) -> None:
    reader = reader_of(tier)
    data = payload(3, 2 * PAGE)
    reservation = tier.reserve(len(data))
    assert reservation is not None
    assert reader.find(key(3), NS) is None
    (offset, _), *_ = reservation.ranges
    tier.range_view(offset, len(data))[:] = np.frombuffer(data, dtype=np.uint8)
    assert reader.find(key(3), NS) is None  # written, not installed: not a block yet
    tier.install(BlockHeader.for_payload(key(3), NS, data), reservation)
    hit = reader.find(key(3), NS)
    assert hit is not None and os.pread(tier.fd, hit[3], hit[2]) == data


def test_a_block_in_several_runs_is_not_published(tier: DramTier) -> None:
    reader = reader_of(tier)
    for n in range(8):
        write(tier, n)
    tier.remove_sync([key(1), key(3)])  # two one-page holes
    data = write(tier, 9, 2 * PAGE)
    assert tier.extents(key(9)) == [(PAGE, PAGE), (3 * PAGE, PAGE)]
    assert reader.find(key(9), NS) is None
    assert tier.read_sync(key(9)) is not None and bytes(tier.read_sync(key(9)).payload) == data  # type: ignore[union-attr]
    assert reader.find(key(0), NS) is not None


async def test_closing_the_tier_closes_its_index() -> None:
    tier = DramTier(4 * PAGE, page_size=PAGE)
    reader = reader_of(tier)
    write(tier, 1)
    await tier.close()
    assert not reader.open


def test_the_arena_cannot_be_resized_by_whoever_holds_its_fd(tier: DramTier) -> None:
    with pytest.raises(PermissionError):
        os.ftruncate(tier.fd, 0)
    write(tier, 1)
    assert tier.read_sync(key(1)) is not None


def test_readers_from_before_the_tags_still_read_the_index() -> None:
    """The tags came without a new version: the header fields, the slots' places and the size a
    reader of the first layout checks are unchanged, so clients older than their server keep
    their direct reads."""
    writer = IndexWriter(max_blocks=256)
    try:
        writer.publish(key(5), NS, 3 * PAGE, 777)
        first_layout = struct.Struct("<QIIQQ")  # magic, version, ways, buckets, closed
        magic, version, ways, buckets, closed = first_layout.unpack_from(writer._mapping, 0)
        assert (magic, version, closed) == (MAGIC, 1, 0)
        assert writer.size >= HEADER_BYTES + ways * buckets * SLOT_BYTES
        slot = writer._slot_of[key(5)]
        at = HEADER_BYTES + slot * SLOT_BYTES
        seq, found, namespace, offset, length = struct.unpack_from(
            "<Q16s16sQQ", writer._mapping, at
        )
        assert seq % 2 == 0 and (found, namespace, offset, length) == (key(5), NS, 3 * PAGE, 777)
        assert struct.unpack_from("<Q", writer._mapping, 32)[0] == FLAG_TAGS
    finally:
        writer.close()


def test_a_key_of_the_wrong_size_is_refused_before_any_slot_changes() -> None:
    writer = IndexWriter(max_blocks=64)
    reader = IndexReader(writer.fd, writer.size)
    try:
        with pytest.raises(ValueError, match="16-byte keys"):
            writer.publish(b"short", NS, 0, 100)
        with pytest.raises(ValueError, match="16-byte namespaces"):
            writer.publish(key(1), b"ns", 0, 100)
        assert len(writer) == 0 and not reader.present([key(1)], NS)[0]
        assert writer.publish(key(1), NS, 0, 100) and reader.find(key(1), NS) is not None
        seqs = writer._seqs[HEADER_BYTES // 8 :: SLOT_BYTES // 8][:64]
        assert all(int(seq) % 2 == 0 for seq in seqs)  # no slot left mid-update
    finally:
        reader.close()
        writer.close()


def test_present_looks_past_a_shared_tag() -> None:
    """Keys alike in their first 8 bytes share a tag, and so does a key that starts with 8 zero
    bytes with every empty slot: the vectorized lookup must still find each of them."""
    writer = IndexWriter(max_blocks=64)  # 8 buckets of 8 ways
    reader = IndexReader(writer.fd, writer.size)
    try:
        low = b"\x11" * 8
        same_bucket = [low + n.to_bytes(8, "little") for n in range(200)]
        same_bucket = [k for k in same_bucket if _bucket(k, writer.buckets) == 0][:3]
        first, second, unpublished = same_bucket
        writer.publish(first, NS, 0, 100)
        writer.publish(second, NS, PAGE, 100)
        assert reader.present([first, second, unpublished], NS).tolist() == [True, True, False]
        writer.withdraw(first)
        assert reader.present([first, second], NS).tolist() == [False, True]

        # A key starting with 8 zero bytes behind a way that was emptied: the empty way's tag
        # matches first.
        in_bucket_one = [
            k
            for k in (n.to_bytes(8, "little") * 2 for n in range(1, 400))
            if _bucket(k, writer.buckets) == 1
        ]
        zeros = (bytes(8) + n.to_bytes(8, "little") for n in range(400))
        zero_tagged = next(k for k in zeros if _bucket(k, writer.buckets) == 1)
        writer.publish(in_bucket_one[0], NS, 2 * PAGE, 100)  # way 0
        writer.publish(zero_tagged, NS, 3 * PAGE, 100)  # way 1
        writer.withdraw(in_bucket_one[0])  # way 0 empty again: tag 0
        assert reader.present([zero_tagged], NS).tolist() == [True]
        assert reader.find(zero_tagged, NS) is not None
    finally:
        reader.close()
        writer.close()
