"""Hybrid models on vLLM's CPU engine: what a kvstore hit loads with the hybrid manager on and off.

Exact command (repository root, in the vLLM environment; about 15 minutes on 2 busy cores)::

    .venv-vllm/bin/python benchmarks/bench_hybrid.py --out benchmarks/results/hybrid_cpu

Two shapes from ``tests/harness/tiny_families.py``: a sliding-window hybrid (``gpt_oss``: layers
sliding 128 / full alternating, attention sinks) and a recurrent hybrid (``qwen3_next``: three
Gated DeltaNet layers, one full-attention layer, bf16). Each runs two ways:

* ``hma``: kvstore configured, vLLM's hybrid KV cache manager on (kvstore's ``SupportsHMA``);
* ``off``: the old behaviour, the manager forced off (``disable_hybrid_kv_cache_manager``, as
  vLLM did for every kvstore engine before ``SupportsHMA``): the sliding layers are allocated and
  stored as full attention, and a recurrent hybrid cannot start.

Per shape and way, against a fresh ``kvstore serve``: engine A (its own process;
``max_model_len`` 16384, prefill steps of 512 tokens) serves ``PREFIX + 16`` tokens per prompt
one at a time with ``max_tokens=1`` (its latency: a miss's TTFT, saving); engine B (a new
process, empty prefix cache) serves the same prefixes with other suffixes, twice: the first
pass loads from kvstore (a kvstore hit's TTFT), the second hits B's own prefix cache (vLLM's own
hit, the floor). Reported: the engine's KV capacity (tokens, and
how many 16K-token requests fit, from vLLM's log), the bytes a hit loaded per KV cache group
and the connector's load time (``vllm:kvstore_loaded_bytes_by_group``,
``vllm:kvstore_load_seconds``), the median TTFTs, and the load average before and after.

Writes ``OUT.json`` (every measurement) and ``OUT.md`` (the table); prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' harness

from _common import run_engine  # noqa: E402
from harness.serve import ServerProcess  # noqa: E402
from harness.tiny_families import build_family  # noqa: E402

SHAPES = {"sliding": "gpt_oss", "recurrent": "qwen3_next"}
#: Tokens per chunk: a whole number of the engine's blocks (vLLM raises the recurrent hybrid's
#: attention block size to 384 so that its pages match the state's).
CHUNKS = {"sliding": 256, "recurrent": 768}
WAYS = {"hma": "auto", "off": "off"}
SUFFIX = 16
#: A context much longer than the window and the prefill batch, as served models have: vLLM
#: sizes a sliding group for window + batched tokens per request, a full group for the context.
MAX_LEN = 16384
MAX_BATCHED = 512
ENGINE_TIMEOUT_S = 900
_CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")
_ROOT_CAUSE = "Engine core initialization failed"
_GROUPS = re.compile(r"kv cache group sizes \(([\d, ]+)\)")
_START_ERROR = re.compile(r"^[\w.]*(?:Error|Exception): .*$", re.M)


def _prompts(prefix: int, count: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(36)
    prefixes = [[rng.randrange(3, 1000) for _ in range(prefix)] for _ in range(count)]
    a = [p + [rng.randrange(3, 1000) for _ in range(SUFFIX)] for p in prefixes]
    b = [p + [rng.randrange(3, 1000) for _ in range(SUFFIX)] for p in prefixes]
    return a, b


def _engine(
    name: str, workdir: Path, model: Path, prompts: list[list[int]], chunk: int, *extra: str
) -> tuple[dict[str, Any] | None, str]:
    """Run one engine_runner.py; its JSON output (None if it failed to start) and its log."""
    flags = [
        *("--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", str(MAX_BATCHED)),
        *("--chunk-size", str(chunk), "--sequential", "--warmup", "256", "--stats"),
        *extra,
    ]
    return run_engine(name, workdir, model, prompts, flags, ENGINE_TIMEOUT_S)


def _kv_cache(log: str) -> dict[str, Any]:
    capacity = _CAPACITY.search(log)
    concurrency = _CONCURRENCY.search(log)
    groups = _GROUPS.search(log)
    return {
        "kv_tokens": int(capacity.group(1).replace(",", "")) if capacity else None,
        "concurrency": float(concurrency.group(1)) if concurrency else None,
        "groups": len(groups.group(1).split(",")) if groups else (1 if capacity else None),
    }


def _median_ms(results: list[dict[str, Any]]) -> float:
    return round(statistics.median(r["latency_s"] for r in results) * 1e3, 1)


def _run(
    workdir: Path, shape: str, family: str, way: str, prefix: int, count: int
) -> dict[str, Any]:
    model = build_family(family, workdir / family)
    a_prompts, b_prompts = _prompts(prefix, count)
    here = workdir / f"{shape}-{way}"
    here.mkdir(exist_ok=True)
    row: dict[str, Any] = {
        "shape": shape,
        "family": family,
        "way": way,
        "prefix": prefix,
        "chunk": CHUNKS[shape],
    }
    env_extra = ["--hybrid-manager", WAYS[way]]
    # The store's chunk size is the connector's: a connector set to another one is refused.
    settings = {"dram.capacity": "1GiB", "keys.chunk_size": CHUNKS[shape]}
    with ServerProcess(here, settings=settings, name="store") as store:
        connector = ["--connector", "kvstore", "--target", store.target, *env_extra]
        chunk = CHUNKS[shape]
        a, a_log = _engine("a", here, model, a_prompts, chunk, *connector)
        row.update(_kv_cache(a_log))
        if a is None:
            # The root cause, not vLLM's "see root cause above" wrapper.
            errors = [e for e in _START_ERROR.findall(a_log) if _ROOT_CAUSE not in e]
            row["start_error"] = errors[0].strip() if errors else "exit != 0 (see the log)"
            return row
        b, b_log = _engine("b", here, model, b_prompts, chunk, *connector, "--passes", "2")
        assert b is not None, b_log[-3000:]
    counters = b["kvstore"]
    kvstore_pass, local_pass = b["results"][:count], b["results"][count:]
    by_group = {
        k.split("{", 1)[1].rstrip("}"): int(v)
        for k, v in counters.items()
        if k.startswith("vllm:kvstore_loaded_bytes_by_group{")
    }
    loads = counters.get("vllm:kvstore_load_seconds_count", 0)
    row.update(
        {
            "miss_ttft_ms": _median_ms(a["results"]),
            "kvstore_hit_ttft_ms": _median_ms(kvstore_pass),
            "local_hit_ttft_ms": _median_ms(local_pass),
            "kvstore_cached_tokens": [r["num_cached_tokens"] for r in kvstore_pass],
            "local_cached_tokens": [r["num_cached_tokens"] for r in local_pass],
            "hit_tokens": int(counters.get("vllm:kvstore_hit_tokens", 0)),
            "loaded_bytes_by_group": by_group,
            "loaded_bytes_per_hit": sum(by_group.values()) // count,
            "load_ms_per_hit": round(
                counters.get("vllm:kvstore_load_seconds_sum", 0) * 1e3 / loads, 2
            )
            if loads
            else None,
            "unsupported": {
                k: v for k, v in counters.items() if k.startswith("vllm:kvstore_unsupported")
            },
            "outputs_equal_across_passes": [r["tokens"] for r in kvstore_pass]
            == [r["tokens"] for r in local_pass],
        }
    )
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"| shape | way | KV groups | KV tokens | {MAX_LEN // 1024}K requests that fit "
        "| hit loads (bytes) "
        "| load ms | miss TTFT ms | kvstore hit TTFT ms | own prefix-cache hit TTFT ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "start_error" in r:
            lines.append(
                f"| {r['shape']} ({r['family']}) | {r['way']} | - | - | - "
                f"| does not start: `{r['start_error'][:120]}` | | | | |"
            )
            continue
        groups = ", ".join(f"{k} {v:,}" for k, v in sorted(r["loaded_bytes_by_group"].items()))
        lines.append(
            f"| {r['shape']} ({r['family']}) | {r['way']} | {r['groups']} | {r['kv_tokens']:,} "
            f"| {r['concurrency']} | {r['loaded_bytes_per_hit']:,} ({groups or 'none'}) "
            f"| {r['load_ms_per_hit']} | {r['miss_ttft_ms']} | {r['kvstore_hit_ttft_ms']} "
            f"| {r['local_hit_ttft_ms']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=1536, help="shared prefix tokens")
    parser.add_argument("--count", type=int, default=4, help="prompts per engine")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", default="benchmarks/results/hybrid_cpu", help="OUT.json, .md")
    parser.add_argument("--workdir", help="keep models, logs and stores here (default: temp)")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-hybrid-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    load_before = os.getloadavg()
    rows = []
    for shape in args.shapes:
        for way in WAYS:
            print(f"{shape} ({SHAPES[shape]}), {way}")
            rows.append(_run(workdir, shape, SHAPES[shape], way, args.prefix, args.count))
    load_after = os.getloadavg()
    table = _table(rows)
    note = (
        f"\n\nPrefix {args.prefix} tokens (+{SUFFIX}), {args.count} prompts, chunks of "
        f"{CHUNKS['sliding']} (sliding) and {CHUNKS['recurrent']} tokens (recurrent), "
        f"vLLM CPU 0.32.0, {os.cpu_count()} cores; load average (1/5/15 min) before "
        f"{'/'.join(f'{x:.1f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.1f}' for x in load_after)}.\n"
    )
    print(table + note)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"rows": rows, "load_before": load_before, "load_after": load_after, **vars(args)}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(table + note)


if __name__ == "__main__":
    main()
