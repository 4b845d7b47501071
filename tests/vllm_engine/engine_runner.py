"""Run one vLLM engine in this process over prompts from a JSON file; write its results as JSON.

Tests and benchmarks start this script as a subprocess so that every engine is its own process,
as separate replicas would be::

    python tests/vllm_engine/engine_runner.py --model DIR --prompts IN.json --out OUT.json \\
        [--connector none|kvstore|example] [--target HOST:PORT] [--storage-path DIR] \\
        [--chunk-size N] [--max-tokens N] [--sequential] [--kv-transfer-params PARAMS.json]
        [--load-policy cost|always|never] [--dtype D] [--no-prefix-caching]
        [--hybrid-manager auto|on|off] [--stats] [--passes N]

``IN.json`` is a list of token-id lists. ``OUT.json`` gets ``{"startup_s": ..., "results":
[{"tokens": [...], "num_cached_tokens": N, "latency_s": S}, ...]}`` in prompt order. Sampling is
greedy with ``ignore_eos``, so outputs are deterministic and always ``--max-tokens`` long.
``--chunk-size 0`` leaves the chunk size to the store (its node's ``keys.chunk_size``).
``--stats`` adds ``"kvstore": {counter: value}``, the connector's ``vllm:kvstore_*`` counters
(a histogram as its ``_sum`` and ``_count``). ``--passes N`` serves the prompts N times in a row
(the results list every pass, in order): a second pass hits the engine's own prefix cache.
``--sequential`` submits prompts one at a time (``latency_s`` is then that request's own
latency; with ``--max-tokens 1`` it is its time to first token); otherwise they go as one batch.
``PARAMS.json`` is a list with one request's ``kv_transfer_params`` (a dict, or null) per prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Run by path, only this file's folder is on the path: the shared parts are tests/harness/'s.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.vllm_engine_config import configure_logging, kv_transfer_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--connector", choices=["none", "kvstore", "example"], default="none")
    # No default: a test's engine talks to the test's own store, never to a user's on 50051.
    parser.add_argument("--target", default="", help="HOST:PORT (needed with --connector kvstore)")
    parser.add_argument("--storage-path", default="/tmp/kvstore-example-connector")
    parser.add_argument("--chunk-size", type=int, default=256, help="0: the store's")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--sequential", action="store_true")
    parser.add_argument("--passes", type=int, default=1, help="serve the prompts N times")
    parser.add_argument("--load-policy", default="", help="the connector's load_policy")
    parser.add_argument("--warmup", type=int, default=0, help="token length of a warm-up prompt")
    parser.add_argument("--kvstore-log-level", default="INFO")
    parser.add_argument("--kv-transfer-params", default=None, help="JSON file: one per prompt")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (the model's: auto)")
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="turn vLLM's own prefix cache off"
    )
    parser.add_argument(
        "--hybrid-manager",
        choices=["auto", "on", "off"],
        default="auto",
        help="vLLM's hybrid KV cache manager: its own choice, forced on, forced off",
    )
    parser.add_argument(
        "--stats", action="store_true", help="write the connector's vllm:kvstore_* counters"
    )
    args = parser.parse_args()
    if args.connector == "kvstore" and not args.target:
        parser.error("--connector kvstore needs --target HOST:PORT (the store to use)")
    configure_logging(Path(args.out).with_suffix(".logging.json"), args.kvstore_log_level)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts: list[list[int]] = json.loads(Path(args.prompts).read_text())
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        dtype=args.dtype,
        disable_hybrid_kv_cache_manager={"auto": None, "on": False, "off": True}[
            args.hybrid_manager
        ],
        enforce_eager=True,  # skips a ~45 s torch.compile warm-up on this CPU
        seed=0,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_transfer_config=kv_transfer_config(args),
        disable_log_stats=not args.stats,
    )
    startup_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    per_prompt = [params] * len(prompts)
    if args.kv_transfer_params:
        asked = json.loads(Path(args.kv_transfer_params).read_text())
        per_prompt = [
            SamplingParams(
                temperature=0.0,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                extra_args=None if p is None else {"kv_transfer_params": p},
            )
            for p in asked
        ]
    if args.warmup:
        # A prompt sharing nothing with the real ones: the first forward pass of an engine pays
        # one-off costs (allocations, kernel selection) that are no part of a request's latency.
        llm.generate([TokensPrompt(prompt_token_ids=[5] * args.warmup)], params, use_tqdm=False)
    results: list[dict[str, Any]] = []
    for _ in range(args.passes):
        if args.sequential:
            for tokens, each in zip(prompts, per_prompt, strict=True):
                t0 = time.perf_counter()
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], each, use_tqdm=False)
                results.append(_result(out, time.perf_counter() - t0))
        else:
            t0 = time.perf_counter()
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=t) for t in prompts], per_prompt, use_tqdm=False
            )
            elapsed = time.perf_counter() - t0
            results.extend(_result(out, elapsed) for out in outs)
    report: dict[str, Any] = {"startup_s": startup_s, "results": results}
    if args.stats:
        report["kvstore"] = _kvstore_counters(llm)
    Path(args.out).write_text(json.dumps(report))
    # The engine's worker processes must not outlive this one, whatever happens next.
    llm.llm_engine.engine_core.shutdown()


def _kvstore_counters(llm: Any) -> dict[str, float]:
    """The connector's ``vllm:kvstore_*`` counters, by name and label values (``name{a,b}``)."""
    from vllm.v1.metrics.reader import Counter, Histogram

    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:kvstore_"):
            continue
        extra = sorted(v for k, v in metric.labels.items() if k not in ("engine", "model_name"))
        key = metric.name + (f"{{{','.join(extra)}}}" if extra else "")
        if isinstance(metric, Counter):
            counters[key] = counters.get(key, 0) + metric.value
        elif isinstance(metric, Histogram):  # latencies: their sum and count
            counters[key + "_sum"] = counters.get(key + "_sum", 0) + metric.sum
            counters[key + "_count"] = counters.get(key + "_count", 0) + metric.count
    return counters


def _result(out: Any, latency_s: float) -> dict[str, Any]:
    return {
        "tokens": list(out.outputs[0].token_ids),
        "num_cached_tokens": int(out.num_cached_tokens or 0),
        "latency_s": latency_s,
    }


if __name__ == "__main__":
    main()
