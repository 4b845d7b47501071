"""Cross-node gets between network namespaces: through peers (UCX, gRPC) vs through Redis.

Exact command (repository root, as root: it creates network namespaces; a few minutes on 2
shared cores)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_peer.py --rounds 9 --round-mib 32 \
        --json benchmarks/results/peer.json --out benchmarks/results/peer.md
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_peer.py --rounds 9 --round-mib 32 \
        --prefault --json benchmarks/results/peer-prefault.json \
        --out benchmarks/results/peer-prefault.md

Two "hosts" (``tests/harness/netns_hosts.py``: network namespaces on a bridge) and a
``redis-server`` in the root namespace on the bridge's address (the Redis host). Every byte between
nodes crosses the bridge over TCP; nothing is shared memory.

* **Host A**: node ``one`` holds the blocks: ``cluster.shared_data = both``, so each put is
  written through to Redis *and* published in the cluster index, and it serves peers over gRPC
  and from its UCX listener.
* **Host B**: three reading nodes, each cold (it never held the blocks):
  ``redis`` (``shared_data = redis``: reads Redis's copy), ``peer-ucx`` and ``peer-grpc``
  (``shared_data = peers`` with ``cluster.peer_transport = ucx`` / ``grpc``: reads node one).
* **The client** (``benchmarks/_peer_reader.py``) runs in host B too, next to the reading nodes
  (as an inference engine runs next to its node), over the automatic data plane (shared memory
  with its local node). So what is timed is a reading node serving gets of blocks it must fetch
  from another host: the cross-host hop is the only remote one, as in a deployment.

Each round gets ``--round-mib`` of fresh blocks per size and path (each block read exactly once
by each reading node, so every read is cold), in gets of ``--batch-mib``, one get of each path in
turn (an order that rotates each round): on a machine shared with other work, every path then
meets the same background load. After the three, a fourth reference case gets the Redis
reader's blocks again (now local to it: the client and shared-memory hop alone). With
``--prefault`` the readers' arenas are resident from the start (``dram.prefault``): a fresh
node's arena otherwise page-faults (and zeroes) every page on its first write, which costs both
paths alike but is a larger share of the faster one. Reported:
bytes/s per round (median, and the slow tail: the 10th percentile of the per-round rates) and
the ratio of each path's median to Redis's. Every payload's digest is checked. The node-side
counters confirm the path each reader took. Done-when of issue 16: peer get >= 1.5x Redis.

**The wire between the same two hosts** (issue 40), after the reads, with the nodes idle:
``ucx_perftest -t tag_bw -e`` over TCP (UCX's C benchmark in the endpoints' error-handling mode)
and ucxx alone (``_ucxx_alone``: the batch as one tagged message per block from Python, no control
call, no store), both sending from host A to host B as a peer read moves its blocks, the same
block sizes and bytes per batch (``--wire-batches`` batches; 0 skips them). The peer reads'
figures are then read against what UCX, and its Python binding alone, move over that bridge.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The benchmarks' helpers, and the tests' hosts (network namespaces), servers and redis-server.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import harness.serve as servers  # the tests' one launcher of a real `kvstore serve`
from _common import GB, machine_info, markdown_table, percentile
from _ucx_perftest import perftest, perftest_binary
from _ucxx_alone import ucxx_alone
from harness.netns_hosts import Hosts
from harness.redis_server import RedisServer

from kvstore import KVStoreClient
from kvstore.cluster import ClusterIndex, Layout, connect
from kvstore.keys import KEY_BYTES

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024**2
NAMESPACE = {"model": "bench-peer", "num_layers": 2, "num_kv_heads": 2, "head_size": 64}
PREFIX = "kvstore:cluster:v1:"
#: The cross-host paths (``--ucx-lanes`` adds UCX readers with other lane counts).
PATHS = ("redis", "peer-ucx", "peer-grpc")
SECRET = "bench-peer-secret"


def node_env(
    name: str, redis_url: str, shared: str, transport: str = "auto", lanes: int = 0
) -> dict[str, str]:
    env = {"KVSTORE_INTEGRITY_SECRETS": SECRET, "KVSTORE_SERVER_INFLIGHT_BYTES": "1GiB"}
    if lanes:
        env["KVSTORE_UCX_LANES"] = str(lanes)  # the UCX endpoints it opens per peer
    if shared in ("redis", "both"):
        env["KVSTORE_REDIS_URL"] = redis_url
        # At the default 0.5 s (+ bytes / 4 MiB/s) a loaded machine (load 10+) timed a pipelined
        # write out on node one, and a pipelined read out on the Redis reader; either marks
        # Redis down, and the reads meanwhile are misses ("redis/1MiB: block 0 missing" ended
        # two runs at load 13-30). The peer readers wait up to 30 s (CLUSTER_PEER_TIMEOUT_S);
        # the Redis path gets a deadline of the same order, so a slow read is timed, not lost.
        env["KVSTORE_REDIS_OP_TIMEOUT_S"] = "10"
    if shared != "redis":
        env.update(
            {
                "KVSTORE_CLUSTER_ENABLED": "1",
                "KVSTORE_CLUSTER_URL": redis_url,
                "KVSTORE_CLUSTER_NODE_ID": name,
                "KVSTORE_CLUSTER_PUBLISH_INTERVAL_S": "0.05",
                "KVSTORE_CLUSTER_SHARED_DATA": shared,
                "KVSTORE_CLUSTER_PEER_TRANSPORT": transport,
                "KVSTORE_CLUSTER_PEER_TIMEOUT_S": "30",
            }
        )
    return env


def start_node(
    workdir: Path, host: Any, env: dict[str, str], dram: str, ucx: bool
) -> servers.ServerProcess:
    flags = ["--dram-capacity", dram, "--nvme-capacity", "64MiB", "--allow-unauthenticated"]
    if ucx:
        flags += ["--ucx-listen", f"{host.address}:0"]
    # The servers' TMPDIR (their shm socket directories) is the run's own work directory.
    return servers.ServerProcess(workdir, flags, env, host=host, tmpdir=workdir.parent).start()


def counters(node: servers.ServerProcess) -> dict[str, int]:
    with KVStoreClient(node.target, data_plane="grpc", timeout=10.0) as client:
        return dict(client.stats()["counters"])


def holders_of(url: str, keys: list[bytes]) -> set[str]:
    async def ask() -> set[str]:
        client = connect(url, 5.0)
        try:
            held = await ClusterIndex(client, Layout(PREFIX)).holders(keys)
            return {node for node, h in held.items() if all(h.tiers)}
        finally:
            await client.aclose()

    return asyncio.run(ask())


def wait_for(condition: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {within:.0f} s")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes-mib", default="1,4", help="block sizes in MiB, comma-separated")
    parser.add_argument("--round-mib", type=int, default=32, help="MiB per size, path and round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch-mib", type=int, default=8, help="MiB per get call")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--prefault",
        action="store_true",
        help="readers' arenas resident from the start (dram.prefault), as on a node whose arena "
        "is page-locked for CUDA or was filled before: no page fault on a block's first write",
    )
    parser.add_argument(
        "--wire-batches",
        type=int,
        default=30,
        help="batches per block size of ucxx alone (and 8x as many ucx_perftest messages) "
        "between the two hosts after the reads; 0: skip them",
    )
    parser.add_argument(
        "--ucx-lanes",
        default="1",
        help="ucx.lanes of the UCX peer reader, comma-separated: one reader per value (the "
        "first is `peer-ucx`, the others `peer-ucx-<N>lanes`)",
    )
    args = parser.parse_args()
    lanes = [int(n) for n in args.ucx_lanes.split(",")]
    sizes = [int(s) * MiB for s in args.sizes_mib.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    started: list[servers.ServerProcess] = []
    with Hosts(2) as hosts:
        a, b = hosts[0], hosts[1]
        with RedisServer(work / "redis", host=hosts.gateway) as redis:
            url = redis.url
            try:
                one = start_node(work / "one", a, node_env("one", url, "both"), "2GiB", ucx=True)
                started.append(one)
                # Resident arenas take their whole capacity: 1 GiB holds what a reader reads.
                warm = {"KVSTORE_DRAM_PREFAULT": "1"} if args.prefault else {}
                dram = "1GiB" if args.prefault else "2GiB"
                kinds: list[tuple[str, str, tuple[Any, ...], bool]] = [
                    ("redis", "r-redis", ("redis",), False),  # first: the local case reads its
                    ("peer-ucx", "r-ucx", ("peers", "ucx", lanes[0]), True),
                    ("peer-grpc", "r-grpc", ("peers", "grpc"), False),
                ]
                kinds += [
                    (f"peer-ucx-{n}lanes", f"r-ucx{n}", ("peers", "ucx", n), True)
                    for n in lanes[1:]
                ]
                readers = {
                    path: start_node(
                        work / name, b, {**node_env(name, url, *how), **warm}, dram, ucx
                    )
                    for path, name, how, ucx in kinds
                }
                started.extend(readers.values())
                load_before = os.getloadavg()[0]
                result = measure(args, sizes, one, readers, b, url, redis)
                if args.wire_batches > 0:
                    # From A (the holder's host) to B (the readers'), as the peer reads move.
                    result["wire"] = measure_wire(args, sizes, (b, a))
                # The machine is shared: how busy it was says how far to trust the figures.
                result["load_average_1min"] = [load_before, os.getloadavg()[0]]
            finally:
                for node in started:
                    try:
                        node.stop()  # graceful: a clean exit (and atexit hooks) where it can
                    except Exception:
                        node.kill()
    result["prefault"] = args.prefault
    result["machine"] = machine_info()
    result["command"] = " ".join(sys.argv)
    text = report(result)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.out is not None:
        args.out.write_text(text + "\n")


def measure(
    args: argparse.Namespace,
    sizes: list[int],
    one: servers.ServerProcess,
    readers: dict[str, servers.ServerProcess],
    b: Any,
    url: str,
    redis: RedisServer,
) -> dict[str, Any]:
    from kvstore import Namespace

    namespace = Namespace(**NAMESPACE)
    rounds: list[list[dict[str, Any]]] = []
    written: list[bytes] = []
    payloads = redis.client()

    def written_through() -> None:
        """Wait (untimed) until every block put so far is in Redis: node one's write-through
        backlog is bounded (1 GiB, then it drops), and a loaded machine drains it slower than
        the puts fill it."""
        wait_for(
            lambda: (
                sum(1 for _ in payloads.scan_iter(match="kvstore:v1:*", count=1000)) >= len(written)
            ),
            120,
            "the payloads written through to Redis",
        )

    with KVStoreClient(one.target, namespace=namespace, data_plane="grpc", timeout=60) as writer:
        for size in sizes:
            count = max(1, args.round_mib * MiB // size)
            batch = max(1, args.batch_mib * MiB // size)
            for round_index in range(-1, args.rounds):  # -1: a warm-up round, not reported
                cases = []
                for path in readers:  # distinct blocks per path: no reader can help another
                    # The warm-up opens every connection (gRPC, UCX endpoint, Redis) untimed.
                    n = count if round_index >= 0 else batch
                    keys = [os.urandom(KEY_BYTES) for _ in range(n)]
                    values = [os.urandom(size) for _ in range(n)]
                    for first in range(0, n, batch):
                        stored = writer.put(
                            keys[first : first + batch], values[first : first + batch]
                        )
                        assert stored.stored == len(keys[first : first + batch]), stored
                    written.extend(keys)
                    digests = [hashlib.blake2b(v, digest_size=16).hexdigest() for v in values]
                    cases.append(
                        {
                            "name": f"{path}/{size // MiB}MiB",
                            "target": readers[path].target,
                            "keys": [k.hex() for k in keys],
                            "digests": digests,
                            "batch": batch,
                            "warmup": round_index < 0,
                        }
                    )
                shift = max(round_index, 0) % len(cases)
                # The reference: the Redis reader's blocks again, now local to it (what the
                # client and its shared-memory hop cost alone, with no remote fetch).
                local = {**cases[0], "name": f"local/{size // MiB}MiB"}
                rounds.append(cases[shift:] + cases[:shift] + [local])
                written_through()
    # Untimed: every block written through to Redis and published by node one.
    wait_for(lambda: holders_of(url, written) == {"one"}, 60, "node one in the index")
    spec = {
        "namespace": NAMESPACE,
        "data_plane": "auto",
        "timeout_s": 60,
        "rounds": rounds,
    }
    proc = b.popen(
        [sys.executable, str(ROOT / "benchmarks" / "_peer_reader.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out, _ = proc.communicate(json.dumps(spec).encode(), timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the reader failed ({proc.returncode})")
    timings = json.loads(out)
    seen = {path: counters(node) for path, node in readers.items()}
    return {
        "paths": list(readers),
        "ucx_lanes": args.ucx_lanes,
        "sizes": sizes,
        "round_mib": args.round_mib,
        "rounds": args.rounds,
        "batch_mib": args.batch_mib,
        "timings": timings,
        "counters": {
            path: {k: v for k, v in c.items() if k.startswith(("peer", "miss", "hits", "tier"))}
            for path, c in seen.items()
        },
    }


def measure_wire(
    args: argparse.Namespace, sizes: list[int], hosts: tuple[Any, Any]
) -> dict[str, Any]:
    """GB/s between ``hosts`` (receiver's, sender's) per block size: ``ucx_perftest -e`` (one
    figure per size) and ucxx alone (one per batch of ``--batch-mib``)."""
    wire: dict[str, Any] = {"perftest": {}, "ucxx": {}, "load": [os.getloadavg()[0]]}
    found = perftest_binary()
    cases = {}
    for size in sizes:
        label = f"{size // MiB}MiB"
        batch = max(1, args.batch_mib * MiB // size)
        cases[label] = (size, batch, args.wire_batches)
        if found is not None:
            binary, env = found
            iters = 8 * batch * args.wire_batches
            wire["perftest"][label] = perftest(binary, env, "tcp", size, iters, hosts=hosts)
    for label, seconds in ucxx_alone(cases, hosts).items():
        size, batch, _ = cases[label]
        wire["ucxx"][label] = [size * batch / s / GB for s in seconds]
    wire["load"].append(os.getloadavg()[0])
    return wire


def _rates(timings: dict[str, Any], name: str) -> list[float]:
    """Bytes/s of each round of case ``name`` (``"PATH/SIZE"``) in the reader's timings."""
    return [n / s for n, s in zip(timings["bytes"][name], timings["seconds"][name], strict=True)]


def wire_report(result: dict[str, Any]) -> list[str]:
    """The wire table: UCX and ucxx alone between the hosts, and the peer reads against them."""
    wire, timings = result["wire"], result["timings"]
    rows = []
    for size in result["sizes"]:
        label = f"{size // MiB}MiB"
        peer = percentile(_rates(timings, f"peer-ucx/{label}"), 50)
        ucxx = wire["ucxx"][label]
        alone = percentile(ucxx, 50)
        ceiling = wire["perftest"].get(label)
        rows.append(
            [
                label,
                "-" if ceiling is None else f"{ceiling:.2f}",
                f"{alone:.2f} ({percentile(ucxx, 10):.2f}-{percentile(ucxx, 90):.2f})",
                f"{peer / 1e9:.3f}",
                f"{peer / 1e9 / alone:.2f}x",
                "-" if ceiling is None else f"{peer / 1e9 / ceiling:.2f}x",
            ]
        )
    headers = [
        "block",
        "`ucx_perftest -e` GB/s",
        "ucxx alone GB/s (p10-p90)",
        "peer-ucx GB/s",
        "peer-ucx / ucxx alone",
        "peer-ucx / perftest",
    ]
    return [
        "",
        "The wire from host A to host B, after the reads (nodes idle; 1-minute load "
        f"{wire['load'][0]:.1f} / {wire['load'][1]:.1f}):",
        "",
        markdown_table(headers, rows),
    ]


def report(result: dict[str, Any]) -> str:
    timings = result["timings"]
    paths = result.get("paths", PATHS)
    shown = [*paths, "local"]
    rows = []
    for size in result["sizes"]:
        label = f"{size // MiB}MiB"
        rates: dict[str, list[float]] = {}
        for path in shown:
            name = f"{path}/{label}"
            rates[path] = _rates(timings, name)
        base = percentile(rates["redis"], 50)
        for path in shown:
            median = percentile(rates[path], 50)
            rows.append(
                [
                    label,
                    path,
                    f"{median / 1e9:.3f}",
                    f"{percentile(rates[path], 10) / 1e9:.3f}",
                    f"{median / base:.2f}x",
                ]
            )
    table = markdown_table(
        ["block", "path", "GB/s (median)", "GB/s (slow tail, p10 of rate)", "vs redis"], rows
    )
    used = {path: result["counters"][path] for path in paths}
    lines = [
        table,
        "",
        f"{result['rounds']} rounds x {result['round_mib']} MiB per size and path, "
        f"{result['batch_mib']} MiB per get; UCX reader lanes {result.get('ucx_lanes', '1')}; "
        "readers' arenas "
        f"{'prefaulted' if result.get('prefault') else 'cold (faulted on first write)'}; "
        "client plane: "
        f"{', '.join(sorted(set(timings['planes'].values())))}; "
        f"1-minute load average before/after: {result['load_average_1min'][0]:.1f} / "
        f"{result['load_average_1min'][1]:.1f} on {os.cpu_count()} cores.",
        "Reader counters: "
        + "; ".join(
            f"{path}: "
            + ", ".join(
                f"{k}={v}"
                for k, v in sorted(c.items())
                if k in ("peer_hits_ucx", "peer_hits_grpc", "peer_ucx_fallbacks", "hits_redis")
                or k.startswith("miss_peer")
            )
            for path, c in used.items()
        ),
    ]
    if "wire" in result:
        lines += wire_report(result)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
