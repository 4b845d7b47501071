"""Run the simulator: one fleet, or the sweep of ``workloads.toml`` (3 to 1,000 nodes).

One run, figures as JSON on stdout::

    .venv/bin/python -m benchmarks.sim run --workload zipf --nodes 100 --routing kv

The sweep, a Markdown table and the raw JSON (progress on stderr)::

    .venv/bin/python -m benchmarks.sim sweep --out benchmarks/results/sim_sweep

Every parameter comes from ``benchmarks/sim/workloads.toml`` (``--config`` for another file);
flags override the ``[fleet]`` table for one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from .simulator import GIB, SimConfig, simulate
from .workloads import CONFIG_PATH, build, ideal_hit_rate, load_config

__all__ = ["fleet_config", "main", "markdown", "run_one"]


def fleet_config(config: dict[str, Any], nodes: int, **overrides: Any) -> SimConfig:
    """A :class:`SimConfig` from the ``[model]`` and ``[fleet]`` tables, with ``overrides``."""
    model, fleet = config["model"], config["fleet"]
    values: dict[str, Any] = {
        "nodes": nodes,
        "dram_bytes": int(float(fleet["dram_gib"]) * GIB),
        "nvme_bytes": int(float(fleet["nvme_gib"]) * GIB),
        "shared_data": fleet["shared_data"],
        "routing": fleet["routing"],
        "kv_bytes_per_token": int(model["kv_bytes_per_token"]),
        "prefill_tokens_per_s": float(model["prefill_tokens_per_s"]),
        "decode_s_per_token": float(model["decode_s_per_token"]),
        "hit_weight": float(fleet["hit_weight"]),
        "request_cost_tokens": int(fleet["request_cost_tokens"]),
        "provisional_ttl_s": float(fleet["provisional_ttl_s"]),
        "node_id_bytes": int(fleet["node_id_bytes"]),
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SimConfig(**values)


def _progress(label: str) -> Any:
    started = time.perf_counter()

    def report(done: int, total: int) -> None:
        elapsed = time.perf_counter() - started
        print(f"\r  {label}: {done}/{total} requests, {elapsed:.0f} s", end="", file=sys.stderr)

    return report


def run_one(config: dict[str, Any], workload: str, seed: int, **fleet: Any) -> dict[str, Any]:
    """Build ``workload`` for the fleet and simulate it; the figures plus the ideal hit rate."""
    sim = fleet_config(config, **fleet)
    built = build(config["workloads"][workload], sim.nodes, seed)
    label = f"{workload} {sim.nodes} nodes {sim.routing}"
    result = simulate(built, sim, _progress(label))
    print(f"\r  {label}: done in {result['wall_s']:.1f} s" + " " * 20, file=sys.stderr)
    result["ideal_hit_rate"] = ideal_hit_rate(built.requests)
    result["seed"] = seed
    return result


_COLUMNS = [
    ("workload", "workload", "{}"),
    ("nodes", "nodes", "{}"),
    ("dram/nvme GiB", None, ""),
    ("routing", "routing", "{}"),
    ("requests", "requests", "{:,}"),
    ("hit rate", "hit_rate", "{:.3f}"),
    ("ideal", "ideal_hit_rate", "{:.3f}"),
    ("prefill tokens saved", "prefill_tokens_saved", "{:,}"),
    ("peer GB moved", "peer_bytes", None),
    ("peer MB/s per node", "peer_bytes_per_node_s", None),
    ("index entries (peak)", "index_fields_peak", "{:,}"),
    ("index MiB (peak)", "index_bytes_peak", None),
    ("index ops/s (mean)", "index_ops_per_s", "{:,.0f}"),
    ("index ops/s (peak 1 s)", "index_ops_per_s_peak", "{:,.0f}"),
    ("peak without lease GETs", "index_ops_per_s_peak_no_leases", "{:,.0f}"),
    ("load max/mean", "load_max_over_mean", "{:.2f}"),
    ("sim s", "wall_s", "{:.1f}"),
]


def _cell(row: dict[str, Any], key: str | None, form: str | None) -> str:
    if key is None:
        return f"{row['dram_gib']:g}/{row['nvme_gib']:g}"
    value = row[key]
    if form is None:  # byte figures
        scale = {"peer_bytes": 1e9, "peer_bytes_per_node_s": 1e6, "index_bytes_peak": 2**20}
        return f"{value / scale[key]:,.1f}"
    return form.format(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The sweep's rows as a Markdown table."""
    head = "| " + " | ".join(name for name, _, _ in _COLUMNS) + " |"
    rule = "| " + " | ".join(":---" if i < 4 else "---:" for i in range(len(_COLUMNS))) + " |"
    body = ["| " + " | ".join(_cell(r, k, f) for _, k, f in _COLUMNS) + " |" for r in rows]
    return "\n".join([head, rule, *body]) + "\n"


def _sweep(config: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    sweep = config["sweep"]
    nodes = [int(n) for n in args.nodes.split(",")] if args.nodes else sweep["nodes"]
    workloads = args.workloads.split(",") if args.workloads else sweep["workloads"]
    rows = []
    grid = itertools.product(
        workloads, nodes, sweep["capacities"], sweep["routing"], sweep["shared_data"]
    )
    for workload, count, (dram, nvme), routing, shared in grid:
        row = run_one(
            config,
            workload,
            int(sweep["seed"]),
            nodes=count,
            dram_bytes=int(dram * GIB),
            nvme_bytes=int(nvme * GIB),
            routing=routing,
            shared_data=shared,
        )
        rows.append(row)
        if args.out:  # written as it goes: a long sweep interrupted keeps what it did
            _write(rows, Path(args.out))
    return rows


def _write(rows: list[dict[str, Any]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))


def main(argv: list[str] | None = None) -> int:
    """``run`` or ``sweep``; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim", description=__doc__)
    parser.add_argument("--config", type=Path, default=CONFIG_PATH)
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="simulate one fleet; JSON on stdout")
    one.add_argument("--workload", default="zipf")
    one.add_argument("--nodes", type=int, default=3)
    one.add_argument("--dram-gib", type=float)
    one.add_argument("--nvme-gib", type=float)
    one.add_argument("--routing", choices=("kv", "round-robin"))
    one.add_argument("--shared-data", choices=("peers", "redis", "both", "none"))
    one.add_argument("--eviction", choices=("lru", "fifo", "lfu-aging"))
    one.add_argument("--seed", type=int, default=1)
    sweep = commands.add_parser("sweep", help="the [sweep] grid; a table and raw JSON")
    sweep.add_argument("--nodes", help="comma-separated node counts (default: [sweep] nodes)")
    sweep.add_argument("--workloads", help="comma-separated workload names")
    sweep.add_argument("--out", help="path without suffix: writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    if args.command == "run":
        gib = {"dram_bytes": args.dram_gib, "nvme_bytes": args.nvme_gib}
        result = run_one(
            config,
            args.workload,
            args.seed,
            nodes=args.nodes,
            routing=args.routing,
            shared_data=args.shared_data,
            eviction=args.eviction,
            **{k: int(v * GIB) for k, v in gib.items() if v is not None},
        )
        print(json.dumps(result, indent=1))
        return 0
    rows = _sweep(config, args)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
