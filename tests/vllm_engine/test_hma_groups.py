"""The connector with vLLM's hybrid KV cache manager: every group kind against vLLM's own objects.

The cache layout is vLLM's (``KVCacheConfig`` of several ``KVCacheGroupSpec``: full attention,
sliding window, Mamba, one group of mixed page sizes), and so are the block tables: a real
``KVCacheManager`` allocates the requests' blocks, with the null blocks it puts where a sliding
window skipped tokens. The store is a real ``kvstore serve``; the KV caches are real CPU tensors
in vLLM's CPU layout. The model's forward pass is not run (tests/vllm_engine/test_vllm_e2e.py and
the family tests run real engines): the caches' contents stand for what it would have written.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness.serve import ServerProcess
from harness.vllm_scheduler import stand_in_output
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import Request

from kvstore.integrations.vllm.common import ConnectorSettings, engine_groups
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.workers import GroupWorkers

pytestmark = pytest.mark.vllm

BLOCK = 16
CHUNK = 32  # two blocks per chunk
WINDOW = 40  # the sliding window: the next token reads itself and the 39 before it
HEADS, HEAD = 2, 8
NUM_BLOCKS = 64
PROMPT = 200  # six whole chunks (192 tokens) and a tail

FULL = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
SLIDING = SlidingWindowSpec(
    block_size=BLOCK,
    num_kv_heads=HEADS,
    head_size=HEAD,
    dtype=torch.float32,
    sliding_window=WINDOW,
)
MAMBA = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.float32,) * 2)


def _mla(head_size: int, dtype: torch.dtype) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=head_size, dtype=dtype)


def _config(*specs: Any) -> KVCacheConfig:
    """One layer per group (``l0``, ``l1``, ...), as vLLM's hybrid manager groups them."""
    groups = [KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs)]
    page = FULL.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=page * NUM_BLOCKS,
            layers=[g.layer_names[0] for g in groups],
            layer_stride=0,
            block_stride=page,
        )
    ]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups)


def _vllm_config() -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(model="hybrid-test", revision=None, max_model_len=1024),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
        cache_config=SimpleNamespace(kv_cache_layout=None, cache_dtype="auto"),
    )


def _manager(config: KVCacheConfig) -> KVCacheManager:
    return KVCacheManager(
        config, max_model_len=1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK
    )


init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)


def _request(req_id: str, tokens: list[int]) -> Request:
    """A request as vLLM's engine makes it (block hashes for its prefix cache included)."""
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=_HASHER)


def _caches(config: KVCacheConfig, seed: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout of every layer: [blocks, kv heads, block size, 2 * head size]."""
    gen = torch.Generator().manual_seed(seed)
    names = [name for group in config.kv_cache_groups for name in group.layer_names]
    return {n: torch.randn((NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD), generator=gen) for n in names}


def _answer(side: SchedulerSide, request: Request, computed: int = 0) -> tuple[int, bool]:
    deadline = time.monotonic() + 5
    while True:
        tokens, is_async = side.get_num_new_matched_tokens(request, computed)
        if tokens is not None:
            return tokens, is_async
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.005)


def _drain(workers: GroupWorkers, req_id: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        sent, _ = workers.get_finished({req_id})
        if req_id in (sent or ()):
            return
        assert time.monotonic() < deadline, "the saves never read their blocks"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """This module's store: its node names chunks of CHUNK tokens."""
    server = ServerProcess(
        tmp_path_factory.mktemp("store"),
        settings={"dram.capacity": "1GiB", "keys.chunk_size": CHUNK},
        name="store",
    )
    with server:
        yield server


class _Engine:
    """One engine's connector halves over a real cache manager and real caches."""

    def __init__(self, target: str, config: KVCacheConfig, seed: int) -> None:
        settings = ConnectorSettings.from_extra_config({"target": target})
        self.config = config
        self.manager = _manager(config)
        self.scheduler = SchedulerSide(settings, _vllm_config(), config)
        self.scheduler.bind_kv_cache_manager(self.manager)
        self.workers = GroupWorkers(settings, _vllm_config(), config)
        self.caches = _caches(config, seed)
        self.workers.register_kv_caches(self.caches)

    def prefill(self, request: Request) -> None:
        """Schedule the whole prompt in one step and save what it completes."""
        blocks, _, *_ = self.manager.get_computed_blocks(request)
        tokens, _ = _answer(self.scheduler, request)
        assert tokens == 0
        self.manager.allocate_slots(
            request, len(request.prompt_token_ids or ()), new_computed_blocks=blocks
        )
        meta = self.scheduler.build_connector_meta(
            stand_in_output([(request.request_id, 0, len(request.prompt_token_ids or ()))])
        )
        self.workers.wait_for_save(meta)
        delay, _ = self.scheduler.request_finished(
            request, self.manager.get_block_ids(request.request_id)
        )
        assert delay
        _drain(self.workers, request.request_id)

    def close(self) -> None:
        self.workers.shutdown()
        self.scheduler.shutdown()


def _wait_stored(engine: _Engine, request: Request, chunks: int) -> None:
    """Until a fresh engine's lookup sees ``chunks`` chunks of every group (puts are async)."""
    state = engine.scheduler._state(request)
    deadline = time.monotonic() + 10
    while True:
        answer = engine.scheduler._client.lookup_tiers(
            engine.scheduler.layout.lookup_keys(state.group_keys, chunks)
        )
        if all(answer.tiers):
            return
        assert time.monotonic() < deadline, "saved chunks never reached the store"
        time.sleep(0.02)


def test_vllm_keeps_its_hybrid_manager_on_with_kvstore_configured() -> None:
    config = KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"target": "127.0.0.1:1"},
    )
    assert KVConnectorFactory.supports_hma_config(config)


def test_each_spec_type_is_its_group_kind() -> None:
    local = ChunkedLocalAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype=torch.float32,
        attention_chunk_size=64,
    )
    mla = _mla(72, torch.float32)
    mixed = UniformTypeKVCacheSpecs(
        block_size=BLOCK,
        kv_cache_specs={
            "a": MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=72, dtype=torch.uint8
            ),
            "b": MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=12, dtype=torch.uint8
            ),
        },
    )
    groups = engine_groups(_config(FULL, SLIDING, local, MAMBA, mla, mixed))
    assert [(g.kind, g.window) for g in groups] == [
        ("full", 0),
        ("sliding", WINDOW),
        ("local", 64),
        ("state", 0),
        ("full", 0),
        ("mixed", 0),
    ]
    assert len({g.fingerprint() for g in groups}) == len(groups)


def test_a_sliding_window_hit_loads_only_the_window_and_never_the_null_block(
    store: ServerProcess,
) -> None:
    config = _config(FULL, SLIDING)
    tokens = list(range(1000, 1000 + PROMPT))
    a = _Engine(store.target, config, seed=1)
    b = _Engine(store.target, config, seed=2)
    try:
        request_a = _request("a", tokens)
        a.prefill(request_a)
        _wait_stored(a, request_a, PROMPT // CHUNK)

        request_b = _request("b", tokens)
        untouched = {name: t.clone() for name, t in b.caches.items()}
        hit, is_async = _answer(b.scheduler, request_b)
        assert (hit, is_async) == (6 * CHUNK, True)  # several groups: an asynchronous load
        blocks, _, *_ = b.manager.get_computed_blocks(request_b)
        b.manager.allocate_slots(
            request_b,
            PROMPT - hit,
            new_computed_blocks=blocks,
            num_external_computed_tokens=hit,
            delay_cache_blocks=True,
        )
        b.scheduler.update_state_after_alloc(request_b, b.manager.get_blocks("b"), hit)
        full_ids, sliding_ids = b.manager.get_block_ids("b")
        null = b.manager.block_pool.null_block.block_id
        assert null in sliding_ids  # vLLM skipped the blocks before the window
        meta = b.scheduler.build_connector_meta(stand_in_output([]))
        by_group = {spec.group: spec for spec in meta.loads}
        assert len(by_group[0].keys) == 6  # full attention: every chunk
        # Sliding: tokens 153..191 are the window before token 192: chunks 4 and 5 only.
        assert len(by_group[1].keys) == 2
        assert null not in by_group[1].block_ids

        b.workers.start_load_kv(meta)
        b.workers.wait_for_save(meta)
        results = b.workers.get_transfer_results(set())
        assert (results.finished_recving, results.failed_recving) == ({"b"}, set())
        assert b.workers.get_block_ids_with_load_errors() == set()

        a_full, a_sliding = a.manager.get_block_ids("a")
        for i in range(12):
            assert torch.equal(b.caches["l0"][full_ids[i]], a.caches["l0"][a_full[i]])
        # 192 - 39 = 153: vLLM keeps blocks 9..11 (tokens 144..191), the rest are null.
        assert [i for i in range(12) if sliding_ids[i] != null] == [9, 10, 11]
        for i in (9, 10, 11):
            assert torch.equal(b.caches["l1"][sliding_ids[i]], a.caches["l1"][a_sliding[i]])
        stats = b.workers.take_stats()
        assert stats is not None
        block_bytes = HEADS * BLOCK * 2 * HEAD * 4
        assert stats["loaded_tokens"] == hit  # prompt tokens, once (not once per group)
        assert stats["loaded_bytes_by_group"] == {
            "full/0": 12 * block_bytes,  # 192 tokens
            "sliding/1": 3 * block_bytes,  # blocks 9..11 of chunks 4 and 5 (block 8 is null)
        }
        # What was loaded is A's KV; the null block and blocks past the hit are untouched.
        assert torch.equal(b.caches["l1"][null], untouched["l1"][null])
        assert torch.equal(b.caches["l0"][full_ids[12]], untouched["l0"][full_ids[12]])
    finally:
        a.close()
        b.close()


def test_saves_skip_window_blocks_vllm_freed_and_the_hit_needs_only_the_window(
    store: ServerProcess,
) -> None:
    """A window of 8 tokens, a prompt prefilled in two steps: between them vLLM frees the
    blocks that left the window (chunk 1's first block among them), so chunk 1 is saved for
    the full-attention group only; a later hit needs no sliding chunk but the last."""
    narrow = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32, sliding_window=8
    )
    config = _config(FULL, narrow)
    tokens = list(range(5000, 5000 + PROMPT))
    a = _Engine(store.target, config, seed=3)
    b = _Engine(store.target, config, seed=4)
    try:
        request = _request("a2", tokens)
        blocks, _, *_ = a.manager.get_computed_blocks(request)
        assert _answer(a.scheduler, request) == (0, False)
        a.manager.allocate_slots(request, 60, new_computed_blocks=blocks)
        first = a.scheduler.build_connector_meta(stand_in_output([("a2", 0, 60)]))
        assert sorted((s.group, len(s.keys)) for s in first.saves) == [(0, 1), (1, 1)]
        a.workers.wait_for_save(first)
        request.num_computed_tokens = 60
        a.manager.allocate_slots(request, PROMPT - 60)
        _, sliding_ids = a.manager.get_block_ids("a2")
        null = a.manager.block_pool.null_block.block_id
        assert sliding_ids[:3] == [null] * 3  # tokens before 60 - 7 = 53 left the window
        a.workers.handle_preemptions(first)  # the next step starts: windowed gathers are done
        second = a.scheduler.build_connector_meta(
            stand_in_output([], cached=[("a2", 60, PROMPT - 60)])
        )
        saves = {s.group: s for s in second.saves}
        assert len(saves[0].keys) == 5  # chunks 1..5 of full attention
        assert len(saves[1].keys) == 4  # chunks 2..5: chunk 1's block 2 is null now
        assert null not in saves[1].block_ids
        assert set(saves[1].block_ids) <= set(sliding_ids)  # the table as it is now
        a.workers.wait_for_save(second)
        a.scheduler.request_finished(request, a.manager.get_block_ids("a2"))
        _drain(a.workers, "a2")
        deadline = time.monotonic() + 10
        while True:
            # B, a new engine, finds the whole prefix: the last chunk is its window.
            probe = _request(f"b2-{time.monotonic_ns()}", tokens)
            hit, _ = _answer(b.scheduler, probe)
            if hit == 6 * CHUNK or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert hit == 6 * CHUNK
    finally:
        a.close()
        b.close()


def test_a_failed_hybrid_load_is_a_failed_request_not_block_ids(store: ServerProcess) -> None:
    """vLLM cannot map per-group block ids back to requests: a hybrid engine's failed load is
    reported as a failed asynchronous load (vLLM recomputes the request), no block is written."""
    config = _config(FULL, SLIDING)
    engine = _Engine(store.target, config, seed=5)
    try:
        untouched = {name: t.clone() for name, t in engine.caches.items()}
        request = _request("lost", list(range(9000, 9000 + PROMPT)))
        state = engine.scheduler._state(request)  # keys the store never held
        meta = engine.scheduler.build_connector_meta(stand_in_output([]))
        meta.loads = engine.scheduler.layout.load_specs(
            "lost", state.group_keys, [list(range(1, 13)), list(range(20, 32))], 0, 192, 0
        )
        engine.workers.start_load_kv(meta)
        engine.workers.wait_for_save(meta)
        results = engine.workers.get_transfer_results(set())
        assert results.finished_recving == {"lost"}
        assert results.failed_recving == {"lost"}
        assert engine.workers.get_block_ids_with_load_errors() == set()
        for name, cache in engine.caches.items():
            assert torch.equal(cache, untouched[name])
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("second", "kind"),
    [
        (MAMBA, "state"),
        (
            UniformTypeKVCacheSpecs(
                block_size=BLOCK,
                kv_cache_specs={
                    # DeepSeek V3.2: an MLA row of 656 bytes and an indexer row of 132.
                    "x": _mla(656, torch.uint8),
                    "y": _mla(132, torch.uint8),
                },
            ),
            "mixed",
        ),
    ],
)
def test_a_group_kvstore_does_not_store_starts_and_answers_nothing(
    store: ServerProcess, second: Any, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(FULL, second)
    settings = ConnectorSettings.from_extra_config({"target": store.target})
    with caplog.at_level("WARNING", logger="kvstore.integrations.vllm.hybrid"):
        scheduler = SchedulerSide(settings, _vllm_config(), config)
        workers = GroupWorkers(settings, _vllm_config(), config)
    try:
        assert [r.message for r in caplog.records if kind in r.message]  # one line at start
        assert workers.workers == []
        workers.register_kv_caches({})
        for i in range(3):
            request = _request(f"r{i}", list(range(i, i + PROMPT)))
            assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
            assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # asked again
        meta = scheduler.build_connector_meta(stand_in_output([("r0", 0, PROMPT)]))
        assert (meta.loads, meta.saves) == ([], [])
        stats = scheduler.take_stats()
        assert stats is not None
        assert stats["unsupported_group_requests"] == {kind: 3}
        assert stats["lookup_tokens"] == 0
    finally:
        workers.shutdown()
        scheduler.shutdown()


def test_an_all_sliding_model_loads_its_window_and_counts_the_prompt_tokens(
    store: ServerProcess,
) -> None:
    """Mistral-style: one sliding-window group (the anchor); layer-wise loads as for any model
    with one group, only the window's blocks written, the hit's tokens counted as loaded."""
    config = _config(SLIDING)
    tokens = list(range(7000, 7000 + PROMPT))
    a = _Engine(store.target, config, seed=6)
    b = _Engine(store.target, config, seed=7)
    try:
        request_a = _request("s-a", tokens)
        a.prefill(request_a)
        _wait_stored(a, request_a, PROMPT // CHUNK)
        request_b = _request("s-b", tokens)
        hit, is_async = _answer(b.scheduler, request_b)
        assert (hit, is_async) == (6 * CHUNK, False)  # one group: loads overlap the forward
        blocks, _, *_ = b.manager.get_computed_blocks(request_b)
        b.manager.allocate_slots(
            request_b, PROMPT - hit, new_computed_blocks=blocks, num_external_computed_tokens=hit
        )
        b.scheduler.update_state_after_alloc(request_b, b.manager.get_blocks("s-b"), hit)
        meta = b.scheduler.build_connector_meta(stand_in_output([("s-b", hit, PROMPT - hit)]))
        (load,) = meta.loads
        assert len(load.keys) == 2  # the window's chunks 4 and 5
        b.workers.start_load_kv(meta)
        b.workers.wait_for_layer_load("l0")
        b.workers.wait_for_save(meta)
        assert b.workers.get_block_ids_with_load_errors() == set()
        (sliding_ids,) = b.manager.get_block_ids("s-b")
        (a_ids,) = a.manager.get_block_ids("s-a")
        for i in (9, 10, 11):
            assert torch.equal(b.caches["l0"][sliding_ids[i]], a.caches["l0"][a_ids[i]])
        stats = b.workers.take_stats()
        assert stats is not None
        assert stats["loaded_tokens"] == hit
        assert stats["loaded_bytes_by_group"] == {"sliding/0": 3 * HEADS * BLOCK * 2 * HEAD * 4}
    finally:
        a.close()
        b.close()
