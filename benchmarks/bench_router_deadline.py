"""How often a loaded router routes blind: the index query's deadline fixed at 0.1 s (the old
default) against the adaptive one (2 x p99 of recent answers, floor 0.1 s, cap 1 s).

Exact command (repository root; under a minute on 2 shared cores)::

    .venv/bin/python benchmarks/bench_router_deadline.py \
        --out benchmarks/results/router_deadline.md

What runs: one :class:`kvstore.router.Router` (ScriptIndex on a real redis-server, as
``kvstore router`` on a single Redis) decides ``--requests`` times with ``--concurrency``
decisions in flight at once (closed loop, one event loop: as a router process under a burst),
after 20 one at a time (an idle router: connected, its deadline at the floor), each for a
``--tokens``-token prompt (8K: 32 chunks) against a synthetic index of ``--nodes`` nodes
(16) each holding a random leading run of it (``bench_router.py``'s: ~1 ms a decision when
idle). The index is not down: every query would be answered, only later than a fixed deadline
allows when many are queued. Reported per deadline: the decisions routed blind (reasons
``index_timeout`` and ``index_unavailable``: past the deadline, or skipped for
``router.index_retry_s`` once nothing answered for longer than the cap), the decision latency
p50/p99 (the index wait included) and the deadline at the end. "Fixed" is today's code with
floor = cap = 0.1 s (the old code skipped the index after *every* timeout: no fewer blind
decisions). The two configurations alternate for ``--rounds`` rounds in the same redis-server,
each on its own router (nothing learnt carries over).
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
from bench_router import CHUNK, NAMESPACE, PREFIX, populate

from kvstore.cluster import Layout, connect
from kvstore.router import Replica, Router, RouterKeys
from kvstore.router.lookup import ScriptIndex

#: name -> (router.index_timeout_s, router.index_timeout_max_s); floor = cap is a fixed deadline.
CONFIGS = {"fixed 0.1 s (the old default)": (0.1, 0.1), "adaptive 0.1-1 s": (0.1, 1.0)}


async def run(
    url: str,
    tokens: list[int],
    nodes: int,
    floor_s: float,
    cap_s: float,
    requests: int,
    concurrency: int,
) -> tuple[list[float], dict[str, int], float]:
    """Decision latencies, the count of each reason and the final deadline of one round."""
    client = connect(url, cap_s)
    keys = RouterKeys(NAMESPACE, CHUNK, "")
    replicas = [Replica(f"http://replica-{n}:8000", f"node-{n}") for n in range(nodes)]
    router = Router(
        replicas,
        keys,
        ScriptIndex(client, Layout(PREFIX)),
        index_timeout_s=floor_s,
        index_timeout_max_s=cap_s,
    )
    for _ in range(20):  # an idle router first: connected, script loaded, deadline at its floor
        await router.decide(tokens)
    latencies: list[float] = []
    reasons: dict[str, int] = {}
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            started = time.perf_counter()
            decision, _ = await router.decide(tokens)
            latencies.append(time.perf_counter() - started)
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    deadline = router.index.deadline.seconds
    router.close()
    await client.aclose()
    return latencies, reasons, deadline


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="decisions per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(args.tokens)]
    results: dict[str, tuple[list[float], dict[str, int], list[float]]] = {
        name: ([], {}, []) for name in CONFIGS
    }
    with redis_server() as server:
        url = f"redis://{server.target}/0"

        async def fill() -> None:
            client = connect(url, 5.0)
            keys = RouterKeys(NAMESPACE, CHUNK, "").keys(tokens)
            await populate(client, keys, args.nodes, seed=7)
            await client.aclose()

        asyncio.run(fill())
        for _ in range(args.rounds):
            for name, (floor_s, cap_s) in CONFIGS.items():
                lat, reasons, deadline = asyncio.run(
                    run(url, tokens, args.nodes, floor_s, cap_s, args.requests, args.concurrency)
                )
                results[name][0].extend(lat)
                for reason, count in reasons.items():
                    results[name][1][reason] = results[name][1].get(reason, 0) + count
                results[name][2].append(deadline)
    rows = []
    for name, (lat, reasons, deadlines) in results.items():
        blind = reasons.get("index_timeout", 0) + reasons.get("index_unavailable", 0)
        rows.append(
            [
                name,
                len(lat),
                blind,
                f"{100 * blind / len(lat):.1f}%",
                f"{percentile(lat, 50) * 1000:.1f}",
                f"{percentile(lat, 99) * 1000:.1f}",
                " / ".join(f"{d * 1000:.0f}" for d in deadlines),
            ]
        )
    lines = [
        f"# Router index deadline under a burst ({args.rounds} rounds x {args.requests} "
        f"decisions, {args.concurrency} in flight, {args.tokens} tokens, {args.nodes} nodes)",
        "",
        markdown_table(
            [
                "deadline",
                "decisions",
                "routed blind",
                "blind %",
                "decide p50 ms",
                "decide p99 ms",
                "deadline at end ms (per round)",
            ],
            rows,
        ),
        "",
        *(f"- {k}: {v}" for k, v in machine_info(["redis"]).items()),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
