"""How long after a restarted server's ``serving on`` its clients talk to it again, after an
outage of 10 s and of 30 s: gRPC's default reconnect backoff against kvstore's channels.

Exact command (repository root; about 2 minutes of outages plus start-ups on 2 shared cores)::

    .venv/bin/python benchmarks/bench_reconnect.py --out benchmarks/results/reconnect.md

Each round starts ``kvstore serve`` (dram only) on a fixed free loopback port, connects three
clients, stops the server for ``OUTAGE`` seconds and starts it again on the same port. The three
clients live through the same outage side by side:

* ``grpc defaults``: a plain ``grpc.insecure_channel`` with only kvstore's message-size options,
  what every kvstore client channel was before (the baseline), calling ``Stats`` every 0.2 s
  during the outage (a caller that keeps trying, as an engine's saves do);
* ``KVStoreClient``: the blocking client (``data_plane="grpc"``), calling ``stats`` the same way;
* ``when_reconnected``: another ``KVStoreClient`` that makes no call during the outage (a
  connector whose circuit breaker is open) and waits for its ``when_reconnected`` callback.

Timed: from the moment the benchmark sees ``kvstore serving on`` in the restarted server's log
(polled every 50 ms, so up to 50 ms late) to the first successful call (the callers poll every
20 ms once the server is back) or to the callback. ``--rounds`` rounds per outage (2).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, kvstore_server, machine_info, markdown_table

from kvstore import KVStoreClient, KVStoreError
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol import messages as wire

CASES = ("grpc defaults", "KVStoreClient", "when_reconnected")


def one_round(outage_s: float) -> dict[str, float]:
    """Seconds from ``serving on`` to each client's first answer, for one restart."""
    port = free_port()
    listen = ["--listen", f"127.0.0.1:{port}"]
    target = f"127.0.0.1:{port}"  # the later --listen wins over kvstore_server's own port
    with kvstore_server(nvme=False, dram_capacity="64MiB", extra_args=listen):
        channel = grpc.insecure_channel(target, options=wire.CHANNEL_OPTIONS)
        stub = pb_grpc.KVStoreStub(channel)
        client = KVStoreClient(target, timeout=1.0, data_plane="grpc")
        idle = KVStoreClient(target, timeout=1.0, data_plane="grpc")
        callers: dict[str, Callable[[], object]] = {
            "grpc defaults": lambda: stub.Stats(pb.StatsRequest(), timeout=0.5),
            "KVStoreClient": lambda: client.stats(timeout=0.5),
        }
        for call in callers.values():
            call()
        idle.stats()
    # The server is stopped here (the context ended): the outage starts.
    fired = threading.Event()
    fired_at: list[float] = []
    try:
        failing = True
        for call in callers.values():
            failing = failing and not _ok(call)
        if not failing:
            raise RuntimeError("a client still answered after the server stopped")
        idle.when_reconnected(lambda: (fired_at.append(time.monotonic()), fired.set()))
        end = time.monotonic() + outage_s
        while time.monotonic() < end:
            for call in callers.values():
                _ok(call)
            time.sleep(0.2)
        with kvstore_server(nvme=False, dram_capacity="64MiB", extra_args=listen):
            serving = time.monotonic()
            back: dict[str, float] = {}
            while len(back) < len(callers) and time.monotonic() - serving < 120:
                for name, call in callers.items():
                    if name not in back and _ok(call):
                        back[name] = time.monotonic() - serving
                time.sleep(0.02)
            fired.wait(max(0.0, 120 - (time.monotonic() - serving)))
            back["when_reconnected"] = fired_at[0] - serving if fired_at else float("nan")
    finally:
        channel.close()
        client.close()
        idle.close()
    return back


def _ok(call: Callable[[], object]) -> bool:
    try:
        call()
    except (grpc.RpcError, KVStoreError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--outages", type=float, nargs="+", default=[10.0, 30.0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    info_before = machine_info(["grpcio"])
    rows = []
    for outage in args.outages:
        results = [one_round(outage) for _ in range(args.rounds)]
        for case in CASES:
            values = [r[case] for r in results]
            rows.append(
                [f"{outage:g}", case, " / ".join(f"{v:.2f}" for v in values), f"{max(values):.2f}"]
            )
    lines = [
        "# Back after a restart: seconds from `serving on` to the first answer",
        "",
        "```sh",
        ".venv/bin/python benchmarks/bench_reconnect.py --out benchmarks/results/reconnect.md",
        "```",
        "",
        markdown_table(["outage s", "client", "seconds, each round", "max"], rows),
        "",
        f"- load average at the start (1/5/15 min): {info_before['load average (1/5/15 min)']}",
        *(f"- {k}: {v}" for k, v in machine_info(["grpcio"]).items()),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
