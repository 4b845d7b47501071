"""Remote reads at the wire, side by side in one run (issue 40): kvstore's UCX get / put against
``ucx_perftest`` on the same transport, ucxx alone, Redis and Mooncake Store.

Exact command (repository root; about 10 minutes on 2 shared cores; needs the ``ucx`` and
``bench`` extras; Mooncake Store from its own interpreter, see below)::

    .venv/bin/python benchmarks/bench_ucx_wire.py --out benchmarks/results/ucx_wire \
        --mooncake-python /tmp/mcvenv/bin/python

Everything runs over loopback on free ports and is stopped on exit: one ``kvstore serve
--ucx-listen 127.0.0.1:0`` (2 GiB of dram; no shared memory, so every byte crosses UCX) and one
``redis-server``. For blocks of 256 KiB, 1, 4 and 16 MiB, one call moves a batch (``--batch``
blocks, 8; 4 for 16 MiB) between a staging array (the batch's blocks one after another, as an
engine's staging buffer) and the store, and these cases run interleaved, round-robin:

* ``kvstore UCX get`` / ``put``, 1 lane and 2 lanes: :class:`~kvstore.client.ucx.UcxDataClient`
  (the path a client on another host takes): one control message over UCX (the endpoint was
  bound by one ``UcxBind`` call) and the batch as its message
  plan's UCX messages (blocks next to each other on both sides as one message), the receives of
  a get posted before its control call; and ``get, server plan``: the same get with its receives
  posted only after the answer (``post_early=False``), to show what the overlap is worth; and
  ``1 lane, gRPC control``: the same get and put with their control calls over gRPC
  (``ucx_control=False``, the path before control messages over UCX); and ``1 lane, 2 calls in
  flight``: two threads each getting the batch into its own array at once through the one client
  (seconds per batch: the pair's time halved), to show whether calls in flight add throughput;
* ``redis-py GET`` / ``SET``: one pipeline of the batch (redis-py + hiredis; GET returns new bytes
  objects, which is the client's receive).

Then, in child processes, the same batches through: ``ucx_perftest -t tag_bw`` with
``UCX_TLS=tcp`` (UCX's C benchmark on the transport kvstore's endpoints use), once with ``-e``
(peer-failure detection, the mode of every kvstore and ucxx endpoint: the ceiling the ratios use)
and once without (UCX may then use rendezvous zero-copy over two interfaces; see
:mod:`_ucx_perftest`), ucxx alone (:mod:`_ucxx_alone`: one tagged message per block from Python, no
control call, no store), and Mooncake Store over its TCP transport between two processes
(:mod:`_mooncake_store`: ``batch_put_from`` / ``batch_get_into`` from registered buffers; needs
``--mooncake-python``, an interpreter with ``mooncake-transfer-engine-non-cuda``, and
``libibverbs1``; without it the report says so).

Each table row gives the median GB/s (GB = 10**9 bytes) with its spread (p10-p90 of the per-call
rate) and the 1-minute load average while it ran (median of the samples). Compare ratios within
one run only: the machine is shared.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
from _common import (
    GB,
    KeySource,
    check,
    exit_on_sigterm,
    kvstore_server,
    machine_info,
    markdown_table,
    percentile,
    redis_server,
    run_interleaved,
)
from _mooncake_store import mooncake_store
from _ucx_listener import ucx_listener
from _ucx_perftest import perftest, perftest_binary
from _ucxx_alone import ucxx_alone

from kvstore import KVStoreClient, Namespace
from kvstore.client.ucx import UcxDataClient
from kvstore.protocol.messages import namespace_bytes

KiB, MiB = 1024, 1024**2
SIZES = {"256 KiB": 256 * KiB, "1 MiB": MiB, "4 MiB": 4 * MiB, "16 MiB": 16 * MiB}
NAMESPACE = Namespace(model="bench-ucx-wire")
CALL_TIMEOUT_S = 120.0
TARGET_BYTES = 512 * MiB
MIN_REPS, MAX_REPS = 10, 60
LANES = (1, 2)
#: The key of the client whose gets wait for the server's plan (receives posted after the answer).
SERVER_PLAN = 0
#: The key of the client whose control calls stay on gRPC (``ucx_control=False``): the before.
GRPC_CONTROL = -1
#: Gets in flight at once in the concurrency row.
IN_FLIGHT = 2
#: The ceiling rows: ``ucx_perftest`` with and without error handling (``-e``).
PERFTEST = {True: "ucx_perftest tcp -e", False: "ucx_perftest tcp, no -e"}


def batch_and_reps(args: argparse.Namespace, label: str) -> tuple[int, int]:
    """Blocks per call and calls per case for block size ``label``."""
    size = SIZES[label]
    batch = args.batch if size < 16 * MiB else max(1, args.batch // 2)
    reps = args.reps or max(MIN_REPS, min(MAX_REPS, TARGET_BYTES // (size * batch)))
    return batch, reps


class _Load:
    """The 1-minute load average, sampled with every call of a case."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def wrap(self, name: str, case: Callable[[], float]) -> Callable[[], float]:
        def sampled() -> float:
            self.samples.setdefault(name, []).append(os.getloadavg()[0])
            return case()

        return sampled


def _cases(
    staging: np.ndarray[Any, Any],
    blocks: list[np.ndarray[Any, Any]],
    keys: list[bytes],
    fresh: KeySource,
    ucx: dict[int, UcxDataClient],
    grpc_client: KVStoreClient,
    rds: redis.Redis,
    pool: concurrent.futures.Executor,
) -> dict[str, Callable[[], float]]:
    size = blocks[0].nbytes
    target = np.zeros_like(staging)
    views = [target[i * size : (i + 1) * size] for i in range(len(blocks))]

    def get(client: UcxDataClient) -> Callable[[], float]:
        def case() -> float:
            started = time.perf_counter()
            filled = client.get_into(keys, views, timeout=CALL_TIMEOUT_S)
            seconds = time.perf_counter() - started
            check(filled == [True] * len(keys), f"UCX get_into: {filled} ({client.last_error})")
            return seconds

        return case

    targets = [np.zeros_like(staging) for _ in range(IN_FLIGHT)]
    split = [[t[i * size : (i + 1) * size] for i in range(len(blocks))] for t in targets]

    def gets_in_flight(client: UcxDataClient) -> Callable[[], float]:
        def one(into: list[np.ndarray[Any, Any]]) -> list[bool] | None:
            return client.get_into(keys, into, timeout=CALL_TIMEOUT_S)

        def case() -> float:
            started = time.perf_counter()
            filled = list(pool.map(one, split))
            seconds = time.perf_counter() - started
            check(all(f == [True] * len(keys) for f in filled), f"{filled} {client.last_error}")
            return seconds / IN_FLIGHT

        return case

    def put(client: UcxDataClient) -> Callable[[], float]:
        def case() -> float:
            new = fresh.take(len(blocks))
            started = time.perf_counter()
            result = client.put(new, blocks, timeout=CALL_TIMEOUT_S)
            seconds = time.perf_counter() - started
            check(result is not None and result.stored == len(blocks), f"UCX put: {result}")
            grpc_client.delete(new)
            return seconds

        return case

    def redis_get() -> float:
        pipe = rds.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        started = time.perf_counter()
        values = pipe.execute()
        seconds = time.perf_counter() - started
        check(all(v is not None and len(v) == size for v in values), "redis GET")
        return seconds

    def redis_set() -> float:
        new = fresh.take(len(blocks))
        pipe = rds.pipeline(transaction=False)
        for key, block in zip(new, blocks, strict=True):
            pipe.set(key, block.data)
        started = time.perf_counter()
        replies = pipe.execute()
        seconds = time.perf_counter() - started
        check(all(replies), "redis SET")
        rds.delete(*new)
        return seconds

    cases: dict[str, Callable[[], float]] = {}
    for lanes, client in ucx.items():
        if lanes == SERVER_PLAN:
            cases["kvstore UCX get, 1 lane, server plan"] = get(client)
            continue
        if lanes == GRPC_CONTROL:
            cases["kvstore UCX get, 1 lane, gRPC control"] = get(client)
            cases["kvstore UCX put, 1 lane, gRPC control"] = put(client)
            continue
        cases[f"kvstore UCX get, {lanes} lane{'s' if lanes > 1 else ''}"] = get(client)
        if lanes == 1:
            cases[f"kvstore UCX get, 1 lane, {IN_FLIGHT} calls in flight"] = gets_in_flight(client)
        cases[f"kvstore UCX put, {lanes} lane{'s' if lanes > 1 else ''}"] = put(client)
    cases["redis-py GET"] = redis_get
    cases["redis-py SET"] = redis_set
    return cases


def bench_store_paths(
    args: argparse.Namespace, load: _Load
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, int]]]:
    """Seconds per call of the interleaved cases per block size, and the UCX clients' counters."""
    results: dict[str, dict[str, list[float]]] = {}
    counters: dict[str, dict[str, int]] = {}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(
            kvstore_server(
                dram_capacity="2GiB",
                nvme_capacity="1GiB",
                extra_args=[
                    "--ucx-listen",
                    "127.0.0.1:0",
                    "--allow-unauthenticated",
                    "--shm-socket",
                    "",
                ],
            )
        )
        redis_proc = stack.enter_context(redis_server())
        grpc_client = stack.enter_context(
            KVStoreClient(
                server.target, namespace=NAMESPACE, timeout=CALL_TIMEOUT_S, data_plane="grpc"
            )
        )
        channel, address = ucx_listener(grpc_client)
        ucx = {
            lanes: UcxDataClient(
                channel,
                address,
                namespace_bytes(NAMESPACE),
                timeout=CALL_TIMEOUT_S,
                lanes=max(lanes, 1),
                post_early=lanes != SERVER_PLAN,
                ucx_control=lanes != GRPC_CONTROL,
            )
            for lanes in (*LANES, SERVER_PLAN, GRPC_CONTROL)
        }
        for client in ucx.values():
            stack.callback(client.close)
        rds = stack.enter_context(
            redis.Redis(host=redis_proc.host, port=redis_proc.port, socket_timeout=CALL_TIMEOUT_S)
        )
        # The threads of the calls-in-flight row, one per get in flight, for every size.
        pool = stack.enter_context(
            concurrent.futures.ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="bench-get")
        )
        rng = np.random.default_rng(0)
        fresh = KeySource(seed=1)
        for label in args.sizes:
            started = time.monotonic()
            size = SIZES[label]
            batch, reps = batch_and_reps(args, label)
            staging = rng.integers(0, 256, size * batch, dtype=np.uint8)
            blocks = [staging[i * size : (i + 1) * size] for i in range(batch)]
            keys = fresh.take(batch)
            stored = ucx[1].put(keys, blocks, timeout=CALL_TIMEOUT_S)
            check(stored is not None and stored.stored == batch, "UCX put of the batch")
            rds.mset({key: block.data for key, block in zip(keys, blocks, strict=True)})
            for client in ucx.values():  # every path reads back the same bytes
                back = client.get(keys, timeout=CALL_TIMEOUT_S)
                check(back == [block.tobytes() for block in blocks], "UCX get differs")
            check(rds.mget(keys) == [block.tobytes() for block in blocks], "redis differs")
            cases = _cases(staging, blocks, keys, fresh, ucx, grpc_client, rds, pool)
            cases = {name: load.wrap(f"{label}/{name}", case) for name, case in cases.items()}
            results[label] = run_interleaved(cases, reps, warmup=2)
            grpc_client.delete(keys)
            rds.delete(*keys)
            print(
                f"  {label}: {reps} calls per case, {time.monotonic() - started:.0f} s", flush=True
            )
        for lanes, client in ucx.items():
            check(client.counters["fallbacks"] == 0, f"UCX ({lanes} lanes) fell back to gRPC")
            name = {SERVER_PLAN: "server plan", GRPC_CONTROL: "gRPC control"}.get(lanes)
            counters[name or f"{lanes} lanes"] = dict(client.counters)
    return results, counters


def bench_children(
    args: argparse.Namespace, load: _Load
) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    """``ucx_perftest``, ucxx alone and Mooncake Store: seconds per batch (perftest: a rate),
    per block size and path; and why a path did not run."""
    out: dict[str, dict[str, list[float]]] = {label: {} for label in args.sizes}
    missing: dict[str, str] = {}
    found = perftest_binary()
    if found is None:
        missing["ucx_perftest"] = "ucx_perftest not found (libucx wheel)"
    else:
        binary, env = found
        for label in args.sizes:
            size = SIZES[label]
            iters = max(100, min(2000, (2048 * MiB) // size))
            rates: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.perftest_runs):
                for errors, name in PERFTEST.items():  # the two modes alternate
                    before = os.getloadavg()[0]
                    rates[errors].append(
                        perftest(binary, env, "tcp", size, iters, error_handling=errors)
                    )
                    load.samples.setdefault(f"{label}/{name}", []).append(before)
            # Stored as "seconds per batch" of the same batch, so every row reads alike.
            batch, _ = batch_and_reps(args, label)
            for errors, name in PERFTEST.items():
                out[label][name] = [size * batch / (rate * GB) for rate in rates[errors]]
                rounded = [round(r, 2) for r in rates[errors]]
                print(f"  {name} {label}: {rounded} GB/s", flush=True)
    cases = {label: (SIZES[label], *batch_and_reps(args, label)) for label in args.sizes}
    before = os.getloadavg()[0]
    for label, seconds in ucxx_alone(cases).items():
        out[label]["ucxx alone"] = seconds
        load.samples[f"{label}/ucxx alone"] = [before, os.getloadavg()[0]]
    print("  ucxx alone: done", flush=True)
    before = os.getloadavg()[0]
    mooncake = mooncake_store(args.mooncake_python, cases)
    if isinstance(mooncake, str):
        missing["Mooncake Store"] = mooncake
    else:
        for label, ops in mooncake.items():
            out[label]["Mooncake Store get"] = ops["get"]
            out[label]["Mooncake Store put"] = ops["put"]
            for op in ("get", "put"):
                load.samples[f"{label}/Mooncake Store {op}"] = [before, os.getloadavg()[0]]
        print("  Mooncake Store: done", flush=True)
    return out, missing


ORDER = (
    PERFTEST[True],
    PERFTEST[False],
    "ucxx alone",
    "kvstore UCX get, 1 lane",
    f"kvstore UCX get, 1 lane, {IN_FLIGHT} calls in flight",
    "kvstore UCX get, 1 lane, gRPC control",
    "kvstore UCX get, 2 lanes",
    "kvstore UCX get, 1 lane, server plan",
    "kvstore UCX put, 1 lane",
    "kvstore UCX put, 1 lane, gRPC control",
    "kvstore UCX put, 2 lanes",
    "Mooncake Store get",
    "Mooncake Store put",
    "redis-py GET",
    "redis-py SET",
)


def table(
    args: argparse.Namespace, samples: dict[str, dict[str, list[float]]], load: _Load
) -> tuple[str, dict[str, dict[str, float]]]:
    """The report's table, and the median GB/s per size and path."""
    medians: dict[str, dict[str, float]] = {}
    rows = []
    for name in ORDER:
        row = [name]
        for label in args.sizes:
            seconds = samples[label].get(name)
            if not seconds:
                row.append("-")
                continue
            batch, _ = batch_and_reps(args, label)
            rates = [SIZES[label] * batch / s / GB for s in seconds]
            median = percentile(rates, 50)
            medians.setdefault(label, {})[name] = median
            loads = load.samples.get(f"{label}/{name}", [])
            at = f", load {percentile(loads, 50):.1f}" if loads else ""
            row.append(
                f"{median:.2f} ({percentile(rates, 10):.2f}-{percentile(rates, 90):.2f}{at})"
            )
        rows.append(row)
    return markdown_table(["GB/s, median (p10-p90, load)", *args.sizes], rows), medians


def ratios(medians: dict[str, dict[str, float]]) -> str:
    """Issue 40's done-when, as ratios within this run."""
    lines = []
    for label, paths in medians.items():
        ceiling, unchecked = paths.get(PERFTEST[True]), paths.get(PERFTEST[False])
        for op, mooncake in (("get", "Mooncake Store get"), ("put", "Mooncake Store put")):
            best = max(
                (v for k, v in paths.items() if k.startswith(f"kvstore UCX {op}")), default=None
            )
            if best is None:
                continue
            parts = [f"{label} {op}: best kvstore UCX {best:.2f} GB/s"]
            if ceiling:
                parts.append(f"{best / ceiling:.2f}x ucx_perftest -e (target 0.7)")
            if unchecked:
                parts.append(f"{best / unchecked:.2f}x ucx_perftest without -e")
            if paths.get(mooncake):
                parts.append(f"{best / paths[mooncake]:.2f}x Mooncake Store (target 2)")
            redis_name = "redis-py GET" if op == "get" else "redis-py SET"
            if paths.get(redis_name):
                parts.append(f"{best / paths[redis_name]:.2f}x {redis_name}")
            before = paths.get(f"kvstore UCX {op}, 1 lane, gRPC control")
            after = paths.get(f"kvstore UCX {op}, 1 lane")
            if before and after:
                parts.append(f"UCX control / gRPC control, 1 lane: {after / before:.2f}x")
            lines.append("- " + ", ".join(parts))
    return "\n".join(lines)


def main() -> int:
    """Run every part; write the report and the samples next to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/ucx_wire", help="output path stem")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batch", type=int, default=8, help="blocks per call")
    parser.add_argument("--reps", type=int, default=0, help="calls per case (0: by size)")
    parser.add_argument("--perftest-runs", type=int, default=3)
    parser.add_argument(
        "--mooncake-python",
        default="/tmp/mcvenv/bin/python",
        help="an interpreter with mooncake-transfer-engine-non-cuda (skipped if missing)",
    )
    args = parser.parse_args()
    exit_on_sigterm()
    command = shlex.join([".venv/bin/python", "benchmarks/bench_ucx_wire.py", *sys.argv[1:]])
    started = datetime.datetime.now(datetime.UTC)
    info = machine_info(
        ["tiered-kvstore", "grpcio", "redis", "numpy", "ucxx-cu12", "libucx-cu12"],
        {"redis-server": ["redis-server", "--version"]},
    )
    clock = time.monotonic()
    load = _Load()
    print("kvstore UCX and redis-py, interleaved ...", flush=True)
    samples, counters = bench_store_paths(args, load)
    print("ucx_perftest, ucxx alone, Mooncake Store ...", flush=True)
    children, missing = bench_children(args, load)
    for label in args.sizes:
        samples[label].update(children[label])
    elapsed = time.monotonic() - clock
    rendered, medians = table(args, samples, load)
    notes = "\n".join(f"- {name} not measured: {why}" for name, why in missing.items())
    report = "\n\n".join(
        part
        for part in [
            "# Remote reads at the wire: kvstore UCX against the ceiling (issue 40)",
            f"Command: `{command}`  \nStarted {started:%Y-%m-%d %H:%M} UTC, took {elapsed:.0f} s.",
            "## Throughput, one client, one batch per call\n\n" + rendered,
            notes,
            "## Against issue 40's done-when (ratios in this run)\n\n" + ratios(medians),
            "## UCX client counters\n\n"
            + "\n".join(f"- {lanes}: {c}" for lanes, c in counters.items()),
            "## Machine\n\n" + "\n".join(f"- {k}: {v}" for k, v in info.items()),
        ]
        if part
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report + "\n")
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "seconds": samples,
                "load": load.samples,
                "counters": counters,
                "missing": missing,
                "machine": info,
                "command": command,
            },
            indent=1,
        )
    )
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
