"""Write-through to Redis Cluster: what waiting for a replica's acknowledgement (``WAIT 1``) costs.

Exact command (repository root; about a minute on 2 shared cores; needs ``redis-server`` and
``redis-cli``)::

    .venv/bin/python benchmarks/bench_cluster_writes.py \
        --out benchmarks/results/cluster_writes.md

A throw-away Redis Cluster of 3 masters with a replica each (``tests/tiers/redis_cluster.py``).
Each round writes ``--blocks`` fresh signed blocks of ``--block-kib`` KiB through the redis tier's
link (one pipeline per master, concurrently, as a write-through batch does), interleaved
round-robin with the order rotating every round:

* **acknowledged**: every master's pipeline ends with ``WAIT 1`` (what the tier does): a write
  counts only once a replica has it;
* **master only**: the same pipelines without ``WAIT`` (before issue 28).

Between rounds the cluster is flushed (untimed). Reported: seconds per batch (median / p90 /
max), payload GB/s at the median, and the ratio acknowledged / master only (time).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import check, machine_info, markdown_table, run_interleaved, summarize
from harness.redis_cluster import RedisCluster

from kvstore.tiers.redis_link import RedisLink


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks per batch")
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    value = os.urandom(args.block_kib * 1024)
    batch_bytes = args.blocks * len(value)
    with tempfile.TemporaryDirectory() as tmp, RedisCluster(Path(tmp) / "c") as cluster:
        loop = asyncio.new_event_loop()
        link = RedisLink(cluster.url.replace("redis://", "redis+cluster://"), 30.0, (0.1, 1.0))
        counter = iter(range(10**9))

        def case(replicated: bool) -> float:
            names = [f"bench:{next(counter)}".encode() for _ in range(args.blocks)]
            start = time.perf_counter()
            replies = loop.run_until_complete(
                link.pipelined(
                    "write",
                    names,
                    lambda pipe, name: pipe.set(name, value),
                    replicated=replicated,
                )
            )
            seconds = time.perf_counter() - start
            check(all(reply is True for reply in replies), f"writes failed: {replies[:3]}")
            for node in cluster.nodes:
                if node.alive:
                    with node.client(5.0) as client:
                        if client.info("replication").get("role") == "master":
                            client.flushall()
            return seconds

        samples = run_interleaved(
            {"acknowledged": lambda: case(True), "master only": lambda: case(False)}, args.reps
        )
        loop.run_until_complete(link.close())
        loop.close()
    rows = []
    for name, values in samples.items():
        s = summarize(values)
        rows.append(
            [name, f"{s.median * 1e3:.1f}", f"{s.p90 * 1e3:.1f}", f"{s.max * 1e3:.1f}",
             f"{batch_bytes / s.median / 1e9:.2f}"]
        )  # fmt: skip
    ratio = summarize(samples["acknowledged"]).median / summarize(samples["master only"]).median
    table = markdown_table(["case", "median ms", "p90 ms", "max ms", "GB/s at median"], rows)
    report = (
        f"{args.blocks} x {args.block_kib} KiB per batch, {args.reps} rounds, load average "
        f"{os.getloadavg()[0]:.1f}\n\n{table}\n\nacknowledged / master only (median time): "
        f"{ratio:.2f}x\n\n"
    ) + "".join(f"- {key}: {val}\n" for key, val in machine_info(["redis"]).items())
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
