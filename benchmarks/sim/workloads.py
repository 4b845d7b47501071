"""Workloads of the simulator: requests with arrival times and chained chunk ids.

A :class:`Request` is what the simulator needs of a prompt: when it arrives, its chunk ids (one
per chunk of ``chunk_tokens`` tokens; equal ids at equal positions are a shared prefix, as the
chained keys of :mod:`kvstore.keys` are), its prompt and output lengths. Three sources, all
parameterised in ``workloads.toml`` (:func:`load_config`):

* ``mooncake``: the Mooncake FAST'25 synthetic trace (its ``hash_ids`` are already per-position
  prefix block ids), replayed as ``ceil(nodes / nodes_per_copy)`` copies with disjoint ids;
* ``zipf``: shared prefixes picked by a Zipf law, each followed by a request's own chunks;
* ``conversation``: multi-turn chats under one system prompt, each turn resending the history.

Every generator is deterministic for its seed.
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_PATH", "Request", "Workload", "build", "ideal_hit_rate", "load_config"]

#: The one file of parameters.
CONFIG_PATH = Path(__file__).with_name("workloads.toml")
_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt: arrival (s), chunk ids (chained: an id names its whole prefix), lengths."""

    arrival_s: float
    chunks: tuple[int, ...]
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival, and the tokens per chunk they were cut with."""

    name: str
    chunk_tokens: int
    requests: list[Request]


def load_config(path: Path = CONFIG_PATH) -> dict[str, Any]:
    """The parsed ``workloads.toml``."""
    with path.open("rb") as handle:
        return tomllib.load(handle)


def build(spec: dict[str, Any], nodes: int, seed: int) -> Workload:
    """The workload ``spec`` (one ``[workloads.X]`` table) for a fleet of ``nodes``."""
    kind = spec["kind"]
    makers = {"mooncake": _mooncake, "zipf": _zipf, "conversation": _conversation}
    if kind not in makers:
        raise ValueError(f"workload kind must be one of {sorted(makers)}, got {kind!r}")
    requests = sorted(makers[kind](spec, nodes, random.Random(seed)), key=lambda r: r.arrival_s)
    return Workload(kind, int(spec["chunk_tokens"]), requests)


def ideal_hit_rate(requests: list[Request]) -> float:
    """Chunks whose id an earlier request already had, over all chunks: the hit rate of one
    infinite cache that every request reaches (a chained id is seen only with its prefix)."""
    seen: set[int] = set()
    hits = total = 0
    for request in requests:
        hits += sum(1 for chunk in request.chunks if chunk in seen)
        total += len(request.chunks)
        seen.update(request.chunks)
    return hits / total if total else 0.0


def _uniform(rng: random.Random, bounds: list[Any]) -> Any:
    low, high = bounds
    return rng.randint(low, high) if isinstance(low, int) else rng.uniform(low, high)


def _mooncake(spec: dict[str, Any], nodes: int, rng: random.Random) -> Iterator[Request]:
    path = Path(spec["path"])
    if not path.is_absolute():  # relative to the checkout, like every benchmark command
        path = _ROOT / path
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if spec.get("requests"):
        rows = rows[: int(spec["requests"])]
    span = 1 + max(max(row["hash_ids"], default=0) for row in rows)
    copies = max(1, math.ceil(nodes / int(spec["nodes_per_copy"])))
    for copy in range(copies):
        offset = copy * span
        for row in rows:
            yield Request(
                row["timestamp"] / 1000.0,
                tuple(offset + h for h in row["hash_ids"]),
                int(row["input_length"]),
                int(row["output_length"]),
            )


def _zipf(spec: dict[str, Any], nodes: int, rng: random.Random) -> Iterator[Request]:
    chunk_tokens = int(spec["chunk_tokens"])
    prefixes = int(spec["prefixes_per_node"]) * nodes
    lengths = [_uniform(rng, spec["prefix_chunks"]) for _ in range(prefixes)]
    weights = [1.0 / (rank + 1) ** float(spec["zipf_s"]) for rank in range(prefixes)]
    total = int(spec["requests_per_node"]) * nodes
    rate = float(spec["rate_per_node_rps"]) * nodes
    # Prefix p's chunk j is id p * stride + j; suffix ids come after every prefix id.
    stride = max(lengths, default=1)
    fresh = prefixes * stride
    now = 0.0
    picks = rng.choices(range(prefixes), weights=weights, k=total)
    for pick in picks:
        now += rng.expovariate(rate)
        own = _uniform(rng, spec["suffix_chunks"])
        chunks = tuple(pick * stride + j for j in range(lengths[pick])) + tuple(
            range(fresh, fresh + own)
        )
        fresh += own
        yield Request(now, chunks, len(chunks) * chunk_tokens, int(spec["output_tokens"]))


def _conversation(spec: dict[str, Any], nodes: int, rng: random.Random) -> Iterator[Request]:
    chunk_tokens = int(spec["chunk_tokens"])
    system = tuple(range(int(spec["system_chunks"])))
    fresh = len(system)
    output_s = int(spec["output_tokens"]) * 0.02  # a turn's answer takes about this long
    for _ in range(int(spec["conversations_per_node"]) * nodes):
        history = system
        now = rng.uniform(0.0, float(spec["start_window_s"]))
        for _turn in range(_uniform(rng, spec["turns"])):
            new = _uniform(rng, spec["turn_chunks"])
            history = history + tuple(range(fresh, fresh + new))
            fresh += new
            yield Request(now, history, len(history) * chunk_tokens, int(spec["output_tokens"]))
            now += output_s + _uniform(rng, spec["think_s"])
