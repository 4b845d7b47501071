"""Memory bounds of :class:`kvstore.store.prefetch.Prefetcher` over a real DRAM arena and LMDB.

Unfinished prefetches hold at most ``max_queued_keys`` keys together (beyond: CapacityError, the
store untouched, and room again once they finish), a finished prefetch keeps only its counts,
and the oldest finished ones are forgotten first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from harness.polling import apoll
from harness.store_blocks import MIB, PAGE, key, payload

from kvstore.errors import CapacityError, UnknownPrefetchError
from kvstore.keys import Namespace
from kvstore.store import TieredStore
from kvstore.store.prefetch import Prefetcher, PrefetchProgress, PrefetchState
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier

NS = Namespace(model="prefetch-bounds").fingerprint()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[TieredStore]:
    """Four one-page blocks of dram above 8 MiB of LMDB."""
    s = TieredStore([DramTier(4 * PAGE, page_size=PAGE), NvmeTier(tmp_path, 8 * MIB)])
    yield s
    await s.close()


async def finished(prefetcher: Prefetcher, prefetch_id: int) -> PrefetchProgress:
    await apoll(lambda: prefetcher.status(prefetch_id).finished, 30.0, f"prefetch {prefetch_id}")
    return prefetcher.status(prefetch_id)


async def test_queue_of_unfinished_keys_is_bounded(store: TieredStore) -> None:
    prefetcher = Prefetcher(store, max_queued_keys=10)
    first = prefetcher.submit([key(n) for n in range(6)], NS)
    with pytest.raises(CapacityError, match=r"6 keys .* limit of 10 \(server.prefetch_queue_keys"):
        prefetcher.submit([key(n) for n in range(6, 11)], NS)
    second = prefetcher.submit([key(n) for n in range(6, 10)], NS)  # exactly fills the queue
    assert prefetcher.stats()["prefetch_refused"] == 1
    with pytest.raises(CapacityError):
        prefetcher.submit([key(99)], NS)
    await finished(prefetcher, first)
    await finished(prefetcher, second)
    third = prefetcher.submit([key(n) for n in range(10)], NS)  # room again
    assert (await finished(prefetcher, third)).total == 10
    await prefetcher.close()


async def test_cancelled_prefetch_gives_its_keys_back(store: TieredStore) -> None:
    prefetcher = Prefetcher(store, max_queued_keys=4)
    first = prefetcher.submit([key(n) for n in range(4)], NS)
    assert prefetcher.cancel(first)
    assert (await finished(prefetcher, first)).state is PrefetchState.CANCELLED
    # The keys are given back once its task is done (a moment after the cancel).
    await apoll(
        lambda: prefetcher.stats()["prefetch_queued_keys"] == 0, 10.0, "the keys given back"
    )
    prefetcher.submit([key(n) for n in range(4)], NS)
    await prefetcher.close()


async def test_finished_prefetch_keeps_counts_not_keys(store: TieredStore) -> None:
    for n in range(2):
        await store.put([key(n)], [payload(n)], NS)
    prefetcher = Prefetcher(store, keep_finished=2)
    ids = [prefetcher.submit([key(0), key(1), key(7)], NS) for _ in range(3)]
    progress = await finished(prefetcher, ids[-1])
    await finished(prefetcher, ids[-2])
    assert progress == PrefetchProgress(PrefetchState.DONE, total=3, ready=2, missing=1)
    # Only counts remain of a finished job; the oldest of three is forgotten.
    assert all(not job.keys for job in prefetcher._jobs.values())
    with pytest.raises(UnknownPrefetchError):
        prefetcher.status(ids[0])
    await prefetcher.close()
