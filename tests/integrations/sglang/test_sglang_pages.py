"""The SGLang backend's page copies without SGLang: the canonical page view of every host layout,
host indices, run coalescing and one copy per run (:mod:`kvstore.integrations.sglang.pages`).

The host pools are :mod:`harness.sglang_pool_stand_in`'s, which allocate SGLang's dimensions; the
contract tier checks the same against SGLang's real pools.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness.sglang_pool_stand_in import HostPoolStandIn, same_bytes

from kvstore.integrations.sglang.identity import LAYOUTS, pool_shape
from kvstore.integrations.sglang.pages import (
    Run,
    coalesce,
    copy_runs,
    flat_to_stored,
    host_pages,
    page_view,
    stored_to_flat,
)

KINDS = [(layout, mla) for layout in LAYOUTS for mla in (False, True)]
IDS = [f"{layout}-{'mla' if mla else 'mha'}" for layout, mla in KINDS]


@pytest.mark.parametrize(("layout", "mla"), KINDS, ids=IDS)
def test_every_layout_stores_a_page_in_one_order(layout: str, mla: bool) -> None:
    pool = HostPoolStandIn(layout, mla=mla)
    shape = pool_shape(pool)
    view = page_view(pool.kv_buffer, shape)
    assert view.shape == (pool.page_num, *shape.page_shape)
    assert view.data_ptr() == pool.kv_buffer.data_ptr()  # a view, never a copy
    # The stored order is layer_first's flat page whatever the layout: the same bytes.
    reference = HostPoolStandIn("layer_first", mla=mla)
    reference_shape = pool_shape(reference)
    reference_view = page_view(reference.kv_buffer, reference_shape)
    for page in (0, 5, pool.page_num - 1):
        flat = pool.data_page(page * pool.page_size)
        assert same_bytes(flat_to_stored(flat, shape), view[page])
        reference_view[page] = view[page]
        stored = flat_to_stored(reference.data_page(page * pool.page_size), reference_shape)
        assert same_bytes(stored, view[page])


@pytest.mark.parametrize(("layout", "mla"), KINDS, ids=IDS)
def test_a_stored_page_goes_back_into_a_flat_page_of_the_layout(layout: str, mla: bool) -> None:
    pool = HostPoolStandIn(layout, mla=mla)
    shape = pool_shape(pool)
    stored = page_view(pool.kv_buffer, shape)[3].contiguous()
    target = torch.zeros_like(pool.data_page(0))
    stored_to_flat(stored, target, shape)
    assert same_bytes(target, pool.data_page(3 * pool.page_size))


def test_host_indices_must_be_whole_pages_in_order() -> None:
    pool = HostPoolStandIn("layer_first")
    assert host_pages(pool.indices([4, 5, 9]), 4, 3) == [4, 5, 9]
    assert host_pages(pool.indices([4, 5]), 4, 3) is None  # too few
    assert host_pages(pool.indices([4, 5]) + 1, 4, 2) is None  # not on a page boundary
    shuffled = pool.indices([4]).flip(0)
    assert host_pages(shuffled, 4, 1) is None  # a page's tokens out of order
    assert host_pages(torch.empty(0, dtype=torch.int64), 4, 0) == []


def test_runs_follow_consecutive_pages_at_equal_distances() -> None:
    size = 100
    # Pages 3, 4, 5 with blocks 128 B apart; page 6's block elsewhere; a missing block;
    # pages 10, 11 back to back.
    pages = [3, 4, 5, 6, 7, 10, 11]
    addresses = [1000, 1128, 1256, 5000, None, 9000, 9100]
    assert coalesce(pages, addresses, size) == [
        Run(0, 3, 3, 128),
        Run(3, 1, 6, size),
        Run(5, 2, 10, 100),
    ]
    # Blocks that would overlap, or host pages that are not consecutive, never share a run.
    assert coalesce([0, 1], [0, 50], size) == [Run(0, 1, 0, size), Run(1, 1, 1, size)]
    assert coalesce([0, 2], [0, 100], size) == [Run(0, 1, 0, size), Run(1, 1, 2, size)]
    assert coalesce([0, 1, 2], [0, 100, 300], size) == [Run(0, 2, 0, 100), Run(2, 1, 2, size)]
    assert coalesce([], [], size) == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_copy_per_run_moves_the_right_bytes(layout: str) -> None:
    source = HostPoolStandIn(layout, seed=1)
    target = HostPoolStandIn(layout, seed=2)
    shape = pool_shape(source)
    nbytes = shape.page_nbytes
    # An "arena": blocks for pages 2, 3, 4 at a stride of 1.5 pages, page 8's far away.
    arena = np.zeros(nbytes * 20, dtype=np.uint8)
    offsets = [0, nbytes + nbytes // 2, 3 * nbytes, 15 * nbytes]
    blocks = [arena[o : o + nbytes] for o in offsets]
    pages = [2, 3, 4, 8]
    runs = coalesce(pages, [int(b.ctypes.data) for b in blocks], nbytes)
    assert [run.count for run in runs] == [3, 1]
    copy_runs(runs, blocks, page_view(source.kv_buffer, shape), shape, into_pool=False)
    copy_runs(runs, blocks, page_view(target.kv_buffer, shape), shape, into_pool=True)
    for page in range(source.page_num):
        moved = same_bytes(source.data_page(page * 4), target.data_page(page * 4))
        assert moved == (page in pages), page
    untouched = np.ones(len(arena), dtype=bool)
    for o in offsets:
        untouched[o : o + nbytes] = False
    assert not arena[untouched].any()  # nothing written between the blocks
