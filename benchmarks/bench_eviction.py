"""Hit rate of each eviction policy on a shared-prefix trace, side by side, by tier capacity.

Exact command (repository root; about 30 seconds on 2 shared cores)::

    .venv/bin/python benchmarks/bench_eviction.py --out benchmarks/results/eviction.md

Replays ``--trace`` (default ``../shared/traces/mooncake_synthetic_trace.jsonl`` next to the
repository: the Mooncake FAST'25 synthetic trace, 3,993 requests whose ``hash_ids`` name their
512-token prefix blocks; equal ids at equal positions are a shared prefix) through one simulated
tier of ``--capacities`` blocks (every block has footprint 1), using the real
:class:`kvstore.store.eviction.RecencyIndex` of each policy. Each request does what an engine's
request does to the store, touching keys the way :class:`~kvstore.store.TieredStore` does:

1. **lookup** of its chain: the *prefix hits* (leading ids held: what a lookup returns and an
   engine can use) and the *block hits* (ids held anywhere in the chain) are counted;
2. **get** of the prefix hits: the found keys are touched suffix first
   (:meth:`kvstore.policy.Policy.recency_order`), so the prefix ends up most recent;
3. **put** of the whole chain: a present key is touched, a missing one is stored after
   :meth:`~kvstore.store.eviction.RecencyIndex.victims` names the block to evict; then the chain
   is touched suffix first.

Rates are hits over all blocks the trace asks for. The ``unbounded`` row is the ceiling: a tier
that never evicts hits every block it has seen before.

Also reported: each policy's index cost per operation (ns per ``add``, ``touch`` and
``victims`` of 8 blocks past 10 pinned ones, on 50,000 keys; median of 5 runs), since ``touch``
is on every read's path. Writes the markdown to ``--out`` and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from _common import machine_info, markdown_table

from kvstore.policy import EVICTIONS, Policy
from kvstore.store.eviction import RecencyIndex

_ROOT = Path(__file__).resolve().parents[1]
_DEFAULT_TRACE = _ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
_DEFAULT_CAPACITIES = (1000, 2000, 4000, 8000, 16000)
_COMMAND = ".venv/bin/python benchmarks/bench_eviction.py --out benchmarks/results/eviction.md"


@dataclass
class Outcome:
    """Blocks one replay asked for, and how many a lookup found (anywhere / as leading prefix)."""

    blocks: int = 0
    block_hits: int = 0
    prefix_hits: int = 0
    evictions: int = 0

    def rates(self) -> tuple[float, float]:
        return self.block_hits / self.blocks, self.prefix_hits / self.blocks


def load_trace(path: Path) -> list[list[bytes]]:
    """Each request's chain of block keys (the hash id as 8 bytes: the index only hashes keys)."""
    with path.open() as trace:
        return [
            [h.to_bytes(8, "little") for h in json.loads(line)["hash_ids"]]
            for line in trace
            if line.strip()
        ]


def replay(requests: Sequence[Sequence[bytes]], policy: str, capacity: int) -> Outcome:
    """Replay ``requests`` through one tier of ``capacity`` blocks evicting by ``policy``."""
    index = RecencyIndex(policy)
    order = Policy.recency_order
    outcome = Outcome()
    for chain in requests:
        held = index.members
        prefix = next((i for i, key in enumerate(chain) if key not in held), len(chain))
        outcome.blocks += len(chain)
        outcome.prefix_hits += prefix
        outcome.block_hits += sum(key in held for key in chain)
        for key in order(chain[:prefix]):  # get of the prefix hits
            index.touch(key)
        for key in chain:  # put of the chain
            if key in index:
                index.touch(key)
                continue
            if len(index) >= capacity:
                victims = index.victims(len(index) - capacity + 1)
                assert victims is not None  # nothing is pinned here
                for victim in victims:
                    index.discard(victim)
                outcome.evictions += len(victims)
            index.add(key, 1)
        for key in order(chain):
            index.touch(key)
    return outcome


def unbounded(requests: Sequence[Sequence[bytes]]) -> Outcome:
    """The ceiling: hits of a tier that never evicts."""
    seen: set[bytes] = set()
    outcome = Outcome()
    for chain in requests:
        prefix = next((i for i, key in enumerate(chain) if key not in seen), len(chain))
        outcome.blocks += len(chain)
        outcome.prefix_hits += prefix
        outcome.block_hits += sum(key in seen for key in chain)
        seen.update(chain)
    return outcome


def op_costs(policy: str, count: int = 50_000, runs: int = 5) -> tuple[float, float, float]:
    """Median ns per ``add``, per ``touch`` and per ``victims`` call of ``policy``'s index."""
    keys = [os.urandom(32) for _ in range(count)]
    samples: tuple[list[float], list[float], list[float]] = ([], [], [])
    pins = set(keys[-10:])  # the keys touched first: where lru and lfu-aging look first

    def per_op(run: Callable[[], None], ops: int) -> float:
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) / ops * 1e9

    for _ in range(runs):
        index = RecencyIndex(policy)

        def adds(index: RecencyIndex = index) -> None:
            for key in keys:
                index.add(key, 4096)

        def touches(index: RecencyIndex = index) -> None:
            for key in reversed(keys):
                index.touch(key)

        def victims(index: RecencyIndex = index) -> None:
            for _ in range(2000):
                index.victims(8 * 4096, pins)

        samples[0].append(per_op(adds, count))
        samples[1].append(per_op(touches, count))
        index.victims(1, pins)  # settles a heap's stale items once, outside the timing
        samples[2].append(per_op(victims, 2000))
    add, touch, pick = (statistics.median(s) for s in samples)
    return add, touch, pick


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def report(
    requests: Sequence[Sequence[bytes]], capacities: Sequence[int], trace: Path
) -> tuple[str, float]:
    started = time.perf_counter()
    unique = len({key for chain in requests for key in chain})
    ceiling = unbounded(requests)
    headers = ["capacity (blocks)", "% of distinct"]
    headers += [f"{p} blocks" for p in EVICTIONS] + [f"{p} prefix" for p in EVICTIONS]
    rows: list[list[str]] = []
    for capacity in capacities:
        outcomes = [replay(requests, policy, capacity) for policy in EVICTIONS]
        row = [str(capacity), _percent(capacity / unique)]
        row += [_percent(o.rates()[0]) for o in outcomes]
        row += [_percent(o.rates()[1]) for o in outcomes]
        rows.append(row)
    block_ceiling, prefix_ceiling = ceiling.rates()
    ceiling_row = ["unbounded", "100.0%"]
    ceiling_row += [_percent(block_ceiling)] * len(EVICTIONS)
    ceiling_row += [_percent(prefix_ceiling)] * len(EVICTIONS)
    rows.append(ceiling_row)
    costs = [(policy, *op_costs(policy)) for policy in EVICTIONS]
    elapsed = time.perf_counter() - started
    lines = [
        "# Eviction policies: hit rate on a shared-prefix trace",
        "",
        f"Command: `{_COMMAND}`",
        "",
        f"Run: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {elapsed:.0f} s. "
        f"Trace: `{trace.name}`, {len(requests)} requests, "
        f"{sum(map(len, requests))} blocks asked for, {unique} distinct. One simulated tier per "
        "cell (footprint 1 per block); each request is a lookup, a get of its prefix hits and a "
        "put of its chain, touched as the store touches them (suffix first). `blocks`: blocks "
        "held anywhere in the chain at lookup; `prefix`: leading blocks held (what a lookup "
        "returns, what an engine can use). Rates are over all blocks asked for.",
        "",
        "## Hit rate by capacity",
        "",
        markdown_table(headers, rows),
        "",
        "## Index cost per operation (ns, median of 5 runs, 50,000 keys)",
        "",
        markdown_table(
            ["policy", "add", "touch", "victims (8 blocks, 10 pinned)"],
            [[p, f"{a:.0f}", f"{t:.0f}", f"{v:.0f}"] for p, a, t, v in costs],
        ),
        "",
        "## Machine",
        "",
        markdown_table(["", ""], list(machine_info().items())),
        "",
    ]
    return "\n".join(lines), elapsed


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=_DEFAULT_TRACE)
    parser.add_argument(
        "--capacities",
        type=lambda text: [int(part) for part in text.split(",")],
        default=list(_DEFAULT_CAPACITIES),
        help="tier capacities in blocks, comma-separated",
    )
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    requests = load_trace(args.trace)
    text, _ = report(requests, args.capacities, args.trace)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
