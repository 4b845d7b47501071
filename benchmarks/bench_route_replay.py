"""Trace replay through ``kvstore router``: KV-aware routing vs round-robin vs least-loaded.

Exact command (repository root; vLLM's CPU build in ``.venv-vllm``; always under the vLLM lock)::

    PYTHONPATH=$PWD flock /tmp/vllm.lock .venv-vllm/bin/python benchmarks/bench_route_replay.py \
        --time-scale 15 --out benchmarks/results/route_replay

About three and a half minutes on two cores: the fleet's start-up, then about 70 s per policy.

The fleet is ``tests/harness/vllm_fleet.py``'s: two vLLM CPU OpenAI API servers (the suite's tiny
random Llama, one core each), each with the kvstore connector on its own ``kvstore serve`` node
(cluster index on, one redis-server), and one ``kvstore router`` per policy in front of both.

The workload is ``../shared/traces/mooncake_synthetic_trace.jsonl`` (``--trace``), scaled down:

* **which requests:** a seeded sample (``--group-fraction``) of the trace's prefix groups
  (requests whose first block id is the same: a conversation or a shared system prompt), all of
  each sampled group's requests, in trace order, so the reuse structure is the trace's own;
* **length:** each 512-token block id becomes ``--block-tokens`` token ids, the same ids for the
  same block id (a seeded generator per id); prompts are cut at ``--max-blocks`` blocks and at
  ``input_length`` scaled the same way; outputs are ``output_length / --output-divisor``, at
  least 1 and at most ``--max-output``;
* **time:** arrival times are the trace's divided by ``--time-scale``; each request is sent at
  its time whatever the others are doing (open loop), streamed.

Each policy replays the same requests with its own ``cache_salt`` (the engines' prefix caches
and the kvstore chunk keys both include it), so no policy reuses another's work; the policies run
one after the other in the order of ``--policies``. Reported per policy: prefill tokens computed
(prompt tokens less ``usage.prompt_tokens_details.cached_tokens``: the engine's own prefix cache
and kvstore loads), the hit rate (cached / prompt tokens), time to first streamed chunk p50/p90,
and the ratios to round-robin; plus the router's fallbacks.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' harness
from _common import machine_info, markdown_table, percentile  # noqa: E402
from harness.vllm_fleet import Fleet, Reply, RouterProcess, build_model  # noqa: E402

TRACE_BLOCK = 512  # tokens per hash id in the trace
VOCAB = 1024  # the tiny model's


@dataclass
class Item:
    """One request of the scaled replay."""

    at_s: float
    prompt: list[int]
    max_tokens: int


def block_tokens(hash_id: int, count: int) -> list[int]:
    """The token ids of one trace block: the same ids for the same id, every run."""
    rng = random.Random(hash_id * 1_000_003 + 17)
    return [rng.randrange(3, VOCAB) for _ in range(count)]


def load_items(args: argparse.Namespace) -> list[Item]:
    """The scaled replay (see the module docstring)."""
    rows = [json.loads(line) for line in Path(args.trace).read_text().splitlines() if line]
    rows = [r for r in rows if r["hash_ids"]]
    groups = sorted({r["hash_ids"][0] for r in rows})
    rng = random.Random(args.seed)
    picked = {g for g in groups if rng.random() < args.group_fraction}
    rows = [r for r in rows if r["hash_ids"][0] in picked]
    start = rows[0]["timestamp"]
    items = []
    for row in rows:
        ids = row["hash_ids"][: args.max_blocks]
        prompt = [t for h in ids for t in block_tokens(h, args.block_tokens)]
        scaled = max(1, row["input_length"] * args.block_tokens // TRACE_BLOCK)
        prompt = prompt[:scaled]
        out = min(max(1, row["output_length"] // args.output_divisor), args.max_output)
        items.append(Item((row["timestamp"] - start) / 1000 / args.time_scale, prompt, out))
    return items


def replay(router: RouterProcess, model: str, items: list[Item], salt: str) -> list[Reply]:
    """Send every item at its time (threads: open loop); the replies in item order."""
    replies: list[Reply | None] = [None] * len(items)

    def send(index: int) -> None:
        item = items[index]
        try:
            replies[index] = router.complete(model, item.prompt, item.max_tokens, cache_salt=salt)
        except OSError as exc:  # counted as failed, not fatal
            print(f"request {index}: {exc!r}", flush=True)
            replies[index] = Reply(0, "", {}, 0.0, 0.0)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=64) as pool:
        for index, item in enumerate(items):
            delay = started + item.at_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(send, index)
    done = [r for r in replies if r is not None]
    if len(done) != len(items):
        raise RuntimeError(f"{len(items) - len(done)} requests got no reply")
    return done


def summarize(policy: str, replies: list[Reply], router: RouterProcess) -> dict[str, Any]:
    """The figures of one policy."""
    failed = [r for r in replies if r.status != 200 or not r.body]
    ok = [r for r in replies if r.status == 200 and r.body]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    fallbacks = sum(
        router.metric("kvstore_router_fallbacks_total", f'reason="{reason}"')
        for reason in ("index_timeout", "index_error", "index_down", "no_index", "no_tokens")
    )
    return {
        "policy": policy,
        "requests": len(replies),
        "failed": len(failed),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "per_replica": {
            url: sum(1 for r in ok if r.replica == url) for url in sorted({r.replica for r in ok})
        },
        "router_fallbacks": fallbacks,
    }


def report(args: argparse.Namespace, items: list[Item], results: list[dict[str, Any]]) -> str:
    """The Markdown table, with ratios to round-robin."""
    base = next((r for r in results if r["policy"] == "round_robin"), results[0])
    rows = []
    for r in results:
        rows.append(
            [
                r["policy"],
                r["requests"],
                r["failed"],
                r["prompt_tokens"],
                r["prefill_tokens"],
                f"{r['prefill_tokens'] / max(base['prefill_tokens'], 1):.2f}",
                f"{100 * r['hit_rate']:.1f}%",
                f"{1000 * r['ttft_p50_s']:.0f}",
                f"{r['ttft_p50_s'] / base['ttft_p50_s']:.2f}",
                f"{1000 * r['ttft_p90_s']:.0f}",
                f"{r['ttft_p90_s'] / base['ttft_p90_s']:.2f}",
                int(r["router_fallbacks"]),
            ]
        )
    headers = [
        "policy",
        "requests",
        "failed",
        "prompt tok",
        "prefill tok",
        "vs rr",
        "hit rate",
        "TTFT p50 ms",
        "vs rr",
        "TTFT p90 ms",
        "vs rr",
        "fallbacks",
    ]
    prompts = [len(i.prompt) for i in items]
    head = (
        f"{len(items)} requests, prompts {min(prompts)}-{max(prompts)} tokens "
        f"(mean {sum(prompts) / len(prompts):.0f}), over {items[-1].at_s:.0f} s; "
        f"group fraction {args.group_fraction}, {args.block_tokens} tokens per block, "
        f"max {args.max_blocks} blocks, time / {args.time_scale}, chunk {args.block_tokens}\n\n"
    )
    return head + markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trace", default=str(ROOT.parent / "shared/traces/mooncake_synthetic_trace.jsonl")
    )
    parser.add_argument("--group-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--max-blocks", type=int, default=16)
    parser.add_argument("--output-divisor", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=15.0)
    parser.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    parser.add_argument("--policies", default="kv,round_robin,least_loaded")
    parser.add_argument("--workdir", default="")
    parser.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = parser.parse_args()

    items = load_items(args)
    if args.limit:
        items = items[: args.limit]
    print(f"{len(items)} requests over {items[-1].at_s:.0f} s", flush=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="route-replay-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_model(workdir)
    max_len = args.max_blocks * args.block_tokens + args.max_output + 16
    fleet = Fleet(workdir, model, max_model_len=max_len, chunk=args.block_tokens)
    results = []
    try:
        # One warm-up request per replica (first-request costs out of the figures).
        warm = fleet.router("round_robin", env={"KVSTORE_ROUTER_INDEX_TIMEOUT_S": "1"})
        for n in range(2):
            warm.complete(str(model), block_tokens(-1 - n, args.block_tokens), 1)
        for policy in args.policies.split(","):
            router = fleet.router(policy, env={"KVSTORE_ROUTER_INDEX_TIMEOUT_S": "1"})
            started = time.monotonic()
            replies = replay(router, str(model), items, salt=f"replay-{policy}")
            result = summarize(policy, replies, router)
            result["wall_s"] = time.monotonic() - started
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        fleet.close()
    table = report(args, items, results)
    print(table)
    if args.out:
        out = Path(args.out)
        payload = {"args": vars(args), "machine": machine_info(), "results": results}
        out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
        out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
