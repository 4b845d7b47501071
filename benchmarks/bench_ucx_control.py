"""The cost of one UCX control exchange (issue 40): over the UCX endpoint itself against the
``UcxGet`` / ``UcxPut`` gRPC call, with (next to) no payload, interleaved.

Exact command (repository root; under a minute)::

    .venv/bin/python benchmarks/bench_ucx_control.py --calls 300

One ``kvstore serve --ucx-listen 127.0.0.1:0`` over loopback (no shared memory); two
:class:`~kvstore.client.ucx.UcxDataClient` on one gRPC channel, one lane each, one with control
messages over UCX (``ucx_control=True``) and one with the gRPC call. Each round makes, on each
client in turn, a get of one missing key (the control exchange alone: nothing follows) and a put
of one 4 KiB block (one small payload message besides). Prints the median and p10-p90 in
milliseconds per case, and the 1-minute load average at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import numpy as np
from _common import kvstore_server
from _ucx_listener import ucx_listener

from kvstore import KVStoreClient, Namespace
from kvstore.client.ucx import UcxDataClient
from kvstore.protocol.messages import namespace_bytes

NAMESPACE = Namespace(model="bench-ucx-control")


def main() -> int:
    """Run the cases; print one line per case."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="rounds (calls per case)")
    args = parser.parse_args()
    flags = ["--ucx-listen", "127.0.0.1:0", "--allow-unauthenticated", "--shm-socket", ""]
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(
            kvstore_server(dram_capacity="256MiB", nvme_capacity="256MiB", extra_args=flags)
        )
        kv = stack.enter_context(
            KVStoreClient(server.target, namespace=NAMESPACE, data_plane="grpc")
        )
        channel, address = ucx_listener(kv)
        clients = {
            name: UcxDataClient(
                channel, address, namespace_bytes(NAMESPACE), timeout=30, ucx_control=over
            )
            for name, over in (("UCX control", True), ("gRPC control", False))
        }
        block = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
        missing = [os.urandom(16)]
        times: dict[str, list[float]] = {}
        for _ in range(args.calls + 2):  # the first two rounds connect and warm up
            for name, client in clients.items():
                started = time.perf_counter()
                assert client.get(missing) == [None], client.last_error
                times.setdefault(f"{name}, get of a missing key", []).append(
                    time.perf_counter() - started
                )
                started = time.perf_counter()
                assert client.put([os.urandom(16)], [block]) is not None, client.last_error
                times.setdefault(f"{name}, put of 4 KiB", []).append(time.perf_counter() - started)
        for name, client in clients.items():
            assert client.counters["fallbacks"] == 0, f"{name}: {client.last_error}"
            client.close()
    for name, seconds in times.items():
        ms = sorted(s * 1e3 for s in seconds[2:])
        p10, p90 = ms[len(ms) // 10], ms[len(ms) * 9 // 10]
        print(f"{name}: median {statistics.median(ms):.3f} ms (p10-p90 {p10:.3f}-{p90:.3f})")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
