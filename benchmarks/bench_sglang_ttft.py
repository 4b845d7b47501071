"""TTFT on SGLang's CPU engine: a prompt recomputed (cold) vs loaded from SGLang's own file backend
vs loaded from kvstore, in one run.

Exact command (repository root, in the SGLang environment; about 10 minutes on 2 cores)::

    PYTHONPATH=$PWD .venv-sglang/bin/python benchmarks/bench_sglang_ttft.py \
        --out benchmarks/results/sglang_ttft

Two SGLang servers start side by side, each with ``docs/sglang.md``'s server command on this CPU
(``tests/harness/sglang_server.py``: the CPU stand-ins, a tiny random-weight Llama built here,
hidden 512, 8 layers, 4 KV heads of 64; float32 weights, and SGLang's ``--dtype auto`` makes
its KV float16: 8 KiB per token, 512 KiB per 64-token page): one with kvstore as
HiCache storage (a ``kvstore serve`` on loopback, dram + nvme, chunk = SGLang's page), one with
SGLang's ``file`` backend (files in a temporary directory, so the page cache; SGLang's baseline).
For every prompt (distinct random token ids, 2,048 by default), one request at a time,
``max_new_tokens=1`` so that a request's latency is its time to first token:

* ``cold``: the prompt's first request: nothing cached, every token prefilled;
* then, once the backend holds every whole page, ``/flush_cache`` empties the device and host
  caches and the same prompt is asked again: ``kvstore`` or ``file``, the pages prefetched from
  storage (``--hicache-storage-prefetch-policy wait_complete``) and only the last page prefilled.

The two servers take turns prompt by prompt, so both see the same load; one unmeasured prompt
first warms each (SGLang compiles its hash extension at the first request). Each hit is checked:
its cache report names the backend and the whole pages as storage tokens, and its first token is
the cold request's.

Writes ``OUT.json`` (every measurement, the machine and its load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]  # the tests' harness

from _common import machine_info  # noqa: E402
from harness.ports import free_port  # noqa: E402
from harness.serve import ServerProcess  # noqa: E402
from harness.sglang_server import (  # noqa: E402
    SGLangServer,
    cpu_command,
    documented_command,
    flag_value,
    server_env,
    wait_all_healthy,
)

MODEL_SIZES = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


def build_model(path: Path) -> Path:
    """The tests' tiny Llama at :data:`MODEL_SIZES`, built in a child with the CPU stand-ins."""
    import subprocess

    code = (
        "import json, sys; sys.path[:0] = [sys.argv[1]];"
        "from harness import sglang_cpu; sglang_cpu.install();"
        "from harness.tiny_model import build_tiny_llama;"
        "build_tiny_llama(sys.argv[2], **json.loads(sys.argv[3]))"
    )
    argv = [str(ROOT / "tests"), str(path), json.dumps(MODEL_SIZES)]
    subprocess.run([sys.executable, "-c", code, *argv], check=True, timeout=900, env=server_env())
    return path


def poll(check: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.1)


def timed_generate(server: SGLangServer, ids: list[int]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    answer = server.generate(ids, max_new_tokens=1)
    return time.perf_counter() - start, answer


def first_token(answer: dict[str, Any]) -> int:
    return int(answer["meta_info"]["output_token_logprobs"][0][1])


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(values) * 1000, 1),
        "mean_ms": round(statistics.fmean(values) * 1000, 1),
        "min_ms": round(min(values) * 1000, 1),
        "max_ms": round(max(values) * 1000, 1),
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    documented = documented_command()
    page = int(flag_value(documented.split(), "--page-size"))
    whole_pages = (args.prompt_tokens - 1) // page
    model = build_model(work / "model")
    file_dir = work / "file-backend"
    file_dir.mkdir()
    load_before = os.getloadavg()
    store = ServerProcess(
        work / "store", settings={"dram.capacity": "1GiB", "keys.chunk_size": page}, name="store"
    )
    with store:
        ports = {"kvstore": free_port(), "file": free_port()}
        commands = {
            "kvstore": cpu_command(model, ports["kvstore"], store.target, documented),
            "file": cpu_command(
                model,
                ports["file"],
                store.target,
                documented,
                hicache_storage_backend="file",
                hicache_storage_backend_extra_config="",
            ),
        }
        env = server_env(SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(file_dir))
        servers = {
            way: SGLangServer(way, command, work / f"{way}.log", ports[way], env)
            for way, command in commands.items()
        }
        stored = {
            "kvstore": lambda: store.stats()["blocks"],
            "file": lambda: len(list(file_dir.iterdir())),
        }
        try:
            start_s = wait_all_healthy(list(servers.values()))
            print(f"both servers up in {start_s:.0f} s", flush=True)
            rng = random.Random(args.seed)
            prompts = [
                rng.choices(range(3, 1024), k=args.prompt_tokens) for _ in range(args.prompts + 1)
            ]
            samples: dict[str, list[float]] = {"cold": [], "file": [], "kvstore": []}
            cold_by_way: dict[str, list[float]] = {"kvstore": [], "file": []}
            for index, ids in enumerate(prompts):
                for way, server in servers.items():
                    before = stored[way]()
                    cold_s, cold = timed_generate(server, ids)
                    if cold["meta_info"]["cached_tokens"] != 0:
                        raise RuntimeError(f"{way}: a fresh prompt had cached tokens: {cold}")
                    poll(
                        lambda: stored[way]() >= before + whole_pages,  # noqa: B023
                        f"{way}: the prompt's {whole_pages} pages stored",
                    )
                    server.flush_cache()
                    hit_s, hit = timed_generate(server, ids)
                    details = hit["meta_info"].get("cached_tokens_details") or {}
                    if details.get("storage") != whole_pages * page:
                        raise RuntimeError(f"{way}: not a whole storage hit: {hit['meta_info']}")
                    if first_token(hit) != first_token(cold):
                        raise RuntimeError(f"{way}: the hit's first token differs from cold")
                    if index == 0:
                        continue  # the warm-up prompt
                    samples["cold"].append(cold_s)
                    cold_by_way[way].append(cold_s)
                    samples[way].append(hit_s)
                    print(
                        f"prompt {index} {way}: cold {cold_s * 1000:.0f} ms, "
                        f"hit {hit_s * 1000:.0f} ms ({details})",
                        flush=True,
                    )
        finally:
            for server in servers.values():
                server.stop()
    load_after = os.getloadavg()
    cold_median = statistics.median(samples["cold"])
    return {
        "benchmark": "bench_sglang_ttft",
        "command": " ".join(sys.argv),
        "machine": machine_info(("sglang", "torch", "tiered-kvstore")),
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in load_after],
        "server_start_s": round(start_s, 1),
        "model": {
            **MODEL_SIZES,
            "dtype": "float32 weights; KV float16 (--dtype auto), 512 KiB per 64-token page",
            "vocab_size": 1024,
        },
        "page_size": page,
        "prompt_tokens": args.prompt_tokens,
        "storage_tokens_per_hit": whole_pages * page,
        "prompts": args.prompts,
        "ttft": {way: summary(values) for way, values in samples.items()},
        "cold_by_server": {way: summary(values) for way, values in cold_by_way.items()},
        "median_vs_cold": {
            way: round(statistics.median(samples[way]) / cold_median, 3)
            for way in ("file", "kvstore")
        },
        "samples_s": {way: [round(v, 4) for v in values] for way, values in samples.items()},
        "server_command": documented,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/sglang_ttft")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sglang-ttft-") as tmp:
        result = run(args, Path(tmp))
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("ttft", "median_vs_cold")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
