"""The vLLM connector's logic without vLLM: load and save planning, key ranks, the breaker.

vLLM is not imported here. Its objects are stood in for by plain namespaces carrying only the
fields the connector reads (:mod:`harness.vllm_scheduler`: the request, ``KVCacheBlocks``,
``KVCacheManager``, ``SchedulerOutput``; :mod:`harness.connector_sides`: ``VllmConfig`` and
``KVCacheConfig``). The store is :class:`~harness.connector_sides.FakeStore`, an in-memory
stand-in for :class:`kvstore.KVStoreClient` (the breaker's resumption runs real clients instead,
over :class:`kvstore.MockTransport`); the KV caches are real CPU tensors in vLLM's CPU layout.
The same halves against a real store and a real engine are tested in tests/vllm_engine (the vLLM
suite).
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from harness.connector_sides import (
    BLOCK,
    CHUNK,
    LAYERS,
    NUM_BLOCKS,
    FakeStore,
    answer_when_known,
    chunk_keys_of,
    connector_settings,
    random_caches,
    stand_in_kv_cache_config,
    stand_in_vllm_config,
)
from harness.connector_sides import scheduler as scheduler  # fixtures, shared
from harness.connector_sides import store as store
from harness.connector_sides import worker as worker
from harness.memory_store import MemoryStore
from harness.vllm_scheduler import StandInBlocks, StandInManager, stand_in_output, stand_in_request

from kvstore import KVStoreClient, MockTransport, Namespace
from kvstore.errors import ConfigError, DeadlineExceededError, StoreUnavailableError
from kvstore.integrations.paged.plan import kernel_ids, load_targets, plan_scatter
from kvstore.integrations.vllm.common import (
    Breaker,
    ConnectorSettings,
    LoadSpec,
    SaveSpec,
    StepPlan,
    base_namespace,
    engine_shape,
    rank_keys,
    warm_up,
)
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide

# -- the scheduler half: lookups and load planning -----------------------------------------------


def test_lookup_hits_count_beyond_the_computed_tokens(
    scheduler: tuple[SchedulerSide, StandInManager], store: FakeStore
) -> None:
    side, _ = scheduler
    tokens = list(range(3 * CHUNK + 5))
    keys = chunk_keys_of(side, stand_in_request("probe", tokens))
    assert len(keys) == 3
    for key in keys[:2]:
        store.chunks[key] = torch.zeros(1)
    assert answer_when_known(side, stand_in_request("a", tokens), 0) == 2 * CHUNK
    assert answer_when_known(side, stand_in_request("b", tokens), BLOCK) == 2 * CHUNK - BLOCK
    assert answer_when_known(side, stand_in_request("c", tokens), 2 * CHUNK) == 0


def test_the_last_prompt_token_is_never_loaded(
    scheduler: tuple[SchedulerSide, StandInManager], store: FakeStore
) -> None:
    side, _ = scheduler
    tokens = list(range(3 * CHUNK))  # three whole chunks, all stored
    for key in chunk_keys_of(side, stand_in_request("probe", tokens)):
        store.chunks[key] = torch.zeros(1)
    # vLLM must compute at least one token, so the third chunk is not loadable.
    assert answer_when_known(side, stand_in_request("a", tokens), 0) == 2 * CHUNK


def test_requests_that_token_ids_do_not_describe_neither_load_nor_save(
    scheduler: tuple[SchedulerSide, StandInManager], store: FakeStore
) -> None:
    side, _ = scheduler
    tokens = list(range(3 * CHUNK))
    for fields in ({"mm_features": ["image"]}, {"prompt_embeds": object()}):
        request = stand_in_request("mm", tokens, **fields)
        assert chunk_keys_of(side, request) == []
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        side.request_finished(request, [])
    assert store.lookups == 0


def test_salt_and_lora_separate_keys(scheduler: tuple[SchedulerSide, StandInManager]) -> None:
    side, _ = scheduler
    tokens = list(range(2 * CHUNK + 1))
    plain = chunk_keys_of(side, stand_in_request("p", tokens))
    salted = chunk_keys_of(side, stand_in_request("s", tokens, cache_salt="tenant-7"))
    lora = SimpleNamespace(lora_name="adapter", lora_path="/adapters/a")
    adapted = chunk_keys_of(side, stand_in_request("l", tokens, lora_request=lora))
    assert len(plain) == len(salted) == len(adapted) == 2
    assert len(set(plain) | set(salted) | set(adapted)) == 6
    assert chunk_keys_of(side, stand_in_request("p2", tokens)) == plain


def test_load_plan_writes_only_the_blocks_the_engine_lacks(
    scheduler: tuple[SchedulerSide, StandInManager], store: FakeStore
) -> None:
    side, _ = scheduler
    tokens = list(range(3 * CHUNK + 3))
    request = stand_in_request("b", tokens)
    keys = chunk_keys_of(side, request)
    for key in keys:
        store.chunks[key] = torch.zeros(1)
    # The engine's own prefix cache holds the first block; the store supplies the rest.
    assert answer_when_known(side, request, BLOCK) == 3 * CHUNK - BLOCK
    side.update_state_after_alloc(
        request, StandInBlocks([30, 20, 21, 22, 23, 24, 25]), 3 * CHUNK - BLOCK
    )
    plan = side.build_connector_meta(stand_in_output([]))
    # The load counts the request's 80 new tokens (3 chunks less the block it holds).
    assert plan.loads == [LoadSpec("b", keys, [-1, 20, 21, 22, 23, 24], tokens=3 * CHUNK - BLOCK)]
    assert side.build_connector_meta(stand_in_output([])).loads == []  # handed out once
    side.update_state_after_alloc(request, StandInBlocks([1]), 0)
    assert side.build_connector_meta(stand_in_output([])).loads == []


def test_load_targets() -> None:
    blocks = [10, 11, 12, 13, 14, 15]
    # Tokens [16, 64): chunk 0 from its second block, and all of chunk 1.
    chunks, targets = load_targets(blocks, 16, 64, CHUNK, BLOCK, 2)
    assert chunks == range(0, 2)
    assert targets == [-1, 11, 12, 13]
    # Tokens [32, 80) end mid-chunk: the blocks past the end stay -1.
    chunks, targets = load_targets(blocks, 32, 80, CHUNK, BLOCK, 2)
    assert chunks == range(1, 3)
    assert targets == [12, 13, 14, -1]
    # More blocks asked for than the request has: the missing ones are -1.
    assert load_targets(blocks[:3], 0, 64, CHUNK, BLOCK, 2)[1] == [10, 11, 12, -1]


# -- the scheduler half: save planning ---------------------------------------------------------


def test_save_plan_covers_chunks_completed_this_step_and_absent_from_the_store(
    scheduler: tuple[SchedulerSide, StandInManager], store: FakeStore
) -> None:
    side, manager = scheduler
    tokens = list(range(3 * CHUNK + 5))
    request = stand_in_request("a", tokens)
    keys = chunk_keys_of(side, request)
    store.chunks[keys[0]] = torch.zeros(1)
    assert answer_when_known(side, request, 0) == CHUNK
    manager.blocks["a"] = list(range(7, 14))
    # A first step computes 2.5 chunks: chunk 0 is stored already, chunk 1 is new.
    plan = side.build_connector_meta(stand_in_output([("a", 0, 2 * CHUNK + CHUNK // 2)]))
    assert [(s.req_id, s.keys, s.block_ids) for s in plan.saves] == [("a", [keys[1]], [9, 10])]
    # The next completes the prompt: chunk 2 only.
    cached = SimpleNamespace(req_ids=["a"], num_computed_tokens=[2 * CHUNK + CHUNK // 2])
    output = stand_in_output([])
    output.scheduled_cached_reqs = cached
    output.num_scheduled_tokens = {"a": CHUNK}
    plan = side.build_connector_meta(output)
    assert [(s.keys, s.block_ids) for s in plan.saves] == [([keys[2]], [11, 12])]
    assert side.request_finished(request, manager.blocks["a"]) == (True, None)


def test_a_chunk_is_planned_once_across_requests_sharing_it(
    scheduler: tuple[SchedulerSide, StandInManager],
) -> None:
    side, manager = scheduler
    tokens = list(range(2 * CHUNK + 1))
    first, second = stand_in_request("a", tokens), stand_in_request("b", tokens)
    assert answer_when_known(side, first, 0) == 0
    assert answer_when_known(side, second, 0) == 0
    manager.blocks["a"], manager.blocks["b"] = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    plan = side.build_connector_meta(
        stand_in_output([("a", 0, len(tokens)), ("b", 0, len(tokens))])
    )
    assert [(s.req_id, len(s.keys)) for s in plan.saves] == [("a", 2)]
    assert side.request_finished(first, []) == (True, None)
    assert side.request_finished(second, []) == (False, None)  # nothing of its own to save


@pytest.mark.parametrize(("failure", "saved"), [("down", []), ("slow", [("a", 2)])])
def test_a_failing_store_is_not_asked_for_a_while_and_only_a_dead_one_loses_saves(
    scheduler: tuple[SchedulerSide, StandInManager],
    store: FakeStore,
    failure: str,
    saved: list[Any],
) -> None:
    """A dead store trips the breaker, so nothing waits on it. A lookup's deadline is short (it
    holds the request): a store that misses it under load is slow, not gone, and its puts have
    deadlines of their own, so the chunks are still planned."""
    side, manager = scheduler
    setattr(store, failure, True)
    tokens = list(range(2 * CHUNK + 1))
    assert answer_when_known(side, stand_in_request("a", tokens), 0) == 0
    calls = store.lookups
    assert answer_when_known(side, stand_in_request("b", tokens), 0) == 0
    assert store.lookups == calls  # answered a miss without asking the store
    manager.blocks["a"] = [1, 2, 3, 4, 5]
    plan = side.build_connector_meta(stand_in_output([("a", 0, len(tokens))]))
    assert [(s.req_id, len(s.keys)) for s in plan.saves] == saved


@pytest.mark.parametrize("slow", [False, True])
def test_a_slow_first_call_is_not_an_outage(slow: bool) -> None:
    # The first call pays for the connection; on a loaded host it may outlive its deadline.
    store = FakeStore()
    store.slow, store.down = slow, not slow
    breaker = Breaker(retry_after_s=5.0)
    warm_up(store, breaker, 0.5)
    assert breaker.is_open() is not slow


# -- the worker half ---------------------------------------------------------------------------


def _wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_saved_chunks_load_into_only_the_planned_blocks(
    worker: WorkerSide, store: FakeStore
) -> None:
    source = random_caches(1)
    worker.register_kv_caches(source)
    keys = [bytes([i]) * 16 for i in range(3)]
    worker.wait_for_save(StepPlan(saves=[SaveSpec("a", keys, list(range(7, 13)))]))
    _wait_for(lambda: len(store.chunks) == 3, "saved chunks never reached the store")
    assert worker.get_finished({"a"}) == ({"a"}, None)

    target = random_caches(2)
    untouched = {name: t.clone() for name, t in target.items()}
    worker.register_kv_caches(target)
    plan = StepPlan(loads=[LoadSpec("b", keys, [-1, 20, 21, 22, 23, -1])])
    worker.start_load_kv(plan)
    for name in target:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(plan)
    assert worker.get_block_ids_with_load_errors() == set()
    for name in target:
        for a_block, b_block in zip(range(8, 12), range(20, 24), strict=True):
            assert torch.equal(target[name][b_block], source[name][a_block])
        for block in set(range(NUM_BLOCKS)) - set(range(20, 24)):
            assert torch.equal(target[name][block], untouched[name][block])


def test_a_failed_load_is_reported_once_and_leaves_blocks_alone(
    worker: WorkerSide, store: FakeStore
) -> None:
    target = random_caches(3)
    untouched = {name: t.clone() for name, t in target.items()}
    worker.register_kv_caches(target)
    present, missing = bytes(16), b"\x01" * 16
    store.chunks[present] = torch.ones((LAYERS, 2, 2, BLOCK, 16), dtype=torch.bfloat16)
    plan = StepPlan(loads=[LoadSpec("x", [present, missing], [1, 2, 3, 4])])
    worker.start_load_kv(plan)
    for name in target:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(plan)
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    assert worker.get_block_ids_with_load_errors() == set()
    for name in target:
        assert torch.equal(target[name][1:3], torch.ones_like(target[name][1:3]))
        assert torch.equal(target[name][3:], untouched[name][3:])


def test_a_layer_never_loaded_makes_the_whole_step_recompute(
    worker: WorkerSide, store: FakeStore
) -> None:
    worker.register_kv_caches(random_caches(4))
    key = bytes(16)
    store.chunks[key] = torch.ones((LAYERS, 2, 2, BLOCK, 16), dtype=torch.bfloat16)
    plan = StepPlan(loads=[LoadSpec("x", [key], [5, 6])])
    worker.start_load_kv(plan)
    worker.wait_for_layer_load("layers.0.attn")  # layer 1's attention never asks
    worker.wait_for_save(plan)
    assert worker.get_block_ids_with_load_errors() == {5, 6}


def test_scatter_plan_sorts_whole_and_partly_new_chunks() -> None:
    specs = [
        LoadSpec("a", [b"k0", b"k1"], [4, 5, -1, 7]),
        LoadSpec("b", [b"k2", b"k3"], [8, 9, 10, 11]),
    ]
    plan = plan_scatter(specs, [True, True, False, True], blocks_per_chunk=2, ratio=2)
    assert plan.whole == [0, 3]
    assert plan.whole_ids == [8, 9, 10, 11, 20, 21, 22, 23]
    assert plan.partial == [(1, specs[0], 1)]
    # Chunks naming the same block twice are written one by one, never in one batched call.
    twice = [LoadSpec("c", [b"k4", b"k5"], [1, 2, 1, 2])]
    plan = plan_scatter(twice, [True, True], blocks_per_chunk=2, ratio=1)
    assert (plan.whole, plan.whole_ids) == ([], [])
    assert plan.partial == [(0, twice[0], 0), (1, twice[0], 1)]


def test_kernel_ids_split_engine_blocks() -> None:
    assert kernel_ids([3, 5], 1) == [3, 5]
    assert kernel_ids([3, 5], 4) == [12, 13, 14, 15, 20, 21, 22, 23]


# -- key ranks, settings, the breaker ----------------------------------------------------------


def test_each_rank_stores_under_its_own_keys() -> None:
    config = stand_in_vllm_config(tp_size=2, pp_size=2)
    settings = connector_settings()
    keys = [bytes([i]) * 16 for i in range(3)]

    def ranked(tp_rank: int, pp_rank: int) -> list[bytes]:
        shape = engine_shape(config, stand_in_kv_cache_config(), pp_rank=pp_rank)
        namespace = base_namespace(config, shape, settings, tp_rank=tp_rank)
        return rank_keys(keys, namespace, tp_rank, pp_rank)

    assert ranked(0, 0) == keys  # rank 0 keeps the names the scheduler looks up
    others = [ranked(1, 0), ranked(0, 1), ranked(1, 1)]
    assert all(len(k) == 16 for ranks in others for k in ranks)
    assert len({k for ranks in [keys, *others] for k in ranks}) == 12
    assert ranked(1, 1) == others[2]  # the same for every worker of that rank


def test_secret_comes_from_the_config_loader_unless_given() -> None:
    extra = {"target": "h:1"}
    assert ConnectorSettings.from_extra_config(extra, env={}).secret == ""
    env = {"KVSTORE_HASH_SECRET": "s3cret"}
    assert ConnectorSettings.from_extra_config(extra, env=env).secret == "s3cret"
    given = {**extra, "secret": "mine"}
    assert ConnectorSettings.from_extra_config(given, env=env).secret == "mine"
    with pytest.raises(ConfigError, match="multiple of the engine's block size"):
        SchedulerSide(
            connector_settings(chunk_size=24),
            stand_in_vllm_config(),
            stand_in_kv_cache_config(),
            FakeStore(),
        )


def test_token_and_tls_ca_are_read_and_the_token_is_not_shown() -> None:
    plain = ConnectorSettings.from_extra_config({"target": "h:1"}, env={})
    assert plain.token is None and plain.tls_ca is None  # the client's environment decides
    extra = {"target": "h:1", "token": "t0ken-value", "tls_ca": "/etc/kvstore/ca.pem"}
    settings = ConnectorSettings.from_extra_config(extra, env={})
    assert (settings.token, settings.tls_ca) == ("t0ken-value", "/etc/kvstore/ca.pem")
    assert "t0ken-value" not in repr(settings)


def test_breaker_opens_on_a_failure_for_retry_after_s_and_logs_once_per_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    breaker = Breaker(retry_after_s=5.0, clock=lambda: now[0])
    assert not breaker.is_open()
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.vllm.common"):
        breaker.trip(StoreUnavailableError("down"))
        assert breaker.is_open()
        now[0] = 103.0
        breaker.trip(StoreUnavailableError("still down"))  # extends the outage, quietly
        now[0] = 107.9
        assert breaker.is_open()
        now[0] = 108.0
        assert not breaker.is_open()
        breaker.trip(StoreUnavailableError("down again"))
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "kvstore unavailable (down)",
        "kvstore unavailable (down again)",
    ]


def test_breaker_closes_when_the_store_connects_again_and_only_an_unreachable_one_is_watched() -> (
    None
):
    watchers: list[Any] = []
    breaker = Breaker(retry_after_s=60.0, reconnected=watchers.append)
    breaker.trip(DeadlineExceededError("slow"))  # a slow store: no connection to wait for
    assert breaker.is_open() and watchers == []
    breaker.trip(StoreUnavailableError("down"))
    breaker.trip(StoreUnavailableError("still down"))  # one watch per outage
    assert breaker.is_open() and len(watchers) == 1
    watchers[0]()  # the channel connected again
    assert not breaker.is_open()
    breaker.trip(StoreUnavailableError("down again"))
    assert breaker.is_open() and len(watchers) == 2


class _CountingTransport(MockTransport):
    """Counts the reconnect watches asked of it."""

    watches = 0

    def when_reconnected(self, callback: Any) -> None:
        self.watches += 1
        super().when_reconnected(callback)


def test_both_connector_halves_resume_as_soon_as_the_store_connects_again() -> None:
    # Real clients (each half's own, as in their own processes) over one store that is down:
    # the client's mapping of UNAVAILABLE opens the breakers, its reconnect watch closes them.
    memory = MemoryStore(fail=(grpc.StatusCode.UNAVAILABLE, "store is down"), chunk_size=CHUNK)
    scheduler_link, worker_link = _CountingTransport(memory), _CountingTransport(memory)
    ns = Namespace(model="test-model")
    scheduler_client = KVStoreClient("unused", namespace=ns, transport=scheduler_link)
    side = SchedulerSide(
        connector_settings(),
        stand_in_vllm_config(),
        stand_in_kv_cache_config(),
        client=scheduler_client,
    )
    side.bind_kv_cache_manager(StandInManager())
    worker_client = KVStoreClient("unused", namespace=ns, transport=worker_link)
    worker = WorkerSide(
        connector_settings(),
        stand_in_vllm_config(),
        stand_in_kv_cache_config(),
        client=worker_client,
    )
    try:
        assert (
            answer_when_known(side, stand_in_request("r", list(range(3 * CHUNK))), 0) == 0
        )  # a miss, not an error
        _wait_for(lambda: side._breaker.is_open(), "the scheduler's breaker opens")
        memory.fail = None
        # Two watches each: the key-scheme agreement at start found the store down (it asks again
        # on reconnection), and the breaker's (warm_up may have asked too, as it shares the
        # scheduler's breaker: still one watch per outage).
        assert scheduler_link.watches == 2
        scheduler_link.reconnect()
        assert not side._breaker.is_open()
        worker._breaker.trip(StoreUnavailableError("a save failed"))  # the worker's own breaker
        assert worker._breaker.is_open() and worker_link.watches == 2
        worker_link.reconnect()
        assert not worker._breaker.is_open()
        assert answer_when_known(side, stand_in_request("r2", list(range(3 * CHUNK))), 0) == 0
        assert "Lookup" in memory.methods()
    finally:
        side.shutdown()
        worker.shutdown()
    assert scheduler_link.closed and worker_link.closed
