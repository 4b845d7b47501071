"""A soak: mixed load with churn and faults against real processes, watched per interval.

Exact command of the one-hour run (repository root; needs ``redis-server`` and ``redis-cli``;
not part of any test suite; it stops by itself)::

    nohup .venv/bin/python benchmarks/soak.py --minutes 60 --warmup-s 600 \
        --prefill-blocks 131072 \
        --out benchmarks/results/soak_1h.json > benchmarks/results/soak_1h.log 2>&1 &

The short version runs in the slow suite (``tests/integration/test_soak.py``, ``--minutes 3``).

What runs, all on loopback: a Redis Cluster of 3 masters with a replica each
(``tests/harness/redis_cluster.py``) and two ``kvstore serve`` nodes on it (``tests/harness/
serve.py``; a small ``dram`` arena, a small ``nvme`` LMDB and the shared ``redis`` tier, so blocks
are evicted, demoted and promoted all the time). ``--workers`` load processes per node
(:mod:`_soak_worker`: half over shared memory, half over gRPC) put and get blocks of a sliding key
window; a get on one node finds what the other stored through Redis, and every byte it returns is
checked against what the key says it must be. ``--prefill-blocks`` first puts that many 1 KiB
blocks of other keys on node 0, so that its bounded per-key caches start full (:meth:`Soak.
prefill`); the samples show them at their bound.

Every ``--fault-every-s`` seconds one fault, in turn: a load process SIGKILLed (and started again
at once); node 1 restarted (SIGTERM, and every other time SIGKILL, on the same LMDB directory and
port); a Redis master SIGKILLed, its replica promoted, the old master started again (it rejoins as
a replica). Node 0 and the first load process of node 0 are never restarted: their RSS and open
descriptors are what "flat" is judged on.

Every ``--sample-s`` seconds the driver samples RSS (and its anonymous, file and shared-memory
parts) and open descriptors of both nodes and of that load process (for the nodes also what they
point to, ``fds.*``: Redis connections, accepted clients, sockets, arenas, files; see
:mod:`_proc_figures`), the LMDB files' size, and the
nodes' own account of what holds memory (``Stats``: re-send queue, write-through backlog, caches,
tasks, glibc's heap and Python's allocated blocks, ``stats.*``, see :data:`STATS_COUNTERS` and
``kvstore/server/memory.py``); per ``--interval-s`` it reports those, the calls, hits, misses,
errors and p50/p99 latency of gets and puts, and wrong blocks and bytes (which must be 0), plus
the load average. "Flat" compares every sample after ``--warmup-s`` with the first one after it:
RSS within ``--tolerance`` (10 %), and descriptors within the tolerance or 4 descriptors,
whichever is more (a few sockets come and go); node 0's RSS is judged twice, over every sample
and over those where its re-send queue and backlog were empty (see :meth:`Soak.flatness`).
The JSON goes to ``--out`` (``benchmarks/results/soak_*.json``); the exit status is 1 when wrong
bytes were seen or a watched figure was not flat. A node's Redis re-send queue (what Redis
refused during a failover, ``redis.resend_queue_bytes``, 256 MiB by default) holds copies of
blocks while a master fails over and drains when it is back: ``--resend-queue-mib`` bounds it
lower (the slow test's 8 MiB).

Debugging (not for figures: tracing slows node 0 several times over): ``--debug-tracemalloc DIR``
makes node 0 trace its allocations and write a snapshot to ``DIR`` every half interval
(``KVSTORE_DEBUG_TRACEMALLOC``, ``kvstore/server/memory.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' harness
from _common import exit_on_sigterm, machine_info, percentile
from _proc_figures import fd_kinds, lmdb_figures, metrics_figures, proc_figures
from _soak_worker import NAMESPACE
from harness.redis_cluster import RedisCluster
from harness.serve import ServerProcess

from kvstore import KVStoreClient, KVStoreError
from kvstore.server.memory import TRACEMALLOC_ENV

ROOT = Path(__file__).resolve().parents[1]

WORKER = ROOT / "benchmarks" / "_soak_worker.py"
FAULTS = ("client_kill", "store_restart", "redis_failover")


#: Of a node's ``Stats`` counters, those that say what holds its memory (``kvstore/server/
#: memory.py`` and the store's queues); with each tier's ``used`` and ``blocks``.
STATS_COUNTERS = (
    "shared_write_queue_blocks",
    "shared_write_queue_bytes",
    "shared_write_backlog_bytes",
    "shared_write_pending_keys",
    "background_tasks",
    "seal_memo_entries",
    "evicted_keys_remembered",
    "asyncio_tasks",
    "malloc_in_use_bytes",
    "malloc_free_bytes",
    "malloc_mmapped_bytes",
    "malloc_trims",
    "python_allocated_blocks",
    "shm_connections",
    "shm_leases",
    "shm_reservations",
    "prefetch_queued_keys",
    "write_through_dropped",
)


def stats_figures(node: ServerProcess) -> dict[str, Any]:
    """The :data:`STATS_COUNTERS` of ``node``'s ``Stats`` and its tiers' ``used`` / ``blocks``
    (``stats.*``); empty if it does not answer within 2 s (restarting, or overloaded)."""
    if not node.target:
        return {}
    try:
        stats = node.stats(timeout=2.0)
    except Exception:  # a node restarting, or too busy to answer: no figures this time
        return {}
    counters = stats.get("counters", {})
    out: dict[str, Any] = {f"stats.{k}": counters[k] for k in STATS_COUNTERS if k in counters}
    for tier, values in stats.get("tiers", {}).items():
        for name in ("used", "blocks"):
            if name in values:
                out[f"stats.{tier}_{name}"] = values[name]
    out["stats.index_blocks"] = stats.get("blocks", 0)
    return out


class Soak:
    """The processes of one soak and what happened to them."""

    def __init__(self, args: argparse.Namespace, workdir: Path, cluster: RedisCluster) -> None:
        self.args = args
        self.workdir = workdir
        self.cluster = cluster
        self.rng = random.Random(args.seed)
        self.start = time.time()
        self.end = self.start + args.minutes * 60
        flags = ["--dram-capacity", args.dram, "--nvme-capacity", args.nvme]
        flags += ["--redis-url", cluster.url, "--redis-ttl", str(args.redis_ttl_s)]
        flags += ["--log-level", "WARNING"]
        env = {}
        if args.resend_queue_mib is not None:
            # The re-send queue holds what Redis refused (a failover) up to this bound: a small
            # one fills during the warm-up, so RSS after it shows leaks, not a filling queue.
            env["KVSTORE_REDIS_RESEND_QUEUE_BYTES"] = str(int(args.resend_queue_mib * 2**20))
        envs = [dict(env), dict(env)]
        if args.debug_tracemalloc is not None:  # node 0 only: snapshots on SIGUSR1 (slow)
            envs[0][TRACEMALLOC_ENV] = str(args.debug_tracemalloc)
        self.nodes = [
            ServerProcess(workdir / f"node{i}", flags, envs[i], name=f"node{i}") for i in range(2)
        ]
        self.redis_ports = {server.port for server in cluster.nodes}
        self.workers: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.crashes: list[str] = []
        self.restarts = 0
        self.prefilled: dict[str, Any] = {}

    # -- processes ------------------------------------------------------------------------------

    def start_all(self) -> None:
        for node in self.nodes:
            node.start()
        self.prefilled = self.prefill()
        for node_index in range(2):
            for slot in range(self.args.workers):
                plane = "shm" if slot % 2 == 0 else "grpc"
                self.workers.append({"node": node_index, "plane": plane, "slot": slot, "runs": 0})
        for worker in self.workers:
            self.spawn(worker)

    def spawn(self, worker: dict[str, Any]) -> None:
        worker["runs"] += 1
        name = f"worker-{worker['node']}-{worker['slot']}"
        worker["stats"] = self.workdir / f"{name}.jsonl"
        log = (self.workdir / f"{name}-{worker['runs']}.log").open("wb")
        argv = [sys.executable, str(WORKER), self.nodes[worker["node"]].target, worker["plane"]]
        argv += [str(self.rng.randrange(2**31)), repr(self.end), str(worker["stats"])]
        argv += ["--rate", str(self.args.rate), "--window-s", str(self.args.window_s)]
        argv += ["--ops-per-s", str(self.args.ops_per_s), "--timeout-s", str(self.args.timeout_s)]
        worker["proc"] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        worker["log"] = log

    def respawn_dead(self) -> None:
        for worker in self.workers:
            proc = worker["proc"]
            if proc.poll() is not None and time.time() < self.end - 5:
                worker["log"].close()
                tail = Path(worker["log"].name).read_text(errors="replace")[-1500:]
                self.crashes.append(
                    f"{worker['node']}/{worker['slot']} exited {proc.returncode}: {tail}"
                )
                self.spawn(worker)

    @property
    def steady(self) -> dict[str, Any]:
        """The load process that is never killed (node 0's first)."""
        return self.workers[0]

    def prefill(self) -> dict[str, Any]:
        """Fill node 0's bounded per-key caches before the load starts: ``--prefill-blocks``
        small blocks of keys the load never uses, put in batches (each sealed for Redis, and
        the older ones evicted). The seal memo (``kvstore.block.MEMO_ENTRIES``) and the evicted
        keys it remembers (``kvstore.store.counters._GONE_KEYS``) otherwise fill at the load's
        20 new keys a second, for most of the hour: a slow rise that is a cache reaching its
        bound, not a leak. The report shows both at their bound after the warm-up."""
        count = self.args.prefill_blocks
        began = time.time()
        if count <= 0:
            return {"blocks": 0}

        batch = 256
        failed = 0
        with KVStoreClient(
            self.nodes[0].target, namespace=NAMESPACE, timeout=30, data_plane="grpc"
        ) as client:
            for first in range(0, count, batch):
                # 16-byte keys, none of which a load process uses (theirs are hashes).
                keys = [b"prefill:%08d" % i for i in range(first, min(first + batch, count))]
                try:
                    client.put(keys, [k * 64 for k in keys])  # 1 KiB each
                except KVStoreError:
                    failed += 1
        return {"blocks": count, "failed_batches": failed, "seconds": round(time.time() - began, 1)}

    # -- faults ---------------------------------------------------------------------------------

    def fault(self, kind: str) -> None:
        began = time.time()
        detail = ""
        if kind == "client_kill":
            victim = self.rng.choice(self.workers[1:])
            victim["proc"].kill()
            victim["proc"].wait()
            victim["log"].close()
            self.spawn(victim)
            detail = f"worker {victim['node']}/{victim['slot']} ({victim['plane']})"
        elif kind == "store_restart":
            node = self.nodes[1]
            self.restarts += 1
            if self.restarts % 2:
                node.stop()
                detail = "node1 SIGTERM"
            else:
                node.kill()
                detail = "node1 SIGKILL"
            node.start(same_address=True)
        else:
            masters = [p for p, (role, _) in self.cluster.roles().items() if role == "master"]
            killed = self.cluster.kill_master(self.cluster.node(self.rng.choice(masters)))
            heir = self.cluster.wait_promoted(killed, within=60)
            self.cluster._launch(killed)  # same nodes.conf: it rejoins as the heir's replica
            self.cluster.wait_ok(60)
            detail = f"master {killed.port} killed, {heir.port} promoted, {killed.port} back"
        self.faults.append(
            {
                "t": round(began - self.start, 1),
                "kind": kind,
                "seconds": round(time.time() - began, 2),
                "detail": detail,
            }
        )

    # -- sampling -------------------------------------------------------------------------------

    def sample(self) -> None:
        row: dict[str, Any] = {"t": round(time.time() - self.start, 1), "load": os.getloadavg()[0]}
        for index, node in enumerate(self.nodes):
            if node.proc is not None:
                row[f"node{index}"] = (
                    proc_figures(node.proc.pid)
                    | fd_kinds(node.proc.pid, self.redis_ports, _ports(node))
                    | lmdb_figures(node.nvme_path)
                    | metrics_figures(node.metrics_url)
                    | stats_figures(node)
                )
        row["steady_worker"] = proc_figures(self.steady["proc"].pid)
        self.samples.append(row)

    def run(self) -> None:
        next_sample = next_fault = next_snapshot = time.time()
        next_fault += self.args.fault_every_s
        turn = 0
        while time.time() < self.end:
            now = time.time()
            if now >= next_sample:
                self.sample()
                next_sample = now + self.args.sample_s
            if self.args.debug_tracemalloc is not None and now >= next_snapshot:
                node0 = self.nodes[0].proc
                if node0 is not None:
                    node0.send_signal(signal.SIGUSR1)  # kvstore/server/memory.py writes one
                next_snapshot = now + self.args.interval_s / 2
            if now >= next_fault and now < self.end - self.args.fault_every_s / 2:
                self.fault(FAULTS[turn % len(FAULTS)])
                turn += 1
                next_fault = time.time() + self.args.fault_every_s
            self.respawn_dead()
            time.sleep(0.5)
        self.sample()

    def stop_all(self) -> None:
        for worker in self.workers:
            proc = worker.get("proc")
            if proc is None:
                continue
            try:
                proc.wait(timeout=self.args.timeout_s * 3)  # they stop by themselves at the end
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            worker["log"].close()
        for node in self.nodes:
            if node.running:
                node.stop(signal.SIGTERM)
            node.close()

    # -- the report -----------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        interval = self.args.interval_s
        lines: list[dict[str, Any]] = []
        for worker in self.workers:
            path = worker.get("stats")
            if path is not None and Path(path).exists():
                for text in Path(path).read_text().splitlines():
                    try:
                        lines.append(json.loads(text) | {"plane": worker["plane"]})
                    except json.JSONDecodeError:  # a line cut short by a kill
                        continue
        count = max(1, round(self.args.minutes * 60 / interval))
        intervals = []
        for index in range(count):
            low, high = index * interval, (index + 1) * interval
            mine = [x for x in lines if low <= x["t"] - self.start < high]
            samples = [s for s in self.samples if low <= s["t"] < high]
            intervals.append(_interval(index, low, high, mine, samples))
        totals = {
            name: sum(x.get(name, 0) for x in lines)
            for name in (
                "puts",
                "gets",
                "hits",
                "misses",
                "errors",
                "wrong_blocks",
                "wrong_bytes",
                "put_bytes",
                "get_bytes",
            )
        }
        flat = self.flatness()
        return {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine_info(),
            "settings": {
                k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()
            },
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.start)),
            "load_average_end": os.getloadavg(),
            "totals": totals,
            "wrong_bytes": totals["wrong_bytes"],
            "flat": flat,
            "ok": totals["wrong_bytes"] == 0
            and totals["wrong_blocks"] == 0
            and all(v["flat"] for v in flat.values()),
            "prefill": self.prefilled,
            "faults": self.faults,
            "worker_crashes": self.crashes,
            "intervals": intervals,
            "samples": self.samples,
        }

    def flatness(self) -> dict[str, dict[str, Any]]:
        """Per watched figure: its first sample after the warm-up, the highest and last after
        it, and whether all stayed within the tolerance. ``node0.vmrss_kib_queues_empty`` judges
        node 0's RSS only at samples where its re-send queue and write-through backlog were
        empty: what it holds between outages (a failover's queue holds up to
        ``redis.resend_queue_bytes`` of copies for seconds, and is given back once drained)."""
        after = [s for s in self.samples if s["t"] >= self.args.warmup_s]
        quiet = [
            s
            for s in after
            if s.get("node0", {}).get("stats.shared_write_queue_bytes", 1) == 0
            and s["node0"].get("stats.shared_write_backlog_bytes", 1) == 0
        ]
        watched: list[tuple[str, str, int, list[dict[str, Any]], str]] = [
            (process, figure, slack, after, f"{process}.{figure}")
            for process in ("node0", "steady_worker")
            for figure, slack in (("vmrss_kib", 0), ("fds", 4))
        ]
        watched.append(("node0", "vmrss_kib", 0, quiet, "node0.vmrss_kib_queues_empty"))
        out: dict[str, dict[str, Any]] = {}
        for process, figure, slack, samples, name in watched:
            values = [s[process][figure] for s in samples if figure in s.get(process, {})]
            if not values:
                out[name] = {"flat": False, "why": "no samples"}
                continue
            base = values[0]
            allowed = max(base * self.args.tolerance, slack)
            out[name] = {
                "baseline": base,
                "max": max(values),
                "last": values[-1],
                "max_ratio": round(max(values) / base, 4) if base else None,
                "samples": len(values),
                "flat": max(values) <= base + allowed,
            }
        return out


def _ports(node: ServerProcess) -> set[int]:
    """The ports ``node`` accepts connections on: its gRPC target and its /metrics."""
    ports = set()
    for address in (node.target, node.metrics_url.split("//", 1)[-1].split("/", 1)[0]):
        if address.rpartition(":")[2].isdigit():
            ports.add(int(address.rpartition(":")[2]))
    return ports


def _interval(
    index: int, low: float, high: float, lines: list[dict[str, Any]], samples: list[dict[str, Any]]
) -> dict[str, Any]:
    row: dict[str, Any] = {"interval": index, "from_s": low, "to_s": high}
    for name in ("puts", "gets", "hits", "misses", "errors", "wrong_blocks", "wrong_bytes"):
        row[name] = sum(x.get(name, 0) for x in lines)
    for op in ("get", "put"):
        for plane in ("shm", "grpc"):
            values = [v for x in lines if x["plane"] == plane for v in x.get(f"{op}_ms", [])]
            if values:
                row[f"{op}_{plane}_p50_ms"] = round(percentile(values, 50), 2)
                row[f"{op}_{plane}_p99_ms"] = round(percentile(values, 99), 2)
    moved = sum(x.get("put_bytes", 0) + x.get("get_bytes", 0) for x in lines)
    row["mb_per_s"] = round(moved / (high - low) / 1e6, 2)
    if samples:
        last = samples[-1]
        row["load_average_1m"] = round(last["load"], 2)
        for process in ("node0", "node1", "steady_worker"):
            figures = last.get(process, {})
            row[process] = {k: figures[k] for k in figures}
            rss = [s[process]["vmrss_kib"] for s in samples if "vmrss_kib" in s.get(process, {})]
            if rss:
                row[process]["vmrss_kib_max"] = max(rss)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--interval-s", type=float, default=None, help="default: 300, or a sixth")
    parser.add_argument("--warmup-s", type=float, default=None, help="default: one interval")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--fault-every-s", type=float, default=None, help="default: 60, or 20")
    parser.add_argument("--workers", type=int, default=2, help="load processes per node")
    parser.add_argument("--dram", default="48MiB")
    parser.add_argument("--nvme", default="96MiB")
    parser.add_argument("--rate", type=float, default=20.0, help="new block ids per second")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--ops-per-s", type=float, default=10.0, help="per load process")
    parser.add_argument("--redis-ttl-s", type=float, default=300.0)
    parser.add_argument(
        "--resend-queue-mib", type=float, default=None, help="redis.resend_queue_bytes (MiB)"
    )
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument(
        "--prefill-blocks",
        type=int,
        default=0,
        help="1 KiB blocks put on node 0 first, to fill its per-key caches (see Soak.prefill)",
    )
    parser.add_argument(
        "--debug-tracemalloc",
        type=Path,
        default=None,
        help="debugging: node 0 traces allocations, a snapshot here every half interval",
    )
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=41)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    span = args.minutes * 60
    args.interval_s = args.interval_s or min(300.0, span / 6)
    args.warmup_s = args.interval_s if args.warmup_s is None else args.warmup_s
    args.fault_every_s = args.fault_every_s or (60.0 if span >= 1800 else 20.0)
    out = args.out or ROOT / "benchmarks" / "results" / f"soak_{int(args.minutes)}m.json"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="kvsoak-") as tmp:
        workdir = Path(tmp)
        with RedisCluster(workdir / "redis", masters=3, replicas=1) as cluster:
            soak = Soak(args, workdir, cluster)
            try:
                soak.start_all()
                soak.run()
            finally:
                soak.stop_all()
            result = soak.report()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    totals = result["totals"]
    print(
        f"soak {args.minutes:g} min: {totals['gets']} gets, {totals['puts']} puts, "
        f"{totals['errors']} errors, {totals['wrong_bytes']} wrong bytes, "
        f"{len(result['faults'])} faults; flat: "
        + ", ".join(f"{k} {v.get('max_ratio')}" for k, v in result["flat"].items())
        + f"; wrote {out}"
    )
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
