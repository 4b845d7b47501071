"""What sealing the arena costs: shared-memory throughput before and after, verified or not.

Exact command (repository root; a few minutes on 2 shared cores; needs git)::

    .venv/bin/python benchmarks/bench_sealed_arena.py --out benchmarks/results/sealed_arena

Three servers run side by side, each a real ``kvstore serve`` (dram only, 1 GiB), each with a
client from its own source tree:

* ``before``: the tree of ``--baseline`` (the commit before the arena was sealed, extracted with
  ``git archive``): clients map the arena writable, a put copies straight into reserved pages;
* ``sealed``: this tree, ``dram.verify_reads`` off (the default): clients map the arena read-only,
  a put copies into the client's write window and the server copies it into the reserved pages;
* ``sealed+verify``: this tree with ``KVSTORE_DRAM_VERIFY_READS=1``: every read path also hashes
  each block (the direct index read against the checksum the index carries).

Per round the three cases run one after another, their order rotating (``--rounds`` rounds); a
case is one client process (:mod:`_sealed_arena_client`) that, for each block size, times
``--reps`` calls of each operation on a batch of ``--batch`` blocks: ``put`` (fresh keys, deleted
again untimed), ``get_into`` (the direct index read into preallocated buffers), ``get_into
leased`` (``KVSTORE_SHM_DIRECT_READS=0``: acquire, copy, release) and ``acquire`` (zero-copy views
through the index, released). Every byte read is checked. Reported: GB/s at the median call per
case, operation and size, the ratio to ``before``, and the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import kvstore_server, machine_info, markdown_table, percentile

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "benchmarks" / "_sealed_arena_client.py"
OPS = ("put", "get_into", "get_into leased", "acquire")


def extract(commit: str, into: Path) -> Path:
    """The tree of ``commit``, extracted into ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--baseline", default="543d9c8", help="the commit before the change")
    parser.add_argument("--sizes-kib", default="1024,4096")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    samples: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvseal-") as tmp:
        baseline = extract(args.baseline, Path(tmp))
        cases = {"before": (baseline, {}), "sealed": (ROOT, {})}
        cases["sealed+verify"] = (ROOT, {"KVSTORE_DRAM_VERIFY_READS": "1"})
        servers = {}
        saved = dict(os.environ)
        try:
            with contextlib.ExitStack() as stack:
                for name, (tree, env) in cases.items():
                    # ``python -m`` puts the working directory first on sys.path: the server
                    # must start in its own tree, not in this one.
                    os.chdir(tree)
                    os.environ.clear()
                    os.environ.update(saved, PYTHONPATH=str(tree), **env)
                    servers[name] = stack.enter_context(
                        kvstore_server(dram_capacity="1GiB", nvme=False, max_block_bytes="16MiB")
                    )
                os.chdir(ROOT)
                os.environ.clear()
                os.environ.update(saved)
                for round_index in range(args.rounds):
                    names = list(cases)
                    shift = round_index % len(names)
                    for name in names[shift:] + names[:shift]:
                        tree, _ = cases[name]
                        got = run_client(tree, servers[name].target, args)
                        for label, values in got.items():
                            samples.setdefault(name, {}).setdefault(label, []).extend(values)
        finally:
            os.environ.clear()
            os.environ.update(saved)
    load_after = os.getloadavg()
    report(args, samples, load_before, load_after)


def run_client(tree: Path, target: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """One case's timings (seconds per call, by ``op size``), from a client of ``tree``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = str(tree)
    argv = [sys.executable, str(CLIENT), target, args.sizes_kib, str(args.batch), str(args.reps)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"client of {tree} failed:\n{done.stderr[-3000:]}")
    result: dict[str, list[float]] = json.loads(done.stdout.splitlines()[-1])
    return result


def report(
    args: argparse.Namespace,
    samples: dict[str, dict[str, list[float]]],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> None:
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    rows = []
    figures: dict[str, Any] = {}
    for op in OPS:
        for size in sizes:
            label = f"{op} {size}"
            batch_bytes = size * 1024 * args.batch
            rates = {
                name: batch_bytes / percentile(by[label], 50) / 1e9
                for name, by in samples.items()
                if by.get(label)
            }
            figures[label] = rates
            base = rates.get("before")
            cells = [f"{op}", f"{size // 1024} MiB" if size >= 1024 else f"{size} KiB"]
            for name in ("before", "sealed", "sealed+verify"):
                rate = rates.get(name)
                if rate is None:
                    cells.append("-")
                elif name == "before" or not base:
                    cells.append(f"{rate:.2f}")
                else:
                    cells.append(f"{rate:.2f} ({rate / base:.2f}x)")
            rows.append(cells)
    table = markdown_table(
        ["operation", "block", "before GB/s", "sealed GB/s (÷ before)", "sealed+verify GB/s"],
        rows,
    )
    load = (
        f"load average (1/5/15 min) before {' / '.join(f'{v:.2f}' for v in load_before)}, "
        f"after {' / '.join(f'{v:.2f}' for v in load_after)}"
    )
    text = (
        f"# Sealed arena: shm throughput before / after\n\n"
        f"Command: `.venv/bin/python benchmarks/bench_sealed_arena.py"
        f"{' --out ' + str(args.out) if args.out else ''}`; baseline `{args.baseline}`; "
        f"{args.batch} blocks per call, {args.reps} calls x {args.rounds} rounds per case; "
        f"GB/s at the median call.\n\n{table}\n\n{load}\n\n"
        + "\n".join(f"- {k}: {v}" for k, v in machine_info().items())
        + "\n"
    )
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.md").write_text(text)
        Path(f"{args.out}.json").write_text(
            json.dumps(
                {
                    "figures_gb_s": figures,
                    "samples_s": samples,
                    "load_before": load_before,
                    "load_after": load_after,
                    "settings": {k: str(v) for k, v in vars(args).items()},
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
