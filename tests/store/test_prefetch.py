"""Tests of :class:`kvstore.store.prefetch.Prefetcher` over a real DRAM arena and a real LMDB dir.

Prefetch moves nvme-only blocks into dram (and a later get is served from dram), counts every key
as ready / missing / failed, keeps at most ``max_concurrency`` promote batches in flight, in
request order, stops at a cancel without interrupting a move in progress, forgets old prefetches,
and refuses a bad request before queueing anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from harness.polling import apoll
from harness.store_blocks import MIB, PAGE, key, payload

from kvstore.errors import InvalidRequestError, StoreUnavailableError, UnknownPrefetchError
from kvstore.keys import Namespace
from kvstore.store import Promotion, TieredStore
from kvstore.store.prefetch import Prefetcher, PrefetchProgress, PrefetchState
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier

DRAM_PAGES = 4
NS = Namespace(model="prefetch-test").fingerprint()
OTHER_NS = Namespace(model="prefetch-test", tenant="someone-else").fingerprint()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[TieredStore]:
    """Four one-page blocks of dram above 8 MiB of LMDB."""
    s = TieredStore([DramTier(DRAM_PAGES * PAGE, page_size=PAGE), NvmeTier(tmp_path, 8 * MIB)])
    yield s
    await s.close()


async def put_blocks(
    store: TieredStore, numbers: Sequence[int], namespace: bytes = NS, length: int = PAGE
) -> None:
    for n in numbers:
        assert (await store.put([key(n)], [payload(n, length)], namespace)).stored == 1


def tiers_of(store: TieredStore, numbers: Sequence[int]) -> list[str]:
    return store.lookup([key(n) for n in numbers], NS).tiers


async def wait_finished(prefetcher: Prefetcher, prefetch_id: int) -> PrefetchProgress:
    await apoll(lambda: prefetcher.status(prefetch_id).finished, 30.0, f"prefetch {prefetch_id}")
    return prefetcher.status(prefetch_id)


def parked(prefetcher: Prefetcher) -> int:
    """Workers holding a batch in flight or waiting for a slot: with the promotes gated, none
    of them can start another batch until one finishes."""
    stats = prefetcher.stats()
    return stats["prefetch_batches_in_flight"] + stats["prefetch_waiting_for_slot"]


class GatedPromote:
    """Stands in for ``store.promote``: records each batch, holds it until released, then runs
    the real promote. Tracks how many batches are in flight at once."""

    def __init__(self, store: TieredStore) -> None:
        self.real = store.promote
        self.calls: list[list[bytes]] = []
        self.in_flight = 0
        self.peak = 0
        self.gate = asyncio.Event()
        self.finished = 0

    async def __call__(self, keys: Sequence[bytes], namespace: bytes) -> list[Promotion]:
        self.calls.append(list(keys))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await self.gate.wait()
            return await self.real(keys, namespace)
        finally:
            self.in_flight -= 1
            self.finished += 1

    async def wait_calls(self, count: int) -> None:
        await apoll(lambda: len(self.calls) >= count, 30.0, f"{count} promote batches started")


def gate(store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> GatedPromote:
    gated = GatedPromote(store)
    monkeypatch.setattr(store, "promote", gated)
    return gated


async def test_prefetch_moves_nvme_blocks_into_dram(store: TieredStore) -> None:
    await put_blocks(store, range(8))  # dram holds 4: blocks 0-3 were demoted to nvme
    assert tiers_of(store, range(4)) == ["nvme"] * 4
    prefetcher = Prefetcher(store, batch_keys=2)
    prefetch_id = prefetcher.submit([key(n) for n in (0, 1, 2)], NS)
    assert prefetch_id == 1
    assert prefetcher.status(prefetch_id).state is PrefetchState.QUEUED  # nothing ran yet
    progress = await wait_finished(prefetcher, prefetch_id)
    assert progress == PrefetchProgress(PrefetchState.DONE, total=3, ready=3)
    assert tiers_of(store, (0, 1, 2)) == ["dram"] * 3
    results = await store.get([key(n) for n in (0, 1, 2)], NS)
    assert [r.tier for r in results] == ["dram"] * 3
    assert [bytes(r.payload or b"") for r in results] == [payload(n) for n in (0, 1, 2)]
    await prefetcher.close()


async def test_status_counts_ready_missing_and_failed(store: TieredStore) -> None:
    await put_blocks(store, range(6))  # 0, 1 in nvme; 2-5 in dram
    await put_blocks(store, [50], namespace=OTHER_NS)  # present, but not under NS
    big = 5 * PAGE  # more than the whole dram tier: lands in nvme, can never move up
    await put_blocks(store, [60], length=big)
    assert tiers_of(store, [0, 5, 60]) == ["nvme", "dram", "nvme"]
    prefetcher = Prefetcher(store, batch_keys=2)
    keys = [key(0), key(5), key(99), key(50), key(60)]
    progress = await wait_finished(prefetcher, prefetcher.submit(keys, NS))
    assert progress == PrefetchProgress(PrefetchState.DONE, total=5, ready=2, missing=2, failed=1)
    assert tiers_of(store, [0, 5, 60]) == ["dram", "dram", "nvme"]
    # The block of the other namespace was not touched by a prefetch under NS.
    assert store.lookup([key(50)], OTHER_NS).tiers == ["dram"]
    stats = prefetcher.stats()
    assert stats["prefetch_keys_ready"] == 2
    assert stats["prefetch_keys_missing"] == 2
    assert stats["prefetch_keys_failed"] == 1
    assert stats["prefetch_active"] == 0
    await prefetcher.close()


async def test_concurrency_is_bounded_across_prefetches_and_batches_go_in_order(
    store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    gated = gate(store, monkeypatch)
    prefetcher = Prefetcher(store, max_concurrency=3, batch_keys=4)
    jobs = {n: [key(1000 * n + i) for i in range(22)] for n in range(1, 4)}  # absent: missing
    ids = {n: prefetcher.submit(keys, NS) for n, keys in jobs.items()}
    await gated.wait_calls(3)
    # Each prefetch runs min(max_concurrency, its 6 batches) = 3 workers: once all 9 hold a
    # batch or wait for a slot, nothing more starts until a batch finishes.
    await apoll(lambda: parked(prefetcher) == 9, 30.0, "every worker holding or waiting")
    assert prefetcher.stats()["prefetch_batches_in_flight"] == 3
    assert len(gated.calls) == 3
    assert gated.in_flight == 3
    gated.gate.set()
    for n, prefetch_id in ids.items():
        progress = await wait_finished(prefetcher, prefetch_id)
        assert progress == PrefetchProgress(PrefetchState.DONE, total=22, missing=22), n
    assert gated.peak == 3
    assert all(1 <= len(batch) <= 4 for batch in gated.calls)
    # Each prefetch's batches started in request order, so the prefix always went first.
    for n, keys in jobs.items():
        started = [k for batch in gated.calls if batch[0] in keys for k in batch]
        assert started == keys, n
    await prefetcher.close()


async def test_cancel_stops_remaining_batches_and_keeps_moved_blocks(
    store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await put_blocks(store, range(8))  # 0-3 in nvme
    gated = gate(store, monkeypatch)
    prefetcher = Prefetcher(store, max_concurrency=1, batch_keys=2)
    prefetch_id = prefetcher.submit([key(n) for n in range(4)], NS)
    await gated.wait_calls(1)
    assert prefetcher.status(prefetch_id).state is PrefetchState.RUNNING
    assert prefetcher.cancel(prefetch_id) is True
    assert prefetcher.status(prefetch_id).state is PrefetchState.CANCELLED
    # The batch already in promote is not interrupted: it completes, and its blocks stay.
    gated.gate.set()
    await asyncio.wait_for(prefetcher.idle(), 30.0)  # a leaked second batch would run first
    assert gated.finished == 1
    assert len(gated.calls) == 1
    assert prefetcher.status(prefetch_id) == PrefetchProgress(
        PrefetchState.CANCELLED, total=4, ready=2
    )
    assert tiers_of(store, range(4)) == ["dram", "dram", "nvme", "nvme"]
    assert prefetcher.cancel(prefetch_id) is False  # already finished
    assert prefetcher.stats()["prefetch_cancelled"] == 1
    # The store is consistent: every block reads back intact from where the index says.
    results = await store.get([key(n) for n in range(8)], NS)
    assert [bytes(r.payload or b"") for r in results] == [payload(n) for n in range(8)]
    await prefetcher.close()


async def test_cancel_of_a_queued_prefetch_runs_nothing(
    store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    gated = gate(store, monkeypatch)
    prefetcher = Prefetcher(store, max_concurrency=1, batch_keys=2)
    first = prefetcher.submit([key(1), key(2)], NS)
    await gated.wait_calls(1)
    queued = prefetcher.submit([key(3), key(4)], NS)
    # Once the queued one's worker holds a batch or waits for the only slot, it cannot start.
    await apoll(lambda: parked(prefetcher) == 2, 30.0, "the queued one's worker waiting")
    assert prefetcher.stats()["prefetch_waiting_for_slot"] == 1
    assert prefetcher.status(queued).state is PrefetchState.QUEUED
    assert prefetcher.cancel(queued) is True
    gated.gate.set()
    assert (await wait_finished(prefetcher, first)).state is PrefetchState.DONE
    await asyncio.wait_for(prefetcher.idle(), 30.0)  # the cancelled one, had it started, too
    assert gated.calls == [[key(1), key(2)]]
    assert prefetcher.status(queued) == PrefetchProgress(PrefetchState.CANCELLED, total=2)
    await prefetcher.close()


async def test_close_cancels_and_waits_for_batches_in_flight(
    store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await put_blocks(store, range(8))
    gated = gate(store, monkeypatch)
    prefetcher = Prefetcher(store, max_concurrency=2, batch_keys=1)
    prefetch_id = prefetcher.submit([key(n) for n in range(4)], NS)
    await gated.wait_calls(2)
    closing = asyncio.create_task(prefetcher.close())
    # Once the cancelled prefetch's task has stopped (its keys given back), only the two
    # batches are left to wait for: a close() that did not wait for them would be done.
    stopped = {"prefetch_queued_keys": 0, "prefetch_waiting_for_slot": 0}
    await apoll(lambda: stopped.items() <= prefetcher.stats().items(), 30.0, "the job stopped")
    assert not closing.done()  # two moves are still in flight
    gated.gate.set()
    await asyncio.wait_for(closing, 5)
    assert gated.in_flight == 0
    assert len(gated.calls) == 2
    assert prefetcher.status(prefetch_id) == PrefetchProgress(
        PrefetchState.CANCELLED, total=4, ready=2
    )
    with pytest.raises(StoreUnavailableError):
        prefetcher.submit([key(0)], NS)


async def test_unknown_and_forgotten_ids(store: TieredStore) -> None:
    prefetcher = Prefetcher(store, keep_finished=2)
    with pytest.raises(UnknownPrefetchError):
        prefetcher.status(12345)
    with pytest.raises(UnknownPrefetchError):
        prefetcher.cancel(12345)
    ids = [prefetcher.submit([key(n)], NS) for n in range(3)]
    await wait_finished(prefetcher, ids[2])

    def forgotten() -> bool:  # the last one's completion is settled once the oldest is gone
        try:
            prefetcher.status(ids[0])
        except UnknownPrefetchError:
            return True
        return False

    await apoll(forgotten, 10.0, "the oldest finished prefetch forgotten")
    with pytest.raises(UnknownPrefetchError):
        prefetcher.status(ids[0])  # the oldest finished one is forgotten first
    assert [prefetcher.status(i).state for i in ids[1:]] == [PrefetchState.DONE] * 2
    await prefetcher.close()


@pytest.mark.parametrize(
    ("keys", "namespace", "message"),
    [
        ([], NS, "no keys"),
        ([key(i) for i in range(40)] + [b"short"], NS, "key 40 is 5 bytes"),
        ([key(1)], b"", "namespace fingerprint is 0 bytes"),
        ([key(i) for i in range(65)], NS, "65 keys in one request; the limit is 64"),
    ],
    ids=["empty", "bad-key-late", "no-namespace", "too-many"],
)
async def test_bad_request_raises_before_anything_is_queued(
    store: TieredStore,
    monkeypatch: pytest.MonkeyPatch,
    keys: list[bytes],
    namespace: bytes,
    message: str,
) -> None:
    store.max_keys_per_request = 64
    calls: list[Any] = []
    monkeypatch.setattr(store, "promote", lambda *args: calls.append(args))
    prefetcher = Prefetcher(store, batch_keys=4)
    with pytest.raises(InvalidRequestError, match=message):
        prefetcher.submit(keys, namespace)
    await asyncio.wait_for(prefetcher.idle(), 30.0)  # a queued batch would have run by then
    assert calls == []
    assert prefetcher.stats() == {
        "prefetch_active": 0,
        "prefetch_batches_in_flight": 0,
        "prefetch_waiting_for_slot": 0,
        "prefetch_queued_keys": 0,
    }
    # No id was used up: the next good request gets the first one.
    monkeypatch.undo()
    assert prefetcher.submit([key(1)], NS) == 1
    await prefetcher.close()


def test_constructor_rejects_nonsense_bounds(tmp_path: Path) -> None:
    store = TieredStore([DramTier(PAGE, page_size=PAGE)])
    for kwargs in ({"max_concurrency": 0}, {"batch_keys": 0}, {"keep_finished": -1}):
        with pytest.raises(ValueError):
            Prefetcher(store, **kwargs)
