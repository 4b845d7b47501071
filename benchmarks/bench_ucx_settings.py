"""UCX settings side by side: kvstore UCX get / put and ``ucx_perftest -e`` under each variant.

A UCX setting (``UCX_TCP_TX_SEG_SIZE``, ``UCX_RNDV_SCHEME``, ...) is read once per process, when
ucxx loads, so variants cannot share a process. Here each variant gets a worker process (this
script with ``--worker``) with its settings in the environment; the worker starts its own
``kvstore serve --ucx-listen 127.0.0.1:0`` (which inherits them) and one
:class:`~kvstore.client.ucx.UcxDataClient`, and the calls run interleaved: a round of ``--per``
calls on one variant, then the next, ``--rounds`` times, for each case. A worker and its server
are stopped (SIGSTOP to their process group) while other variants run: a variant that
busy-polls (``UCXPY_PROGRESS_MODE=thread-polling``) would otherwise spin through every other
variant's turn and slow it. Then ``ucx_perftest -t
tag_bw -e`` (the error-handling mode of kvstore's endpoints) runs once per variant and size with
the same settings, to show what the C layer does with them. Exact command (repository root,
about 4 minutes on 2 shared cores)::

    .venv/bin/python benchmarks/bench_ucx_settings.py --out benchmarks/results/ucx_settings \
        base: seg32k:UCX_TCP_TX_SEG_SIZE=32K seg64k:UCX_TCP_TX_SEG_SIZE=64K

A variant is ``NAME:VAR=VALUE,VAR=VALUE`` (``NAME:`` alone: the defaults,
``kvstore.protocol.ucx.UCX_ENV_DEFAULTS``). Each row gives the median GB/s (GB = 10**9 bytes),
p10-p90 of the per-call rate, and the median 1-minute load while it ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
from _common import (
    GB,
    KeySource,
    check,
    exit_on_sigterm,
    kvstore_server,
    machine_info,
    markdown_table,
    percentile,
)
from _ucx_listener import ucx_listener
from _ucx_perftest import perftest, perftest_binary

from kvstore import KVStoreClient, Namespace
from kvstore.client.ucx import UcxDataClient
from kvstore.protocol.messages import namespace_bytes

MiB = 1024**2
#: (block size, blocks per call): the wire bench's batches.
CASES = ((MiB, 8), (4 * MiB, 8), (16 * MiB, 4))
CALL_TIMEOUT_S = 60.0
NAMESPACE = Namespace(model="bench-ucx-settings")


def worker() -> None:
    """One variant: a server and a client in this environment; a JSON command per stdin line
    (``{"op", "size", "batch", "calls"}``) answered with the calls' seconds."""
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(
            kvstore_server(
                dram_capacity="1GiB",
                nvme=False,
                extra_args=[
                    "--ucx-listen",
                    "127.0.0.1:0",
                    "--allow-unauthenticated",
                    "--shm-socket",
                    "",
                ],
            )
        )
        grpc_client = stack.enter_context(
            KVStoreClient(server.target, namespace=NAMESPACE, timeout=CALL_TIMEOUT_S)
        )
        channel, address = ucx_listener(grpc_client)
        client = UcxDataClient(channel, address, namespace_bytes(NAMESPACE), timeout=60.0)
        stack.callback(client.close)
        fresh = KeySource(seed=os.getpid())
        batches: dict[tuple[int, int], tuple[list[bytes], list[Any], list[Any]]] = {}
        print("ready", flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            size, batch = command["size"], command["batch"]
            if (size, batch) not in batches:
                staging = np.random.default_rng(0).integers(0, 256, size * batch, dtype=np.uint8)
                blocks = [staging[i * size : (i + 1) * size] for i in range(batch)]
                keys = fresh.take(batch)
                stored = client.put(keys, blocks, timeout=CALL_TIMEOUT_S)
                check(stored is not None and stored.stored == batch, "UCX put of the batch")
                target = np.zeros_like(staging)
                views = [target[i * size : (i + 1) * size] for i in range(batch)]
                check(client.get_into(keys, views) == [True] * batch, "UCX get")
                check(bool((target == staging).all()), "UCX get returned other bytes")
                batches[size, batch] = keys, blocks, views
            keys, blocks, views = batches[size, batch]
            seconds = []
            for _ in range(command["calls"]):
                if command["op"] == "get":
                    started = time.perf_counter()
                    filled = client.get_into(keys, views, timeout=CALL_TIMEOUT_S)
                    seconds.append(time.perf_counter() - started)
                    check(filled == [True] * batch, f"UCX get: {client.last_error}")
                else:
                    new = fresh.take(batch)
                    started = time.perf_counter()
                    result = client.put(new, blocks, timeout=CALL_TIMEOUT_S)
                    seconds.append(time.perf_counter() - started)
                    check(result is not None and result.stored == batch, "UCX put")
                    grpc_client.delete(new)
            print(json.dumps(seconds), flush=True)
        check(client.counters["fallbacks"] == 0, "the UCX client fell back to gRPC")


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME:VAR=VALUE,...`` as the name and its settings."""
    name, colon, settings = spec.partition(":")
    if not name or not colon:
        raise SystemExit(f"variant {spec!r}: expected NAME:VAR=VALUE,... (or NAME: alone)")
    env = {}
    for item in filter(None, settings.split(",")):
        var, equals, value = item.partition("=")
        if not var.startswith("UCX") or not equals:
            raise SystemExit(f"variant {spec!r}: {item!r} is not UCX...=VALUE")
        env[var] = value
    return name, env


def _ask(proc: subprocess.Popen[str], command: dict[str, Any]) -> list[float]:
    """Run ``command`` on a stopped worker: continue its group, wait for the answer, stop it."""
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None
    os.killpg(proc.pid, signal.SIGCONT)
    stdin.write(json.dumps(command) + "\n")
    stdin.flush()
    answer = stdout.readline()
    check(bool(answer), "a worker died; its output is above")
    os.killpg(proc.pid, signal.SIGSTOP)
    return list(json.loads(answer))


def _resume(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)


def main() -> int:
    """Run the variants interleaved; write the report and the samples next to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help="NAME:VAR=VALUE,... (NAME: = defaults)")
    parser.add_argument("--out", default="benchmarks/results/ucx_settings")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per", type=int, default=8, help="calls per round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0
    if not args.variants:
        parser.error("give at least one variant, e.g. base: seg64k:UCX_TCP_TX_SEG_SIZE=64K")
    exit_on_sigterm()
    command = shlex.join([".venv/bin/python", "benchmarks/bench_ucx_settings.py", *sys.argv[1:]])
    variants = dict(parse_variant(spec) for spec in args.variants)
    seconds: dict[str, list[float]] = {}
    load: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        workers: dict[str, subprocess.Popen[str]] = {}
        for name, env in variants.items():
            proc = subprocess.Popen(
                [sys.executable, __file__, "--worker"],
                env={**os.environ, **env},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its server with it: one group to stop and continue
            )
            stack.callback(proc.wait, 60)
            stack.callback(_close, proc.stdin)
            stack.callback(_resume, proc)
            workers[name] = proc
        for name, proc in workers.items():
            assert proc.stdout is not None
            check(proc.stdout.readline().strip() == "ready", f"worker {name} did not start")
            os.killpg(proc.pid, signal.SIGSTOP)
        for op in ("get", "put"):
            for size, batch in CASES:
                for _ in range(args.rounds):
                    for name, proc in workers.items():
                        row = f"{op} {batch} x {size // MiB} MiB/{name}"
                        load.setdefault(row, []).append(os.getloadavg()[0])
                        ask = {"op": op, "size": size, "batch": batch, "calls": args.per}
                        seconds.setdefault(row, []).extend(_ask(proc, ask))
                print(f"  {op} {batch} x {size // MiB} MiB done", flush=True)
    found = perftest_binary()
    rates: dict[str, float] = {}
    if found is not None:
        binary, base_env = found
        for name, env in variants.items():
            for size, _ in CASES:
                load.setdefault(f"perftest {size // MiB} MiB/{name}", []).append(os.getloadavg()[0])
                iters = max(100, min(1000, (1024 * MiB) // size))
                rates[f"perftest {size // MiB} MiB/{name}"] = perftest(
                    binary, {**base_env, **env}, "tcp", size, iters
                )
    report = render(args, command, variants, seconds, rates, load)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report + "\n")
    out.with_suffix(".json").write_text(
        json.dumps({"seconds": seconds, "perftest": rates, "load": load, "command": command})
    )
    print(report)
    return 0


def _close(stream: IO[str] | None) -> None:
    if stream is not None:
        stream.close()


def render(
    args: argparse.Namespace,
    command: str,
    variants: dict[str, dict[str, str]],
    seconds: dict[str, list[float]],
    rates: dict[str, float],
    load: dict[str, list[float]],
) -> str:
    """The report: a row per case, a column per variant."""
    names = list(variants)
    rows = []
    for op in ("get", "put"):
        for size, batch in CASES:
            case = f"{op} {batch} x {size // MiB} MiB"
            cells = [f"kvstore UCX {case}"]
            for name in names:
                per_call = [size * batch / s / GB for s in seconds[f"{case}/{name}"]]
                at = percentile(load[f"{case}/{name}"], 50)
                cells.append(
                    f"{percentile(per_call, 50):.2f} ({percentile(per_call, 10):.2f}-"
                    f"{percentile(per_call, 90):.2f}, load {at:.1f})"
                )
            rows.append(cells)
    for size, _ in CASES:
        key = f"perftest {size // MiB} MiB"
        if f"{key}/{names[0]}" in rates:
            rows.append(
                [f"`ucx_perftest -t tag_bw -e`, {size // MiB} MiB messages"]
                + [
                    f"{rates[f'{key}/{name}']:.2f} (load {load[f'{key}/{name}'][0]:.1f})"
                    for name in names
                ]
            )
    settings = "\n".join(
        f"- `{name}`: " + (", ".join(f"`{k}={v}`" for k, v in env.items()) or "the defaults")
        for name, env in variants.items()
    )
    info = machine_info(["tiered-kvstore", "ucxx-cu12", "libucx-cu12"], {})
    return "\n\n".join(
        [
            "# UCX settings side by side (issue 40)",
            f"Command: `{command}`  \n{args.rounds} rounds of {args.per} calls per variant "
            "and case, interleaved.",
            settings,
            markdown_table(["GB/s, median (p10-p90, load)", *names], rows),
            "## Machine\n\n" + "\n".join(f"- {k}: {v}" for k, v in info.items()),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
