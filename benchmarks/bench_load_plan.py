"""Load or recompute, simulated: TTFT on the Mooncake trace with the cost model, always-load and
never-load, at the figures measured on an H100 and across hosts (issue 31).

Exact command (repository root; about a minute on 2 cores)::

    .venv/bin/python benchmarks/bench_load_plan.py --out benchmarks/results/load_plan_sim

The fleet simulator (:mod:`benchmarks.sim`) replays the Mooncake FAST'25 trace
(``/work/shared/traces``, 3,993 requests over 17 minutes, 512-token chunks) through kvstore's own
index, eviction and router scoring, and each engine decides per request how many leading hits to
load with :func:`kvstore.client.cost_model.plan_loads`, the function the vLLM connector calls
(``load_policy``: ``cost``; ``always`` is the connector without it; ``never`` recomputes every
prompt). A request's TTFT is its wait in its engine's FIFO queue plus its loads plus the prefill
of the rest.

The figures (BENCHMARKS.md, "GPU: loads and saves against the PCIe link", and DESIGN.md):

- a Llama-1B shape: 32 KiB of KV per token, hidden size 2,048; prefill of 8K tokens 51.7 ms,
  attention weighed as :func:`~kvstore.client.cost_model.prefill_work` does (context scale
  6 x 2,048); an 8B shape: 128 KiB per token, hidden 4,096, 8K in 261.8 ms;
- the engine's own copy of a loaded chunk from the shared arena: 8K tokens of the 1B shape in
  6.7 ms (one copy per chunk and layer; the dram tier costs nothing more);
- a Redis read 0.3 GB/s, a peer read between hosts 0.5 GB/s (measured on this machine's bridge);
  nvme (LMDB from the page cache) 3 GB/s, the low end of DESIGN.md's 3-13 GB/s.

Scenarios, each on as many engines as keep up with the trace (2 of the 1B shape, 6 of the 8B),
behind kvstore's KV-aware routing: ``redis`` (each node's dram holds 4 GiB; everything else is
read back from Redis), ``peers`` (4 GiB each, reading each other's blocks across hosts), ``fast``
(dram only, 64 GiB each, no sharing: no slow tier at all). Writes ``OUT.json`` and ``OUT.md``;
prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.sim.run import fleet_config  # noqa: E402
from benchmarks.sim.simulator import GIB, LOAD_POLICIES, SimConfig, simulate  # noqa: E402
from benchmarks.sim.workloads import Workload, build, load_config  # noqa: E402
from kvstore.client.cost_model import context_scale, prefill_work  # noqa: E402

__all__ = ["MODELS", "SCENARIOS", "Model", "scenario_config"]


@dataclass(frozen=True)
class Model:
    """A model shape on the engine: KV bytes per token, hidden size, measured 8K prefill."""

    name: str
    kv_bytes_per_token: int
    hidden_size: int
    prefill_8k_s: float
    #: The engine's copy of 8K loaded tokens from the arena (the 1B shape measured; the 8B
    #: scaled by its bytes).
    load_8k_s: float
    #: Engines (nodes) that keep up with the trace's arrivals (~60K prompt tokens/s).
    nodes: int

    @property
    def scale(self) -> float:
        """The context scale of :func:`~kvstore.client.cost_model.prefill_work`."""
        return context_scale(self.hidden_size)

    @property
    def prefill_units_per_s(self) -> float:
        """The engine's prefill rate in :func:`~kvstore.client.cost_model.prefill_work` units."""
        return prefill_work(0, 8192, self.scale) / self.prefill_8k_s

    @property
    def transfer_bytes_per_s(self) -> float:
        """The engine's own copy of loaded bytes."""
        return 8192 * self.kv_bytes_per_token / self.load_8k_s


MODELS = {
    "1b": Model("Llama-1B shape, H100", 32768, 2048, 0.0517, 0.0067, nodes=2),
    "8b": Model("Llama-8B shape, H100", 131072, 4096, 0.2618, 0.0067 * 4, nodes=6),
}
#: Read rates by source: (bytes per s, fixed seconds per read).
RATES = {"nvme": (3e9, 0.0), "redis": (0.3e9, 0.0), "peer": (0.5e9, 0.0)}
#: name: (dram GiB per node, shared_data); every scenario runs the model's number of nodes.
SCENARIOS = {"redis": (4.0, "redis"), "peers": (4.0, "peers"), "fast": (64.0, "none")}


def scenario_config(
    config: dict[str, Any], scenario: str, model: Model, policy: str, **overrides: Any
) -> SimConfig:
    """The simulated fleet of ``scenario`` for ``model`` deciding by ``policy``."""
    dram_gib, shared = SCENARIOS[scenario]
    values: dict[str, Any] = {
        "dram_bytes": int(dram_gib * GIB),
        "nvme_bytes": 0,
        "shared_data": shared,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "prefill_tokens_per_s": model.prefill_units_per_s,
        "prefill_context_scale": model.scale,
        "transfer_bytes_per_s": model.transfer_bytes_per_s,
        "read_rates": tuple((name, rate, latency) for name, (rate, latency) in RATES.items()),
        "load_policy": policy,
        **overrides,
    }
    return fleet_config(config, model.nodes, **values)


def _row(result: dict[str, Any], scenario: str, model: str) -> dict[str, Any]:
    keep = (
        "load_policy",
        "requests",
        "hit_rate",
        "loaded_chunks",
        "declined_chunks",
        "load_s",
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "hits_by_source",
    )
    return {"scenario": scenario, "model": model, **{k: result[k] for k in keep}}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a table, TTFT in ms and as a ratio of always-load's in the same run."""
    base = {
        (r["scenario"], r["model"]): r["ttft_mean_s"] for r in rows if r["load_policy"] == "always"
    }
    lines = [
        "| scenario | model | policy | hits by source | loaded / declined chunks | "
        "TTFT mean ms | p50 | p90 | p99 | mean vs always |",
        "| :--- | :--- | :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        sources = ", ".join(f"{k} {v:,}" for k, v in sorted(r["hits_by_source"].items()))
        ratio = r["ttft_mean_s"] / base[(r["scenario"], r["model"])]
        lines.append(
            f"| {r['scenario']} | {r['model']} | {r['load_policy']} | {sources} | "
            f"{r['loaded_chunks']:,} / {r['declined_chunks']:,} | "
            f"{r['ttft_mean_s'] * 1e3:,.1f} | {r['ttft_p50_s'] * 1e3:,.1f} | "
            f"{r['ttft_p90_s'] * 1e3:,.1f} | {r['ttft_p99_s'] * 1e3:,.1f} | {ratio:.3f} |"
        )
    return "\n".join(lines) + "\n"


def run(workload: Workload, config: dict[str, Any], scenarios: list[str]) -> list[dict[str, Any]]:
    """Every scenario x model x policy on ``workload``."""
    rows = []
    for scenario in scenarios:
        for model_name, model in MODELS.items():
            for policy in LOAD_POLICIES:
                sim = scenario_config(config, scenario, model, policy)
                rows.append(_row(simulate(workload, sim), scenario, model_name))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios; print the table, write ``--out`` .json and .md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="path without suffix: writes OUT.json and OUT.md")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args(argv)
    config = load_config()
    workload = build(config["workloads"]["mooncake"], 1, seed=1)
    rows = run(workload, config, args.scenarios.split(","))
    table = markdown(rows)
    load = os.getloadavg()[0]
    print(table)
    print(f"load average {load:.1f}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        out.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
