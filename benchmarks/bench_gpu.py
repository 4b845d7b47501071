"""GPU figures of the connector's device path: arena -> HBM, layer-wise loads, overlap with compute.

Runs only where CUDA is present (says so and exits 2 otherwise). Exact command (repository root)::

    python benchmarks/bench_gpu.py --out benchmarks/results/gpu

Three measurements, each against its baseline in the same run, interleaved:

1. **arena -> HBM bandwidth.** A dram-tier arena (shared memory, page-locked with
   ``cudaHostRegister`` as ``kvstore serve`` does where CUDA exists) is copied into device memory
   ``--arena-copy-mib`` at a time, against ``torch``'s own pinned host-to-device copy
   (``pin_memory=True`` tensor) of the same bytes; GB/s median over ``--rounds``, and the ratio
   (the issue asks >= 0.8).
2. **Layer-wise load of an ``--prefix``-token prefix** (8K by default) from a real
   ``kvstore serve`` (dram + nvme) into a paged cache shaped like vLLM's for a Llama of about 1B
   parameters (16 layers, 8 KV heads of 64, bf16, block 16, packed ``[blocks, heads, block, 2 *
   head]`` NHD view), through the connector's worker half (``WorkerSide``: get into a page-locked
   staging buffer, one DMA per chunk and layer on a load stream, scatter, an event per layer),
   against the prefill of the same prompt by a ``transformers`` ``LlamaForCausalLM`` of that
   size with random weights (``LlamaConfig``, no download) on the same GPU (the issue asks
   load <= prefill / 10).
3. **Hidden fraction.** The same load while that model runs its prefill, each decoder layer
   waiting for its own layer's load first (a forward pre-hook calling ``wait_for_layer_load``, as
   vLLM's attention does): ``hidden = (load + prefill - together) / load``.

Writes ``OUT.json`` (every sample, the device) and ``OUT.md`` (medians); prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 heads, 8 KV heads of 64.
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
}
BLOCK, CHUNK = 16, 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gpu", help="OUT.json and OUT.md")
    parser.add_argument("--rounds", type=int, default=10, help="repetitions of each case")
    parser.add_argument("--prefix", type=int, default=8192, help="prefix tokens to load")
    parser.add_argument("--arena-copy-mib", type=int, default=256, help="bytes per arena copy")
    return parser.parse_args(argv)


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def arena_to_hbm(torch: Any, nbytes: int, rounds: int) -> dict[str, Any]:
    """Arena pages -> device vs a torch pinned tensor -> device, same bytes, interleaved."""
    from kvstore.tiers.dram import DramTier

    tier = DramTier(nbytes, force_cuda_check=True)
    arena = None  # the tensor over the arena's pages, dropped before the tier unmaps them
    try:
        arena = torch.from_numpy(tier.range_view(0, nbytes))
        arena.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(arena)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        times: dict[str, list[float]] = {"arena": [], "torch_pinned": []}
        for r in range(rounds + 1):
            for name, src in (("arena", arena), ("torch_pinned", pinned))[:: 1 if r % 2 else -1]:
                torch.cuda.synchronize()
                start = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                if r:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
        assert torch.equal(dst.cpu(), pinned), "arena copy returned wrong bytes"
        arena_gbps = _median_gbps(nbytes, times["arena"])
        torch_gbps = _median_gbps(nbytes, times["torch_pinned"])
        return {
            "bytes": nbytes,
            "arena_pinned": tier.pinned,
            "arena_gbps": arena_gbps,
            "torch_pinned_gbps": torch_gbps,
            "ratio": arena_gbps / torch_gbps,
            "samples_s": times,
        }
    finally:
        del arena
        import asyncio

        asyncio.run(tier.close())


def _engine(torch: Any, target: str, prefix: int, layers: int) -> tuple[Any, dict[str, Any]]:
    """A connector worker half over CUDA caches of ``layers`` Llama-1B layers."""
    from kvstore.integrations.vllm_common import ConnectorSettings
    from kvstore.integrations.vllm_worker import WorkerSide

    heads, head = LLAMA_1B["num_key_value_heads"], 64
    num_blocks = 2 * prefix // BLOCK + 8
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    spec = SimpleNamespace(
        block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16
    )
    config = SimpleNamespace(
        model_config=SimpleNamespace(model="bench-gpu", revision=None, max_model_len=prefix * 2),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cuda"),
        cache_config=SimpleNamespace(kv_cache_layout="NHD", cache_dtype="auto"),
    )
    kv_config = SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)],
    )
    settings = ConnectorSettings.from_extra_config(
        {"target": target, "chunk_size": CHUNK, "timeout_s": 30.0}, env={}
    )
    worker = WorkerSide(settings, config, kv_config)  # type: ignore[arg-type]
    # vLLM's packed view, NHD memory: [blocks, tokens, heads, 2 * head] viewed [b, h, n, 2d].
    caches = {
        name: torch.randn(num_blocks, BLOCK, heads, 2 * head, device="cuda")
        .to(torch.bfloat16)
        .permute(0, 2, 1, 3)
        for name in names
    }
    worker.register_kv_caches(caches, backend="FLASH_ATTN")
    return worker, caches


def layerwise_load(torch: Any, target: str, prefix: int, rounds: int) -> dict[str, Any]:
    """Load time of the prefix, prefill time of the prompt, and both together."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvstore.integrations.vllm_common import LoadSpec, SaveSpec, StepPlan

    layers = LLAMA_1B["num_hidden_layers"]
    worker, caches = _engine(torch, target, prefix, layers)
    chunks = prefix // CHUNK
    bpc = CHUNK // BLOCK
    keys = [i.to_bytes(16, "big") for i in range(1, chunks + 1)]
    saved_ids = list(range(chunks * bpc))
    load_ids = [b + chunks * bpc for b in saved_ids]
    worker.wait_for_save(StepPlan(saves=[SaveSpec("w", keys, saved_ids)]))
    deadline = time.monotonic() + 300
    while worker.get_finished({"w"})[0] != {"w"}:
        assert time.monotonic() < deadline, "the save never gathered"
        time.sleep(0.01)
    while worker._client.lookup(keys) < chunks:  # the put follows the gather (rank 0's keys)
        assert time.monotonic() < deadline, "the saved chunks never reached the store"
        time.sleep(0.05)
    plan = StepPlan(loads=[LoadSpec("r", keys, load_ids)])
    names = list(caches)

    config = LlamaConfig(**LLAMA_1B, dtype=torch.bfloat16)  # transformers 5 names it dtype
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    prompt = torch.randint(0, LLAMA_1B["vocab_size"], (1, prefix), device="cuda")
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda _module, _args, name=names[i]: worker.wait_for_layer_load(name)
        )

    def load() -> None:
        worker.start_load_kv(plan)
        for name in names:
            worker.wait_for_layer_load(name)
        worker.wait_for_save(plan)

    def prefill() -> None:
        with torch.inference_mode():
            model.model(input_ids=prompt, use_cache=False)  # the LM head of one token is noise

    def together() -> None:
        worker.start_load_kv(plan)  # the hooks wait per layer inside the forward
        prefill()
        worker.wait_for_save(plan)

    times: dict[str, list[float]] = {"load": [], "prefill": [], "together": []}
    cases = [("load", load), ("prefill", prefill), ("together", together)]
    for r in range(rounds + 1):
        for name, call in cases[r % 3 :] + cases[: r % 3]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            if r:
                times[name].append(time.perf_counter() - start)
    errors = worker.get_block_ids_with_load_errors()
    assert not errors, f"{len(errors)} blocks failed to load"
    for name in names:  # the loaded blocks are the saved ones, bit for bit
        cache = caches[name]
        assert torch.equal(cache[load_ids].view(torch.int16), cache[saved_ids].view(torch.int16))
    worker.shutdown()
    med = {name: statistics.median(values) for name, values in times.items()}
    nbytes = chunks * int(torch.Size(worker._chunk_shape).numel()) * 2
    return {
        "prefix_tokens": prefix,
        "model_parameters": params,
        "bytes": nbytes,
        "load_s": med["load"],
        "load_gbps": nbytes / med["load"] / 1e9,
        "prefill_s": med["prefill"],
        "together_s": med["together"],
        "load_over_prefill": med["load"] / med["prefill"],
        "hidden_fraction": (med["load"] + med["prefill"] - med["together"]) / med["load"],
        "samples_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    """Run both measurements; 2 without CUDA."""
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device; none is present here", file=sys.stderr)
        return 2
    from _common import kvstore_server, machine_info, markdown_table

    device = torch.cuda.get_device_name(0)
    arena = arena_to_hbm(torch, args.arena_copy_mib << 20, args.rounds)
    with kvstore_server(dram_capacity="2GiB", nvme_capacity="4GiB") as server:
        load = layerwise_load(torch, server.target, args.prefix, args.rounds)
    rows = [
        ["arena -> HBM", f"{arena['arena_gbps']:.1f} GB/s", "torch pinned H2D",
         f"{arena['torch_pinned_gbps']:.1f} GB/s", f"{arena['ratio']:.2f}"],
        [f"load {args.prefix} tokens (layer-wise)", f"{load['load_s'] * 1e3:.1f} ms",
         f"prefill ({load['model_parameters'] / 1e9:.2f}B Llama)",
         f"{load['prefill_s'] * 1e3:.1f} ms", f"{load['load_over_prefill']:.3f}"],
        ["load + prefill together", f"{load['together_s'] * 1e3:.1f} ms", "load hidden",
         f"{load['hidden_fraction'] * 100:.0f} %", ""],
    ]  # fmt: skip
    table = markdown_table(["path", "time / rate", "baseline", "baseline figure", "ratio"], rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = machine_info(["torch", "transformers", "triton"])
    info["device"] = device
    out.with_suffix(".json").write_text(
        json.dumps({"machine": info, "arena": arena, "load": load}, indent=2)
    )
    out.with_suffix(".md").write_text(f"Device: {device}\n\n{table}\n")
    print(f"Device: {device}\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
