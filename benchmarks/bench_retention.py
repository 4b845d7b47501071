"""A pinned system prompt against a flood of one-off prompts: plain LRU vs retention, one run.

Exact command (repository root; about a minute on 2 shared cores)::

    .venv/bin/python benchmarks/bench_retention.py --out benchmarks/results/retention.md

Each case runs its own ``kvstore serve`` (``--dram-capacity 16MiB --nvme-capacity 32MiB``,
256 KiB chunks: the two tiers hold about 48 MiB, 24 one-off prompts) and replays ``--rounds``
rounds of: the system prompt's request (a lookup of its 16 chunks, a get of the leading chunks
found, a put of the whole chain, as the vLLM connector does), then ``gap`` one-off prompts of 8
chunks each (a put each, never read again). What is counted is the system prompt's prefix hits
in rounds 2 and later (round 1 is a cold miss everywhere). The cases, side by side per gap:

* ``plain``: every put is plain, as before retention existed: LRU evicts the system prompt once
  more than the tiers hold of one-offs went by since its last use;
* ``retained``: the system prompt's put asks ``Retention(3600)``, the one-offs are plain;
* ``flood not stored``: the system prompt is plain, the one-offs ask ``Retention(tiers="none")``
  (a client that knows a prompt is one-off keeps it out of the cache).

Also reported per case: the system prompt's get time when it hit (median ms), the store's
retained blocks per tier and blocks evicted early, and the case's wall time. Writes the markdown
to ``--out`` and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from _common import exit_on_sigterm, kvstore_server, machine_info, markdown_table

from kvstore import ChunkHasher, KVStoreClient, Namespace, Retention

_COMMAND = ".venv/bin/python benchmarks/bench_retention.py --out benchmarks/results/retention.md"
CHUNK_BYTES = 256 * 1024
SYSTEM_CHUNKS = 16
ONE_OFF_CHUNKS = 8
TOKENS_PER_CHUNK = 16
NS = Namespace(model="bench-retention", num_layers=2, num_kv_heads=2, head_size=64)
CASES = ("plain", "retained", "flood not stored")
PLAIN = Retention()


@dataclass
class Outcome:
    """What one case measured."""

    asked: int = 0
    hits: int = 0
    hit_get_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    retained: dict[str, int] = field(default_factory=dict)
    evicted_early: int = 0

    @property
    def rate(self) -> float:
        return self.hits / self.asked if self.asked else 0.0


def _prompt(seed: int, chunks: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, chunks * TOKENS_PER_CHUNK).tolist()
    keys = ChunkHasher(chunk_size=TOKENS_PER_CHUNK, namespace=NS).keys(tokens)
    return keys, [rng.bytes(CHUNK_BYTES) for _ in keys]


def run_case(case: str, gap: int, rounds: int) -> Outcome:
    """One server, ``rounds`` rounds of the system prompt then ``gap`` one-offs."""
    outcome = Outcome()
    system_keys, system_values = _prompt(1, SYSTEM_CHUNKS)
    pin = Retention(3600) if case == "retained" else PLAIN
    flood = Retention(tiers="none") if case == "flood not stored" else PLAIN
    seed = 1000
    started = time.perf_counter()
    with (
        kvstore_server(dram_capacity="16MiB", nvme_capacity="32MiB") as server,
        KVStoreClient(server.target, namespace=NS, timeout=60) as client,
    ):
        for round_ in range(rounds):
            hits = client.lookup(system_keys)
            if hits:
                began = time.perf_counter()
                got = client.get(system_keys[:hits])
                outcome.hit_get_ms.append((time.perf_counter() - began) * 1e3)
                if got != system_values[:hits]:
                    raise RuntimeError(f"{case}: the system prompt came back changed")
            if round_:
                outcome.asked += SYSTEM_CHUNKS
                outcome.hits += hits
            client.put(system_keys, system_values, retention=pin)
            for _ in range(gap):
                keys, values = _prompt(seed, ONE_OFF_CHUNKS)
                seed += 1
                client.put(keys, values, retention=flood)
        tiers = client.stats()["tiers"]
    outcome.wall_s = time.perf_counter() - started
    outcome.retained = {name: int(t.get("retained_blocks", 0)) for name, t in tiers.items()}
    outcome.evicted_early = sum(int(t.get("retained_evicted_early", 0)) for t in tiers.values())
    return outcome


def report(gaps: Sequence[int], rounds: int, results: dict[tuple[int, str], Outcome]) -> str:
    info = machine_info()
    load = os.getloadavg()
    rows = []
    for gap in gaps:
        row: list[str] = [str(gap), f"{gap * ONE_OFF_CHUNKS * CHUNK_BYTES / 2**20:.0f}"]
        for case in CASES:
            row.append(f"{results[gap, case].rate * 100:.0f} %")
        rows.append(row)
    hit_table = markdown_table(
        ["one-offs between uses", "MiB between uses", *(f"{c} hit rate" for c in CASES)], rows
    )
    detail = []
    for gap in gaps:
        for case in CASES:
            o = results[gap, case]
            ms = f"{statistics.median(o.hit_get_ms):.1f}" if o.hit_get_ms else "-"
            retained = ", ".join(f"{k} {v}" for k, v in o.retained.items() if v) or "-"
            detail.append(
                [str(gap), case, f"{o.hits}/{o.asked}", ms, retained, str(o.evicted_early),
                 f"{o.wall_s:.1f}"]
            )  # fmt: skip
    detail_table = markdown_table(
        [
            "gap",
            "case",
            "prefix chunks hit",
            "hit get p50 (ms)",
            "retained blocks at end",
            "evicted early",
            "wall (s)",
        ],
        detail,
        "llrrlrr",
    )
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"# Retention: a pinned system prompt against a flood of one-off prompts\n\n"
        f"Run {when}; `{_COMMAND}`; {rounds} rounds per case (hits counted from round 2); "
        f"dram 16 MiB + nvme 32 MiB, {CHUNK_BYTES // 1024} KiB chunks, system prompt "
        f"{SYSTEM_CHUNKS} chunks, one-off prompts {ONE_OFF_CHUNKS} chunks. Load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end; {info.get('cpu', '')}, "
        f"{info.get('cores', '')} cores.\n\n{hit_table}\n\n{detail_table}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gaps", default="4,16,24,32,64", help="one-off prompts between uses")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    exit_on_sigterm()
    gaps = [int(g) for g in args.gaps.split(",")]
    results: dict[tuple[int, str], Outcome] = {}
    for gap in gaps:
        for case in CASES:  # side by side: each gap's cases run back to back
            results[gap, case] = run_case(case, gap, args.rounds)
            print(f"gap {gap} {case}: {results[gap, case].rate:.0%}", file=sys.stderr)
    text = report(gaps, args.rounds, results)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
