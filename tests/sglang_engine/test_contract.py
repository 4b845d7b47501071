"""The contract tier: kvstore's HiCache backend under SGLang's own storage interface.

SGLang's real host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) over CPU device
pools, the backend made by SGLang's ``StorageBackendFactory.create_backend("dynamic", ...)`` from
the extra config ``docs/sglang.md`` shows, and a real ``kvstore serve``: byte-identical round
trips for each host layout (zero-copy v1 calls and the legacy calls), pages shared across host
layouts, partial prefixes and misses, other namespaces and secrets, MLA stored once for every
rank. Failures are ``test_contract_failures.py``'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.serve import ServerProcess
from harness.sglang_contract import (
    PAGE_SIZE,
    hashes,
    host_pool,
    open_backend,
    page_indices,
    storage_config,
)

from kvstore.errors import ConfigError

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
KINDS = [(layout, mla) for layout in LAYOUTS for mla in (False, True)]
IDS = [f"{layout}-{'mla' if mla else 'mha'}" for layout, mla in KINDS]


def page_bytes(pool: Any, index: int) -> torch.Tensor:
    """The page at host index ``index`` as SGLang's pool itself reads it (``get_data_page``),
    in one order for every layout: ``[2, layers, page, heads, dim]`` (MHA) or
    ``[layers, page, 1, dim]`` (MLA), as raw bytes."""
    page = pool.get_data_page(int(index), flat=False)
    if not hasattr(pool, "head_num"):  # MLA
        if pool.layout == "page_first":
            page = page.permute(1, 0, 2, 3)
        elif pool.layout == "page_first_direct":
            page = page[0]
    elif pool.layout == "page_first":
        page = page.permute(0, 2, 1, 3, 4)
    elif pool.layout == "page_first_direct":
        page = page[:, 0]
    flat: torch.Tensor = page.contiguous().view(torch.uint8)
    return flat


def assert_same_pages(source: Any, source_at: Any, target: Any, target_at: Any) -> None:
    for s, t in zip(source_at[::PAGE_SIZE].tolist(), target_at[::PAGE_SIZE].tolist(), strict=True):
        assert torch.equal(page_bytes(source, s), page_bytes(target, t)), (s, t)


def test_the_factory_makes_the_backend_from_the_documented_extra_config(
    store: ServerProcess,
) -> None:
    from kvstore.integrations.sglang import KVStoreHiCacheStorage

    pool = host_pool("layer_first")
    backend = open_backend(storage_config(store.target), pool)
    try:
        assert isinstance(backend, KVStoreHiCacheStorage)
        assert backend.pages.shape.page_size == PAGE_SIZE
        assert backend.batch_exists(hashes("nothing", 3)) == 0
    finally:
        backend.close()


@pytest.mark.parametrize(("layout", "mla"), KINDS, ids=IDS)
def test_v1_pages_round_trip_byte_identical(store: ServerProcess, layout: str, mla: bool) -> None:
    writer_pool = host_pool(layout, mla=mla, seed=1)
    reader_pool = host_pool(layout, mla=mla, seed=2)
    config = storage_config(store.target, mla=mla, layout=layout, cache_salt=f"v1-{layout}")
    writer = open_backend(config, writer_pool)
    reader = open_backend(config, reader_pool)
    try:
        keys = hashes(f"v1-{layout}-{mla}", 6)
        source = page_indices(writer_pool, 6)
        assert reader.batch_exists(keys) == 0
        assert writer.batch_set_v1(keys, source) == [True] * 6
        assert reader.batch_exists(keys) == 6
        page_indices(reader_pool, 3)  # somewhere else in the reader's pool
        target = page_indices(reader_pool, 6)
        assert reader.batch_get_v1(keys, target) == [True] * 6
        assert_same_pages(writer_pool, source, reader_pool, target)
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_host_layouts_share_pages_because_the_bytes_are_the_same(
    store: ServerProcess, mla: bool
) -> None:
    pools = {layout: host_pool(layout, mla=mla, seed=3) for layout in LAYOUTS}
    backends = {
        layout: open_backend(storage_config(store.target, mla=mla, layout=layout), pool)
        for layout, pool in pools.items()
    }
    try:
        keys = hashes(f"shared-{mla}", 4)
        source = page_indices(pools["page_first"], 4)
        assert backends["page_first"].batch_set_v1(keys, source) == [True] * 4
        for layout in ("layer_first", "page_first_direct"):
            target = page_indices(pools[layout], 4)
            assert backends[layout].batch_get_v1(keys, target) == [True] * 4
            assert_same_pages(pools["page_first"], source, pools[layout], target)
    finally:
        for backend in backends.values():
            backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_legacy_calls_round_trip_and_meet_the_v1_pages(store: ServerProcess, layout: str) -> None:
    writer_pool = host_pool(layout, seed=4)
    reader_pool = host_pool(layout, seed=5)
    config = storage_config(store.target, layout=layout, cache_salt=f"legacy-{layout}")
    writer = open_backend(config, writer_pool)
    reader = open_backend(config, reader_pool)
    try:
        keys = hashes(f"legacy-{layout}", 3)
        source = page_indices(writer_pool, 3)
        starts = source[::PAGE_SIZE].tolist()
        # What SGLang's _generic_page_set hands over: flat pages in the pool's own order.
        assert writer.batch_set(keys, [writer_pool.get_data_page(i) for i in starts])
        assert all(reader.exists(key) for key in keys)
        targets = [reader_pool.get_dummy_flat_data_page() for _ in keys]
        got = reader.batch_get(keys, targets)
        assert all(page is not None for page in got)
        into = page_indices(reader_pool, 3)
        for start, page in zip(into[::PAGE_SIZE].tolist(), got, strict=True):
            reader_pool.set_from_flat_data_page(start, page)  # as _generic_page_get does
        assert_same_pages(writer_pool, source, reader_pool, into)
        # The same bytes through the zero-copy call, and back through get().
        again = page_indices(reader_pool, 3)
        assert reader.batch_get_v1(keys, again) == [True] * 3
        assert_same_pages(writer_pool, source, reader_pool, again)
        single = reader.get(keys[0], reader_pool.get_dummy_flat_data_page())
        assert single is not None and torch.equal(
            single.view(torch.uint8), writer_pool.get_data_page(starts[0]).view(torch.uint8)
        )
        assert reader.get(hashes("absent", 1)[0], reader_pool.get_dummy_flat_data_page()) is None
        assert not reader.exists(hashes("absent", 1)[0])
    finally:
        writer.close()
        reader.close()


def test_partial_prefixes_and_misses(store: ServerProcess) -> None:
    pool = host_pool("layer_first", seed=6)
    backend = open_backend(storage_config(store.target, cache_salt="partial"), pool)
    try:
        keys = hashes("partial", 5)
        assert backend.batch_set_v1(keys[:3], page_indices(pool, 3)) == [True] * 3
        assert backend.batch_exists(keys) == 3  # the leading run
        assert backend.batch_exists(keys[1:]) == 2
        assert backend.batch_exists(keys[3:]) == 0
        assert backend.batch_get_v1(keys, page_indices(pool, 5)) == [True] * 3 + [False] * 2
        # A hole in the middle: the leading run stops there.
        assert backend.batch_exists([keys[0], keys[4], keys[1]]) == 1
    finally:
        backend.close()


def test_other_models_ranks_and_salts_never_see_the_pages(store: ServerProcess) -> None:
    pool = host_pool("layer_first", seed=7)
    keys = hashes("isolated", 2)
    writer = open_backend(storage_config(store.target, cache_salt="iso"), pool)
    others = [
        storage_config(store.target, cache_salt="iso", model="another-model"),
        storage_config(store.target, cache_salt="iso", tp_rank=1, tp_size=2),
        storage_config(store.target, cache_salt="iso", tp_size=2),
        storage_config(store.target, cache_salt="iso", revision="v2"),
        storage_config(store.target, cache_salt="iso", tenant="someone-else"),
        storage_config(store.target, cache_salt="other-salt"),
    ]
    try:
        assert writer.batch_set_v1(keys, page_indices(pool, 2)) == [True, True]
        assert writer.batch_exists(keys) == 2
        for config in others:
            backend = open_backend(config, host_pool("layer_first"))
            try:
                assert backend.batch_exists(keys) == 0, config.extra_config
                assert backend.batch_get_v1(keys, page_indices(backend.mem_pool_host, 2)) == [
                    False,
                    False,
                ]
            finally:
                backend.close()
        # Another dtype is another pool: its pages are other pages.
        fp16 = open_backend(
            storage_config(store.target, cache_salt="iso"),
            host_pool("layer_first", dtype=torch.float16),
        )
        try:
            assert fp16.batch_exists(keys) == 0
        finally:
            fp16.close()
    finally:
        writer.close()


def test_a_backend_with_another_key_secret_is_refused(store: ServerProcess) -> None:
    # The store keeps the first secret each tenant's engines declared; another one is refused.
    first = open_backend(
        storage_config(store.target, tenant="keyed", secret="the-secret"), host_pool("layer_first")
    )
    try:
        with pytest.raises(ConfigError, match="KVSTORE_HASH_SECRET"):
            open_backend(
                storage_config(store.target, tenant="keyed", secret="a-guess"),
                host_pool("layer_first"),
            )
    finally:
        first.close()


def test_mla_is_stored_once_by_rank_0_and_read_by_every_rank(store: ServerProcess) -> None:
    pools = [host_pool("layer_first", mla=True, seed=10 + rank) for rank in range(2)]
    ranks = [
        open_backend(
            storage_config(store.target, mla=True, tp_rank=rank, tp_size=2, cache_salt="mla"),
            pools[rank],
        )
        for rank in range(2)
    ]
    try:
        keys = hashes("mla-ranks", 3)
        # Rank 1 is no writer: its call succeeds (rank 0 stores the same bytes) but stores nothing.
        assert ranks[1].batch_set_v1(keys, page_indices(pools[1], 3)) == [True] * 3
        assert ranks[0].batch_exists(keys) == 0
        source = page_indices(pools[0], 3)
        assert ranks[0].batch_set_v1(keys, source) == [True] * 3
        assert ranks[1].batch_exists(keys) == 3
        target = page_indices(pools[1], 3)
        assert ranks[1].batch_get_v1(keys, target) == [True] * 3
        assert_same_pages(pools[0], source, pools[1], target)
        # Another TP size reads the same copy too.
        other = open_backend(
            storage_config(store.target, mla=True, tp_rank=3, tp_size=4, cache_salt="mla"),
            host_pool("layer_first", mla=True),
        )
        try:
            assert other.batch_exists(keys) == 3
        finally:
            other.close()
    finally:
        for backend in ranks:
            backend.close()


def test_a_page_size_other_than_the_stores_chunk_size_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = ServerProcess(tmp_path, settings={"keys.chunk_size": 64}, name="chunks64")
    with other, caplog.at_level(logging.ERROR), pytest.raises(ConfigError) as refused:
        open_backend(storage_config(other.target), host_pool("layer_first"))
    message = str(refused.value)
    assert f"--page-size {PAGE_SIZE} differs from the store's keys.chunk_size 64" in message
    mine = [r for r in caplog.records if r.name == "kvstore.integrations.sglang"]
    assert [r.getMessage() for r in mine if r.levelno >= logging.ERROR] == [message]
