"""The connector logic tests' setup: a store STAND-IN, the vLLM configs stood in for, and both
connector halves built on them (as fixtures).

vLLM is not imported. :class:`FakeStore` stands in for :class:`kvstore.KVStoreClient` (chunks in
a dict, calls counted, outages and stalls on demand); :func:`stand_in_vllm_config` and
:func:`stand_in_kv_cache_config` stand in for vLLM's ``VllmConfig`` and ``KVCacheConfig`` with
only the fields the connector reads; the request, blocks, manager and scheduler output are
:mod:`harness.vllm_scheduler`'s. The KV caches are real CPU tensors in vLLM's CPU layout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from harness.store_stand_in import StoreStandIn
from harness.vllm_scheduler import StandInManager
from kvstore.errors import DeadlineExceededError, StoreUnavailableError
from kvstore.integrations.vllm.common import ConnectorSettings
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide
from kvstore.key_scheme import KeyScheme
from kvstore.retention import KEEP, Retention
from kvstore.types import LookupResult, PutResult

__all__ = [
    "BLOCK",
    "CHUNK",
    "LAYERS",
    "NUM_BLOCKS",
    "FakeStore",
    "answer_when_known",
    "chunk_keys_of",
    "connector_settings",
    "random_caches",
    "scheduler",
    "stand_in_kv_cache_config",
    "stand_in_vllm_config",
    "store",
    "worker",
]

BLOCK = 16
CHUNK = 32  # two blocks per chunk
LAYERS = 2
NUM_BLOCKS = 24


class FakeStore(StoreStandIn):
    """Stands in for :class:`kvstore.KVStoreClient`: chunks in a dict, calls counted."""

    #: A store whose node names chunks of CHUNK tokens, as the tests' settings do (a test's
    #: stand-in may set ``None``: a store that cannot be reached).
    scheme: KeyScheme | None = KeyScheme(chunk_size=CHUNK)

    def __init__(self) -> None:
        self.chunks: dict[bytes, torch.Tensor] = {}
        self.down = False
        #: Answers nothing within a call's deadline (a loaded or stalled store, not a dead one).
        self.slow = False
        self.lookups = 0
        self.lock = threading.Lock()
        #: The tier each stored chunk is reported in (``dram`` where not named) ...
        self.tiers: dict[bytes, str] = {}
        #: ... and what ``stats`` answers (the tiers' measured rates, for the load plan).
        self.stats_answer: dict[str, Any] = {}
        #: Keys asked to be prefetched into dram.
        self.prefetched: list[bytes] = []

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailableError("store is down")
        if self.slow:
            raise DeadlineExceededError("deadline exceeded before the store answered")

    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        return self.lookup_tiers(keys, timeout=timeout).hits

    def lookup_tiers(self, keys: Sequence[bytes], *, timeout: float | None = None) -> LookupResult:
        self.lookups += 1
        self._check()
        tiers = [self.tiers.get(key, "dram") if key in self.chunks else "" for key in keys]
        hits = next((i for i, tier in enumerate(tiers) if not tier), len(keys))
        return LookupResult(hits, tiers)

    def get_into(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[torch.Tensor],
        *,
        timeout: float | None = None,
    ) -> list[bool]:
        self._check()
        found = []
        for key, buffer in zip(keys, buffers, strict=True):
            chunk = self.chunks.get(key)
            if chunk is not None and chunk.shape == buffer.shape:
                buffer.copy_(chunk)
            found.append(chunk is not None)
        return found

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[torch.Tensor],
        *,
        timeout: float | None = None,
        retention: Retention = KEEP,
    ) -> PutResult:
        self._check()
        with self.lock:
            for key, value in zip(keys, values, strict=True):
                self.chunks[key] = value.clone()
        return PutResult(stored=len(keys))

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        self._check()
        return self.stats_answer

    def prefetch(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        self._check()
        with self.lock:
            self.prefetched.extend(keys)
        return 1

    def open_data_plane(self, *, timeout: float | None = None) -> str:
        self._check()
        return "grpc"


def stand_in_vllm_config(
    tp_size: int = 1,
    pp_size: int = 1,
    *,
    model: str = "test-model",
    max_model_len: int = 4 * CHUNK,
) -> Any:
    """Stands in for ``VllmConfig``: model, parallelism, a CPU device, the default layout."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, max_model_len=max_model_len),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size
        ),
        device_config=SimpleNamespace(device_type="cpu"),
        cache_config=SimpleNamespace(kv_cache_layout=None, cache_dtype="auto"),
    )


def stand_in_kv_cache_config(
    *, block: int = BLOCK, layers: int = LAYERS, num_blocks: int = NUM_BLOCKS, head_size: int = 8
) -> Any:
    """Stands in for ``KVCacheConfig``: one group of ``layers`` layers, bfloat16 blocks."""
    spec = SimpleNamespace(
        block_size=block, num_kv_heads=2, head_size=head_size, dtype=torch.bfloat16
    )
    group = SimpleNamespace(
        layer_names=[f"layers.{i}.attn" for i in range(layers)], kv_cache_spec=spec
    )
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[group])


def connector_settings(**extra: Any) -> ConnectorSettings:
    """The connector's settings for chunks of :data:`CHUNK` tokens, plus ``extra``."""
    return ConnectorSettings.from_extra_config(
        {"target": "127.0.0.1:1", "chunk_size": CHUNK, **extra}, env={}
    )


def random_caches(
    seed: int,
    *,
    layers: int = LAYERS,
    num_blocks: int = NUM_BLOCKS,
    block: int = BLOCK,
    width: int = 16,
) -> dict[str, torch.Tensor]:
    """Each layer's KV cache, random (the same for the same ``seed``), in vLLM's CPU layout:
    ``[blocks, kv heads, block size, width]`` with ``width`` = 2 x head size."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, block, width)
    return {
        f"layers.{i}.attn": torch.randn(shape, generator=gen).to(torch.bfloat16)
        for i in range(layers)
    }


def answer_when_known(side: SchedulerSide, request: Any, computed: int) -> int | None:
    """Ask until the lookup has answered (the first call may say "not known yet")."""
    deadline = time.monotonic() + 5
    while True:
        tokens, is_async = side.get_num_new_matched_tokens(request, computed)
        assert is_async is False
        if tokens is not None or time.monotonic() > deadline:
            return tokens


@pytest.fixture()
def store() -> FakeStore:
    """A fresh, empty store stand-in, the one ``scheduler`` and ``worker`` use."""
    return FakeStore()


@pytest.fixture()
def scheduler(store: FakeStore) -> Iterator[tuple[SchedulerSide, StandInManager]]:
    """The scheduler half on ``store``, with the block manager the test fills."""
    config, kv_config = stand_in_vllm_config(), stand_in_kv_cache_config()
    side = SchedulerSide(connector_settings(), config, kv_config, client=store)
    manager = StandInManager()
    side.bind_kv_cache_manager(manager)
    yield side, manager
    side.shutdown()


@pytest.fixture()
def worker(store: FakeStore) -> Iterator[WorkerSide]:
    """The worker half on ``store`` (its caches not registered yet)."""
    config, kv_config = stand_in_vllm_config(), stand_in_kv_cache_config()
    side = WorkerSide(connector_settings(), config, kv_config, client=store)
    yield side
    side.shutdown()


def chunk_keys_of(side: SchedulerSide, request: Any) -> list[bytes]:
    """The chunk keys the scheduler half named ``request``'s prompt by."""
    keys: list[bytes] = side._state(request).keys
    return keys
