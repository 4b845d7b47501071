"""The connector takes its chunk size and hash algorithm from its store (``vllm_scheme``).

Its halves ask the store at start, declaring the engine's base namespace and secret check, and
use the answer; a setting of the connector's own that differs is one ERROR line and a refusal to
start; a store unreachable at start is asked again once it answers, and a different answer then
stops loading and saving for good. Against the tests' stand-in store, and against a real
``kvstore serve`` whose node has ``[keys]`` settings (:mod:`harness.serve`); what it holds
declared is read from the cluster index in a real redis-server (:mod:`harness.node_schemes`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness.connector_sides import (
    BLOCK,
    CHUNK,
    FakeStore,
    connector_settings,
    random_caches,
    stand_in_kv_cache_config,
    stand_in_vllm_config,
)
from harness.node_schemes import cluster_settings, wait_published
from harness.polling import poll
from harness.ports import free_port
from harness.redis_server import RedisServer
from harness.serve import ServerProcess
from harness.vllm_scheduler import StandInManager, stand_in_output, stand_in_request

from kvstore.errors import (
    CapacityError,
    ConfigError,
    DeadlineExceededError,
    InternalStoreError,
    KVStoreError,
    NamespaceMismatchError,
    PermissionDeniedError,
)
from kvstore.integrations.vllm.common import ConnectorSettings, LoadSpec, StepPlan
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide
from kvstore.key_scheme import KeyScheme, secret_fingerprint
from kvstore.keys import ChunkHasher, Namespace

SCHEME_LOGGER = "kvstore.integrations.vllm.scheme"


class SchemeStore(FakeStore):
    """The tests' store, answering ``scheme`` (``None``: unreachable) or raising ``refusal``."""

    def __init__(self, scheme: KeyScheme | None, refusal: KVStoreError | None = None) -> None:
        super().__init__()
        self.scheme = scheme
        self.refusal = refusal
        self.asked: list[tuple[Namespace, str]] = []
        self.closed = False
        #: The reconnect watches asked of it, for a test to fire.
        self.reconnect_callbacks: list[Callable[[], None]] = []

    def when_reconnected(self, callback: Callable[[], None]) -> None:
        self.reconnect_callbacks.append(callback)

    def key_scheme(
        self, namespace: Namespace, secret_check: str, *, timeout: float | None = None
    ) -> KeyScheme:
        self.asked.append((namespace, secret_check))
        if self.refusal is not None:
            raise self.refusal
        return super().key_scheme(namespace, secret_check, timeout=timeout)

    def close(self) -> None:
        self.closed = True


def _unpinned(target: str = "127.0.0.1:1", **extra: Any) -> ConnectorSettings:
    """Settings that leave the chunk size and hash algorithm to the store."""
    return ConnectorSettings.from_extra_config({"target": target, **extra}, env={})


def _scheduler(settings: ConnectorSettings, store: Any = None) -> SchedulerSide:
    return SchedulerSide(settings, stand_in_vllm_config(), stand_in_kv_cache_config(), client=store)


def _scheme_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == SCHEME_LOGGER and r.levelno == level
    ]


def test_both_halves_take_the_stores_chunk_size_and_algorithm_when_the_config_sets_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = SchemeStore(KeyScheme(chunk_size=4 * BLOCK, hash_algorithm="sha256"))
    with caplog.at_level(logging.INFO, logger=SCHEME_LOGGER):
        side = _scheduler(_unpinned(), store)
        worker = WorkerSide(
            _unpinned(), stand_in_vllm_config(), stand_in_kv_cache_config(), client=store
        )
    try:
        assert (side._settings.chunk_size, side._settings.hash_algorithm) == (64, "sha256")
        assert (side.layout.blocks_per_chunk(0), worker._blocks_per_chunk) == (4, 4)
        # Declared: the engine's base namespace and the fingerprint of its (empty) secret.
        namespace, check = store.asked[0]
        assert namespace == side._base and check == secret_fingerprint("")
        tokens = list(range(2 * 64 + 1))
        expected = ChunkHasher(64, side._base, algorithm="sha256").keys(tokens)
        assert side._state(stand_in_request("r", tokens)).keys == [bytes(k) for k in expected]
        assert (
            side.build_connector_meta(stand_in_output([])).chunk_size == 64
        )  # told to the workers
        assert _scheme_lines(caplog, logging.WARNING) == _scheme_lines(caplog, logging.ERROR) == []
    finally:
        worker.shutdown()
        side.shutdown()


@pytest.mark.parametrize(
    ("extra", "answer", "said"),
    [
        (
            {"chunk_size": CHUNK},
            KeyScheme(chunk_size=2 * CHUNK),
            "kv_connector_extra_config chunk_size=32 differs from the store's keys.chunk_size=64",
        ),
        (
            {"hash_algorithm": "sha256"},
            KeyScheme(chunk_size=CHUNK),
            "kv_connector_extra_config hash_algorithm='sha256' differs from the store's "
            "keys.hash_algorithm='xxh3_128'",
        ),
    ],
    ids=["chunk_size", "hash_algorithm"],
)
def test_a_setting_that_differs_from_the_stores_is_one_error_line_and_no_start(
    caplog: pytest.LogCaptureFixture, extra: dict[str, Any], answer: KeyScheme, said: str
) -> None:
    store = SchemeStore(answer)
    with pytest.raises(ConfigError, match=said), caplog.at_level(logging.ERROR):
        _scheduler(_unpinned(**extra), store)
    (line,) = _scheme_lines(caplog, logging.ERROR)
    assert said in line and "kvstore connector (scheduler)" in line
    assert store.closed  # nothing left open behind the refusal


def test_a_store_chunk_size_that_is_no_whole_number_of_blocks_is_refused() -> None:
    store = SchemeStore(KeyScheme(chunk_size=BLOCK + 8))
    with pytest.raises(ConfigError, match=r"the store's keys\.chunk_size 24 must be a multiple"):
        _scheduler(_unpinned(), store)
    # The connector's own setting is checked before the store is asked.
    with pytest.raises(ConfigError, match="extra_config chunk_size 24 must be a multiple"):
        _scheduler(connector_settings(chunk_size=24), store)
    assert len(store.asked) == 1


@pytest.mark.parametrize(
    "refusal",
    [
        NamespaceMismatchError("the engine's $KVSTORE_HASH_SECRET differs from this node's"),
        PermissionDeniedError("the declared namespace's tenant 'b' is not yours ('a')"),
        CapacityError("this node already serves 64 declared namespaces"),
    ],
    ids=["secret", "tenant", "too-many"],
)
def test_a_refusal_by_the_store_stops_the_start(refusal: KVStoreError) -> None:
    store = SchemeStore(None, refusal)
    with pytest.raises(ConfigError, match=re.escape(f"refused its key scheme: {refusal}")):
        _scheduler(connector_settings(), store)


def test_a_store_without_the_call_leaves_the_connector_its_own_settings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = SchemeStore(None, InternalStoreError("UNIMPLEMENTED: Method not found!"))
    with caplog.at_level(logging.WARNING, logger=SCHEME_LOGGER):
        side = _scheduler(connector_settings(), store)
    try:
        (line,) = _scheme_lines(caplog, logging.WARNING)
        assert "cannot ask the store for its key scheme (UNIMPLEMENTED" in line
        assert side._settings.chunk_size == CHUNK and store.reconnect_callbacks == []
    finally:
        side.shutdown()


def test_an_unreachable_store_is_asked_again_when_it_answers_and_confirms(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = SchemeStore(None)
    with caplog.at_level(logging.INFO, logger=SCHEME_LOGGER):
        side = _scheduler(connector_settings(), store)
        try:
            (warning,) = _scheme_lines(caplog, logging.WARNING)
            assert "did not answer at start" in warning and "chunk_size=32" in warning
            assert side._settings.chunk_size == CHUNK
            (watch,) = store.reconnect_callbacks
            watch()  # the store answers, with nothing asked again yet: still unreachable
            poll(lambda: len(store.reconnect_callbacks) == 2, 10, "a new watch")
            store.scheme = KeyScheme(chunk_size=CHUNK)
            store.reconnect_callbacks[1]()
            poll(lambda: _scheme_lines(caplog, logging.INFO), 10, "the store's confirmation")
            assert "confirms chunk_size=32" in _scheme_lines(caplog, logging.INFO)[0]
            assert not side._breaker.is_open() and len(store.asked) == 3
        finally:
            side.shutdown()
    assert _scheme_lines(caplog, logging.ERROR) == []


def test_a_store_too_slow_at_start_is_asked_again_after_retry_after_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = SchemeStore(None, DeadlineExceededError("deadline exceeded"))
    with caplog.at_level(logging.INFO, logger=SCHEME_LOGGER):
        side = _scheduler(connector_settings(retry_after_s=0), store)  # asked again after 1 s
        try:
            assert store.reconnect_callbacks == []  # its connection may be up all along
            store.refusal, store.scheme = None, KeyScheme(chunk_size=CHUNK)
            poll(lambda: _scheme_lines(caplog, logging.INFO), 10, "the store's confirmation")
            assert len(store.asked) == 2 and not side._breaker.is_open()
        finally:
            side.shutdown()


def test_a_store_that_answers_otherwise_after_a_start_without_it_stops_loads_and_saves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = SchemeStore(None)
    side = _scheduler(_unpinned(), store)  # the default chunk size, 256 tokens
    manager = StandInManager()
    side.bind_kv_cache_manager(manager)
    try:
        store.scheme = KeyScheme(chunk_size=CHUNK)
        with caplog.at_level(logging.ERROR, logger=SCHEME_LOGGER):
            store.reconnect_callbacks[0]()
            poll(lambda: _scheme_lines(caplog, logging.ERROR), 10, "the ERROR line")
        assert side._breaker.held  # before the line is logged
        (line,) = _scheme_lines(caplog, logging.ERROR)
        assert "the connector's default chunk_size=256 differs from the store's" in line
        assert "keys.chunk_size=32" in line and "not loading or saving" in line
        request = stand_in_request("r", list(range(2 * 256 + 1)))
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        manager.blocks["r"] = list(range(24))
        assert side.build_connector_meta(stand_in_output([("r", 0, 513)])).saves == []
        assert store.lookups == 0  # never asked, never named chunks of the wrong size
    finally:
        side.shutdown()


def test_a_worker_told_another_chunk_size_by_its_scheduler_stops_with_one_error_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = SchemeStore(KeyScheme(chunk_size=CHUNK))
    worker = WorkerSide(
        connector_settings(), stand_in_vllm_config(), stand_in_kv_cache_config(), client=store
    )
    try:
        worker.register_kv_caches(random_caches(1))
        key = b"k" * 16
        same = StepPlan(loads=[LoadSpec("r", [key], [0, 1])], chunk_size=CHUNK)
        assert worker.scheme.plan_agrees(same.chunk_size) and not worker._breaker.is_open()
        with caplog.at_level(logging.ERROR, logger=SCHEME_LOGGER):
            for _ in range(2):
                worker.start_load_kv(StepPlan(loads=[LoadSpec("r", [key], [0, 1])], chunk_size=64))
                worker.wait_for_save(StepPlan(chunk_size=64))
        (line,) = _scheme_lines(caplog, logging.ERROR)
        assert "the scheduler names chunks of 64 tokens, this worker of 32" in line
        assert worker._breaker.held
    finally:
        worker.shutdown()


def test_a_node_with_keys_settings_decides_the_chunk_size_of_both_halves(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis:
        settings = {"keys.chunk_size": 8 * BLOCK, **cluster_settings(redis.url, "n")}
        with ServerProcess(tmp_path / "node", settings=settings) as node:
            side = _scheduler(_unpinned(node.target))
            worker = WorkerSide(
                _unpinned(node.target), stand_in_vllm_config(), stand_in_kv_cache_config()
            )
            try:
                assert side._settings.chunk_size == worker._settings.chunk_size == 128
                assert worker._blocks_per_chunk == 8
                # Declared once (both halves name the same base namespace), as the node publishes.
                seen = wait_published(redis.url, "n", lambda seen: any(s.namespace for s in seen))
                assert [(s.namespace, s.chunk_size) for s in seen] == [(side._base, 128)]
            finally:
                worker.shutdown()
                side.shutdown()
            with pytest.raises(ConfigError, match="chunk_size=32 differs from the store's keys"):
                _scheduler(connector_settings(target=node.target))


@pytest.mark.parametrize(("node_chunk", "stops"), [(CHUNK, False), (2 * CHUNK, True)])
def test_a_node_that_comes_up_after_the_engine_is_checked_on_its_first_answer(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, node_chunk: int, stops: bool
) -> None:
    port = free_port()
    with caplog.at_level(logging.INFO, logger=SCHEME_LOGGER):
        side = _scheduler(connector_settings(target=f"127.0.0.1:{port}"))
        try:
            assert "did not answer at start" in _scheme_lines(caplog, logging.WARNING)[0]
            settings = {"keys.chunk_size": node_chunk}
            with ServerProcess(tmp_path, settings=settings, listen=f"127.0.0.1:{port}"):
                level = logging.ERROR if stops else logging.INFO
                poll(lambda: _scheme_lines(caplog, level), 30, "the check on reconnection")
            assert side._breaker.held is stops  # (the store down at start also tripped it)
        finally:
            side.shutdown()
