"""The vLLM connector's ``kv_role``s and the prefill/decode hand-off, planning only (no vLLM).

A ``kv_producer`` never looks up or loads and saves every computed whole prompt chunk, then
reports their count in its output's ``kv_transfer_params``; a ``kv_consumer`` loads and never
saves, and a request carrying a producer's count waits (without blocking the scheduler) until the
store holds those chunks, because the producer's puts are asynchronous. Stand-ins for vLLM's
objects and the in-memory store come from :mod:`test_connector_logic`; the last test runs the
hand-off against a real ``kvstore serve`` with the producer's puts held back, and compares the
loaded blocks bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness.connector_sides import (
    BLOCK,
    CHUNK,
    FakeStore,
    answer_when_known,
    chunk_keys_of,
    connector_settings,
    random_caches,
    stand_in_kv_cache_config,
    stand_in_vllm_config,
)
from harness.serve import ServerProcess
from harness.vllm_scheduler import StandInManager, stand_in_output, stand_in_request

from kvstore import KVStoreClient
from kvstore.errors import ConfigError
from kvstore.integrations.vllm.common import base_namespace, engine_shape
from kvstore.integrations.vllm.scheduler import HANDOFF_KEY, SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide


def _side(
    store: FakeStore | None, role: str | None, **extra: Any
) -> tuple[SchedulerSide, StandInManager]:
    """A scheduler half in ``role``; ``store`` None: a real client of ``extra``'s target."""
    config = stand_in_vllm_config()
    config.kv_transfer_config = SimpleNamespace(kv_role=role)
    side = SchedulerSide(
        connector_settings(**extra), config, stand_in_kv_cache_config(), client=store
    )
    manager = StandInManager()
    side.bind_kv_cache_manager(manager)
    return side, manager


@pytest.fixture()
def sides() -> Iterator[list[SchedulerSide]]:
    made: list[SchedulerSide] = []
    yield made
    for side in made:
        side.shutdown()


def test_an_unknown_kv_role_is_one_config_error_naming_it() -> None:
    with pytest.raises(ConfigError) as info:
        _side(FakeStore(), "kv_prefill")
    message = str(info.value)
    assert "kv_prefill" in message and "kv_producer" in message and "kv_consumer" in message
    assert "\n" not in message


def test_no_role_is_kv_both(sides: list[SchedulerSide]) -> None:
    side, _ = _side(FakeStore(), None)
    sides.append(side)
    assert side.role == "kv_both"


def test_a_producer_never_loads_and_saves_every_chunk_and_reports_them(
    sides: list[SchedulerSide],
) -> None:
    store = FakeStore()
    side, manager = _side(store, "kv_producer")
    sides.append(side)
    tokens = list(range(3 * CHUNK + 5))
    request = stand_in_request("p", tokens)
    keys = chunk_keys_of(side, request)
    for key in keys:  # all stored already: a kv_both engine would load two and save none
        store.chunks[key] = torch.zeros(1)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert store.lookups == 0
    manager.blocks["p"] = list(range(7))
    plan = side.build_connector_meta(stand_in_output([("p", 0, len(tokens))]))
    assert plan.loads == []
    assert [(s.keys, s.block_ids) for s in plan.saves] == [(keys, list(range(6)))]
    assert side.request_finished(request, manager.blocks["p"]) == (True, {HANDOFF_KEY: 3})


def test_a_producer_reports_chunks_already_being_saved_too(sides: list[SchedulerSide]) -> None:
    side, manager = _side(FakeStore(), "kv_producer")
    sides.append(side)
    tokens = list(range(2 * CHUNK + 1))
    first, second = stand_in_request("a", tokens), stand_in_request("b", tokens)
    side.get_num_new_matched_tokens(first, 0)
    side.get_num_new_matched_tokens(second, 0)
    manager.blocks["a"], manager.blocks["b"] = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    plan = side.build_connector_meta(
        stand_in_output([("a", 0, len(tokens)), ("b", 0, len(tokens))])
    )
    assert [(s.req_id, len(s.keys)) for s in plan.saves] == [("a", 2)]
    # b saved nothing itself, but its two chunks are on their way: the hand-off may wait for them.
    assert side.request_finished(second, []) == (False, {HANDOFF_KEY: 2})


def test_a_consumer_loads_and_never_saves(sides: list[SchedulerSide]) -> None:
    store = FakeStore()
    side, manager = _side(store, "kv_consumer")
    sides.append(side)
    tokens = list(range(3 * CHUNK + 5))
    request = stand_in_request("c", tokens)
    keys = chunk_keys_of(side, request)
    store.chunks[keys[0]] = torch.zeros(1)
    assert answer_when_known(side, request, 0) == CHUNK
    manager.blocks["c"] = list(range(7))
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([0, 1],)), CHUNK)
    plan = side.build_connector_meta(stand_in_output([("c", 0, len(tokens))]))
    assert [load.keys for load in plan.loads] == [[keys[0]]]
    assert plan.saves == []
    assert side.request_finished(request, manager.blocks["c"]) == (False, None)


def test_a_handoff_waits_for_the_producers_chunks_without_blocking(
    sides: list[SchedulerSide],
) -> None:
    store = FakeStore()
    side, _ = _side(store, "kv_consumer", handoff_wait_s=30.0)
    sides.append(side)
    tokens = list(range(3 * CHUNK + 5))
    keys = chunk_keys_of(side, stand_in_request("probe", tokens))
    store.chunks[keys[0]] = torch.zeros(1)  # the producer's later puts are still on their way
    request = stand_in_request("d", tokens, kv_transfer_params={HANDOFF_KEY: 3})
    # Asked repeatedly (as vLLM does each step), it answers "not known yet" while one is missing.
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)
    assert store.lookups > 2  # it asked the store again, not once
    store.chunks[keys[1]] = store.chunks[keys[2]] = torch.zeros(1)
    assert (
        answer_when_known(side, request, 0) == 3 * CHUNK
    )  # every whole chunk, now that they are there
    # A request without the producer's count does not wait.
    assert (
        answer_when_known(side, stand_in_request("plain", tokens[: 2 * CHUNK + 3]), BLOCK)
        == 2 * CHUNK - BLOCK
    )


def test_a_handoff_goes_ahead_with_what_arrived_after_handoff_wait_s(
    sides: list[SchedulerSide],
) -> None:
    store = FakeStore()
    side, _ = _side(store, "kv_both", handoff_wait_s=0.2)
    sides.append(side)
    tokens = list(range(3 * CHUNK + 5))
    keys = chunk_keys_of(side, stand_in_request("probe", tokens))
    store.chunks[keys[0]] = torch.zeros(1)
    request = stand_in_request("d", tokens, kv_transfer_params={HANDOFF_KEY: 3})
    assert answer_when_known(side, request, 0) == CHUNK


@pytest.mark.parametrize("params", [None, {}, {HANDOFF_KEY: "3"}, {HANDOFF_KEY: True}, {"x": 1}])
def test_other_transfer_params_do_not_wait(sides: list[SchedulerSide], params: Any) -> None:
    store = FakeStore()
    side, _ = _side(store, "kv_consumer", handoff_wait_s=30.0)
    sides.append(side)
    request = stand_in_request("d", list(range(3 * CHUNK + 5)), kv_transfer_params=params)
    assert answer_when_known(side, request, 0) == 0
    assert store.lookups == 1


# -- the hand-off against a real kvstore serve -------------------------------------------------


class _SlowPuts:
    """The producer worker's real client, with every put held back ``delay_s`` (a slow store)."""

    def __init__(self, client: KVStoreClient, delay_s: float) -> None:
        self._client, self._delay_s = client, delay_s

    def put(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self._delay_s)  # sleep: the slow store's work, as slow as asked
        return self._client.put(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_a_consumer_loads_a_producers_chunks_still_being_put_bit_for_bit(
    tmp_path: Path, sides: list[SchedulerSide]
) -> None:
    (tmp_path / "tmp").mkdir()
    args = ["--listen", "127.0.0.1:0", "--nvme-path", str(tmp_path / "nvme")]
    flags = [*args, "--dram-capacity", "16MiB"]
    server = ServerProcess(
        tmp_path / "serve", flags, tmpdir=tmp_path / "tmp", settings={"keys.chunk_size": CHUNK}
    ).start()
    try:
        settings = {"target": server.target, "handoff_wait_s": 30.0}
        producer, manager = _side(None, "kv_producer", **settings)
        consumer, _ = _side(None, "kv_consumer", **settings)
        sides += [producer, consumer]
        base = base_namespace(
            stand_in_vllm_config(),
            engine_shape(stand_in_vllm_config(), stand_in_kv_cache_config(), 0),
            connector_settings(),
            0,
        )
        slow = _SlowPuts(KVStoreClient(server.target, namespace=base), delay_s=1.0)
        config = stand_in_vllm_config()
        config.kv_transfer_config = SimpleNamespace(kv_role="kv_producer")
        writer = WorkerSide(
            connector_settings(**settings), config, stand_in_kv_cache_config(), client=slow
        )
        source = random_caches(1)
        writer.register_kv_caches(source)
        tokens = list(range(3 * CHUNK + 5))
        request = stand_in_request("p", tokens)
        producer.get_num_new_matched_tokens(request, 0)
        manager.blocks["p"] = list(range(7))
        plan = producer.build_connector_meta(stand_in_output([("p", 0, len(tokens))]))
        writer.wait_for_save(plan)  # queued: the puts reach the store a second later
        _, params = producer.request_finished(request, manager.blocks["p"])
        assert params == {HANDOFF_KEY: 3}

        # The decode engine gets the request at once, before the store holds the chunks.
        decode = stand_in_request("d", tokens, kv_transfer_params=params)
        assert consumer.get_num_new_matched_tokens(decode, 0) == (None, False)
        assert answer_when_known(consumer, decode, 0) == 3 * CHUNK
        consumer.update_state_after_alloc(
            decode,
            SimpleNamespace(get_block_ids=lambda: ([12, 13, 14, 15, 16, 17, 18],)),
            3 * CHUNK,
        )
        load = consumer.build_connector_meta(stand_in_output([("d", 0, len(tokens))]))
        assert load.saves == []
        reader = WorkerSide(
            connector_settings(**settings), stand_in_vllm_config(), stand_in_kv_cache_config()
        )
        try:
            target = random_caches(2)
            reader.register_kv_caches(target)
            reader.start_load_kv(load)
            for name in target:
                reader.wait_for_layer_load(name)
            reader.wait_for_save(load)
            assert reader.get_block_ids_with_load_errors() == set()
            for name in target:
                for a, b in zip(range(0, 6), range(12, 18), strict=True):
                    assert torch.equal(target[name][b], source[name][a])
        finally:
            reader.shutdown()
            writer.shutdown()
    finally:
        server.stop()
