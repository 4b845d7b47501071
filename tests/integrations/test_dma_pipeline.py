"""The load pipeline's direct path on the CUDA STAND-IN: DMA from the arena, order, cancellation.

harness/cuda_stand_in.py queues every DMA, gather and scatter until something waits for it, so these
tests see what a real device would do with a missing wait: a scatter reading its staging before
the layer's DMA ran, a lease ended while a DMA still reads the arena. The arena is a plain buffer
here, "page-locked" by the stand-in registrar; the same code runs on a GPU in the harness
(tests/integrations/test_harness_pipeline.py, ``gpu``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import numpy as np
import pytest
import torch
from harness import cuda_stand_in
from harness.cuda_stand_in import StandInDevice, StandInRegistrar

from kvstore.client.arena_registration import ArenaRegistration
from kvstore.integrations.paged import device_pipeline
from kvstore.integrations.paged.arena_dma import arena_source
from kvstore.integrations.paged.device_pipeline import LoadPipeline, StepLoad
from kvstore.integrations.vllm.common import LoadSpec

LAYERS, BLOCKS, BLOCK, CHUNKS = 3, 16, 4, 3
LAYOUT = kvstore_kernels.CacheLayout("vllm-packed", block_dim=0, ndim=4)
CHUNK_SHAPE = (LAYERS, 2, 2, BLOCK, 6)  # two blocks per chunk
CHUNK_BYTES = int(np.prod(CHUNK_SHAPE)) * 4


@pytest.fixture(autouse=True)
def queued_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(device_pipeline, "kvstore_kernels", cuda_stand_in.deferred_kernels())
    cuda_stand_in.log.clear()
    yield


class _Pipeline(LoadPipeline):
    """The stand-in pipeline; holds the loader before layer ``held`` until ``go`` is set."""

    def __init__(self, caches: list[torch.Tensor], held: int = -1) -> None:
        super().__init__(StandInDevice(torch.device("cpu")), caches, LAYOUT, CHUNK_SHAPE, 2, 1)
        self.held, self.entered, self.go = held, threading.Event(), threading.Event()

    def _issue_layers(self, load: StepLoad, layers: range) -> None:
        if self.held in layers:
            self.entered.set()
            assert self.go.wait(30)
        super()._issue_layers(load, layers)


class _Arena:
    """Chunks of random floats in a buffer, page-locked by the stand-in, at uneven places."""

    def __init__(self) -> None:
        self.buffer = np.zeros(1 << 20, dtype=np.uint8)
        self.registration = ArenaRegistration(
            self.buffer.ctypes.data, self.buffer.nbytes, StandInRegistrar(), piece_bytes=4096
        )
        assert self.registration.wait_covered(self.buffer.ctypes.data, self.buffer.nbytes, 30)
        self.offsets = [1000, 1000 + CHUNK_BYTES, 200_000]
        rng = np.random.default_rng(3)
        self.chunks = [rng.standard_normal(CHUNK_SHAPE).astype(np.float32) for _ in self.offsets]
        for offset, chunk in zip(self.offsets, self.chunks, strict=True):
            self.buffer[offset : offset + CHUNK_BYTES] = chunk.view(np.uint8).reshape(-1)
        self.released = threading.Event()

    def fetch(self, load: StepLoad) -> list[bool]:
        """What the worker's fetch does with a lease whose pages are registered."""
        views = [self.buffer[o : o + CHUNK_BYTES] for o in self.offsets]
        source = arena_source(views, self.registration, CHUNK_BYTES, LAYERS)
        assert source is not None
        load.direct, load.path = source, "shm-dma"
        load.release = self.release
        return [True] * len(views)

    def release(self) -> None:
        cuda_stand_in.log.append(("release", 0, 0))
        self.released.set()


def _caches() -> list[torch.Tensor]:
    return [torch.zeros(BLOCKS, 2, BLOCK, 6) for _ in range(LAYERS)]


def _start(pipeline: LoadPipeline, arena: _Arena) -> tuple[StepLoad, threading.Thread]:
    host = torch.zeros(CHUNKS, *CHUNK_SHAPE)  # unused on the direct path
    spec = LoadSpec("r", [b"a", b"b", b"c"], [4, 5, 6, 7, 10, 11])
    load = pipeline.new_load([spec], host)
    thread = threading.Thread(target=pipeline.run, args=(load, arena.fetch))
    thread.start()
    return load, thread


def _expected(arena: _Arena, layer: int) -> dict[int, Any]:
    blocks = [4, 5, 6, 7, 10, 11]
    rows = [torch.from_numpy(chunk[layer]) for chunk in arena.chunks]  # [2, 2, BLOCK, 6] each
    flat = torch.cat(rows)
    return {block: flat[i] for i, block in enumerate(blocks)}


def test_each_layer_is_dmaed_out_of_the_arena_and_the_lease_ends_after_the_last_dma() -> None:
    arena, caches = _Arena(), _caches()
    pipeline = _Pipeline(caches)
    load, thread = _start(pipeline, arena)
    for layer in range(LAYERS):
        assert pipeline.wait_layer(load, layer, timeout=30)
    thread.join(30)
    assert load.settled.is_set() and arena.released.is_set()
    for layer, cache in enumerate(caches):
        for block, want in _expected(arena, layer).items():
            assert torch.equal(cache[block], want), (layer, block)
        untouched = [b for b in range(BLOCKS) if b not in _expected(arena, layer)]
        assert cache[untouched].abs().sum() == 0
    kinds = [kind for kind, _, _ in cuda_stand_in.log]
    assert kinds.count("release") == 1 and kinds[-1] == "release", kinds
    # Every byte of every chunk, once (rows cut where a 4 KiB "page-locked piece" ends).
    assert sum(n for kind, _, n in cuda_stand_in.log if kind == "h2d") == CHUNKS * CHUNK_BYTES
    assert arena.registration._users == 0  # the transfer has left the registration
    assert arena.registration.close()


def test_a_load_cancelled_mid_step_writes_no_later_layer_and_releases_after_its_dmas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device_pipeline, "GROUP_BYTES", 1)  # one layer per scatter launch
    arena, caches = _Arena(), _caches()
    pipeline = _Pipeline(caches, held=1)
    load, thread = _start(pipeline, arena)
    assert pipeline.entered.wait(30)
    assert not pipeline.wait_layer(load, 1, timeout=0.05)  # the forward gives up on layer 1
    assert load.cancelled
    stopper = threading.Thread(target=pipeline.stop, args=(load,))
    stopper.start()
    pipeline.go.set()
    stopper.join(30)
    thread.join(30)
    assert arena.released.is_set() and load.settled.is_set()
    assert caches[2].abs().sum() == 0  # cancelled before it was issued
    for layer in (0, 1):  # issued whole (layer 1 was being issued when the forward gave up)
        for block, want in _expected(arena, layer).items():
            assert torch.equal(caches[layer][block], want)
    kinds = [kind for kind, _, _ in cuda_stand_in.log]
    assert kinds[-1] == "release" and "h2d" in kinds, kinds
    assert arena.registration._users == 0
    assert arena.registration.close()


def test_a_dma_that_fails_makes_the_step_recompute_and_still_ends_the_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    arena, caches = _Arena(), _caches()
    pipeline = _Pipeline(caches)

    def refuse(*_: Any) -> None:
        raise RuntimeError("cudaMemcpy2DAsync failed with CUDA error 1 (invalid argument)")

    monkeypatch.setattr(pipeline.device, "dma_to_device", refuse)
    load, thread = _start(pipeline, arena)
    assert pipeline.wait_layer(load, 0, timeout=30)  # ready is set even on a crash
    thread.join(30)
    assert load.crashed and arena.released.is_set() and load.settled.is_set()
    assert all(cache.abs().sum() == 0 for cache in caches)
    assert arena.registration._users == 0
    assert arena.registration.close()


def test_layers_are_scattered_in_groups_that_outlast_a_launch_the_first_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipeline = _Pipeline(_caches() * 4)  # 12 layers
    load = pipeline.new_load([], torch.zeros(CHUNKS, 12, *CHUNK_SHAPE[1:]))
    layer_bytes = load.host[:, 0].nbytes
    monkeypatch.setattr(device_pipeline, "GROUP_BYTES", 3 * layer_bytes)
    assert pipeline._layer_groups(load) == [
        range(0, 1),
        range(1, 4),
        range(4, 7),
        range(7, 10),
        range(10, 12),
    ]
    monkeypatch.setattr(device_pipeline, "GROUP_BYTES", 1)
    assert pipeline._layer_groups(load) == [range(layer, layer + 1) for layer in range(12)]
