"""What block integrity costs: checksum at put, MAC to and from nvme, ``dram.verify_reads``.

Exact command (repository root; well under a minute on 2 shared cores)::

    .venv/bin/python benchmarks/bench_integrity.py --out benchmarks/results/integrity.md

One run measures, interleaved round-robin so that noise from other work hits every case alike:

* **Header per block** (in-process, 1 MiB and 4 MiB payloads): the xxh3-64 checksum every put
  computes (:meth:`kvstore.block.BlockHeader.for_payload`, at commit for shm reservations), the
  keyed BLAKE3/128 (header version 3) computed only when a block goes to nvme or redis or is
  sealed for a peer (:func:`kvstore.block.block_mac`) and checked when it comes back, the
  HMAC-SHA256/128 of version 2 (blocks written before still verify with it), and keyed
  BLAKE2b-128 (another alternative considered).
* **Put over shm** to a dram-only server: ``KVStoreClient.put`` of a batch of 8 fresh 1 MiB blocks
  (checksum only: no MAC is ever computed there).
* **Put and get over gRPC to an nvme-only server** (dram capacity 0): every put is signed and
  every get verified, in the nvme tier's worker thread.
* **get_into over shm**, the same stored batch of 8 x 1 MiB, against two ``kvstore serve``
  processes that differ only in ``dram.verify_reads`` (off / on): leased reads
  (``shm_direct_reads`` off, so every block goes through the server's lease path, where the
  server verifies), plus the client's direct index reads for reference (the server never sees
  those, so they are unverified in both servers).

Throughput is GB/s (10**9 bytes) of payload per call at the median (and p90) call time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    GB,
    KeySource,
    check,
    fresh_put_case,
    kvstore_server,
    machine_info,
    markdown_table,
    run_interleaved,
    summarize,
    timed,
)

from kvstore import KVStoreClient, Namespace
from kvstore.block import HMAC_VERSION, BlockHeader, Keyring, block_mac
from kvstore.client.settings import ClientSettings

MIB = 1024**2
KEY, NS_BYTES = bytes(range(16)), bytes(16)
NS = Namespace(model="bench-integrity")
RING = Keyring([b"bench secret"])


def header_cases(sizes: list[int]) -> dict[str, Callable[[], float]]:
    cases: dict[str, Callable[[], float]] = {}
    for size in sizes:
        data = memoryview(np.random.default_rng(size).bytes(size))
        label = f"{size // MIB} MiB"
        cases[f"xxh3-64 checksum (put), {label}"] = lambda d=data: timed(
            lambda: BlockHeader.for_payload(KEY, NS_BYTES, d)
        )[0]
        cases[f"keyed BLAKE3/128 (v3: nvme, redis, peers), {label}"] = lambda d=data: timed(
            lambda: block_mac(KEY, NS_BYTES, d)
        )[0]
        cases[f"HMAC-SHA256/128 (v2: still verified), {label}"] = lambda d=data: timed(
            lambda: RING.sign(b"", (d,), HMAC_VERSION)
        )[0]
        cases[f"BLAKE2b-128 keyed (not used), {label}"] = lambda d=data: timed(
            lambda: hashlib.blake2b(d, key=KEY * 2, digest_size=16).digest()
        )[0]
    return cases


@contextlib.contextmanager
def server(verify: bool) -> Iterator[str]:
    """A dram-only ``kvstore serve`` with ``dram.verify_reads`` set (only while it starts)."""
    started = kvstore_server(dram_capacity="512MiB", nvme=False)
    os.environ["KVSTORE_DRAM_VERIFY_READS"] = "1" if verify else "0"
    try:
        process = started.__enter__()
    finally:
        del os.environ["KVSTORE_DRAM_VERIFY_READS"]
    with contextlib.ExitStack() as stack:
        stack.push(started)
        yield process.target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    block = MIB
    blocks = [np.random.default_rng(i).bytes(block) for i in range(args.batch)]
    keys = KeySource(1).take(args.batch)
    outs = [bytearray(block) for _ in blocks]
    leased = ClientSettings(data_plane="shm", shm_direct_reads=False)
    direct = ClientSettings(data_plane="shm", shm_direct_reads=True)
    nvme_only = kvstore_server(dram_capacity="0", nvme_capacity="2GiB")
    with server(False) as plain_target, server(True) as verify_target, nvme_only as disk:
        grpc = ClientSettings(data_plane="grpc")
        disk_client = KVStoreClient(disk.target, namespace=NS, settings=grpc)
        clients = {
            "off": KVStoreClient(plain_target, namespace=NS, settings=leased),
            "on": KVStoreClient(verify_target, namespace=NS, settings=leased),
            "off, direct": KVStoreClient(plain_target, namespace=NS, settings=direct),
            "on, direct": KVStoreClient(verify_target, namespace=NS, settings=direct),
        }
        with contextlib.ExitStack() as stack:
            for client in [*clients.values(), disk_client]:
                stack.enter_context(client)
            for name in ("off", "on"):
                check(clients[name].put(keys, blocks).stored == args.batch, "put")
            check(disk_client.put(keys, blocks).stored == args.batch, "nvme put")

            def get_case(client: KVStoreClient, name: str) -> Callable[[], float]:
                def case() -> float:
                    seconds, got = timed(lambda: client.get_into(keys, outs))
                    check(all(got) and outs[0] == blocks[0], f"{name}: wrong get_into")
                    check(client.data_plane == ("grpc" if name == "nvme" else "shm"), name)
                    return seconds

                return case

            cases = header_cases([MIB, 4 * MIB])
            cases["put 8 x 1 MiB over shm, dram only (no MAC)"] = fresh_put_case(
                clients["off"], blocks, KeySource(2), "put"
            )
            for name, client in clients.items():
                cases[f"get_into 8 x 1 MiB, verify_reads {name}"] = get_case(client, name)
            cases["put 8 x 1 MiB over gRPC, nvme only (MAC)"] = fresh_put_case(
                disk_client, blocks, KeySource(3), "nvme put"
            )
            cases["get_into 8 x 1 MiB over gRPC, nvme only (MAC)"] = get_case(disk_client, "nvme")
            samples = run_interleaved(cases, args.reps, warmup=2)
            verified = clients["on"].stats()["tiers"]["dram"]["corrupt_blocks"]
            check(verified == 0, "a block failed verification")
    rows = []
    for name, values in samples.items():
        summary = summarize(values)
        size = 4 * MIB if "4 MiB" in name else MIB
        size *= args.batch if name.startswith(("put", "get")) else 1
        rows.append(
            [
                name,
                f"{summary.median * 1e3:.3f}",
                f"{size / summary.median / GB:.2f}",
                f"{size / summary.p90 / GB:.2f}",
            ]
        )
    report = "\n".join(
        [
            "# Integrity: checksum at put, keyed MAC to and from nvme/redis, `dram.verify_reads`",
            "",
            "Command: `.venv/bin/python benchmarks/bench_integrity.py "
            "--out benchmarks/results/integrity.md`",
            "",
            markdown_table(["case", "ms median", "GB/s median", "GB/s p90"], rows),
            "",
            *(f"- {k}: {v}" for k, v in machine_info().items()),
            "",
        ]
    )
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
