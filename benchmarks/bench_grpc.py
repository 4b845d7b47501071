"""Put / get / lookup through kvstore's gRPC path, side by side with memcpy and redis-py.

Exact command (repository root; about 2 minutes on 2 shared cores)::

    .venv/bin/python benchmarks/bench_grpc.py --out benchmarks/results/grpc.md

The script starts everything it measures on free loopback ports and stops it on exit, error or
SIGTERM: a ``kvstore serve`` with 1 GiB of dram (every block stays in dram; checked: no dram
evictions), a second ``kvstore serve`` with ``--dram-capacity 0`` (every block is stored in and
served from the nvme tier, an LMDB file in a temporary directory, so reads come from the page
cache), and a ``redis-server --save '' --appendonly no``.

For each block size (256 KiB, 1 MiB, 4 MiB) one call moves a batch of ``--batch`` blocks (8):

* ``memcpy``: ``numpy.copyto`` of each block into a preallocated buffer (the floor of any copy);
* ``redis-py SET`` / ``redis-py GET``: one pipeline of SET / GET commands (redis-py + hiredis);
* ``gRPC put`` / ``gRPC get``: ``KVStoreClient.put`` / ``.get`` (one streamed call each), against
  the dram server and against the nvme-only server.

Puts always write keys the server does not hold (a put of a present key is a no-op), deleted
again outside the timed region; gets read the same stored batch again and again. The cases of one
size run interleaved, round-robin with a rotating order, so that noise from other work on the
machine hits every case alike. Before timing, each size is verified once: the bytes read back
through every path equal the bytes put, and the servers report the tier each block is in.

Throughput columns (GB = 10**9 bytes; a call moves ``batch x block`` bytes):

* ``GB/s median``: bytes per call / median seconds per call;
* ``GB/s p90``: bytes per call / 90th-percentile seconds per call, i.e. 90% of calls were at
  least this fast;
* ``vs memcpy``: median GB/s / memcpy's median GB/s for the same block size;
* ``vs redis``: median GB/s / redis-py's median GB/s in the same direction (put vs SET, get vs
  GET) for the same block size.

Lookup latency (``KVStoreClient.lookup`` of 16 / 128 / 1024 stored keys, whose answer is the
number of leading keys present) is reported as median / p90 / p99 / max microseconds per call,
next to redis ``EXISTS`` of the same keys in one command, the cheapest round trip to a local
server that touches as many keys (it counts present keys, not leading ones).

Writes the markdown report to ``--out`` and prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
from _common import (
    GB,
    KeySource,
    ServerProcess,
    Summary,
    check,
    exit_on_sigterm,
    kvstore_server,
    machine_info,
    markdown_table,
    redis_server,
    run_interleaved,
    summarize,
    timed,
)

from kvstore import KVStoreClient, Namespace

KiB = 1024
MiB = 1024**2
SIZES = {"256 KiB": 256 * KiB, "1 MiB": MiB, "4 MiB": 4 * MiB}
LOOKUP_COUNTS = (16, 128, 1024)
NAMESPACE = Namespace(model="bench-grpc")
CALL_TIMEOUT_S = 120.0
#: Bytes each case should move per block size, which sets the default repetitions.
TARGET_BYTES = 2048 * MiB
MIN_REPS, MAX_REPS = 40, 120

MEMCPY = "memcpy"
REDIS_SET = "redis-py SET"
REDIS_GET = "redis-py GET"
PUT_DRAM = "gRPC put (dram)"
GET_DRAM = "gRPC get (dram)"
PUT_NVME = "gRPC put (nvme)"
GET_NVME = "gRPC get (nvme)"
CASE_ORDER = (MEMCPY, REDIS_SET, REDIS_GET, PUT_DRAM, GET_DRAM, PUT_NVME, GET_NVME)
REDIS_BASELINE = {REDIS_SET: REDIS_SET, PUT_DRAM: REDIS_SET, PUT_NVME: REDIS_SET}
REDIS_BASELINE |= {REDIS_GET: REDIS_GET, GET_DRAM: REDIS_GET, GET_NVME: REDIS_GET}


@dataclass
class SizeResult:
    """Seconds per call of every case at one block size."""

    label: str
    block_bytes: int
    batch: int
    reps: int
    seconds: dict[str, list[float]] = field(default_factory=dict)

    @property
    def call_bytes(self) -> int:
        """Bytes one call moves."""
        return self.block_bytes * self.batch


def _check_values(
    name: str, values: list[Any], expected: list[np.ndarray[Any, Any]], *, full: bool = False
) -> None:
    """Every value present with the right length (and, with ``full``, the right bytes)."""
    check(len(values) == len(expected), f"{name}: {len(values)} values for {len(expected)} keys")
    for index, (value, block) in enumerate(zip(values, expected, strict=True)):
        check(value is not None, f"{name}: value {index} missing")
        check(len(value) == block.nbytes, f"{name}: value {index} has {len(value)} bytes")
        if full:
            check(bytes(value) == block.tobytes(), f"{name}: value {index} differs from its put")


def _verify_size(
    label: str,
    blocks: list[np.ndarray[Any, Any]],
    keys: list[bytes],
    dram: KVStoreClient,
    nvme: KVStoreClient,
    rds: redis.Redis,
) -> None:
    """Store ``blocks`` under ``keys`` everywhere and check every path reads the same bytes."""
    for client, tier in ((dram, "dram"), (nvme, "nvme")):
        result = client.put(keys, blocks)
        check(result.stored == len(keys), f"{label} {tier}: put stored {result.stored}")
        lookup = client.lookup_tiers(keys)
        check(lookup.hits == len(keys), f"{label} {tier}: lookup found {lookup.hits}")
        check(
            set(lookup.tiers) == {tier}, f"{label}: blocks in tiers {set(lookup.tiers)}, not {tier}"
        )
        _check_values(f"{label} gRPC get ({tier})", client.get(keys), blocks, full=True)
    pipe = rds.pipeline(transaction=False)
    for key, block in zip(keys, blocks, strict=True):
        pipe.set(key, block.data)
    check(all(pipe.execute()), f"{label}: redis SET failed")
    pipe = rds.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    _check_values(f"{label} redis GET", pipe.execute(), blocks, full=True)
    copies = [np.empty_like(block) for block in blocks]
    for copy, block in zip(copies, blocks, strict=True):
        np.copyto(copy, block)
    _check_values(f"{label} memcpy", [c.data for c in copies], blocks, full=True)


def _cases(
    blocks: list[np.ndarray[Any, Any]],
    keys: list[bytes],
    fresh: KeySource,
    dram: KVStoreClient,
    nvme: KVStoreClient,
    rds: redis.Redis,
) -> dict[str, Callable[[], float]]:
    """One callable per case, returning the seconds of its timed region."""
    batch = len(blocks)
    copies = [np.empty_like(block) for block in blocks]

    def memcpy() -> float:
        start = time.perf_counter()
        for copy, block in zip(copies, blocks, strict=True):
            np.copyto(copy, block)
        return time.perf_counter() - start

    def redis_set() -> float:
        new_keys = fresh.take(batch)

        def call() -> list[Any]:
            pipe = rds.pipeline(transaction=False)
            for key, block in zip(new_keys, blocks, strict=True):
                pipe.set(key, block.data)
            return pipe.execute()

        seconds, replies = timed(call)
        check(all(replies), "redis SET failed")
        rds.delete(*new_keys)
        return seconds

    def redis_get() -> float:
        def call() -> list[Any]:
            pipe = rds.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            return pipe.execute()

        seconds, values = timed(call)
        _check_values(REDIS_GET, values, blocks)
        return seconds

    def grpc_put(client: KVStoreClient, name: str) -> Callable[[], float]:
        def case() -> float:
            new_keys = fresh.take(batch)
            seconds, result = timed(lambda: client.put(new_keys, blocks))
            check(result.stored == batch, f"{name}: stored {result.stored} of {batch}")
            client.delete(new_keys)
            return seconds

        return case

    def grpc_get(client: KVStoreClient, name: str) -> Callable[[], float]:
        def case() -> float:
            seconds, values = timed(lambda: client.get(keys))
            _check_values(name, values, blocks)
            return seconds

        return case

    cases = {
        MEMCPY: memcpy,
        REDIS_SET: redis_set,
        REDIS_GET: redis_get,
        PUT_DRAM: grpc_put(dram, PUT_DRAM),
        GET_DRAM: grpc_get(dram, GET_DRAM),
        PUT_NVME: grpc_put(nvme, PUT_NVME),
        GET_NVME: grpc_get(nvme, GET_NVME),
    }
    return {name: cases[name] for name in CASE_ORDER}


def default_reps(call_bytes: int) -> int:
    """Enough calls to move :data:`TARGET_BYTES`, within ``[MIN_REPS, MAX_REPS]``."""
    return max(MIN_REPS, min(MAX_REPS, math.ceil(TARGET_BYTES / call_bytes)))


def bench_throughput(
    args: argparse.Namespace, dram: KVStoreClient, nvme: KVStoreClient, rds: redis.Redis
) -> list[SizeResult]:
    """Verify, then time every case, for every block size."""
    rng = np.random.default_rng(0)
    fresh = KeySource(seed=1)
    results = []
    for label in args.sizes:
        started = time.monotonic()
        block_bytes = SIZES[label]
        blocks = [rng.integers(0, 256, size=block_bytes, dtype=np.uint8) for _ in range(args.batch)]
        keys = fresh.take(args.batch)
        _verify_size(label, blocks, keys, dram, nvme, rds)
        result = SizeResult(label, block_bytes, args.batch, 0)
        result.reps = args.reps or default_reps(result.call_bytes)
        cases = _cases(blocks, keys, fresh, dram, nvme, rds)
        result.seconds = run_interleaved(cases, result.reps, warmup=args.warmup)
        results.append(result)
        elapsed = time.monotonic() - started
        print(f"  {label}: {result.reps} calls per case, {elapsed:.0f} s", file=sys.stderr)
    return results


def bench_lookup(
    args: argparse.Namespace, client: KVStoreClient, rds: redis.Redis
) -> dict[str, list[float]]:
    """Latency of lookups of 16 / 128 / 1024 stored keys, and of redis EXISTS of them."""
    keys = KeySource(seed=2).take(max(LOOKUP_COUNTS) + 1)
    stored, absent = keys[:-1], keys[-1]
    value = np.zeros(4 * KiB, dtype=np.uint8)
    client.put(stored, [value] * len(stored))
    rds.mset({key: value.data for key in stored})
    # A lookup counts *leading* hits: check that, so the timings are of a working lookup.
    check(client.lookup(stored) == len(stored), "lookup missed stored keys")
    check(client.lookup([*stored[:5], absent, *stored[5:9]]) == 5, "lookup miscounted")
    cases: dict[str, Callable[[], float]] = {}
    for count in LOOKUP_COUNTS:
        subset = stored[:count]

        def grpc_lookup(subset: list[bytes] = subset) -> float:
            seconds, hits = timed(lambda: client.lookup(subset))
            check(hits == len(subset), f"lookup of {len(subset)} keys found {hits}")
            return seconds

        def redis_exists(subset: list[bytes] = subset) -> float:
            seconds, present = timed(lambda: rds.exists(*subset))
            check(present == len(subset), f"EXISTS of {len(subset)} keys found {present}")
            return seconds

        cases[f"gRPC Lookup|{count}"] = grpc_lookup
        cases[f"redis EXISTS|{count}"] = redis_exists
    return run_interleaved(cases, args.lookup_reps, warmup=args.lookup_warmup)


def _gbps(call_bytes: int, seconds: float) -> float:
    return call_bytes / seconds / GB


def throughput_table(results: list[SizeResult]) -> str:
    """The markdown throughput table."""
    rows = []
    for result in results:
        summaries = {name: summarize(s) for name, s in result.seconds.items()}
        memcpy = _gbps(result.call_bytes, summaries[MEMCPY].median)
        for name in CASE_ORDER:
            summary = summaries[name]
            median = _gbps(result.call_bytes, summary.median)
            baseline = REDIS_BASELINE.get(name)
            vs_redis = (
                f"{median / _gbps(result.call_bytes, summaries[baseline].median):.2f}"
                if baseline
                else "—"
            )
            rows.append(
                [
                    name,
                    result.label,
                    f"{median:.3f}",
                    f"{_gbps(result.call_bytes, summary.p90):.3f}",
                    f"{median / memcpy:.3f}",
                    vs_redis,
                    f"{summary.median * 1e3:.2f}",
                    summary.count,
                ]
            )
    headers = [
        "operation",
        "block",
        "GB/s median",
        "GB/s p90",
        "vs memcpy",
        "vs redis",
        "ms/call median",
        "calls",
    ]
    return markdown_table(headers, rows, align="llrrrrrr")


def lookup_table(samples: dict[str, list[float]]) -> str:
    """The markdown lookup latency table (microseconds)."""
    rows = []
    for count in LOOKUP_COUNTS:
        redis_median = summarize(samples[f"redis EXISTS|{count}"]).median
        for name in ("gRPC Lookup", "redis EXISTS"):
            summary: Summary = summarize(samples[f"{name}|{count}"])
            rows.append(
                [
                    name,
                    count,
                    f"{summary.median * 1e6:.0f}",
                    f"{summary.p90 * 1e6:.0f}",
                    f"{summary.p99 * 1e6:.0f}",
                    f"{summary.max * 1e6:.0f}",
                    f"{summary.median / redis_median:.2f}",
                    summary.count,
                ]
            )
    headers = ["call", "keys", "median µs", "p90 µs", "p99 µs", "max µs", "vs redis", "calls"]
    return markdown_table(headers, rows, align="lrrrrrrr")


def _server_check(dram_server: ServerProcess, dram: KVStoreClient) -> str:
    """Confirm the dram server never evicted (so every dram row really read dram)."""
    dram_server.check_alive()
    tier = dram.stats()["tiers"]["dram"]
    check(tier.get("evictions", 0) == 0, f"the dram server evicted {tier['evictions']} blocks")
    return f"dram server: {tier.get('evictions', 0)} evictions, {tier.get('blocks', 0)} blocks held"


def report(
    command: str,
    started: datetime.datetime,
    elapsed: float,
    info_before: dict[str, str],
    load_after: str,
    args: argparse.Namespace,
    results: list[SizeResult],
    lookups: dict[str, list[float]],
    server_note: str,
) -> str:
    """The whole markdown report."""
    machine = "\n".join(f"- {name}: {value}" for name, value in info_before.items())
    return f"""# gRPC data path vs memcpy and redis-py

Command: `{command}`

Run: {started:%Y-%m-%d %H:%M} UTC, {elapsed:.0f} s. Batch of {args.batch} blocks per call; \
{args.warmup} warm-up round(s) per size, then the calls counted below, all cases of a size \
interleaved. GB = 10^9 bytes. `GB/s p90` is the throughput of the 90th-percentile (slow) call. \
`vs memcpy` and `vs redis` compare medians within this run (redis: put vs SET, get vs GET). \
"(nvme)" rows use a server with `--dram-capacity 0`, reading LMDB through the page cache. \
Every path was checked once per size to read back the exact bytes put; {server_note}.

## Throughput

{throughput_table(results)}

## Lookup latency

`KVStoreClient.lookup` of N stored keys (one unary call) vs redis `EXISTS` of the same N keys
(one command); `vs redis` compares medians.

{lookup_table(lookups)}

## Machine

Shared with other work while this ran; compare rows with each other, not with other runs.

{machine}
- load average after the run: {load_after}
"""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    parser.add_argument(
        "--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), help="block sizes"
    )
    parser.add_argument("--batch", type=int, default=8, help="blocks per call (default 8)")
    parser.add_argument(
        "--reps",
        type=int,
        default=0,
        help=f"timed calls per case and size (default: enough to move {TARGET_BYTES // MiB} MiB, "
        f"{MIN_REPS}-{MAX_REPS})",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per size")
    parser.add_argument("--lookup-reps", type=int, default=2000, help="timed lookups per case")
    parser.add_argument("--lookup-warmup", type=int, default=50, help="untimed lookups per case")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the report and write it to ``--out``."""
    args = _parse_args(argv)
    exit_on_sigterm()
    command = shlex.join([".venv/bin/python", "benchmarks/bench_grpc.py", *sys.argv[1:]])
    started = datetime.datetime.now(datetime.UTC)
    clock = time.monotonic()
    info = machine_info(
        ("grpcio", "protobuf", "redis", "hiredis", "numpy", "lmdb"),
        {"redis-server": ["redis-server", "--version"]},
    )
    with contextlib.ExitStack() as stack:
        dram_server = stack.enter_context(
            kvstore_server(dram_capacity="1GiB", nvme_capacity="2GiB")
        )
        nvme_server = stack.enter_context(kvstore_server(dram_capacity="0", nvme_capacity="2GiB"))
        redis_proc = stack.enter_context(redis_server())
        dram = stack.enter_context(
            KVStoreClient(
                dram_server.target, namespace=NAMESPACE, timeout=CALL_TIMEOUT_S, data_plane="grpc"
            )
        )
        nvme = stack.enter_context(
            KVStoreClient(
                nvme_server.target, namespace=NAMESPACE, timeout=CALL_TIMEOUT_S, data_plane="grpc"
            )
        )
        rds = stack.enter_context(
            redis.Redis(host=redis_proc.host, port=redis_proc.port, socket_timeout=CALL_TIMEOUT_S)
        )
        print("throughput ...", file=sys.stderr, flush=True)
        results = bench_throughput(args, dram, nvme, rds)
        print("lookup ...", file=sys.stderr, flush=True)
        lookups = bench_lookup(args, dram, rds)
        server_note = _server_check(dram_server, dram)
        nvme_server.check_alive()
    load_after = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    text = report(
        command,
        started,
        time.monotonic() - clock,
        info,
        load_after,
        args,
        results,
        lookups,
        server_note,
    )
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
