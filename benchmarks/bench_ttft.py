"""TTFT of a second replica on shared prefixes: recompute vs ExampleConnector vs kvstore.

Exact command (repository root, in the vLLM environment; about 8 minutes on 2 cores)::

    .venv-vllm/bin/python benchmarks/bench_ttft.py --out benchmarks/ttft_cpu

For every prefix length (1K, 2K, 4K and 8K tokens by default) and repetition, engine A (its own
process) serves ``prefix + 16 tokens``; engine B (another process, empty local prefix cache)
then serves ``prefix + 16 other tokens`` one request at a time with ``max_tokens=1``, so a
request's latency is its time to first token. B runs five ways (each connector's B after that
connector's own engine A):

* ``recompute``: no connector; B prefills the whole prompt;
* ``recompute_conn``: ``KVStoreConnector`` configured but its store down, so B prefills the whole
  prompt with the engine set up exactly as for the kvstore run (vLLM's CPU engine prefills
  noticeably faster with a KV connector configured than without one; this is the fair baseline);
* ``local``: the floor every connector is bounded by: vLLM's own prefix-cache hit. One engine,
  set up as ``recompute_conn``, serves A's prompt and right after it B's, so B's prefix is in its
  local prefix cache; only B's requests count;
* ``example``: vLLM's ``ExampleConnector`` (safetensors files on local disk);
* ``kvstore``: ``KVStoreConnector`` against a ``kvstore serve`` on loopback (dram + nvme tiers).

The 16-token suffix keeps the prompts inside one 128-token engine block past the prefix, the only
case where ``ExampleConnector`` (which keys on the whole prompt) can hit at all; both connectors
then load the same tokens. B's first tokens are checked to agree across the five ways.

kvstore's TTFT is broken down from the connector's own debug log: the scheduler's lookup, the
worker's get (on a background thread; over shared memory, since the store runs on the same host,
which the report checks), how long the forward pass waited for it, and the scatter into the paged
cache; the rest is the engine (the suffix prefill, scheduling, sampling).

Writes ``OUT.json`` (every measurement) and ``OUT.md`` (median table); prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' harness

from _common import engine_or_exit, run_engine  # noqa: E402
from harness.tiny_model import build_tiny_llama  # noqa: E402

SUFFIX = 16
CHUNK = 256
ENGINE_TIMEOUT_S = 1200
MODEL_SIZES = {
    "vocab_size": 1024,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
}
B_FLAGS = ["--sequential", "--warmup", "256"]
_LOOKUP = re.compile(r"kvstore lookup: (\d+) keys -> (\d+) hits in ([\d.]+) ms")
_LOAD = re.compile(r"get ([\d.]+) ms(?: via \S+)?, waited ([\d.]+) ms, scatter ([\d.]+) ms")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _prompts(sizes: list[int], reps: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    rng = random.Random(7)
    a, b, lengths = [], [], []
    for _ in range(reps):
        for size in sizes:
            prefix = [rng.randrange(3, 1000) for _ in range(size)]
            a.append(prefix + [rng.randrange(3, 1000) for _ in range(SUFFIX)])
            b.append(prefix + [rng.randrange(3, 1000) for _ in range(SUFFIX)])
            lengths.append(size)
    return a, b, lengths


def _engine(
    name: str, workdir: Path, model: Path, prompts: list[list[int]], max_len: int, *extra: str
) -> tuple[dict[str, Any], str]:
    flags = [
        *("--max-model-len", str(max_len), "--chunk-size", str(CHUNK)),
        # One step per prefill (with A sequential too): ExampleConnector saves only a prompt's
        # first prefill step yet files it under the whole prompt, so a chunked prefill makes
        # its loads crash.
        *("--max-num-batched-tokens", str(max_len)),
        *extra,
    ]
    return engine_or_exit(name, run_engine(name, workdir, model, prompts, flags, ENGINE_TIMEOUT_S))


def _breakdown(log: str, count: int) -> list[dict[str, float]] | None:
    """Per B request: lookup, get, waited and scatter milliseconds, from the debug log."""
    lookups = [m for m in _LOOKUP.finditer(log)]
    loads = [m for m in _LOAD.finditer(log)]
    if len(lookups) != count or len(loads) != count:
        return None  # the one-lookup-and-one-load-per-request pairing does not hold
    return [
        {
            "lookup_ms": float(lk.group(3)),
            "get_ms": float(ld.group(1)),
            "waited_ms": float(ld.group(2)),
            "scatter_ms": float(ld.group(3)),
        }
        for lk, ld in zip(lookups, loads, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/ttft_cpu", help="OUT.json and OUT.md")
    parser.add_argument("--workdir", help="keep models, logs and stores here (default: temp)")
    parser.add_argument(
        "--floor-only",
        action="store_true",
        help="only the local hit and kvstore (for profiling): print their medians, write nothing",
    )
    args = parser.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-ttft-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = build_tiny_llama(workdir / "model", **MODEL_SIZES)
    a_prompts, b_prompts, lengths = _prompts(args.sizes, args.reps)
    max_len = max(args.sizes) + 2 * SUFFIX + 32

    dead = ["--connector", "kvstore", "--target", f"127.0.0.1:{_free_port()}"]
    recompute = recompute_conn = example = {}
    if not args.floor_only:
        recompute, recompute_conn, example = _recompute_and_example(
            workdir, model, a_prompts, b_prompts, max_len, dead
        )

    print("local prefix-cache hit")
    # The floor every connector is bounded by: the same engine (set up as for the kvstore run,
    # connector on, store down) serves A's prompt and then B's, so B's prefix comes from vLLM's
    # own prefix cache. Only the B requests' latencies count.
    interleaved = [p for pair in zip(a_prompts, b_prompts, strict=True) for p in pair]
    local_run, _ = _engine("b_local", workdir, model, interleaved, max_len, *dead, *B_FLAGS)
    local = {**local_run, "results": local_run["results"][1::2]}

    kvstore, kv_log, data_plane = _kvstore(workdir, model, a_prompts, b_prompts, max_len)
    breakdown = _breakdown(kv_log, len(b_prompts))
    if args.floor_only:
        _print_floor(local, kvstore, breakdown, lengths, args.sizes)
        return
    runs = {
        "recompute": recompute,
        "recompute_conn": recompute_conn,
        "local": local,
        "example": example,
        "kvstore": kvstore,
    }
    report = _report(runs, breakdown, lengths, args, data_plane)
    Path(f"{args.out}.json").write_text(json.dumps(report["raw"], indent=1))
    Path(f"{args.out}.md").write_text(report["markdown"])
    print(report["markdown"])


def _recompute_and_example(
    workdir: Path,
    model: Path,
    a_prompts: list[list[int]],
    b_prompts: list[list[int]],
    max_len: int,
    dead: list[str],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """B's runs without a hit: no connector, the kvstore connector with its store down; and
    ExampleConnector's A and B."""
    b_flags = B_FLAGS
    print("recompute")
    recompute, _ = _engine("b_recompute", workdir, model, b_prompts, max_len, *b_flags)
    # The same engine with the connector loaded but its store down (every lookup a miss at no
    # cost): vLLM's CPU engine prefills markedly faster with any KV connector configured than
    # without one, so this is the like-for-like recompute baseline.
    recompute_conn, _ = _engine(
        "b_recompute_conn", workdir, model, b_prompts, max_len, *dead, *b_flags
    )

    print("ExampleConnector")
    storage = workdir / "example-storage"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir()
    ex = ["--connector", "example", "--storage-path", str(storage)]
    _engine("a_example", workdir, model, a_prompts, max_len, *ex, "--sequential")
    example, _ = _engine("b_example", workdir, model, b_prompts, max_len, *ex, *b_flags)

    return recompute, recompute_conn, example


def _kvstore(
    workdir: Path, model: Path, a_prompts: list[list[int]], b_prompts: list[list[int]], max_len: int
) -> tuple[dict[str, Any], str, str]:
    """kvstore's A then B against a fresh ``kvstore serve``: B's run, its log, the data plane."""
    b_flags = B_FLAGS
    print("kvstore")
    target = f"127.0.0.1:{_free_port()}"
    store_log = (workdir / "store.log").open("wb")
    store = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from kvstore.cli import main; sys.exit(main())",
            "serve",
            "--metrics-listen",
            "127.0.0.1:0",
            "--listen",
            target,
            "--nvme-path",
            str(workdir / "nvme"),
            "--dram-capacity",
            "2GiB",
        ],
        stdout=store_log,
        stderr=subprocess.STDOUT,
    )
    try:
        time.sleep(3)
        kv = ["--connector", "kvstore", "--target", target]
        _engine("a_kvstore", workdir, model, a_prompts, max_len, *kv, "--sequential")
        kvstore, kv_log = _engine(
            "b_kvstore", workdir, model, b_prompts, max_len, *kv, *b_flags,
            "--kvstore-log-level", "DEBUG",
        )  # fmt: skip
        # Which data plane the connector's gets took: only shared memory reads blocks through
        # the published index (counted when the TOUCH arrives) or leases them.
        from kvstore import KVStoreClient

        with KVStoreClient(target, timeout=10) as client:
            counters = client.stats()["counters"]
        on_shm = counters.get("blocks_read_direct", 0) + counters.get("blocks_leased", 0)
        data_plane = "shared memory" if on_shm else "gRPC"
    finally:
        store.terminate()
        store.wait(timeout=30)
        store_log.close()

    return kvstore, kv_log, data_plane


def _print_floor(
    local: dict[str, Any],
    kvstore: dict[str, Any],
    breakdown: list[dict[str, float]] | None,
    lengths: list[int],
    sizes: list[int],
) -> None:
    for size in sizes:
        pick = [i for i, n in enumerate(lengths) if n == size]
        loc = [local["results"][i]["latency_s"] * 1e3 for i in pick]
        kv = [kvstore["results"][i]["latency_s"] * 1e3 for i in pick]
        ratio = statistics.median(kv) / statistics.median(loc)
        print(f"{size}: local {loc} kvstore {kv} ratio of medians {ratio:.2f}")
        if breakdown is not None:
            print("   ", [breakdown[i] for i in pick])


def _report(
    runs: dict[str, dict[str, Any]],
    breakdown: list[dict[str, float]] | None,
    lengths: list[int],
    args: argparse.Namespace,
    data_plane: str,
) -> dict[str, Any]:
    first_tokens = {name: [r["tokens"] for r in run["results"]] for name, run in runs.items()}
    # Every way must give every prompt the same first token (kvstore's loads are exact).
    mismatches = sum(
        1 for i in range(len(lengths)) if len({tuple(first_tokens[name][i]) for name in runs}) != 1
    )

    def med(name: str, size: int, key: str = "latency_s", scale: float = 1e3) -> float:
        rows = [r for r, n in zip(runs[name]["results"], lengths, strict=True) if n == size]
        return statistics.median(r[key] for r in rows) * scale

    def med_bd(size: int, key: str) -> float:
        assert breakdown is not None
        return statistics.median(
            b[key] for b, n in zip(breakdown, lengths, strict=True) if n == size
        )

    lines = [
        "| shared prefix | recompute, no connector | recompute, connector on, store down "
        "| local prefix-cache hit | ExampleConnector | kvstore | **kvstore / local hit** "
        "| recompute (store down) / kvstore | Example / kvstore "
        "| tokens cached (local / Example / kvstore) | kvstore lookup | get | forward waited "
        "| scatter |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    table = []
    for size in args.sizes:
        row = {
            "prefix": size,
            "recompute_ms": med("recompute", size),
            "recompute_conn_ms": med("recompute_conn", size),
            "local_ms": med("local", size),
            "example_ms": med("example", size),
            "kvstore_ms": med("kvstore", size),
            "local_cached": med("local", size, "num_cached_tokens", 1),
            "example_cached": med("example", size, "num_cached_tokens", 1),
            "kvstore_cached": med("kvstore", size, "num_cached_tokens", 1),
        }
        if breakdown is not None:
            for key in ("lookup_ms", "get_ms", "waited_ms", "scatter_ms"):
                row[key] = med_bd(size, key)
        table.append(row)
        parts = [
            f"{size // 1024}K",
            f"{row['recompute_ms']:.0f} ms",
            f"{row['recompute_conn_ms']:.0f} ms",
            f"{row['local_ms']:.1f} ms",
            f"{row['example_ms']:.1f} ms",
            f"{row['kvstore_ms']:.1f} ms",
            f"**{row['kvstore_ms'] / row['local_ms']:.2f}x**",
            f"{row['recompute_conn_ms'] / row['kvstore_ms']:.1f}x",
            f"{row['example_ms'] / row['kvstore_ms']:.1f}x",
            f"{row['local_cached']:.0f} / {row['example_cached']:.0f} / "
            f"{row['kvstore_cached']:.0f}",
        ]
        if breakdown is not None:
            parts += [
                f"{row[k]:.1f} ms" for k in ("lookup_ms", "get_ms", "waited_ms", "scatter_ms")
            ]
        else:
            parts += ["n/a"] * 4
        lines.append("| " + " | ".join(parts) + " |")
    sizes = ", ".join(f"{k}={v}" for k, v in MODEL_SIZES.items() if k != "max_position_embeddings")
    lines += [
        "",
        f"Median of {args.reps} requests per prefix length; engine B's time to first token "
        f"(`max_tokens=1`, one request at a time, after a warm-up request). Random Llama "
        f"({sizes}), bf16, vLLM CPU build, 2 cores. First tokens differing between the five "
        f"ways: {mismatches} of {len(lengths)}. The kvstore breakdown comes from the "
        f"connector's debug log: lookup on the scheduler, get ({data_plane}; over shared "
        f"memory a lease on the chunks in the store's arena, no copy) on the worker's fetch "
        f"thread, the time the forward pass waited for it, and the scatter into the paged "
        f"cache (on CPU, the copies out of the arena on the forward pass's own thread, layer "
        f"by layer as each layer's attention asks for it).",
    ]
    return {
        "raw": {"runs": runs, "lengths": lengths, "breakdown": breakdown, "table": table},
        "markdown": "\n".join(lines) + "\n",
    }


if __name__ == "__main__":
    main()
