"""Get / put / lookup through ``KVStoreClient`` with blocks in each tier, and gets after Prefetch.

Exact command (repository root; about 1 minute on 2 shared cores)::

    .venv/bin/python benchmarks/bench_tiers.py --out benchmarks/results/tiers

Writes ``tiers.md`` and ``tiers.json`` (the ``--out`` path with those suffixes) and prints the
markdown. Everything measured is started here on free loopback ports and stopped on exit, error
or SIGTERM: one ``redis-server --save '' --appendonly no`` and four ``kvstore serve``:

* ``D``: 1 GiB of dram, no Redis: blocks put there stay in dram;
* ``N``: ``--dram-capacity 0``: every block is stored in and served from nvme (LMDB through the
  page cache);
* ``A`` and ``B``: 1 GiB of dram each, one shared Redis: a block put at ``A`` is written through
  to Redis, and ``B``, which never saw it, has it only in Redis.

For each block size (1 MiB, 4 MiB) every call moves a batch of ``--batch`` blocks (8); gets are
``get_into`` preallocated buffers. Cases, timed interleaved round-robin with a rotating order
(``_common.run_interleaved``):

* ``put dram`` / ``put nvme`` / ``put dram+redis``: a put of fresh keys at D / N / A (at A the
  write-through to Redis runs in the background, after the put returns); deleted untimed.
* ``get dram`` / ``get nvme``: a get of a stored batch at D / N.
* ``get redis (cold)``: fresh keys put at A, waited until B sees them in Redis (untimed), then
  a get at B: read from Redis (B promotes them into its dram in the background afterwards).
* ``get after prefetch``: the same setup, then ``B.prefetch(keys)`` and ``B.wait_prefetch``
  (untimed; B's lookup must say ``dram`` for every key), then the timed get at B.
* ``get B dram``: a get at B of blocks put at B itself, always in B's dram: the baseline of the
  prefetch target "a prefetched get within 20% of a block that was always in dram".

``prefetch → DONE`` is the untimed-case's prefetch itself, from the Prefetch call until the
status poll (1 ms, backing off to 50 ms) saw DONE: an upper bound, reported for information.

Lookup latency: ``KVStoreClient.lookup`` of one batch of keys held in dram (at D), in nvme (at N)
and only in Redis (at B: the server's index misses them and asks Redis with one EXISTS), as
median / p90 / p99 microseconds.

Every path is checked once per size to return the exact bytes put, and each server's lookup to
report the tier the case claims; afterwards D, A and B must report no dram evictions.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    GB,
    KeySource,
    ServerProcess,
    check,
    exit_on_sigterm,
    fresh_put_case,
    kvstore_server,
    machine_info,
    markdown_table,
    redis_server,
    run_interleaved,
    summarize,
    timed,
)

from kvstore import KVStoreClient, Namespace
from kvstore.types import PrefetchState

MiB = 1024**2
SIZES = {"1 MiB": MiB, "4 MiB": 4 * MiB}
NAMESPACE = Namespace(model="bench-tiers")
CALL_TIMEOUT_S = 120.0
WRITE_THROUGH_TIMEOUT_S = 30.0

PUT_DRAM = "put dram"
PUT_NVME = "put nvme"
PUT_REDIS = "put dram+redis"
GET_DRAM = "get dram"
GET_NVME = "get nvme"
GET_COLD = "get redis (cold)"
GET_PREFETCHED = "get after prefetch"
GET_B_DRAM = "get B dram"
PREFETCH = "prefetch → DONE"
CASES = (PUT_DRAM, PUT_NVME, PUT_REDIS, GET_DRAM, GET_NVME, GET_COLD, GET_PREFETCHED, GET_B_DRAM)
LOOKUPS = {"dram": "D", "nvme": "N", "redis": "B"}


@dataclass
class Clients:
    """A client per server, by the letters of the module docstring."""

    d: KVStoreClient
    n: KVStoreClient
    a: KVStoreClient
    b: KVStoreClient


@dataclass
class SizeResult:
    """Seconds per call of every case (and of the prefetches) at one block size."""

    label: str
    block_bytes: int
    batch: int
    seconds: dict[str, list[float]] = field(default_factory=dict)
    lookups: dict[str, list[float]] = field(default_factory=dict)

    @property
    def call_bytes(self) -> int:
        """Bytes one call moves."""
        return self.block_bytes * self.batch


def _expect_tiers(client: KVStoreClient, keys: list[bytes], tier: str, what: str) -> None:
    tiers = client.lookup_tiers(keys).tiers
    check(tiers == [tier] * len(keys), f"{what}: blocks in {sorted(set(tiers))}, not {tier}")


def _expect_values(values: list[bytes | None], blocks: Sequence[bytes], what: str) -> None:
    check(len(values) == len(blocks), f"{what}: {len(values)} values for {len(blocks)} keys")
    for index, (value, block) in enumerate(zip(values, blocks, strict=True)):
        check(value is not None and len(value) == len(block), f"{what}: value {index} wrong")


def _redis_only_at_b(clients: Clients, keys: list[bytes], blocks: Sequence[bytes]) -> None:
    """Put ``keys`` at A and wait until B finds every one of them in Redis."""
    stored = clients.a.put(keys, blocks).stored
    check(stored == len(keys), f"put at A stored {stored} of {len(keys)}")
    deadline = time.monotonic() + WRITE_THROUGH_TIMEOUT_S
    while clients.b.lookup_tiers(keys).tiers != ["redis"] * len(keys):
        check(time.monotonic() < deadline, "write-through from A to Redis did not finish")
        time.sleep(0.005)


def _forget(clients: Clients, keys: list[bytes]) -> None:
    """Delete ``keys`` at B and A (A's delete also removes them from Redis)."""
    clients.b.delete(keys)
    clients.a.delete(keys)


def _prefetch_at_b(clients: Clients, keys: list[bytes]) -> float:
    """Prefetch ``keys`` at B until DONE; every key must then be in B's dram."""
    start = time.perf_counter()
    progress = clients.b.wait_prefetch(clients.b.prefetch(keys), timeout=CALL_TIMEOUT_S)
    seconds = time.perf_counter() - start
    check(progress.state is PrefetchState.DONE, f"prefetch ended {progress}")
    check(progress.ready == len(keys), f"prefetch moved {progress.ready} of {len(keys)}")
    _expect_tiers(clients.b, keys, "dram", "after prefetch at B")
    return seconds


def _verify(clients: Clients, blocks: Sequence[bytes], pools: dict[str, list[bytes]]) -> None:
    """Every path returns the exact bytes put, from the tier its case claims."""
    for client, pool, tier, what in (
        (clients.d, pools["d"], "dram", GET_DRAM),
        (clients.n, pools["n"], "nvme", GET_NVME),
        (clients.b, pools["b"], "dram", GET_B_DRAM),
    ):
        _expect_tiers(client, pool, tier, what)
        check(client.get(pool) == list(blocks), f"{what}: bytes differ from the put")
    _expect_tiers(clients.b, pools["a"], "redis", "A's pool seen from B")
    fresh = KeySource(seed=99).take(len(blocks))
    _redis_only_at_b(clients, fresh, blocks)
    check(clients.b.get(fresh) == list(blocks), f"{GET_COLD}: bytes differ from the put")
    _forget(clients, fresh)
    fresh = KeySource(seed=98).take(len(blocks))
    _redis_only_at_b(clients, fresh, blocks)
    _prefetch_at_b(clients, fresh)
    check(clients.b.get(fresh) == list(blocks), f"{GET_PREFETCHED}: bytes differ from the put")
    _forget(clients, fresh)


def _cases(
    clients: Clients,
    blocks: list[bytes],
    pools: dict[str, list[bytes]],
    fresh: KeySource,
    prefetch_seconds: list[float],
) -> dict[str, Callable[[], float]]:
    """One callable per case, returning the seconds of its timed region."""
    batch = len(blocks)
    # Gets land in preallocated buffers (get_into), as an engine's loads do: a fresh ``bytes`` per
    # block would time the page faults of allocating it as much as the store.
    buffers = [np.empty(len(block), dtype=np.uint8) for block in blocks]

    def read(client: KVStoreClient, keys: list[bytes], name: str) -> float:
        seconds, filled = timed(lambda: client.get_into(keys, buffers))
        check(filled == [True] * batch, f"{name}: filled {filled}")
        _expect_values([buffer.tobytes() for buffer in buffers], blocks, name)
        return seconds

    def put(client: KVStoreClient, name: str) -> Callable[[], float]:
        return fresh_put_case(client, blocks, fresh, name)

    def get(client: KVStoreClient, keys: list[bytes], name: str) -> Callable[[], float]:
        def case() -> float:
            return read(client, keys, name)

        return case

    def get_cold() -> float:
        keys = fresh.take(batch)
        _redis_only_at_b(clients, keys, blocks)
        seconds = read(clients.b, keys, GET_COLD)
        _forget(clients, keys)
        return seconds

    def get_prefetched() -> float:
        keys = fresh.take(batch)
        _redis_only_at_b(clients, keys, blocks)
        prefetch_seconds.append(_prefetch_at_b(clients, keys))
        seconds = read(clients.b, keys, GET_PREFETCHED)
        _forget(clients, keys)
        return seconds

    cases = {
        PUT_DRAM: put(clients.d, PUT_DRAM),
        PUT_NVME: put(clients.n, PUT_NVME),
        PUT_REDIS: put(clients.a, PUT_REDIS),
        GET_DRAM: get(clients.d, pools["d"], GET_DRAM),
        GET_NVME: get(clients.n, pools["n"], GET_NVME),
        GET_COLD: get_cold,
        GET_PREFETCHED: get_prefetched,
        GET_B_DRAM: get(clients.b, pools["b"], GET_B_DRAM),
    }
    return {name: cases[name] for name in CASES}


def _lookup_cases(
    clients: Clients, pools: dict[str, list[bytes]]
) -> dict[str, Callable[[], float]]:
    """Lookups of keys in dram (D), in nvme (N) and only in Redis (B asks Redis)."""
    targets = {
        "dram": (clients.d, pools["d"]),
        "nvme": (clients.n, pools["n"]),
        "redis": (clients.b, pools["a"]),  # A's pool: B never read it, so only Redis has it
    }

    def lookup(client: KVStoreClient, keys: list[bytes], tier: str) -> Callable[[], float]:
        def case() -> float:
            seconds, hits = timed(lambda: client.lookup(keys))
            check(hits == len(keys), f"lookup ({tier}) found {hits} of {len(keys)}")
            return seconds

        return case

    return {tier: lookup(client, keys, tier) for tier, (client, keys) in targets.items()}


def bench_size(args: argparse.Namespace, clients: Clients, label: str) -> SizeResult:
    """Store the pools, verify every path, then time every case and the lookups."""
    result = SizeResult(label, SIZES[label], args.batch)
    rng = np.random.default_rng(len(label))
    blocks = [
        rng.integers(0, 256, result.block_bytes, dtype=np.uint8).tobytes()
        for _ in range(args.batch)
    ]
    fresh = KeySource(seed=result.block_bytes)
    pools = {name: fresh.take(args.batch) for name in ("d", "n", "a", "b")}
    for name, client in (("d", clients.d), ("n", clients.n), ("a", clients.a), ("b", clients.b)):
        stored = client.put(pools[name], blocks).stored
        check(stored == args.batch, f"pool {name}: stored {stored} of {args.batch}")
    deadline = time.monotonic() + WRITE_THROUGH_TIMEOUT_S
    while clients.b.lookup(pools["a"]) < args.batch:  # A's pool must reach Redis
        check(time.monotonic() < deadline, "write-through of A's pool did not finish")
        time.sleep(0.01)
    _verify(clients, blocks, pools)
    prefetch_seconds: list[float] = []
    cases = _cases(clients, blocks, pools, fresh, prefetch_seconds)
    result.seconds = run_interleaved(cases, args.reps, warmup=args.warmup)
    result.seconds[PREFETCH] = prefetch_seconds[-args.reps :]
    lookups = _lookup_cases(clients, pools)
    result.lookups = run_interleaved(lookups, args.lookup_reps, warmup=args.lookup_warmup)
    for name, client in (("d", clients.d), ("n", clients.n), ("a", clients.a), ("b", clients.b)):
        client.delete(pools[name])
    return result


def _gbps(call_bytes: int, seconds: float) -> float:
    return call_bytes / seconds / GB


def throughput_table(results: list[SizeResult]) -> str:
    """Median / p90 GB/s and ms per call of every case."""
    rows = []
    for result in results:
        for name in (*CASES, PREFETCH):
            summary = summarize(result.seconds[name])
            rows.append(
                [
                    name,
                    result.label,
                    f"{_gbps(result.call_bytes, summary.median):.3f}",
                    f"{_gbps(result.call_bytes, summary.p90):.3f}",
                    f"{summary.median * 1e3:.1f}",
                    f"{summary.p90 * 1e3:.1f}",
                    summary.count,
                ]
            )
    headers = ["case", "block", "GB/s median", "GB/s p90", "ms median", "ms p90", "calls"]
    return markdown_table(headers, rows, align="llrrrrr")


def prefetch_table(results: list[SizeResult]) -> str:
    """The prefetch target: median get after prefetch / median get of always-in-dram blocks."""
    rows = []
    for result in results:
        medians = {name: summarize(result.seconds[name]).median for name in CASES}
        ratio = medians[GET_PREFETCHED] / medians[GET_B_DRAM]
        rows.append(
            [
                result.label,
                f"{medians[GET_COLD] * 1e3:.1f}",
                f"{medians[GET_PREFETCHED] * 1e3:.1f}",
                f"{medians[GET_B_DRAM] * 1e3:.1f}",
                f"{ratio:.3f}",
                "yes" if ratio <= 1.2 else "no",
            ]
        )
    headers = [
        "block",
        "cold get ms",
        "get after prefetch ms",
        "always-dram get ms",
        "prefetched / dram",
        "within 20%",
    ]
    return markdown_table(headers, rows, align="lrrrrl")


def lookup_table(results: list[SizeResult]) -> str:
    """Lookup latency in microseconds, per tier the keys are in."""
    rows = []
    for result in results:
        for tier, server in LOOKUPS.items():
            summary = summarize(result.lookups[tier])
            rows.append(
                [
                    tier,
                    server,
                    result.label,
                    result.batch,
                    f"{summary.median * 1e6:.0f}",
                    f"{summary.p90 * 1e6:.0f}",
                    f"{summary.p99 * 1e6:.0f}",
                    summary.count,
                ]
            )
    headers = ["keys in", "server", "block", "keys", "p50 µs", "p90 µs", "p99 µs", "calls"]
    return markdown_table(headers, rows, align="lllrrrrr")


def _evictions(clients: Clients) -> str:
    """Confirm no dram server evicted (so every dram case really read dram)."""
    notes = []
    for name, client in (("D", clients.d), ("A", clients.a), ("B", clients.b)):
        evictions = client.stats()["tiers"]["dram"].get("evictions", 0)
        check(evictions == 0, f"server {name} evicted {evictions} dram blocks")
        notes.append(f"{name}: {evictions}")
    return "dram evictions " + ", ".join(notes)


def to_json(results: list[SizeResult], info: dict[str, str], command: str) -> dict[str, Any]:
    """The figures of the report, machine-readable (seconds per call; GB/s; ratios)."""
    sizes = {}
    for result in results:
        cases = {}
        for name, samples in result.seconds.items():
            summary = summarize(samples)
            cases[name] = {
                "median_s": summary.median,
                "p90_s": summary.p90,
                "p99_s": summary.p99,
                "gbps_median": _gbps(result.call_bytes, summary.median),
                "calls": summary.count,
            }
        lookups = {}
        for tier, samples in result.lookups.items():
            summary = summarize(samples)
            lookups[tier] = {"p50_s": summary.median, "p99_s": summary.p99, "calls": summary.count}
        ratio = cases[GET_PREFETCHED]["median_s"] / cases[GET_B_DRAM]["median_s"]
        sizes[result.label] = {
            "block_bytes": result.block_bytes,
            "batch": result.batch,
            "cases": cases,
            "lookups": lookups,
            "prefetched_over_dram": ratio,
        }
    return {"command": command, "machine": info, "sizes": sizes}


def report(
    command: str,
    started: datetime.datetime,
    elapsed: float,
    info: dict[str, str],
    args: argparse.Namespace,
    results: list[SizeResult],
    note: str,
) -> str:
    """The whole markdown report."""
    machine = "\n".join(f"- {name}: {value}" for name, value in info.items())
    load_after = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    return f"""# Tiers: get / put / lookup by tier, and gets after Prefetch

Command: `{command}`

Run: {started:%Y-%m-%d %H:%M} UTC, {elapsed:.0f} s. Batch of {args.batch} blocks per call; \
{args.warmup} warm-up round(s), then {args.reps} timed calls per case and size, all cases of a \
size interleaved. GB = 10^9 bytes. Servers: D (dram only), N (`--dram-capacity 0`: nvme), A and \
B (dram, one shared Redis; B reads blocks put at A). Every path was checked once per size to \
read back the exact bytes put, from the tier its case claims; {note}. A server without a dram \
arena (N) offers no shared-memory data plane, so rows of different planes compare the planes as \
much as the tiers.

## Prefetch target: a get after prefetch vs a get of blocks always in dram

Both at server B, same batch size; target: prefetched / dram ≤ 1.2.

{prefetch_table(results)}

## Throughput by tier

`get redis (cold)`: B reads blocks only Redis holds. `prefetch → DONE`: Prefetch call until a
status poll (1 ms backing off to 50 ms) saw DONE, an upper bound.

{throughput_table(results)}

## Lookup latency by tier

`KVStoreClient.lookup` of {args.batch} keys; for `redis`, B's index misses every key and asks
Redis (one EXISTS).

{lookup_table(results)}

## Machine

Shared with other work while this ran; compare rows with each other, not with other runs.

{machine}
- load average after the run: {load_after}
"""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, help="write OUT.md and OUT.json (e.g. benchmarks/results/tiers)"
    )
    parser.add_argument(
        "--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), help="block sizes"
    )
    parser.add_argument("--batch", type=int, default=8, help="blocks per call (default 8)")
    parser.add_argument("--reps", type=int, default=40, help="timed calls per case and size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per size")
    parser.add_argument("--lookup-reps", type=int, default=400, help="timed lookups per case")
    parser.add_argument("--lookup-warmup", type=int, default=20, help="untimed lookups per case")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the report and write it (and its JSON) next to ``--out``."""
    args = _parse_args(argv)
    exit_on_sigterm()
    command = shlex.join([".venv/bin/python", "benchmarks/bench_tiers.py", *sys.argv[1:]])
    started = datetime.datetime.now(datetime.UTC)
    clock = time.monotonic()
    info = machine_info(
        ("grpcio", "protobuf", "redis", "numpy", "lmdb"),
        {"redis-server": ["redis-server", "--version"]},
    )
    # A and B share one Redis, so they need the same integrity secrets: with each generating its
    # own, B reads A's blocks as MAC failures, and since the keyring check at start it runs
    # without the shared tier at all (the servers inherit this environment).
    os.environ.setdefault("KVSTORE_INTEGRITY_SECRETS", f"bench-tiers-{os.urandom(8).hex()}")
    with contextlib.ExitStack() as stack:
        rds = stack.enter_context(redis_server())
        shared = ["--redis-url", f"redis://{rds.target}/0"]
        servers: dict[str, ServerProcess] = {
            "d": stack.enter_context(kvstore_server(dram_capacity="1GiB")),
            "n": stack.enter_context(kvstore_server(dram_capacity="0")),
            "a": stack.enter_context(kvstore_server(dram_capacity="1GiB", extra_args=shared)),
            "b": stack.enter_context(kvstore_server(dram_capacity="1GiB", extra_args=shared)),
        }
        clients = Clients(
            **{
                name: stack.enter_context(
                    KVStoreClient(server.target, namespace=NAMESPACE, timeout=CALL_TIMEOUT_S)
                )
                for name, server in servers.items()
            }
        )
        results = []
        for label in args.sizes:
            size_clock = time.monotonic()
            results.append(bench_size(args, clients, label))
            print(f"  {label}: {time.monotonic() - size_clock:.0f} s", file=sys.stderr)
        # The client picks its data plane itself (shared memory on the same host, where the
        # server offers it); record which one the figures are of.
        planes = ", ".join(
            f"{name.upper()}: {getattr(client, 'data_plane', 'grpc')}"
            for name, client in vars(clients).items()
        )
        note = f"{_evictions(clients)}; client data plane per server: {planes}"
        for server in (*servers.values(), rds):
            server.check_alive()
    text = report(command, started, time.monotonic() - clock, info, args, results, note)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        payload = to_json(results, info, command)
        args.out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
