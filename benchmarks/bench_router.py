"""Router decision latency: chunk keys + one cluster index query + scoring, for 8K- and
32K-token prompts against a synthetic index of 16 and 256 nodes in a real redis-server.

Exact command (repository root; about a minute on 2 shared cores)::

    .venv/bin/python benchmarks/bench_router.py \
        --out benchmarks/results/router.md

What is timed: :meth:`kvstore.router.Router.decide` on the prompt's token ids, i.e. the rank-0
chunk keys (xxh3-128, 256-token chunks, as the connector), the index query (either
``ClusterIndex.holders``: one pipeline of ``HGETALL`` per chunk plus the leases of the nodes
seen before; or, what the router uses on a single Redis, ``ScriptIndex``:
one ``EVALSHA``), scoring every
replica, and the metrics updates. **Tokenizing is excluded** (the requests carry token ids; a
text prompt adds the tokenizer's time); the keys alone are reported in their own column.

The synthetic index: N nodes with live leases, one replica per node, and every node holding a
random leading run (0 to all chunks) of the prompt, in dram or nvme: the worst case of a hot
prefix spread over the whole fleet, where every chunk's hash has up to N fields. Each case runs
``--warmup`` untimed decisions (the router learns the leases), then ``--decisions`` timed ones;
the cases run in turn, each several times interleaved (``--rounds``), and percentiles are over
all of a case's samples. Done-when of issue 15: p99 <= 2 ms for 8K tokens with 16 nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, markdown_table, percentile, redis_server

from kvstore.cluster import ClusterIndex, Layout, connect
from kvstore.cluster.layout import Client
from kvstore.keys import Namespace
from kvstore.router import Replica, Router, RouterKeys
from kvstore.router.lookup import ScriptIndex

PREFIX = "kvstore:cluster:v1:"
CHUNK = 256
NAMESPACE = Namespace(model="bench/router", num_layers=32, num_kv_heads=8, head_size=128)


async def populate(client: Client, keys: list[bytes], nodes: int, seed: int) -> None:
    """Leases for ``nodes`` nodes (epoch 1) and each node's random leading run of ``keys``."""
    layout = Layout(PREFIX)
    rng = random.Random(seed)
    await client.flushdb()
    pipe = client.pipeline(transaction=False)
    for node in range(nodes):
        name = f"node-{node}"
        pipe.set(layout.lease(name), 1)
        tier = rng.choice(("dram", "nvme"))
        for key in keys[: rng.randint(0, len(keys))]:
            pipe.hset(layout.entry(key), name, f"1:{tier}")
    await pipe.execute()


async def run_case(
    url: str, tokens: list[int], nodes: int, script: bool, warmup: int, decisions: int
) -> tuple[list[float], list[float]]:
    """Decision and key-only latencies (seconds) of one case."""
    client = connect(url, 5.0)
    keys = RouterKeys(NAMESPACE, CHUNK, "")
    await populate(client, keys.keys(tokens), nodes, seed=nodes + len(tokens))
    replicas = [Replica(f"http://replica-{n}:8000", f"node-{n}") for n in range(nodes)]
    layout = Layout(PREFIX)
    index = ScriptIndex(client, layout) if script else ClusterIndex(client, layout)
    # A deadline far above any answer: this times decisions, bench_router_deadline.py the cut-offs.
    router = Router(replicas, keys, index, index_timeout_s=5.0, index_timeout_max_s=5.0)
    for _ in range(warmup):
        await router.decide(tokens)
    decide, key_only = [], []
    for _ in range(decisions):
        start = time.perf_counter()
        decision, _ = await router.decide(tokens)
        decide.append(time.perf_counter() - start)
        assert decision.reason == "prefix", decision.reason
        start = time.perf_counter()
        keys.keys(tokens)
        key_only.append(time.perf_counter() - start)
    # Undo nothing: decide() only reads the index; provisional entries stay in the router.
    await client.aclose()
    return decide, key_only


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--decisions", type=int, default=200, help="timed decisions per round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cases = [
        (length, nodes, script)
        for length in (8192, 32768)
        for nodes in (16, 256)
        for script in (True, False)
    ]
    samples: dict[tuple[int, int, bool], tuple[list[float], list[float]]] = {
        case: ([], []) for case in cases
    }
    rng = random.Random(0)
    prompts = {length: [rng.randrange(150_000) for _ in range(length)] for length in (8192, 32768)}
    with redis_server() as server:
        url = f"redis://{server.target}/0"
        for _ in range(args.rounds):
            for length, nodes, script in cases:
                decide, key_only = asyncio.run(
                    run_case(url, prompts[length], nodes, script, args.warmup, args.decisions)
                )
                samples[(length, nodes, script)][0].extend(decide)
                samples[(length, nodes, script)][1].extend(key_only)
    report(samples, args)


def report(
    samples: dict[tuple[int, int, bool], tuple[list[float], list[float]]],
    args: argparse.Namespace,
) -> None:
    """Print (and with ``--out`` write) the table."""
    rows = []
    for (length, nodes, script), (decide, key_only) in samples.items():
        rows.append(
            [
                f"{length // 1024}K",
                length // CHUNK,
                nodes,
                "script (router)" if script else "pipeline (ClusterIndex)",
                f"{percentile(decide, 50) * 1000:.3f}",
                f"{percentile(decide, 99) * 1000:.3f}",
                f"{percentile(key_only, 50) * 1000:.3f}",
            ]
        )
    done = percentile(samples[(8192, 16, True)][0], 99) * 1000
    lines = [
        f"# Router decision latency ({args.rounds} rounds x {args.decisions} decisions per case)",
        "",
        markdown_table(
            [
                "prompt",
                "chunks",
                "nodes",
                "index query",
                "decide p50 ms",
                "decide p99 ms",
                "keys alone p50 ms",
            ],
            rows,
        ),
        "",
        f"8K tokens, 16 nodes: p99 = {done:.3f} ms (done when <= 2 ms)",
        "",
        *(
            f"- {k}: {v}"
            for k, v in machine_info(
                ["redis", "xxhash"], {"redis-server": ["redis-server", "-v"]}
            ).items()
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
