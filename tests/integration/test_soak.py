"""The soak's short version (slow suite): three minutes of mixed load with churn and faults.

``benchmarks/soak.py`` (its docstring has the one-hour command) runs two real ``kvstore serve``
nodes on a real Redis Cluster, load processes over shared memory and gRPC, and in turn a load
process SIGKILLed, node 1 restarted, a Redis master killed and failed over. Here it runs for
``--minutes 3`` with a small arena, LMDB and Redis re-send queue (so all fill during the first
minute, the warm-up) and must report: no wrong block and no wrong byte, every kind of fault
survived, blocks found (hits) through it all, no load process that died by itself, and the
never-restarted node's and load process's open descriptors and RSS flat after the warm-up.
The tolerances are wider than the hour's 10% (BENCHMARKS.md): two minutes after a one-minute
warm-up on a loaded machine catch a leak that grows with the load, not a slow drift.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_three_minutes_of_churn_and_faults_leave_no_wrong_byte_and_flat_figures(
    tmp_path: Path,
) -> None:
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "3"]
    argv += ["--dram", "16MiB", "--nvme", "32MiB", "--resend-queue-mib", "8"]
    argv += ["--warmup-s", "60", "--tolerance", "0.3"]
    argv += ["--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.exists(), f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    result = json.loads(out.read_text())
    totals = result["totals"]
    assert totals["wrong_blocks"] == 0 and totals["wrong_bytes"] == 0, totals
    assert {fault["kind"] for fault in result["faults"]} == {
        "client_kill",
        "store_restart",
        "redis_failover",
    }, result["faults"]
    assert totals["gets"] > 100 and totals["puts"] > 100 and totals["hits"] > 0, totals
    assert result["worker_crashes"] == [], result["worker_crashes"]
    # Next to RSS, the node's own account of what holds memory (its queues, caches and heap).
    sampled = [s["node0"] for s in result["samples"] if "stats.asyncio_tasks" in s.get("node0", {})]
    assert len(sampled) >= len(result["samples"]) // 2, result["samples"][-1]
    assert all("stats.shared_write_queue_bytes" in s for s in sampled), sampled[-1]
    flat = result["flat"]
    assert flat["node0.fds"]["flat"] and flat["steady_worker.fds"]["flat"], flat
    assert flat["steady_worker.vmrss_kib"]["flat"], flat
    # The node's RSS after a one-minute warm-up still moves with the load (its caches and queues
    # settle later; measured at 1.13x and 1.53x at load 40-58): a leak that grows with the load
    # doubles it within these two minutes, which is what this bound catches.
    assert flat["node0.vmrss_kib"]["max_ratio"] <= 2.0, flat
