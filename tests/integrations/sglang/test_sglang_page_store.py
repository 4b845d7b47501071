"""The SGLang backend's calls on a real ``kvstore serve``, without SGLang: pages of a host pool
(:mod:`harness.sglang_pool_stand_in`) stored and loaded over shared memory and over gRPC, prefixes,
misses, a store that dies, the page-size agreement and the counters
(:mod:`kvstore.integrations.sglang.opening`, :mod:`~kvstore.integrations.sglang.transfer`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from harness.serve import ServerProcess
from harness.sglang_pool_stand_in import HostPoolStandIn, same_bytes
from prometheus_client import REGISTRY

from kvstore.errors import ConfigError
from kvstore.integrations.sglang.metrics import Metrics
from kvstore.integrations.sglang.opening import open_pages
from kvstore.integrations.sglang.settings import BackendSettings
from kvstore.integrations.sglang.transfer import PageStore

PAGE = 4
HASHES = [f"{i:064x}" for i in range(1, 13)]


def conf(**changes: Any) -> SimpleNamespace:
    fields = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "model_name": "tiny"}
    return SimpleNamespace(**{**fields, **changes})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tmp_path_factory.mktemp("store"),
        settings={"dram.capacity": "64MiB", "keys.chunk_size": PAGE},
        name="store",
    )
    with server:
        yield server


def opened(
    target: str, pool: HostPoolStandIn, *, data_plane: str | None = None, **extra: Any
) -> PageStore:
    # Generous deadlines where the test is not about them (2 cores at load 10).
    timeouts = {"timeout_s": 20.0, "lookup_timeout_s": 10.0}
    settings = BackendSettings.from_extra_config({"target": target, **timeouts, **extra}, env={})
    pages, _ = open_pages(settings, conf(), pool, Metrics(0), data_plane=data_plane)
    return pages


def page(pool: HostPoolStandIn, number: int) -> Any:
    return pool.data_page(number * PAGE)


@pytest.mark.parametrize("data_plane", ["shm", "grpc"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pages_round_trip_byte_identical(
    store: ServerProcess, layout: str, data_plane: str
) -> None:
    writer_pool = HostPoolStandIn(layout, page_size=PAGE, seed=3)
    reader_pool = HostPoolStandIn(layout, page_size=PAGE, seed=4)
    hashes = [f"{layout}-{data_plane}-{i}" for i in range(6)]
    writer = opened(store.target, writer_pool, data_plane=data_plane, cache_salt=layout)
    reader = opened(store.target, reader_pool, data_plane=data_plane, cache_salt=layout)
    try:
        assert writer._client.open_data_plane() == data_plane
        assert reader.exists(hashes) == 0
        # Host pages 2, 3, 4 (one run), 9, 10 and 0.
        assert writer.store(hashes, writer_pool.indices([2, 3, 4, 9, 10, 0])) == [True] * 6
        assert writer.store(hashes[:2], writer_pool.indices([2, 3])) == [True] * 2  # present
        assert reader.exists(hashes) == 6
        assert reader.load(hashes, reader_pool.indices([7, 8, 9, 1, 2, 3])) == [True] * 6
        for source, target in zip([2, 3, 4, 9, 10, 0], [7, 8, 9, 1, 2, 3], strict=True):
            assert same_bytes(page(writer_pool, source), page(reader_pool, target))
    finally:
        writer.close()
        reader.close()


def test_prefixes_misses_and_bad_indices(store: ServerProcess) -> None:
    pool = HostPoolStandIn("layer_first", page_size=PAGE, seed=5)
    pages = opened(store.target, pool, cache_salt="prefix")
    try:
        assert pages.store(HASHES[:3], pool.indices([0, 1, 2])) == [True] * 3
        assert pages.exists(HASHES[:5]) == 3
        assert pages.exists(HASHES[3:5]) == 0
        assert pages.load(HASHES[:5], pool.indices([5, 6, 7, 8, 9])) == [True] * 3 + [False] * 2
        assert pages.load(HASHES[:1], pool.indices([5])[1:]) == [False]  # not a whole page
        assert pages.store(HASHES[:2], pool.indices([0])) == [False, False]
        assert pages.load([], pool.indices([])) == []
    finally:
        pages.close()


def test_other_namespaces_and_secrets_never_see_the_pages(store: ServerProcess) -> None:
    pool = HostPoolStandIn("layer_first", page_size=PAGE, seed=6)
    tenant = opened(store.target, pool, tenant="t1", secret="s1")
    others = [
        opened(store.target, pool, tenant="t2", secret="s1"),
        opened(store.target, pool, tenant="t1", secret="s1", revision="v2"),
        opened(store.target, pool, tenant="t1", secret="s1", cache_salt="x"),
    ]
    try:
        assert tenant.store(HASHES[:2], pool.indices([0, 1])) == [True, True]
        assert tenant.exists(HASHES[:2]) == 2
        assert [other.exists(HASHES[:2]) for other in others] == [0, 0, 0]
        with pytest.raises(ConfigError, match="KVSTORE_HASH_SECRET"):
            opened(store.target, pool, tenant="t1", secret="another")
    finally:
        for pages in (tenant, *others):
            pages.close()


def test_a_page_size_other_than_the_stores_chunk_size_is_refused(
    store: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    pool = HostPoolStandIn("layer_first", page_size=8)
    with caplog.at_level(logging.ERROR), pytest.raises(ConfigError) as refused:
        opened(store.target, pool)
    assert "--page-size 8 differs from the store's keys.chunk_size 4" in str(refused.value)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [str(refused.value)]


def sample(name: str, **labels: str) -> float:
    return (
        REGISTRY.get_sample_value(f"kvstore_sglang_{name}_total", {"tp_rank": "0", **labels}) or 0.0
    )


def test_the_counters_count_pages(store: ServerProcess) -> None:
    pool = HostPoolStandIn("layer_first", page_size=PAGE, seed=7)
    pages = opened(store.target, pool, cache_salt="counted")
    names = ("pages_looked_up", "pages_hit", "pages_loaded", "pages_stored")
    before = {name: sample(name) for name in names}
    missing = sample("pages_failed", op="load", reason="missing")
    try:
        pages.store(HASHES[:2], pool.indices([0, 1]))
        pages.exists(HASHES[:4])
        pages.load(HASHES[:3], pool.indices([4, 5, 6]))
    finally:
        pages.close()
    after = {name: sample(name) - before[name] for name in names}
    assert after == {"pages_looked_up": 4, "pages_hit": 2, "pages_loaded": 2, "pages_stored": 2}
    assert sample("pages_failed", op="load", reason="missing") - missing == 1


def test_a_killed_store_costs_misses_within_the_deadline(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, settings={"keys.chunk_size": PAGE}, name="doomed")
    pool = HostPoolStandIn("layer_first", page_size=PAGE, seed=8)
    with server:
        pages = opened(server.target, pool, timeout_s=1.0, lookup_timeout_s=0.5)
        try:
            assert pages.store(HASHES[:3], pool.indices([0, 1, 2])) == [True] * 3
            assert pages.exists(HASHES[:3]) == 3
            server.kill()
            started = time.monotonic()
            assert pages.exists(HASHES[:3]) == 0
            assert pages.load(HASHES[:3], pool.indices([3, 4, 5])) == [False] * 3
            assert pages.store(HASHES[3:5], pool.indices([3, 4])) == [False] * 2
            assert time.monotonic() - started < 3.0  # a miss, never a stall
            assert sample("pages_failed", op="store", reason="store_down") >= 2
        finally:
            pages.close()


def test_off_shared_memory_a_call_is_staged_in_bounded_parts(
    store: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.integrations.sglang import transfer

    writer_pool = HostPoolStandIn("page_first", page_size=PAGE, seed=9)
    reader_pool = HostPoolStandIn("page_first", page_size=PAGE, seed=10)
    writer = opened(store.target, writer_pool, data_plane="grpc", cache_salt="parts")
    reader = opened(store.target, reader_pool, data_plane="grpc", cache_salt="parts")
    # Two pages per part: five pages go as three gets and three puts.
    monkeypatch.setattr(transfer, "MAX_STAGING_BYTES", 2 * writer.shape.page_nbytes + 1)
    gets: list[int] = []
    puts: list[int] = []
    for pages, calls in ((reader, gets), (writer, puts)):
        client = pages._client
        name = "get_into" if calls is gets else "put"
        real = getattr(client, name)

        def counted(
            keys: Any, *args: Any, _real: Any = real, _calls: Any = calls, **kw: Any
        ) -> Any:
            _calls.append(len(keys))
            return _real(keys, *args, **kw)

        monkeypatch.setattr(client, name, counted)
    try:
        hashes = [f"parts-{i}" for i in range(5)]
        assert writer.store(hashes, writer_pool.indices([1, 2, 3, 8, 9])) == [True] * 5
        assert reader.load(hashes, reader_pool.indices([10, 11, 12, 13, 0])) == [True] * 5
        assert puts == [2, 2, 1] and gets == [2, 2, 1]
        for source, target in zip([1, 2, 3, 8, 9], [10, 11, 12, 13, 0], strict=True):
            assert same_bytes(page(writer_pool, source), page(reader_pool, target))
    finally:
        writer.close()
        reader.close()


def test_a_missing_or_wrong_token_is_refused_at_start(tmp_path: Path) -> None:
    import hashlib

    token = "token-of-alice-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {hashlib.sha256(token.encode()).hexdigest()}\n")
    server = ServerProcess(
        tmp_path / "store", ("--tokens-file", str(tokens)), settings={"keys.chunk_size": PAGE}
    )
    pool = HostPoolStandIn("layer_first", page_size=PAGE, seed=11)
    with server:
        pages = opened(server.target, pool, token=token, tenant="alice")
        try:
            assert pages.store(HASHES[:2], pool.indices([0, 1])) == [True, True]
            assert pages.exists(HASHES[:2]) == 2
        finally:
            pages.close()
        for wrong in ("a-guess", None):
            extra = {"tenant": "alice"} if wrong is None else {"tenant": "alice", "token": wrong}
            with pytest.raises(ConfigError, match="refused its key scheme"):
                opened(server.target, pool, **extra)
