"""Drive the vLLM connector's two halves without vLLM: save from one "engine", load into another.

vLLM's GPU build cannot be installed on the GPU machine, so this harness stands in for the engine:
paged KV caches shaped and strided the way vLLM allocates them for each layout
:mod:`kvstore.integrations.paged.kv_layout` knows (on the CPU or a CUDA device), a real
:class:`~kvstore.integrations.vllm.scheduler.SchedulerSide` building the step metadata from
stand-ins for vLLM's request, block and scheduler-output objects (:mod:`harness.vllm_scheduler`:
only the fields it reads), a real
:class:`~kvstore.integrations.vllm.worker.WorkerSide` moving the blocks, and a real
``kvstore serve`` (dram + nvme). Engine A computes a prompt (random KV) and saves it; engine B,
with other block ids, looks the prompt up, loads it layer by layer and must end up with exactly
A's blocks, bit for bit, and nothing else written.

A STAND-IN for the engine, used by tests/integrations/test_harness_pipeline.py, and runnable
alone on a machine without pytest (``tests/gpu_harness.py`` calls :func:`main`)::

    PYTHONPATH=. python tests/gpu_harness.py --device cuda     # every layout; exit 1 on a mismatch
    PYTHONPATH=. python tests/gpu_harness.py --device cuda --data-plane ucx

The data plane is the client's (``KVSTORE_DATA_PLANE``): ``auto`` finds the server's shared
memory; ``ucx`` loads as a worker on another host would, over the server's UCX listener (on CUDA
straight into device memory where UCX reaches it). Each case reports the path engine B's load
took.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import torch

from harness.polling import poll
from harness.vllm_scheduler import StandInBlocks, StandInManager, stand_in_output, stand_in_request
from kvstore.client import KVStoreClient
from kvstore.integrations.paged.kv_layout import CacheSpec, detect_layout
from kvstore.integrations.vllm.common import ConnectorSettings, StepPlan, base_namespace
from kvstore.integrations.vllm.common import engine_shape as _engine_shape
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide

BLOCK, CHUNK, LAYERS, NUM_BLOCKS, HEADS, HEAD = 16, 32, 3, 24, 2, 16
#: ``kvstore serve`` flags for a UCX listener on loopback (it binds every interface, which a
#: server without credentials must be told it may do).
UCX_FLAGS = ["--ucx-listen", "127.0.0.1:0", "--allow-unauthenticated"]


@dataclass(frozen=True)
class Case:
    """One cache layout as an attention backend allocates it."""

    backend: str
    kind: str  # packed, kv_first, blocks_kv, mla
    order: str  # NHD / HND physical order ("-" for mla)
    ratio: int = 1  # kernel blocks per engine block

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.kind}-{self.order}-r{self.ratio}"

    @property
    def mla(self) -> bool:
        return "MLA" in self.backend


CASES = [
    Case("CPU_ATTN", "packed", "HND"),
    Case("FLASH_ATTN", "packed", "NHD"),
    Case("FLASHINFER", "packed", "HND", ratio=2),
    Case("FLASH_ATTN", "kv_first", "NHD"),
    Case("FLASH_ATTN", "kv_first", "HND"),
    Case("FLASHINFER", "blocks_kv", "NHD"),
    Case("FLASHINFER", "blocks_kv", "HND"),
    Case("FLASHMLA", "mla", "-"),
    Case("FLASHMLA", "packed", "NHD"),
]


def cache_spec(case: Case) -> CacheSpec:
    """The spec the fake engine's configuration describes."""
    if case.mla:
        return CacheSpec(NUM_BLOCKS, BLOCK, 1, 4 * HEAD, 0, mla=True)
    return CacheSpec(NUM_BLOCKS, BLOCK, HEADS, HEAD, HEAD)


def make_cache(case: Case, device: str, gen: torch.Generator) -> torch.Tensor:
    """One layer's cache as vLLM allocates it: memory in the physical order, logical view."""
    spec = cache_spec(case)
    b, n = spec.num_blocks * case.ratio, spec.block_size // case.ratio
    h, d = spec.num_kv_heads, spec.head_size
    physical: tuple[int, ...]
    perm: tuple[int, ...] | None
    if case.kind == "packed":
        physical, perm = ((b, h, n, d + spec.head_size_v), None)
        if case.order == "NHD":
            physical, perm = ((b, n, h, d + spec.head_size_v), (0, 2, 1, 3))
    elif case.kind == "mla":
        physical, perm = ((b, n, d), None)
    else:
        lead = (2, b) if case.kind == "kv_first" else (b, 2)
        physical, perm = ((*lead, n, h, d), None)
        if case.order == "HND":  # get_kv_cache_stride_order: heads before tokens in memory
            physical, perm = ((*lead, h, n, d), (0, 1, 3, 2, 4))
    values = torch.randn(physical, generator=gen).to(torch.bfloat16).to(device)
    return values.permute(*perm) if perm else values


class _Layer:
    """Stands in for vLLM's attention layer (``static_forward_context`` values)."""

    def __init__(self, backend: str) -> None:
        self._backend = SimpleNamespace(get_name=lambda: backend)

    def get_attn_backend(self) -> Any:
        return self._backend


def vllm_config(case: Case, device: str, model: str) -> Any:
    """The fields of vLLM's ``VllmConfig`` the connector reads."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model, revision=None, max_model_len=8 * CHUNK, use_mla=case.mla
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type=device),
        cache_config=SimpleNamespace(kv_cache_layout=case.order, cache_dtype="auto"),
        compilation_config=SimpleNamespace(
            static_forward_context={name: _Layer(case.backend) for name in names}
        ),
    )


def kv_cache_config(case: Case) -> Any:
    """The fields of vLLM's ``KVCacheConfig`` the connector reads."""
    spec = cache_spec(case)
    kv_spec = SimpleNamespace(
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        head_size_v=spec.head_size_v,
        dtype=torch.bfloat16,
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    group = SimpleNamespace(layer_names=names, kv_cache_spec=kv_spec)
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[group])


class Engine:
    """One fake engine: both connector halves against ``target``, caches on ``device``."""

    def __init__(self, case: Case, device: str, target: str, model: str, seed: int) -> None:
        self.case = case
        self.vllm_config = vllm_config(case, device, model)
        self.kv_cache_config = kv_cache_config(case)
        settings = ConnectorSettings.from_extra_config(
            {"target": target, "chunk_size": CHUNK, "timeout_s": 10.0, "lookup_timeout_s": 5.0},
            env={},
        )
        self.settings = settings
        # The harness's store names chunks of CHUNK tokens (keys.chunk_size): so do these.
        self.scheduler = SchedulerSide(settings, self.vllm_config, self.kv_cache_config)
        self.worker = WorkerSide(settings, self.vllm_config, self.kv_cache_config)
        self.manager = StandInManager()
        self.scheduler.bind_kv_cache_manager(self.manager)
        gen = torch.Generator().manual_seed(seed)
        names = self.kv_cache_config.kv_cache_groups[0].layer_names
        self.caches = {name: make_cache(case, device, gen) for name in names}
        self.worker.register_kv_caches(self.caches)

    def lookup(self, req: Any) -> int:
        """The scheduler's answer once its asynchronous lookup is known."""
        deadline = time.monotonic() + 30
        while True:
            tokens, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
            if tokens is not None:
                return tokens
            assert time.monotonic() < deadline, "lookup never answered"
            time.sleep(0.01)

    def step(self, meta: StepPlan) -> None:
        """One forward pass as vLLM runs it: loads, each layer's wait, then the saves."""
        self.worker.start_load_kv(meta)
        for name in self.caches:
            self.worker.wait_for_layer_load(name)
            # The layer's attention would run here, after the compute stream's wait.
        self.worker.wait_for_save(meta)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def _block_view(engine: Engine, ids: list[int]) -> list[torch.Tensor]:
    """Blocks ``ids`` (engine blocks) of every layer, gathered to the CPU in logical order."""
    spec = cache_spec(engine.case)
    first = next(iter(engine.caches.values()))
    layout = detect_layout(first.shape, first.stride(), spec, engine.case.backend)
    kernel = [b * layout.ratio + i for b in ids for i in range(layout.ratio)]
    caches = list(engine.caches.values())
    return list(kvstore_kernels.gather_blocks(caches, kernel, layout.kernel).cpu().unbind(0))


def round_trip(case: Case, device: str, target: str, model: str) -> str:
    """Save a prompt from engine A, load it into engine B; raise AssertionError on a mismatch.

    Returns the path engine B's load took (``WorkerSide.last_load_path``). On CUDA over shared
    memory both engines wait until their arena mapping is page-locked, so the save and the load
    take the direct path (``shm-dma``)."""
    chunks = 3
    tokens = [(7 * i + 3) % 1000 for i in range(chunks * CHUNK + 5)]
    blocks_needed = len(tokens) // BLOCK + 1
    a = Engine(case, device, target, model, seed=1)
    b = Engine(case, device, target, model, seed=2)
    try:
        # Engine A: a miss, the whole prompt computed in one step, its chunks saved.
        req_a = stand_in_request("a", tokens)
        assert a.lookup(req_a) == 0, "the store already held the prompt"
        a_ids = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - blocks_needed, -1))
        a.manager.blocks["a"] = a_ids
        meta = a.scheduler.build_connector_meta(stand_in_output([("a", 0, len(tokens))]))
        assert meta.saves, "the scheduler planned no save"
        _wait_registered(a)
        a.step(meta)
        _wait(lambda: a.worker.get_finished({"a"})[0] == {"a"}, "the save never gathered")
        _wait_stored(a, meta, chunks)

        # Engine B: the same prompt hits; its blocks are other ids.
        req_b = stand_in_request("b", tokens)
        hit = b.lookup(req_b)
        assert hit == chunks * CHUNK, f"lookup found {hit} tokens, expected {chunks * CHUNK}"
        b_ids = list(range(1, 1 + blocks_needed))
        b.manager.blocks["b"] = b_ids
        before = {name: cache.clone() for name, cache in b.caches.items()}
        b.scheduler.update_state_after_alloc(req_b, StandInBlocks(b_ids), hit)
        meta_b = b.scheduler.build_connector_meta(stand_in_output([("b", hit, len(tokens) - hit)]))
        assert [len(spec.keys) for spec in meta_b.loads] == [chunks]
        _wait_registered(b)
        b.step(meta_b)
        if device == "cuda":
            torch.cuda.synchronize()
        assert b.worker.get_block_ids_with_load_errors() == set()
        loaded = chunks * CHUNK // BLOCK
        for layer, (want, got) in enumerate(
            zip(_block_view(a, a_ids[:loaded]), _block_view(b, b_ids[:loaded]), strict=True)
        ):
            assert torch.equal(want.view(torch.int16), got.view(torch.int16)), (
                f"{case.id}: layer {layer} differs after the round trip"
            )
        rest = [i for i in range(NUM_BLOCKS) if i not in b_ids[:loaded]]
        b_before = Engine.__new__(Engine)
        b_before.case, b_before.caches = case, before
        for layer, (want, got) in enumerate(
            zip(_block_view(b_before, rest), _block_view(b, rest), strict=True)
        ):
            assert torch.equal(want.view(torch.int16), got.view(torch.int16)), (
                f"{case.id}: layer {layer} blocks outside the load were written"
            )
        return b.worker.last_load_path
    finally:
        a.close()
        b.close()


def _wait(condition: Any, what: str) -> None:
    poll(condition, 30, what, every=0.01)


def _wait_registered(engine: Engine) -> None:
    """Until a CUDA engine's mapping of the store's arena is page-locked (over shared memory),
    so that its loads and saves take the direct path; a real engine's first seconds go through
    host staging instead (tests that want that path refuse the registration)."""
    client: Any = engine.worker._client  # the real client: its settings and shm plane
    if client.settings.data_plane not in ("auto", "shm"):
        return  # not over shared memory: nothing to register
    # On a loaded machine the first attach may fail and the client retries it a few seconds
    # later (then the registration starts only at the first transfer): attach first.
    _wait(lambda: client.open_data_plane() == "shm", "shared memory never attached")
    plane = client._shm.plane
    registration = None if plane is None else plane.registration
    if registration is not None:
        # False where the registrar refused (a test of that path): then host staging it is.
        registration.wait_covered(registration.base, registration.size, timeout=30)


def _wait_stored(engine: Engine, meta: StepPlan, chunks: int) -> None:
    """Until the store holds the saved chunks (the put runs after the gather)."""
    shape = _engine_shape(engine.vllm_config, engine.kv_cache_config, pp_rank=0)
    namespace = base_namespace(engine.vllm_config, shape, engine.settings, tp_rank=0)
    keys = [key for spec in meta.saves for key in spec.keys]
    with KVStoreClient(engine.settings.target, namespace=namespace) as client:
        _wait(lambda: client.lookup(keys) == chunks, "the saved chunks never reached the store")


def main(argv: list[str] | None = None) -> int:
    """Run every case against a fresh ``kvstore serve``; print one line per case."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data-plane", choices=["auto", "ucx"], default="auto")
    args = parser.parse_args(argv)
    os.environ["KVSTORE_DATA_PLANE"] = args.data_plane
    from harness.serve import ServerProcess

    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp) / "tmp"
        tmpdir.mkdir()
        flags = ["--listen", "127.0.0.1:0", "--dram-capacity", "64MiB"]
        flags += ["--nvme-path", str(Path(tmp) / "nvme"), "--nvme-capacity", "64MiB"]
        if args.data_plane == "ucx":
            flags += UCX_FLAGS
        server = ServerProcess(
            Path(tmp) / "serve", flags, tmpdir=tmpdir, settings={"keys.chunk_size": CHUNK}
        ).start()
        try:
            for case in CASES:
                try:
                    path = round_trip(case, args.device, server.target, f"harness-{case.id}")
                    print(f"OK    {args.device} {case.id} via {path}")
                except AssertionError as exc:
                    failed += 1
                    print(f"FAIL  {args.device} {case.id}: {exc}")
        finally:
            server.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
