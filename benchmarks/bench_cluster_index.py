"""Cluster index publish throughput: block events through the publisher vs raw Redis pipelines.

Exact command (repository root; well under a minute on 2 shared cores)::

    .venv/bin/python benchmarks/bench_cluster_index.py \
        --out benchmarks/results/cluster_index.md

One throw-away ``redis-server`` (no persistence). Each round makes ``--events`` fresh 32-byte
chunk keys and times, interleaved round-robin with the order rotating every round:

* **publisher**: ``Publisher.on_change(key, "dram")`` for every key (what the store's listener
  does inside a put) and then ``Publisher.flush()`` (what the background task does every
  ``cluster.publish_interval_s``): coalescing, diffing against what was published, and pipelines
  of ``PIPELINE_COMMANDS`` ``HSET``;
* **raw HSET**: the same keys' ``HSET entry NODE EPOCH:TIER`` in pipelines of the same size,
  built by hand (the floor of this layout);
* **raw SET**: ``SET entry EPOCH:TIER`` of the same keys in pipelines of the same size (the
  cheapest write of the same keys Redis has).

Between cases the database is flushed (untimed), so every case writes into an empty Redis.
Events per second are at the median (and p90) round time; the ratio is the publisher's median
rate over the faster raw case's. Done-when of issue 15: ratio >= 0.5.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, markdown_table, redis_server, run_interleaved, summarize

from kvstore.cluster import Layout, NodeInfo, connect
from kvstore.cluster.layout import Client
from kvstore.node import Membership, Publisher
from kvstore.node.publisher import PIPELINE_COMMANDS

NODE = "bench-node"
VALUE = b"1:dram"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000, help="block events per round")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with redis_server() as server:
        url = f"redis://{server.target}/0"
        loop = asyncio.new_event_loop()
        client = connect(url, 5.0)
        layout = Layout("kvstore:cluster:v1:")
        membership = Membership(
            client, layout, lambda epoch: NodeInfo(NODE, epoch, "bench"), 10.0, lambda: None
        )
        membership.epoch = 1
        publisher = Publisher(client, layout, None, membership, 0.1)
        loop.run_until_complete(publisher.flush())  # the first flush is a (here empty) resync
        samples = run_interleaved(
            cases(loop, client, layout, publisher, args.events), reps=args.reps
        )
        loop.run_until_complete(client.aclose())
        loop.close()
    report(samples, args.events, args.reps, args.out)


def cases(
    loop: asyncio.AbstractEventLoop,
    client: Client,
    layout: Layout,
    publisher: Publisher,
    events: int,
) -> dict[str, Callable[[], float]]:
    """The three timed cases; each returns the seconds of its own round."""

    def fresh() -> list[bytes]:
        return [os.urandom(32) for _ in range(events)]

    def reset() -> None:
        loop.run_until_complete(client.flushdb())

    def through_publisher() -> float:
        keys = fresh()
        publisher.published.clear()
        sent = publisher.sent

        async def run() -> float:
            start = time.perf_counter()
            for key in keys:
                publisher.on_change(key, "dram")
            assert await publisher.flush()
            return time.perf_counter() - start

        seconds = loop.run_until_complete(run())
        assert publisher.sent - sent == events
        reset()
        return seconds

    def raw(command: str) -> Callable[[], float]:
        def case() -> float:
            entries = [layout.entry(key) for key in fresh()]

            async def run() -> float:
                start = time.perf_counter()
                for first in range(0, events, PIPELINE_COMMANDS):
                    pipe = client.pipeline(transaction=False)
                    for entry in entries[first : first + PIPELINE_COMMANDS]:
                        if command == "hset":
                            pipe.hset(entry, NODE, VALUE)
                        else:
                            pipe.set(entry, VALUE)
                    await pipe.execute()
                return time.perf_counter() - start

            seconds = loop.run_until_complete(run())
            reset()
            return seconds

        return case

    return {"publisher": through_publisher, "raw HSET": raw("hset"), "raw SET": raw("set")}


def report(samples: dict[str, list[float]], events: int, reps: int, out: Path | None) -> None:
    """Print (and with ``out`` write) the table."""
    rates = {name: events / summarize(values).median for name, values in samples.items()}
    raw_best = max(rates["raw HSET"], rates["raw SET"])
    rows = []
    for name, values in samples.items():
        summary = summarize(values)
        rows.append(
            [
                name,
                f"{events / summary.median:,.0f}",
                f"{events / summary.p90:,.0f}",
                f"{summary.median * 1000:.1f}",
                f"{rates[name] / raw_best:.2f}",
            ]
        )
    lines = [
        f"# Cluster index publish throughput ({events:,} block events per round, {reps} rounds)",
        "",
        markdown_table(
            ["case", "events/s (median)", "events/s (p90 round)", "round ms", "vs best raw"], rows
        ),
        "",
        f"publisher / best raw = {rates['publisher'] / raw_best:.2f} (done when >= 0.5)",
        "",
        *(
            f"- {k}: {v}"
            for k, v in machine_info(["redis"], {"redis-server": ["redis-server", "-v"]}).items()
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        out.write_text(text)


if __name__ == "__main__":
    main()
