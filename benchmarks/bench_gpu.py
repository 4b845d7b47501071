"""GPU figures of the connector's device path: loads and saves against the link and prefill.

Runs where CUDA is present (says so and exits 2 otherwise). Exact command (repository root)::

    python benchmarks/bench_gpu.py --out benchmarks/results/gpu

``--rehearse`` runs the same code on the CPU with tiny shapes (no figures worth keeping: it is
how the script is checked where no GPU is at hand; tests/project/test_gpu_verify_script.py runs it).

Everything against a real ``kvstore serve`` (dram + nvme; its arena page-locked, as ``serve``
does where CUDA exists), through the connector's worker half (``WorkerSide``) over paged caches
shaped like vLLM's (bf16, block 16, packed ``[blocks, heads, block, 2 * head]`` NHD view), for
two model shapes: Llama-3.2-1B (16 layers, 8 KV heads of 64) and Llama-3.1-8B (32 layers, 8 KV
heads of 128). Per shape, interleaved, medians over ``--rounds``:

1. **Load of an ``--prefix``-token prefix** (8K: 268 MB / 1 GiB), layer by layer, on each path:
   ``shm-dma`` (the worker's mapping of the arena page-locked, one strided DMA per layer straight
   out of the leased chunks) and ``shm-staged`` (``KVSTORE_SHM_CUDA_REGISTER=off``: the chunks
   copied into page-locked host staging first, the path of every load before the arena is
   registered), against torch's pinned host-to-device copy of the same bytes (the link).
2. **Save of the same blocks**, until the engine's blocks are free (gathered and copied out) and
   until committed in the store, against torch's device-to-host copy into pinned memory.
3. **Against prefill**: the prefill of the same prompt by a ``transformers`` Llama of that shape
   with random weights (no download) on the same GPU, and the load hidden behind it (each decoder
   layer waits for its own layer first, as vLLM's attention does):
   ``hidden = (load + prefill - together) / load``.
4. **Registration**: what page-locking the worker's mapping of the arena cost (seconds per GiB).

Also the arena -> HBM copy against torch's pinned copy (the server's own page-locked mapping).
Writes ``OUT.json`` (every sample, the device) and ``OUT.md`` (medians); prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# Model shapes: (layers, KV heads, head size) of the cache, and the transformers config.
SHAPES: dict[str, dict[str, int]] = {
    "llama-1b": {  # Llama-3.2-1B
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
    "llama-8b": {  # Llama-3.1-8B (vocabulary cut to 32000: the LM head is not run)
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}
TINY = {  # --rehearse
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
BLOCK, CHUNK, VOCAB = 16, 256, 32000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gpu", help="OUT.json and OUT.md")
    parser.add_argument("--rounds", type=int, default=10, help="repetitions of each load")
    parser.add_argument("--save-rounds", type=int, default=5, help="repetitions of each save")
    parser.add_argument("--prefix", type=int, default=8192, help="prefix tokens to load")
    parser.add_argument("--arena-copy-mib", type=int, default=256, help="bytes per arena copy")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="model shapes to run")
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes on the CPU")
    return parser.parse_args(argv)


class Bench:
    """The device, its synchronization and the interleaved timing of cases."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch, self.device = torch, device
        self.cuda = device == "cuda"

    def sync(self) -> None:
        """Wait for the device's queued work."""
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, cases: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
        """Seconds per call of each case, rounds interleaved (rotated), after a warm-up round."""
        names = list(cases)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds + 1):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                self.sync()
                start = time.perf_counter()
                cases[name]()
                self.sync()
                if r:
                    times[name].append(time.perf_counter() - start)
        return times


def _median(values: list[float]) -> float:
    return statistics.median(values)


def link(bench: Bench, nbytes: int, rounds: int) -> dict[str, Any]:
    """torch's pinned host <-> device copies of ``nbytes`` (the link's speed)."""
    torch = bench.torch
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=bench.cuda)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=bench.device)
    times = bench.time(
        {
            "h2d": lambda: on_device.copy_(pinned, non_blocking=True),
            "d2h": lambda: pinned.copy_(on_device, non_blocking=True),
        },
        rounds,
    )
    return {
        "bytes": nbytes,
        "h2d_gbps": nbytes / _median(times["h2d"]) / 1e9,
        "d2h_gbps": nbytes / _median(times["d2h"]) / 1e9,
        "samples_s": times,
    }


def arena_to_hbm(bench: Bench, nbytes: int, rounds: int) -> dict[str, Any]:
    """Arena pages (page-locked by a dram tier, as the server's) -> device vs torch pinned."""
    import asyncio

    from kvstore.tiers.dram import DramTier

    torch = bench.torch
    tier = DramTier(nbytes, force_cuda_check=True)
    arena = None  # the tensor over the arena's pages, dropped before the tier unmaps them
    try:
        arena = torch.from_numpy(tier.range_view(0, nbytes))
        arena.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(arena)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        times = bench.time(
            {
                "arena": lambda: dst.copy_(arena, non_blocking=True),
                "torch_pinned": lambda: dst.copy_(pinned, non_blocking=True),
            },
            rounds,
        )
        assert torch.equal(dst.cpu(), pinned), "arena copy returned wrong bytes"
        arena_gbps = nbytes / _median(times["arena"]) / 1e9
        torch_gbps = nbytes / _median(times["torch_pinned"]) / 1e9
        return {
            "bytes": nbytes,
            "arena_pinned": tier.pinned,
            "arena_gbps": arena_gbps,
            "torch_pinned_gbps": torch_gbps,
            "ratio": arena_gbps / torch_gbps,
            "samples_s": times,
        }
    finally:
        arena = None  # the tier unmaps the pages under it next
        asyncio.run(tier.close())


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def make_engine(
    bench: Bench, target: str, prefix: int, shape: dict[str, int], *, register: bool
) -> tuple[Any, dict[str, Any]]:
    """A connector worker half over paged caches of ``shape``; ``register``: page-lock its
    mapping of the arena (else every load and save goes through host staging)."""
    from kvstore.integrations.vllm.common import ConnectorSettings
    from kvstore.integrations.vllm.worker import WorkerSide

    torch = bench.torch
    layers, heads, head = (
        shape["num_hidden_layers"],
        shape["num_key_value_heads"],
        shape["head_dim"],
    )
    num_blocks = 2 * prefix // BLOCK + 8
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    spec = SimpleNamespace(
        block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16
    )
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            model=f"bench-gpu-{layers}x{heads}x{head}", revision=None, max_model_len=prefix * 2
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type=bench.device),
        cache_config=SimpleNamespace(kv_cache_layout="NHD", cache_dtype="auto"),
    )
    kv_config = SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)],
    )
    settings = ConnectorSettings.from_extra_config(
        {"target": target, "chunk_size": CHUNK, "timeout_s": 60.0}, env={}
    )
    with _environment("KVSTORE_SHM_CUDA_REGISTER", None if register else "off"):
        worker = WorkerSide(settings, config, kv_config)  # type: ignore[arg-type]
        worker._client.open_data_plane()  # connect while the variable is set
    # vLLM's packed view, NHD memory: [blocks, tokens, heads, 2 * head] viewed [b, h, n, 2d].
    caches = {
        name: torch.randn(num_blocks, BLOCK, heads, 2 * head, device=bench.device)
        .to(torch.bfloat16)
        .permute(0, 2, 1, 3)
        for name in names
    }
    worker.register_kv_caches(caches, backend="FLASH_ATTN")
    return worker, caches


def registration(worker: Any) -> dict[str, Any]:
    """Wait until the worker's mapping of the arena is page-locked; what that cost."""
    plane = worker._client._shm.plane
    held = None if plane is None else plane.registration
    if held is None:
        return {"registered_bytes": 0, "register_s": 0.0, "failure": "not registered"}
    held.wait_covered(held.base, held.size, timeout=300)
    stats = held.stats()
    gib = stats["registered_bytes"] / 2**30
    stats["s_per_gib"] = stats["register_s"] / gib if gib else None
    return dict(stats)


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 300
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.0005)


def save_once(worker: Any, keys: list[bytes], ids: list[int], req: str) -> tuple[float, float]:
    """Save ``keys`` from blocks ``ids``: seconds until the blocks are free (gathered and
    copied out), and until the store has committed every chunk."""
    from kvstore.integrations.vllm.common import SaveSpec, StepPlan

    start = time.perf_counter()
    worker.wait_for_save(StepPlan(saves=[SaveSpec(req, keys, ids)]))
    _wait(lambda: (worker.get_finished({req})[0] or set()) == {req}, "the save never gathered")
    freed = time.perf_counter() - start
    _wait(lambda: worker._client.lookup(keys) == len(keys), "the save never reached the store")
    return freed, time.perf_counter() - start


def model_prefill(bench: Bench, shape: dict[str, int], prefix: int) -> tuple[Any, Any, int]:
    """A random-weight Llama of ``shape`` on the device, a prompt, and its parameter count."""
    torch = bench.torch
    if not bench.cuda:
        return _rehearsal_model(torch, shape, prefix)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape, vocab_size=VOCAB, max_position_embeddings=2 * prefix, dtype=torch.bfloat16
    )
    with torch.device(bench.device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    prompt = torch.randint(0, VOCAB, (1, prefix), device=bench.device)
    return model, prompt, sum(p.numel() for p in model.parameters())


def _rehearsal_model(torch: Any, shape: dict[str, int], prefix: int) -> tuple[Any, Any, int]:
    """A CPU stand-in for the Llama (``--rehearse``, where transformers may be absent): an
    embedding and one linear layer per decoder layer, called as ``model.model(...)``."""

    class Decoder(torch.nn.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            width = shape["hidden_size"]
            self.embed = torch.nn.Embedding(VOCAB, width)
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(width, width) for _ in range(shape["num_hidden_layers"])
            )

        def forward(self, input_ids: Any, use_cache: bool = False) -> Any:
            hidden = self.embed(input_ids)
            for layer in self.layers:
                hidden = layer(hidden)
            return hidden

    model = SimpleNamespace(model=Decoder().eval())
    prompt = torch.randint(0, VOCAB, (1, prefix))
    return model, prompt, sum(p.numel() for p in model.model.parameters())


def run_shape(
    bench: Bench, target: str, name: str, shape: dict[str, int], args: argparse.Namespace
) -> dict[str, Any]:
    """Every figure of one model shape (see the module docstring)."""
    from kvstore.integrations.vllm.common import LoadSpec, StepPlan

    torch = bench.torch
    prefix = args.prefix
    chunks, bpc = prefix // CHUNK, CHUNK // BLOCK
    engines = {
        "shm-dma": make_engine(bench, target, prefix, shape, register=True),
        "shm-staged": make_engine(bench, target, prefix, shape, register=False),
    }
    direct, caches = engines["shm-dma"]
    result: dict[str, Any] = {"registration": registration(direct), "paths": {}}
    nbytes = chunks * direct._chunk_nbytes()
    result["bytes"] = nbytes
    result["link"] = link(bench, nbytes, args.rounds)

    keys = [f"{name}-{i}".encode().ljust(16, b".")[:16] for i in range(chunks)]
    saved_ids = list(range(chunks * bpc))
    load_ids = [b + chunks * bpc for b in saved_ids]
    save_once(direct, keys, saved_ids, "first")
    plan = StepPlan(loads=[LoadSpec("r", keys, load_ids)])

    steps: dict[str, list[Any]] = {path: [] for path in engines}

    def loader(path: str, worker: Any) -> Callable[[], None]:
        def load() -> None:
            worker.start_load_kv(plan)
            steps[path].append(worker._load)  # its fetch and issue times, for the breakdown
            for layer in worker._layer_names:
                worker.wait_for_layer_load(layer)
            worker.wait_for_save(plan)

        return load

    load_times = bench.time({p: loader(p, w) for p, (w, _) in engines.items()}, args.rounds)
    for path, (worker, engine_caches) in engines.items():
        errors = worker.get_block_ids_with_load_errors()
        assert not errors, f"{path}: {len(errors)} blocks failed to load"
        expected = path if bench.cuda else "shm-lease"  # a CPU rehearsal reads in place
        assert worker.last_load_path == expected, f"{path} loads went {worker.last_load_path}"
        for layer_name, cache in engine_caches.items():  # the saved blocks, bit for bit
            want = caches[layer_name][saved_ids].view(torch.int16)
            assert torch.equal(cache[load_ids].view(torch.int16), want), (
                f"{path}: {layer_name} differs from what was saved"
            )
        freed, committed = [], []
        for r in range(args.save_rounds):
            round_keys = [f"{path}{r}-{i}".encode().ljust(16, b".")[:16] for i in range(chunks)]
            gone, stored = save_once(worker, round_keys, saved_ids, f"{path}-{r}")
            freed.append(gone)
            committed.append(stored)
            worker._client.delete(round_keys)  # room in the arena for the next round
        load_s = _median(load_times[path])
        # Where a load's time goes: the lease (or get) on the loader thread, then issuing the
        # layers' copies and scatters until the last has run.
        fetch = [step.fetch_s for step in steps[path][1:]]
        issue = [step.scatter_s for step in steps[path][1:]]
        started = time.perf_counter()
        fresh = [f"rpc-{path}-{i}".encode().ljust(16, b".")[:16] for i in range(chunks)]
        held = worker._client.reserve(fresh, [worker._chunk_nbytes()] * chunks)
        reserve_s = time.perf_counter() - started
        if held is not None:
            held.cancel()
        result["paths"][path] = {
            "fetch_s": _median(fetch) if fetch else None,
            "issue_s": _median(issue) if issue else None,
            "reserve_rpc_s": reserve_s,
            "load_s": load_s,
            "load_gbps": nbytes / load_s / 1e9,
            "load_vs_link": (nbytes / load_s / 1e9) / result["link"]["h2d_gbps"],
            "save_freed_s": _median(freed),
            "save_committed_s": _median(committed),
            "save_gbps": nbytes / _median(freed) / 1e9,
            "save_vs_link": (nbytes / _median(freed) / 1e9) / result["link"]["d2h_gbps"],
            "load_samples_s": load_times[path],
            "save_samples_s": {"freed": freed, "committed": committed},
        }
    for path, (worker, _) in engines.items():
        if path != "shm-dma":
            worker.shutdown()

    model, prompt, params = model_prefill(bench, shape, prefix)
    names = direct._layer_names
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda _module, _args, name=names[i]: direct.wait_for_layer_load(name)
        )

    def prefill() -> None:
        with torch.inference_mode():
            model.model(input_ids=prompt, use_cache=False)  # the LM head of one token is noise

    def together() -> None:
        direct.start_load_kv(plan)  # the hooks wait per layer inside the forward
        prefill()
        direct.wait_for_save(plan)

    rounds = args.rounds if shape["num_hidden_layers"] <= 16 else max(3, args.rounds // 2)
    times = bench.time({"prefill": prefill, "together": together}, rounds)
    assert not direct.get_block_ids_with_load_errors(), "a load inside the prefill failed"
    direct.shutdown()
    load_s = result["paths"]["shm-dma"]["load_s"]
    prefill_s, together_s = _median(times["prefill"]), _median(times["together"])
    result.update(
        model_parameters=params,
        prefill_s=prefill_s,
        together_s=together_s,
        load_over_prefill=load_s / prefill_s,
        staged_over_prefill=result["paths"]["shm-staged"]["load_s"] / prefill_s,
        hidden_fraction=(load_s + prefill_s - together_s) / load_s,
        prefill_samples_s=times,
    )
    model = None  # its memory goes back before the next shape
    if bench.cuda:
        torch.cuda.empty_cache()
    return result


def table(results: dict[str, Any], prefix: int) -> str:
    """The medians as a markdown table."""
    from _common import markdown_table

    rows = []
    for name, shape in results.items():
        link_figures = shape["link"]
        for path, figures in shape["paths"].items():
            rows.append(
                [
                    name,
                    path,
                    f"{figures['load_s'] * 1e3:.1f} ms",
                    f"{figures['load_gbps']:.1f} GB/s",
                    f"{figures['load_vs_link']:.2f}",
                    f"{figures['save_freed_s'] * 1e3:.1f} ms",
                    f"{figures['save_gbps']:.1f} GB/s",
                    f"{figures['save_vs_link']:.2f}",
                    f"{figures['load_s'] / shape['prefill_s']:.3f}",
                    f"{shape['hidden_fraction'] * 100:.0f} %" if path == "shm-dma" else "",
                ]
            )
        rows.append(
            [
                name,
                "torch pinned (the link)",
                f"{shape['bytes'] / link_figures['h2d_gbps'] / 1e6:.1f} ms",
                f"{link_figures['h2d_gbps']:.1f} GB/s",
                "1.00",
                f"{shape['bytes'] / link_figures['d2h_gbps'] / 1e6:.1f} ms",
                f"{link_figures['d2h_gbps']:.1f} GB/s",
                "1.00",
                f"prefill {shape['prefill_s'] * 1e3:.1f} ms",
                "",
            ]
        )
    header = [
        "shape",
        "path",
        f"load {prefix} tok",
        "load rate",
        "÷ H2D",
        "save (blocks free)",
        "save rate",
        "÷ D2H",
        "load ÷ prefill",
        "hidden",
    ]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    """Run every measurement; 2 without CUDA (unless rehearsing)."""
    args = parse_args(argv)
    import torch

    if args.rehearse:
        device, shapes = "cpu", {"tiny": TINY}
        args.prefix, args.rounds, args.save_rounds = 1024, 2, 1
    elif not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device; none is present here", file=sys.stderr)
        return 2
    else:
        device = "cuda"
        unknown = set(args.shapes.split(",")) - set(SHAPES)
        if unknown:
            print(f"unknown shapes {sorted(unknown)}; allowed: {', '.join(SHAPES)}")
            return 2
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    from _common import kvstore_server, machine_info

    bench = Bench(torch, device)
    name = torch.cuda.get_device_name(0) if bench.cuda else "cpu (rehearsal)"
    arena = arena_to_hbm(bench, args.arena_copy_mib << 20, args.rounds) if bench.cuda else None
    results: dict[str, Any] = {}
    with kvstore_server(dram_capacity="4GiB", nvme_capacity="8GiB") as server:
        for shape_name, shape in shapes.items():
            print(f"--- {shape_name}", flush=True)
            results[shape_name] = run_shape(bench, server.target, shape_name, shape, args)
    text = table(results, args.prefix)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = machine_info(["torch", "transformers", "triton"])
    info["device"] = name
    first = next(iter(results.values()))
    summary = {  # the figures the GPU issue names, where a reader looks first
        "device": name,
        "load_gbps": first["paths"]["shm-dma"]["load_gbps"],
        "torch_pinned_gbps": first["link"]["h2d_gbps"],
        "save_gbps": first["paths"]["shm-dma"]["save_gbps"],
        "torch_pinned_d2h_gbps": first["link"]["d2h_gbps"],
    }
    out.with_suffix(".json").write_text(
        json.dumps(
            {"machine": info, "summary": summary, "arena": arena, "shapes": results}, indent=2
        )
    )
    header = f"Device: {name}; arena -> HBM " + (
        f"{arena['arena_gbps']:.1f} GB/s vs torch pinned {arena['torch_pinned_gbps']:.1f}"
        if arena
        else "not measured"
    )
    out.with_suffix(".md").write_text(f"{header}\n\n{text}\n")
    print(f"{header}\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
