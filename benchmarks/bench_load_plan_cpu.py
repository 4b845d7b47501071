"""Load or recompute on the real vLLM CPU engine: Redis behind a rate-limited link (issue 31).

Exact command (repository root, as root: it makes a network namespace; in the vLLM environment;
about 15 minutes on 2 cores)::

    .venv-vllm/bin/python benchmarks/bench_load_plan_cpu.py --out benchmarks/results/load_plan_cpu

Redis runs in a network namespace of its own (tests/harness/netns_hosts.py) whose link out is shaped
with ``tc tbf`` (``--rate``, e.g. ``40mbit``; ``none`` leaves it unshaped: the bridge's own speed);
``kvstore serve`` runs outside with a dram tier of a few prompts, no nvme, and that Redis as its
shared tier. Engine A (its own process, ``load_policy`` always) serves every prompt once, then
``--filler`` prompts of no use to B, so every chunk lands in Redis and dram keeps none. Then one
engine B per policy (``always``, ``never``, ``cost``; each its own process, the same tiny random
Llama) serves its own prompts, one at a time with ``max_tokens=1`` (its latency is its time to first
token): each prompt's prefix is stored only in Redis, so ``always`` reads every chunk through the
shaped link, ``never`` recomputes it, and ``cost`` decides from the rates the store measured
(Redis's, from the earlier B engines' reads: a long-running store has them) and its own steps. Each
B first serves ``--warm`` prompts of its own, never stored (their TTFT not counted), so that the
cost model has steps to measure.

Writes ``OUT.json`` (every request, and the connector's load-plan log lines) and ``OUT.md`` (the
table); prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "tests"):
    sys.path.insert(0, str(extra))

from _common import engine_or_exit, run_engine  # noqa: E402
from harness.netns_hosts import Hosts  # noqa: E402
from harness.tiny_model import build_tiny_llama  # noqa: E402

CHUNK = 256
SUFFIX = 16
POLICIES = ("always", "never", "cost")
# The bench_ttft.py model: 4 KiB of KV per token, 1 MiB per chunk.
MODEL_SIZES = {
    "vocab_size": 1024,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
}
ENGINE_TIMEOUT_S = 1200


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(condition: Any, what: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


def _redis_ping(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _redis_dbsize(address: str, port: int) -> int:
    with socket.create_connection((address, port), timeout=5) as sock:
        sock.sendall(b"DBSIZE\r\n")
        return int(sock.recv(64).strip().lstrip(b":"))


def _engine(
    name: str, workdir: Path, model: Path, prompts: list[list[int]], *extra: str
) -> tuple[dict[str, Any], str]:
    max_len = max(len(p) for p in prompts) + 16
    flags = [
        *("--max-model-len", str(max_len), "--max-num-batched-tokens", str(max_len)),
        *("--chunk-size", str(CHUNK), "--connector", "kvstore"),
        *extra,
    ]
    return engine_or_exit(name, run_engine(name, workdir, model, prompts, flags, ENGINE_TIMEOUT_S))


def _prompts(count: int, prefix: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 1000) for _ in range(prefix + SUFFIX)] for _ in range(count)]


def run(args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The three B engines against one shaped Redis; a row per measured request, and the
    connector's load-plan log lines."""
    model = build_tiny_llama(workdir / "model", **MODEL_SIZES)
    rng = random.Random(11)
    sets = {policy: _prompts(args.prompts, args.prefix, rng) for policy in POLICIES}
    warm = {policy: _prompts(args.warm, args.prefix, rng) for policy in POLICIES}
    rows: list[dict[str, Any]] = []
    decisions: list[str] = []
    with Hosts(1) as hosts:
        host = hosts[0]
        if args.rate != "none":
            host.run(
                [
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "eth0",
                    "root",
                    "tbf",
                    "rate",
                    args.rate,
                    "burst",
                    "64kb",
                    "latency",
                    "2s",
                ],
                check=True,
            )
        port = _free_port()
        redis = host.popen(
            [
                "redis-server",
                "--bind",
                host.address,
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--dir",
                str(workdir),
            ],
            stdout=subprocess.DEVNULL,
        )
        serve_out = (workdir / "serve.out").open("wb")
        serve = None
        try:
            _wait(lambda: _redis_ping(host.address, port), "redis")
            listen = f"127.0.0.1:{_free_port()}"
            # A batched read through the shaped link takes seconds: past the default 0.5 s
            # the store would mark Redis down and always-load would recompute after a wait.
            env = {
                **os.environ,
                "TMPDIR": str(workdir),
                "PYTHONUNBUFFERED": "1",
                "KVSTORE_REDIS_OP_TIMEOUT_S": "30",
            }
            env.pop("XDG_RUNTIME_DIR", None)
            serve = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvstore.cli",
                    "serve",
                    "--listen",
                    listen,
                    "--dram-capacity",
                    args.dram,
                    "--nvme-path",
                    "",
                    "--metrics-listen",
                    "",
                    "--redis-url",
                    f"redis://{host.address}:{port}/0",
                ],
                stdout=serve_out,
                stderr=subprocess.STDOUT,
                env=env,
            )
            _wait(
                lambda: "kvstore serving on" in (workdir / "serve.out").read_text(errors="replace"),
                "kvstore serve",
            )
            every = [p for policy in POLICIES for p in sets[policy]]
            # Then prompts of no use to any B, so that dram keeps none of the ones above.
            filler = _prompts(args.filler, args.prefix, rng)
            a_prompts = every + filler
            _engine("A", workdir, model, a_prompts, "--target", listen, "--load-policy", "always")
            chunks = sum(len(p) // CHUNK for p in a_prompts)
            _wait(lambda: _redis_dbsize(host.address, port) >= chunks, "chunks in redis", 600)
            for policy in POLICIES:
                result, log = _engine(
                    f"B-{policy}",
                    workdir,
                    model,
                    warm[policy] + sets[policy],
                    "--target",
                    listen,
                    "--load-policy",
                    policy,
                    "--sequential",
                    "--kvstore-log-level",
                    "DEBUG",
                )
                decisions.extend(line for line in log.splitlines() if "load plan" in line)
                for item in result["results"][args.warm :]:
                    rows.append(
                        {
                            "policy": policy,
                            "rate": args.rate,
                            "prefix": args.prefix,
                            "ttft_s": item["latency_s"],
                            "cached_tokens": item["num_cached_tokens"],
                        }
                    )
        finally:
            if serve is not None:
                serve.terminate()
                serve.wait(timeout=30)
            serve_out.close()
            redis.terminate()
            redis.wait(timeout=30)
    return rows, decisions


def markdown(rows: list[dict[str, Any]]) -> str:
    """Median and mean TTFT per policy, and the ratio to always-load's median."""
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(row["policy"], []).append(row)
    base = statistics.median(r["ttft_s"] for r in by["always"])
    lines = [
        "| link | prefix tokens | policy | requests | cached tokens (median) | TTFT median ms | "
        "mean ms | max ms | median vs always |",
        "| :--- | ---: | :--- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for policy, group in by.items():
        ttft = [r["ttft_s"] for r in group]
        cached = statistics.median(r["cached_tokens"] for r in group)
        lines.append(
            f"| {group[0]['rate']} | {group[0]['prefix']} | {policy} | {len(group)} | {cached:.0f} "
            f"| {statistics.median(ttft) * 1e3:.1f} | {statistics.fmean(ttft) * 1e3:.1f} | "
            f"{max(ttft) * 1e3:.1f} | {statistics.median(ttft) / base:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run; print the table, write ``--out`` .json and .md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="path without suffix: writes OUT.json and OUT.md")
    parser.add_argument("--rate", default="40mbit", help="tc tbf rate of Redis's link, or none")
    parser.add_argument("--prefix", type=int, default=2048, help="prefix tokens per prompt")
    parser.add_argument("--prompts", type=int, default=6, help="measured prompts per policy")
    parser.add_argument("--warm", type=int, default=2, help="unmeasured prompts first")
    parser.add_argument("--dram", default="16MiB", help="the store's dram tier")
    parser.add_argument("--filler", type=int, default=3, help="prompts that fill dram after A's")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvstore-load-plan-") as tmp:
        rows, decisions = run(args, Path(tmp))
    table = markdown(rows)
    print(table)
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        data = {"rows": rows, "load_plan_lines": decisions}
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
