"""The layer-wise load pipeline on CPU: each layer waits for itself only; failures recompute.

The same code runs on CUDA with real streams and events
(tests/integrations/test_harness_pipeline.py, ``gpu``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import pytest
import torch
from harness.store_stand_in import StoreStandIn

from kvstore.client.shm import ShmLease
from kvstore.integrations.paged import device_pipeline
from kvstore.integrations.paged.device_pipeline import Device, LoadPipeline, StepLoad
from kvstore.integrations.vllm.common import ConnectorSettings, LoadSpec, StepPlan
from kvstore.integrations.vllm.worker import WorkerSide

LAYERS, BLOCKS, BLOCK, CHUNK = 3, 8, 4, 8  # two blocks per chunk
LAYOUT = kvstore_kernels.CacheLayout("vllm-packed", block_dim=0, ndim=4)
CHUNK_SHAPE = (LAYERS, 2, 2, BLOCK, 6)


class _HeldPipeline(LoadPipeline):
    """Holds the loader before layer ``held`` until ``release`` is set."""

    def __init__(self, caches: Sequence[torch.Tensor], held: int) -> None:
        super().__init__(Device(torch.device("cpu")), caches, LAYOUT, CHUNK_SHAPE, 2, 1)
        self.held = held
        self.entered = threading.Event()  # the loader is inside layer ``held``
        self.release = threading.Event()

    def _issue_layers(self, load: StepLoad, layers: range) -> None:
        if self.held in layers:
            self.entered.set()
            assert self.release.wait(30)
        super()._issue_layers(load, layers)


def _caches() -> list[torch.Tensor]:
    return [torch.zeros(BLOCKS, 2, BLOCK, 6) for _ in range(LAYERS)]


def _start(pipeline: LoadPipeline) -> tuple[StepLoad, threading.Thread]:
    host = torch.arange(float(torch.Size(CHUNK_SHAPE).numel())).reshape(1, *CHUNK_SHAPE) + 1
    load = pipeline.new_load([LoadSpec("r", [b"k"], [5, 6])], host)
    thread = threading.Thread(target=pipeline.run, args=(load, lambda _: [True]))
    thread.start()
    return load, thread


def test_a_layer_is_ready_while_later_layers_are_still_loading() -> None:
    caches = _caches()
    pipeline = _HeldPipeline(caches, held=1)
    load, thread = _start(pipeline)
    assert pipeline.wait_layer(load, 0, timeout=30)
    assert caches[0][5:7].abs().sum() > 0  # layer 0 is written ...
    assert not load.ready[1].is_set()  # ... while layer 1 has not started
    assert caches[1].abs().sum() == 0
    pipeline.release.set()
    assert pipeline.wait_layer(load, 1, timeout=30)
    assert pipeline.wait_layer(load, 2, timeout=30)
    thread.join(30)
    for layer, cache in enumerate(caches):
        assert torch.equal(cache[5:7], load.host[0, layer])
        assert cache[:5].abs().sum() == 0 and cache[7:].abs().sum() == 0
    assert load.waited == {0, 1, 2} and not load.cancelled


def test_a_layer_not_ready_in_time_cancels_the_rest_of_the_step() -> None:
    caches = _caches()
    pipeline = _HeldPipeline(caches, held=1)
    load, thread = _start(pipeline)
    assert not pipeline.wait_layer(load, 1, timeout=0.05)
    assert load.cancelled
    pipeline.release.set()
    thread.join(30)
    assert caches[2].abs().sum() == 0  # nothing written after the forward gave up
    assert all(ready.is_set() for ready in load.ready)


def test_stopping_a_load_waits_for_the_layer_being_written_and_stops_the_rest() -> None:
    """Once the step's loaded tokens are to be recomputed, nothing the loader does may write
    into the cache afterwards (it would land on top of vLLM's recompute)."""
    caches = _caches()
    pipeline = _HeldPipeline(caches, held=1)
    load, thread = _start(pipeline)
    assert pipeline.entered.wait(30)  # layer 1 is being written
    stopper = threading.Thread(target=pipeline.stop, args=(load,))
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()  # it waits for that layer ...
    pipeline.release.set()
    stopper.join(30)
    assert not stopper.is_alive() and load.cancelled
    thread.join(30)
    assert torch.equal(caches[1][5:7], load.host[0, 1])  # ... which was written whole,
    assert caches[2].abs().sum() == 0  # and no later layer was


def test_cpu_streams_and_events_are_stand_ins() -> None:
    device = Device(torch.device("cpu"))
    stream, event = device.new_stream(), device.new_event()
    with stream.use():
        event.record(stream)
    stream.wait(event)
    event.synchronize()
    assert stream.raw is None and event.raw is None
    assert not device.host_buffer((2, 3), torch.float32).is_pinned()
    assert device.device_buffer((2,), torch.float32) is None


class _Store(StoreStandIn):
    """The worker's store: one chunk of ones."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def get_into(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[torch.Tensor],
        *,
        timeout: float | None = None,
    ) -> list[bool]:
        for buffer in buffers:
            buffer.fill_(1)
        return [True] * len(keys)


def _worker(client: Any) -> WorkerSide:
    spec = SimpleNamespace(block_size=BLOCK, num_kv_heads=2, head_size=3, dtype=torch.float32)
    names = [f"l{i}" for i in range(LAYERS)]
    config = SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, max_model_len=4 * CHUNK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
        cache_config=SimpleNamespace(kv_cache_layout=None, cache_dtype="auto"),
    )
    kv_config = SimpleNamespace(
        num_blocks=BLOCKS,
        kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)],
    )
    settings = ConnectorSettings.from_extra_config(
        {"target": "127.0.0.1:1", "chunk_size": CHUNK}, env={}
    )
    side = WorkerSide(settings, config, kv_config, client=client)
    side.register_kv_caches({name: cache for name, cache in zip(names, _caches(), strict=True)})
    return side


@pytest.fixture()
def worker() -> Iterator[WorkerSide]:
    side = _worker(_Store())
    yield side
    side.shutdown()


class _LeasingStore(_Store):
    """A store read in place (like shared memory): one chunk, intact or torn once read."""

    def __init__(self, chunk: torch.Tensor, intact: bool) -> None:
        super().__init__()
        self.chunk, self.is_intact, self.released = chunk, intact, 0

    def lease(self, keys: Sequence[bytes], *, timeout: float | None = None) -> ShmLease:
        view = self.chunk.view(torch.uint8).numpy().reshape(-1)

        def release() -> None:
            self.released += 1

        return ShmLease([view] * len(keys), release, lambda: [self.is_intact] * len(keys))


@pytest.mark.parametrize("intact", [True, False], ids=["intact", "torn"])
def test_chunks_read_in_place_land_in_the_cache_or_are_recomputed_if_torn(intact: bool) -> None:
    chunk = torch.randn(CHUNK_SHAPE)
    store = _LeasingStore(chunk, intact)
    side = _worker(store)
    try:
        plan = StepPlan(loads=[LoadSpec("r", [b"k"], [5, 6])])
        side.start_load_kv(plan)
        for i in range(LAYERS):
            side.wait_for_layer_load(f"l{i}")
        side.wait_for_save(plan)
        for layer, cache in enumerate(side._caches):
            assert torch.equal(cache[5:7], chunk[layer])
        assert store.released == 1
        figures = side.counters.take()
        assert figures is not None  # a load was counted either way
        if intact:
            assert side.get_block_ids_with_load_errors() == set()
            assert figures["loaded_tokens"] == CHUNK
        else:
            assert side.get_block_ids_with_load_errors() == {5, 6}
            assert figures["load_failed_tokens"] == {"missing": CHUNK}
    finally:
        side.shutdown()


def test_a_scatter_that_fails_makes_the_step_recompute(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def failing(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        raise RuntimeError("scatter failed")

    # The CPU path copies slices itself (on the forward's thread, in merged groups); CUDA goes
    # through the kernels.
    monkeypatch.setattr(device_pipeline, "strided_groups", failing)
    plan = StepPlan(loads=[LoadSpec("r", [b"k"], [5, 6])])
    worker.start_load_kv(plan)
    for i in range(LAYERS):
        worker.wait_for_layer_load(f"l{i}")
    worker.wait_for_save(plan)
    assert calls == [1]
    assert worker.get_block_ids_with_load_errors() == {5, 6}
    figures = worker.counters.take()
    assert figures is not None and figures["load_failed_tokens"] == {"error": CHUNK}


def test_the_layout_found_is_reported(worker: WorkerSide) -> None:
    assert worker.layout_name == "packed/HND"


def test_bench_gpu_parses_its_arguments_and_refuses_to_run_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    bench = root / "benchmarks" / "bench_gpu.py"
    helped = subprocess.run(
        [sys.executable, str(bench), "--help"], capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0 and "--prefix" in helped.stdout, helped.stderr
    sys.path.insert(0, str(bench.parent))
    try:
        # By name at run time: benchmarks/ is on sys.path only here, not where mypy looks.
        bench_gpu = importlib.import_module("bench_gpu")
    finally:
        sys.path.remove(str(bench.parent))
    args = bench_gpu.parse_args(["--prefix", "4096", "--rounds", "3"])
    assert (args.prefix, args.rounds, args.arena_copy_mib) == (4096, 3, 256)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_a_cache_whose_layout_cannot_be_told_is_refused(worker: WorkerSide) -> None:
    from kvstore.errors import ConfigError

    five_d = {f"l{i}": torch.zeros(2, BLOCKS, BLOCK, 2, 3) for i in range(LAYERS)}
    with pytest.raises(ConfigError, match=r"\(2, 8, 4, 2, 3\) from attention backend unknown"):
        worker.register_kv_caches(five_d)
    worker.register_kv_caches(five_d, backend="FLASH_ATTN")
    assert worker.layout_name == "kv_first/NHD"


@pytest.mark.parametrize("copy_on_wait", [False, True], ids=["loader", "on_wait"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_loads_write_exactly_what_the_reference_scatter_writes(
    dtype: torch.dtype, copy_on_wait: bool
) -> None:
    """Whole chunks, a partly new chunk, scattered and repeated block runs, two kernel blocks
    per engine block: every written block equals the reference kernels' scatter of the same
    chunk rows, blocks the engine holds (-1) and failed chunks stay untouched."""
    layers, ratio, bpc, blocks = 2, 2, 2, 40
    chunk_shape = (layers, bpc * ratio, 3, 5)
    caches = [torch.zeros(blocks, 3, 5, dtype=dtype) for _ in range(layers)]
    layout = kvstore_kernels.CacheLayout("t", block_dim=0, ndim=3)
    pipeline = LoadPipeline(
        Device(torch.device("cpu")),
        caches,
        layout,
        chunk_shape,
        bpc,
        ratio,
        copy_on_wait=copy_on_wait,
    )
    specs = [
        LoadSpec("a", [b"1", b"2"], [2, 3, 9, 4]),  # chunk 0 consecutive, chunk 1 split
        LoadSpec("b", [b"3", b"4", b"5"], [-1, 7, 10, 11, 5, 6]),  # partial; ok; failed
        LoadSpec("c", [b"6", b"7", b"8"], [0, 1, 12, 13, 14, 15]),  # merged with chunk 3
    ]
    host = torch.randn(8, *chunk_shape).to(dtype)
    load = pipeline.new_load(specs, host)
    pipeline.run(load, lambda _: [True, True, True, True, False, True, True, True])
    # On wait: nothing is written until the layer is asked for (here, on the main thread).
    assert (caches[1].abs().sum() == 0) == copy_on_wait
    for layer in range(layers):
        assert pipeline.wait_layer(load, layer, timeout=30)
    assert load.runs is not None and not load.crashed
    expected = [torch.zeros_like(c) for c in caches]
    targets = [[2, 3], [9, 4], [-1, 7], [10, 11], [-1, -1], [0, 1], [12, 13], [14, 15]]
    for chunk, engine_blocks in enumerate(targets):
        for j, block in enumerate(engine_blocks):
            if block < 0:
                continue
            rows = [j * ratio, j * ratio + 1]
            ids = [block * ratio, block * ratio + 1]
            kvstore_kernels.scatter_blocks(host[chunk][:, rows], expected, ids, layout)
    for cache, want in zip(caches, expected, strict=True):
        assert torch.equal(cache, want)
    # Chunks 6 and 7 lie at equal distances in the staging buffer and land back to back.
    assert load.groups is None or [g[3] for g in load.groups] == [1, 1, 1, 1, 1, 2, 1]


def test_copy_runs_merge_consecutive_blocks_within_a_chunk_only() -> None:
    from kvstore.integrations.paged.plan import copy_runs, plan_scatter

    specs = [LoadSpec("a", [b"1", b"2", b"3"], [4, 5, 6, 7, 9, 8])]
    plan = plan_scatter(specs, [True, True, True], blocks_per_chunk=2, ratio=1)
    # Chunks 0 and 1 continue each other in the cache but are separate sources.
    assert copy_runs(plan, 2, 1) == [(0, 0, 4, 2), (1, 0, 6, 2), (2, 0, 9, 1), (2, 1, 8, 1)]
    partial = [LoadSpec("b", [b"1"], [-1, 3])]
    plan = plan_scatter(partial, [True], blocks_per_chunk=2, ratio=2)
    assert copy_runs(plan, 2, 2) == [(0, 2, 6, 2)]


def test_a_lease_that_arrives_after_the_forward_gave_up_is_released() -> None:
    caches = _caches()
    pipeline = LoadPipeline(
        Device(torch.device("cpu")), caches, LAYOUT, CHUNK_SHAPE, 2, 1, copy_on_wait=True
    )
    host = torch.ones(1, *CHUNK_SHAPE)
    load = pipeline.new_load([LoadSpec("r", [b"k"], [5, 6])], host)
    fetching, released = threading.Event(), []

    def late_fetch(step: StepLoad) -> list[bool]:
        assert fetching.wait(30)
        step.release = lambda: released.append(1)
        return [True]

    thread = threading.Thread(target=pipeline.run, args=(load, late_fetch))
    thread.start()
    assert not pipeline.wait_layer(load, 0, timeout=0.05)
    pipeline.finish(load)  # the step's end, before the lease exists
    fetching.set()
    thread.join(30)
    assert released == [1]
    assert caches[0].abs().sum() == 0
