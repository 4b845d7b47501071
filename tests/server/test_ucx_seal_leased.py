"""A sealed UCX get is sent from the leased arena pages (:func:`kvstore.server.ucx._seal_payloads`):
each block's seal comes from its stored header and the store's keyring, after its pages are
checked against the checksum recorded at put; pages changed since are never signed (the block is
not sent); a block the keyring signed before (at write-through) is not signed again."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from harness.store_blocks import PAGE, arena, key, make_store, payload

from kvstore.block import CorruptBlockError, Keyring, verify_sealed
from kvstore.keys import Namespace
from kvstore.protocol.ucx import payload_checksum
from kvstore.server.sessions import Leased
from kvstore.server.ucx import _seal_payloads
from kvstore.store import TieredStore

NS = Namespace(model="ucx-sealed-test").fingerprint()
SECRET = b"cluster secret"


@pytest.fixture
async def store() -> AsyncIterator[TieredStore]:
    s = make_store(None, dram_pages=8, keyring=Keyring([SECRET]).for_tenant("a"))
    yield s
    await s.close()


async def test_leased_pages_are_sealed_under_the_store_s_keyring(store: TieredStore) -> None:
    keys = [key(n) for n in range(3)]
    await store.put(keys, [payload(n) for n in range(3)], NS)
    acquired = await store.acquire(keys, NS)
    try:
        items = [Leased(n, lease) for n, lease in enumerate(acquired)]  # type: ignore[arg-type]
        tier = arena(store)
        payloads = [(n, tier.range_view(*lease.ranges[0])) for n, lease in enumerate(acquired)]  # type: ignore[union-attr]
        seals, checksums = _seal_payloads(keys, NS, items, payloads, store.keyring)
    finally:
        store.release(acquired)  # type: ignore[arg-type]
    ring = Keyring([SECRET]).for_tenant("a")
    assert checksums == [payload_checksum(payload(n)) for n in range(3)]
    for n in range(3):
        sealed = seals[n]
        assert sealed is not None
        verify_sealed(keys[n], NS, sealed, payload(n), ring)
        with pytest.raises(CorruptBlockError):
            verify_sealed(keys[n], NS, sealed, payload(n), Keyring([SECRET]).for_tenant("b"))


async def test_pages_changed_since_the_put_are_never_signed(store: TieredStore) -> None:
    keys = [key(1), key(2)]
    await store.put(keys, [payload(1), payload(2)], NS)
    acquired = await store.acquire(keys, NS)
    try:
        tier = arena(store)
        views = [tier.range_view(*lease.ranges[0]) for lease in acquired]  # type: ignore[union-attr]
        views[0][:PAGE] = np.frombuffer(payload(3), dtype=np.uint8)  # a co-located client's write
        items = [Leased(n, lease) for n, lease in enumerate(acquired)]  # type: ignore[arg-type]
        seals, checksums = _seal_payloads(keys, NS, items, list(enumerate(views)), store.keyring)
    finally:
        store.release(acquired)  # type: ignore[arg-type]
    assert seals[0] is None
    assert seals[1] is not None
    assert checksums == [0, payload_checksum(payload(2))]  # nothing announced for the refused


async def test_a_block_signed_at_write_through_is_not_signed_again(store: TieredStore) -> None:
    await store.put([key(1)], [payload(1)], NS)
    ring = store.keyring
    header = arena(store).header(key(1))
    assert header is not None
    signed = header.seal(payload(1), ring)  # what the write-through to redis does
    calls: list[int] = []
    original = ring._mac

    def spy(*args: Any) -> bytes:
        calls.append(1)
        return original(*args)  # type: ignore[no-any-return]

    ring._mac = spy  # type: ignore[method-assign]
    acquired = await store.acquire([key(1)], NS)
    try:
        view = arena(store).range_view(*acquired[0].ranges[0])  # type: ignore[union-attr]
        items = [Leased(0, acquired[0])]  # type: ignore[arg-type]
        seals, _ = _seal_payloads([key(1)], NS, items, [(0, view)], ring)
    finally:
        store.release(acquired)  # type: ignore[arg-type]
    assert seals[0] == signed
    assert calls == []
