"""Validate the simulator: one scaled workload on three real nodes and on the simulator.

The real side: one ``redis-server`` and three ``kvstore serve`` processes with the cluster index
on it (``cluster.shared_data = peers``: a node reads blocks it lacks straight from the node
holding them), dram + nvme with small capacities so that eviction matters. A driver plays the
engines, one request at a time: it routes the request as the simulator does (kvstore's
:class:`~kvstore.router.scoring.Scorer`, fed by the real :class:`~kvstore.cluster.ClusterIndex`;
or round robin), gets the request's chunks from that node (its tiers, then its peers), counts the
leading run found (checking every byte), and puts the chunks it missed. The simulated side runs
the same requests in the same order (``sequential``). Hit rates side by side; the target is
within 0.10 absolute. Also measured: the Redis memory the real index took against the
simulator's estimate for the same entries.

    .venv/bin/python -m benchmarks.sim.validate --out benchmarks/results/sim_validate

Parameters: the ``[validate]`` table of ``benchmarks/sim/workloads.toml`` (flags override).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis

from benchmarks._common import kvstore_server, redis_server
from kvstore import KVStoreClient, Namespace
from kvstore.cluster import ClusterIndex, Layout, connect
from kvstore.router.scoring import Provisional, Replica, Scorer

from .index import SimIndex
from .node import key_of
from .run import fleet_config
from .simulator import simulate
from .workloads import CONFIG_PATH, Workload, build, load_config

__all__ = ["main", "run_real", "run_sim", "scaled_workload"]

NODES = 3
NAMESPACE = Namespace(model="sim-validate", num_layers=2, num_kv_heads=2, head_size=64)
PREFIX = "kvstore:cluster:v1:"
MIB = 1024**2


def scaled_workload(config: dict[str, Any], params: dict[str, Any]) -> Workload:
    """The ``[validate]`` window of its workload (one copy, as three nodes replay it)."""
    full = build(config["workloads"][params["workload"]], NODES, int(params.get("seed", 1)))
    skip, count = int(params["skip"]), int(params["requests"])
    return replace(full, requests=full.requests[skip : skip + count])


def _payload(chunk: int, size: int) -> bytes:
    return chunk.to_bytes(8, "big") * (size // 8)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (what a spawned server inherits) for a while."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _node_env(url: str, node: str, params: dict[str, Any]) -> dict[str, str]:
    return {
        "KVSTORE_CLUSTER_ENABLED": "1",
        "KVSTORE_CLUSTER_URL": url,
        "KVSTORE_REDIS_URL": url,
        "KVSTORE_CLUSTER_NODE_ID": node,
        "KVSTORE_CLUSTER_LEASE_TTL_S": "30",
        "KVSTORE_CLUSTER_PUBLISH_INTERVAL_S": "0.01",
        "KVSTORE_CLUSTER_SHARED_DATA": "peers",
        "KVSTORE_INTEGRITY_SECRETS": "sim-validate-secret",
        "KVSTORE_DRAM_PAGE_SIZE": str(int(params["dram_page_size"])),
    }


def run_real(workload: Workload, routing: str, params: dict[str, Any]) -> dict[str, Any]:
    """Play ``workload`` on three real nodes; hit rate, wrong bytes and the index's memory."""
    size = int(params["block_bytes"])
    names = [f"node-{i:04d}" for i in range(NODES)]
    with contextlib.ExitStack() as stack:
        redis_proc = stack.enter_context(redis_server())
        url = f"redis://{redis_proc.target}"
        targets = []
        for name in names:
            with _environment(_node_env(url, name, params)):
                server = stack.enter_context(
                    kvstore_server(
                        dram_capacity=f"{int(params['dram_mib'])}MiB",
                        nvme_capacity=f"{int(params['nvme_mib'])}MiB",
                    )
                )
            targets.append(server.target)
        plain = redis.Redis.from_url(url)
        stack.callback(plain.close)
        base_memory = int(plain.info("memory")["used_memory"])
        clients = {
            name: stack.enter_context(
                KVStoreClient(target, namespace=NAMESPACE, data_plane="grpc", timeout=10.0)
            )
            for name, target in zip(names, targets, strict=True)
        }
        result = _drive(workload, routing, params, url, clients, size)
        time.sleep(0.2)  # the last publishes
        used = int(plain.info("memory")["used_memory"]) - base_memory
        hashes = fields = 0
        for key in plain.scan_iter(match=PREFIX.encode() + b"k:*", count=1000):
            hashes += 1
            fields += int(plain.hlen(key))
        estimate = SimIndex(len(names[0])).bytes_for(hashes, fields)
        result.update(
            index_hashes=hashes,
            index_fields=fields,
            index_bytes_measured=used,
            index_bytes_estimated=estimate,
        )
        return result


def _drive(
    workload: Workload,
    routing: str,
    params: dict[str, Any],
    url: str,
    clients: dict[str, KVStoreClient],
    size: int,
) -> dict[str, Any]:
    names = list(clients)
    replicas = [Replica(url=name, node=name) for name in names]
    fleet = fleet_config(load_config(Path(params["config"])), NODES)
    arrival = [0.0]
    # The provisional entries age by the trace's clock, as in the simulator.
    provisional = Provisional(fleet.provisional_ttl_s, clock=lambda: arrival[0])
    scorer = Scorer(
        replicas, workload.chunk_tokens, fleet.hit_weight, fleet.request_cost_tokens, provisional
    )
    loop = asyncio.new_event_loop()
    index_client = connect(url, 5.0)
    index = ClusterIndex(index_client, Layout(PREFIX))
    chunks = hits = wrong = turn = 0
    settle = float(params["settle_s"])
    try:
        for request in workload.requests:
            arrival[0] = request.arrival_s
            keys = [key_of(chunk) for chunk in request.chunks]
            if routing == "kv":
                holdings = loop.run_until_complete(index.holders(keys))
                decision = scorer.choose(keys, request.input_tokens, holdings)
                replica, predicted = decision.replica, decision.predicted_hit_tokens
            else:
                turn += 1
                replica, predicted = replicas[turn % NODES], 0
            client = clients[replica.url]
            got = client.get(keys)
            leading = next((i for i, value in enumerate(got) if value is None), len(keys))
            for chunk, value in zip(request.chunks, got, strict=True):
                if value is not None and bytes(value) != _payload(chunk, size):
                    wrong += 1
            queued = max(request.input_tokens - predicted, 0)
            scorer.dispatched(replica, keys, queued)
            missing = request.chunks[leading:]
            if missing:
                client.put(keys[leading:], [_payload(chunk, size) for chunk in missing])
            scorer.prefilled(replica, queued)
            scorer.finished(replica)
            chunks += len(keys)
            hits += leading
            time.sleep(settle)
    finally:
        loop.run_until_complete(index_client.aclose())
        loop.close()
    return {"hit_rate": hits / max(chunks, 1), "chunks": chunks, "wrong_blocks": wrong}


def run_sim(workload: Workload, routing: str, params: dict[str, Any]) -> dict[str, Any]:
    """The same requests on the simulator's three nodes, one at a time."""
    config = load_config(Path(params["config"]))
    sim = fleet_config(
        config,
        NODES,
        dram_bytes=int(params["dram_mib"]) * MIB,
        nvme_bytes=int(params["nvme_mib"]) * MIB,
        block_bytes=int(params["block_bytes"]),
        dram_page_size=int(params["dram_page_size"]),
        routing=routing,
        shared_data="peers",
        sequential=True,
    )
    return simulate(workload, sim)


def validate(params: dict[str, Any]) -> list[dict[str, Any]]:
    """Both sides per routing of ``params``; one row each."""
    config = load_config(Path(params["config"]))
    workload = scaled_workload(config, params)
    rows = []
    for routing in params["routing"]:
        print(f"  {routing}: real nodes ...", file=sys.stderr)
        started = time.perf_counter()
        real = run_real(workload, routing, params)
        real_s = time.perf_counter() - started
        sim = run_sim(workload, routing, params)
        rows.append(
            {
                "routing": routing,
                "requests": len(workload.requests),
                "chunks": real["chunks"],
                "real_hit_rate": real["hit_rate"],
                "sim_hit_rate": sim["hit_rate"],
                "difference": sim["hit_rate"] - real["hit_rate"],
                "within_0_10": abs(sim["hit_rate"] - real["hit_rate"]) <= 0.10,
                "wrong_blocks": real["wrong_blocks"],
                "sim_evicted": sim["evicted"],
                "index_hashes": real["index_hashes"],
                "index_fields": real["index_fields"],
                "index_bytes_measured": real["index_bytes_measured"],
                "index_bytes_estimated": real["index_bytes_estimated"],
                "real_s": real_s,
                "sim_s": sim["wall_s"],
            }
        )
        print(
            f"  {routing}: real {real['hit_rate']:.3f} sim {sim['hit_rate']:.3f}", file=sys.stderr
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| routing | requests | chunks | real hit rate | sim hit rate | sim - real | wrong blocks "
        "| index MiB measured | index MiB estimated | real s | sim s |",
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['routing']} | {r['requests']} | {r['chunks']:,} | {r['real_hit_rate']:.3f} "
            f"| {r['sim_hit_rate']:.3f} | {r['difference']:+.3f} | {r['wrong_blocks']} "
            f"| {r['index_bytes_measured'] / MIB:.2f} | {r['index_bytes_estimated'] / MIB:.2f} "
            f"| {r['real_s']:.1f} | {r['sim_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run both sides; exit 1 if a hit rate differs by more than 0.10 or a byte was wrong."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim.validate", description=__doc__)
    parser.add_argument("--config", type=Path, default=CONFIG_PATH)
    parser.add_argument("--requests", type=int, help="override [validate] requests")
    parser.add_argument("--skip", type=int, help="override [validate] skip")
    parser.add_argument("--routing", help="comma-separated; override [validate] routing")
    parser.add_argument("--out", help="path without suffix: writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    params = dict(load_config(args.config)["validate"], config=str(args.config))
    if args.requests is not None:
        params["requests"] = args.requests
    if args.skip is not None:
        params["skip"] = args.skip
    if args.routing:
        params["routing"] = args.routing.split(",")
    rows = validate(params)
    table = markdown(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        out.with_suffix(".md").write_text(table)
    ok = all(r["within_0_10"] and r["wrong_blocks"] == 0 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
