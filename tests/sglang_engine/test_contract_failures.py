"""The contract tier's failures: what SGLang gets from kvstore's HiCache backend when the store
dies, stalls or holds forged bytes, and under SGLang's own failure injection
(``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE``). Always a miss within the deadline, never wrong
bytes, never a stall; SGLang's real host pools and storage factory as in ``test_contract.py``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from harness.polling import poll
from harness.redis_server import RedisServer
from harness.serve import ServerProcess
from harness.sglang_contract import (
    PAGE_SIZE,
    hashes,
    host_pool,
    open_backend,
    page_indices,
    storage_config,
)

CHUNKS = {"keys.chunk_size": PAGE_SIZE}


def same_page(a: object, a_at: int, b: object, b_at: int) -> bool:
    return torch.equal(
        a.get_data_page(a_at).view(torch.uint8),  # type: ignore[attr-defined]
        b.get_data_page(b_at).view(torch.uint8),  # type: ignore[attr-defined]
    )


def test_a_killed_store_costs_misses_within_the_deadline(tmp_path: Path) -> None:
    with ServerProcess(tmp_path, settings=CHUNKS, name="doomed") as server:
        pool = host_pool("layer_first", seed=20)
        config = storage_config(server.target, timeout_s=1.0, lookup_timeout_s=0.5)
        backend = open_backend(config, pool)
        try:
            keys = hashes("killed", 3)
            assert backend.batch_set_v1(keys, page_indices(pool, 3)) == [True] * 3
            server.kill()
            started = time.monotonic()
            assert backend.batch_exists(hashes("never-stored", 2)) == 0
            assert backend.batch_get_v1(keys, page_indices(pool, 3)) == [False] * 3
            assert backend.batch_set_v1(hashes("after", 2), page_indices(pool, 2)) == [False] * 2
            assert backend.batch_exists(keys) == 0  # the breaker is open: no waiting
            assert time.monotonic() - started < 1.0 + 0.5 + 2.0
        finally:
            backend.close()


def test_a_stalled_store_is_a_miss_after_the_deadline_and_is_used_again_after(
    tmp_path: Path,
) -> None:
    with ServerProcess(tmp_path, settings=CHUNKS, name="stalled") as server:
        pool = host_pool("layer_first", seed=21)
        config = storage_config(
            server.target, timeout_s=0.5, lookup_timeout_s=0.3, retry_after_s=0.5
        )
        backend = open_backend(config, pool)
        assert server.proc is not None
        try:
            assert backend.batch_set_v1(hashes("warm", 1), page_indices(pool, 1)) == [True]
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                # Pages the store does not hold: only the (stopped) server could say so.
                assert backend.batch_exists(hashes("stalled", 2)) == 0
                assert backend.batch_set_v1(hashes("stalled", 2), page_indices(pool, 2)) == [
                    False,
                    False,
                ]
                assert time.monotonic() - started < 0.3 + 0.5 + 2.0  # misses, not a stall
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            keys = hashes("resumed", 2)
            poll(
                lambda: backend.batch_set_v1(keys, page_indices(pool, 2)) == [True, True],
                within=30.0,
                what="stores resuming after the store woke up",
            )
            assert backend.batch_exists(keys) == 2
        finally:
            backend.close()


def test_sglangs_random_failures_are_misses_never_wrong_bytes(
    store: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    writer_pool = host_pool("page_first", seed=22)
    config = storage_config(store.target, layout="page_first", cache_salt="injected")
    writer = open_backend(config, writer_pool)
    keys = hashes("injected", 4)
    source = page_indices(writer_pool, 4)
    assert writer.batch_set_v1(keys, source) == [True] * 4
    writer.close()

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    reader_pool = host_pool("page_first", seed=23)
    reader = open_backend(config, reader_pool)
    try:
        assert isinstance(reader, HiCacheStorageFailureInjector)
        outcomes = set()
        for _ in range(30):
            hits = reader.batch_exists(keys)
            assert hits in (0, 4)
            target = page_indices(reader_pool, 4)
            got = reader.batch_get_v1(keys, target)
            assert got in ([True] * 4, [False] * 4)
            if got[0]:
                for s, t in zip(source[::PAGE_SIZE], target[::PAGE_SIZE], strict=True):
                    assert same_page(writer_pool, int(s), reader_pool, int(t))
            outcomes.add((hits, got[0]))
            reader_pool.free(target)
        # 30 rounds at p=0.5 each way: both outcomes of both calls show up.
        assert {hits for hits, _ in outcomes} == {0, 4}
        assert {loaded for _, loaded in outcomes} == {False, True}
        # Stores: a refused one stores nothing, an accepted one everything.
        for round_ in range(10):
            fresh = hashes(f"injected-store-{round_}", 2)
            stored = reader.batch_set_v1(fresh, page_indices(reader_pool, 2))
            assert stored in ([True, True], [False, False])
            if stored[0]:

                def present(fresh: list[str] = fresh) -> bool:
                    return bool(reader.batch_exists(fresh) == 2)

                poll(present, 10.0, "a stored page")
    finally:
        reader.close()


def test_a_forged_block_is_a_miss_and_never_reaches_the_host_pool(tmp_path: Path) -> None:
    secrets = {"KVSTORE_INTEGRITY_SECRETS": "the-cluster's"}
    with RedisServer(tmp_path / "redis") as redis_server:
        flags = ("--redis-url", redis_server.url)
        writer_store = ServerProcess(tmp_path / "w", flags, secrets, settings=CHUNKS, name="w")
        reader_store = ServerProcess(tmp_path / "r", flags, secrets, settings=CHUNKS, name="r")
        with writer_store, reader_store:
            writer_pool, reader_pool = host_pool("layer_first", seed=24), host_pool("layer_first")
            writer = open_backend(storage_config(writer_store.target), writer_pool)
            reader = open_backend(storage_config(reader_store.target), reader_pool)
            try:
                keys = hashes("forged", 3)
                source = page_indices(writer_pool, 3)
                assert writer.batch_set_v1(keys, source) == [True] * 3
                names = [
                    "kvstore:v1:" + key.hex() for key in writer.pages.keys.of(keys)
                ]  # redis.key_prefix's default
                raw = redis_server.client()
                poll(lambda: None not in raw.mget(names), 10.0, "the write-through to redis")
                # Someone with write access to Redis flips bits of the middle page's payload.
                stored = raw.get(names[1])
                assert isinstance(stored, bytes), stored
                value = bytearray(stored)
                value[-100:] = bytes(b ^ 0xFF for b in value[-100:])
                raw.set(names[1], bytes(value))

                target = page_indices(reader_pool, 3)
                before = reader_pool.get_data_page(int(target[PAGE_SIZE])).clone()
                assert reader.batch_get_v1(keys, target) == [True, False, True]
                assert same_page(writer_pool, int(source[0]), reader_pool, int(target[0]))
                assert same_page(writer_pool, int(source[32]), reader_pool, int(target[32]))
                untouched = reader_pool.get_data_page(int(target[PAGE_SIZE]))
                assert torch.equal(untouched.view(torch.uint8), before.view(torch.uint8))
                redis_stats = reader_store.stats()["tiers"]["redis"]
                assert redis_stats["corrupt_blocks"] == 1
            finally:
                writer.close()
                reader.close()
