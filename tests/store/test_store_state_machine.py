"""A hypothesis state machine of :class:`kvstore.store.TieredStore` against a dict model.

The store runs over a tiny DRAM arena and a tiny LMDB directory, so that almost every put evicts,
demotes or promotes. The store is a cache, so a key the model holds may be missing (evicted), but:

* a returned payload is always exactly the bytes put under that key and namespace;
* a key never put, deleted, or held under the other namespace is never found;
* ``lookup`` agrees with ``get`` made right after it: the same tier for every key, and ``hits`` is
  the number of leading keys ``get`` finds;
* no tier ever uses more than its capacity, and the index agrees with what the tiers hold;
* pinned blocks stay in the store until unpinned or deleted.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvstore.errors import NamespaceMismatchError
from kvstore.keys import Namespace
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier

PAGE = 4096
POOL = 16
DRAM_PAGES = 6
NAMESPACES = (
    Namespace(model="state-machine").fingerprint(),
    Namespace(model="state-machine", tenant="other").fingerprint(),
)

numbers = st.integers(min_value=0, max_value=POOL - 1)
batches = st.lists(numbers, min_size=1, max_size=4)
namespaces = st.sampled_from(range(len(NAMESPACES)))
sizes = st.one_of(
    st.sampled_from([PAGE, 2 * PAGE, 3 * PAGE]), st.integers(min_value=1, max_value=3 * PAGE)
)


def key(n: int) -> bytes:
    return (n + 1).to_bytes(2, "little") * 8


class StoreMachine(RuleBasedStateMachine):
    """Random put / get / lookup / delete / pin / drain sequences, checked against a model.

    The LMDB map is so small that it fills before the tier's own estimate says so, which drives
    the store's evict-and-retry path and evictions out of the store.
    """

    nvme_map_size = 96 * 1024
    restartable = False

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.directory = tempfile.mkdtemp(prefix="kvstore-state-machine-")
        self.store = self.open_store()
        self.sizes: list[int] = [PAGE] * POOL
        # The model: key number -> (namespace index, payload) of the last successful put.
        self.model: dict[int, tuple[int, bytes]] = {}
        self.pins: Counter[int] = Counter()
        # A get may leave promotions running in the background between steps; rules that need a
        # settled store (exact predictions) drain first, the others run concurrently with them.
        self.in_flight = False

    def open_store(self) -> TieredStore:
        return TieredStore(
            [
                DramTier(DRAM_PAGES * PAGE, page_size=PAGE),
                NvmeTier(self.directory, self.nvme_map_size),
            ],
            max_block_bytes=3 * PAGE,
        )

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def settle(self) -> None:
        self.run(self.store.drain())
        self.in_flight = False

    def payload(self, n: int, ns: int) -> bytes:
        rng = np.random.default_rng([n, ns, self.sizes[n]])
        return rng.integers(0, 256, size=self.sizes[n], dtype=np.uint8).tobytes()

    def present(self, n: int) -> int | None:
        """The namespace index the store's index holds ``n`` under, or None."""
        for ns, fingerprint in enumerate(NAMESPACES):
            if self.store.lookup([key(n)], fingerprint).hits:
                return ns
        return None

    def check_returned(self, wanted: list[int], ns: int, results: list[Any]) -> None:
        assert len(results) == len(wanted)
        for n, result in zip(wanted, results, strict=True):
            if result.payload is None:
                assert result.tier == ""
                continue
            assert n in self.model, f"key {n} found but never put (or deleted)"
            model_ns, model_bytes = self.model[n]
            assert model_ns == ns, f"key {n} found under the wrong namespace"
            assert bytes(result.payload) == model_bytes, f"wrong bytes for key {n}"
            assert result.tier in ("dram", "nvme")

    def check_index(self) -> None:
        """With no background move in flight, the index and the tiers agree exactly."""
        stats = self.store.stats()
        for name, tier in stats["tiers"].items():
            assert tier["indexed_blocks"] == tier["blocks"], name
        held = 0
        for n in range(POOL):
            ns = self.present(n)
            if ns is not None:
                held += 1
                assert n in self.model and self.model[n][0] == ns
        assert stats["blocks"] == held

    # -- rules --------------------------------------------------------------------------------

    @initialize(drawn=st.lists(sizes, min_size=POOL, max_size=POOL))
    def choose_sizes(self, drawn: list[int]) -> None:
        self.sizes = drawn

    @rule(batch=batches, ns=namespaces)
    def put(self, batch: list[int], ns: int) -> None:
        self.put_batch(batch, ns)

    @rule(batch=batches)
    def put_default_namespace(self, batch: list[int]) -> None:
        self.put_batch(batch, 0)  # a second put rule makes puts as frequent as reads

    def put_batch(self, batch: list[int], ns: int) -> None:
        self.settle()  # so that whether the batch conflicts is known exactly
        conflict = any(self.present(n) not in (None, ns) for n in batch)
        before = [self.store.lookup([key(n)], f).tiers[0] for n in batch for f in NAMESPACES]
        values = [self.payload(n, ns) for n in batch]
        if conflict:
            with pytest.raises(NamespaceMismatchError):
                self.run(self.store.put([key(n) for n in batch], values, NAMESPACES[ns]))
            after = [self.store.lookup([key(n)], f).tiers[0] for n in batch for f in NAMESPACES]
            assert after == before, "a refused put changed what is stored"
            return
        result = self.run(self.store.put([key(n) for n in batch], values, NAMESPACES[ns]))
        assert result.stored + result.already_present + result.dropped == len(batch)
        for n in batch:
            self.model[n] = (ns, self.payload(n, ns))

    @rule(batch=batches, ns=namespaces)
    def get(self, batch: list[int], ns: int) -> None:
        results = self.run(self.store.get([key(n) for n in batch], NAMESPACES[ns]))
        self.in_flight = True
        self.check_returned(batch, ns, results)

    @rule(batch=st.lists(numbers, min_size=1, max_size=6), ns=namespaces)
    def lookup_agrees_with_get(self, batch: list[int], ns: int) -> None:
        self.settle()
        keys = [key(n) for n in batch]
        answer = self.store.lookup(keys, NAMESPACES[ns])
        results = self.run(self.store.get(keys, NAMESPACES[ns]))
        self.in_flight = True
        self.check_returned(batch, ns, results)
        found = [r.found for r in results]
        leading = found.index(False) if False in found else len(found)
        assert answer.hits == leading
        assert answer.tiers == [r.tier for r in results]
        for n, tier in zip(batch, answer.tiers, strict=True):
            if n not in self.model or self.model[n][0] != ns:
                assert tier == ""

    @rule(batch=batches)
    def delete(self, batch: list[int]) -> None:
        settled = not self.in_flight
        held = {n for n in batch if self.present(n) is not None}
        removed = self.run(self.store.delete([key(n) for n in batch]))
        assert 0 <= removed <= len(set(batch))
        if settled:  # else a background promotion may evict or (re)place a key meanwhile
            assert removed == len(held)
        for n in batch:
            self.model.pop(n, None)
            self.pins.pop(n, None)
            assert self.present(n) is None
        # A deleted key is gone even from a read that bypasses the index's view.
        for fingerprint in NAMESPACES:
            results = self.run(self.store.get([key(n) for n in batch], fingerprint))
            assert not any(r.found for r in results)

    @precondition(lambda self: sum(self.pins.values()) < 3)
    @rule(n=numbers)
    def pin(self, n: int) -> None:
        self.settle()  # a pin does not stop an eviction already under way (see test_store.py)
        if self.present(n) is None:
            return
        self.store.pin([key(n)])
        self.pins[n] += 1

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        n = data.draw(st.sampled_from(sorted(self.pins)))
        self.store.unpin([key(n)])
        self.pins[n] -= 1
        if self.pins[n] <= 0:
            del self.pins[n]

    @precondition(lambda self: self.restartable)
    @rule()
    def restart(self) -> None:
        """Close the store and open a new one over the same LMDB directory."""
        self.settle()
        nvme = self.store.tiers[1]
        assert isinstance(nvme, NvmeTier)
        on_disk = {n: self.present(n) for n in range(POOL) if key(n) in nvme}
        self.run(self.store.close())
        self.store = self.open_store()
        assert self.store.load_index() == len(on_disk)
        self.pins.clear()
        # Exactly the blocks the nvme tier held come back, under their namespaces; dram is lost.
        for n in range(POOL):
            assert self.present(n) == on_disk.get(n), f"key {n} after restart"
        self.check_index()

    @rule()
    def drain(self) -> None:
        self.settle()
        self.check_index()

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def capacity_is_never_exceeded(self) -> None:
        stats = self.store.stats()
        for name, tier in stats["tiers"].items():
            assert 0 <= tier["used"] <= tier["capacity"], name
        dram = stats["tiers"]["dram"]
        assert dram["wasted_bytes"] >= 0
        assert dram["wasted_bytes"] == dram["used"] - dram["payload_bytes"]

    @invariant()
    def pinned_blocks_stay(self) -> None:
        for n in self.pins:
            assert self.present(n) is not None, f"pinned key {n} was evicted"

    def teardown(self) -> None:
        try:
            self.run(self.store.close())
        finally:
            self.loop.close()
            shutil.rmtree(self.directory, ignore_errors=True)


class RestartingStoreMachine(StoreMachine):
    """The same, plus restarts over the same LMDB directory, with a map small enough to fill.

    A delete that hits a full map is refused by LMDB; the store must then keep indexing the block
    rather than forget it and find it again at the next restart.
    """

    nvme_map_size = 96 * 1024
    restartable = True


_SETTINGS = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
StoreMachine.TestCase.settings = _SETTINGS
RestartingStoreMachine.TestCase.settings = _SETTINGS
TestStoreMachine = StoreMachine.TestCase
TestRestartingStoreMachine = RestartingStoreMachine.TestCase
