"""A kvstore server with the UCX data path, for the UCX tests and ``benchmarks/bench_ucx.py``.

It composes the public pieces the way ``kvstore serve`` does (``build_store``, the KVStore
servicer, ``add_ucx_to_server``) until ``kvstore.server.app`` starts the UCX path itself::

    python tests/integration/ucx_serve.py --listen 127.0.0.1:0 --ucx-listen 127.0.0.1:0 \\
        --dram-capacity 256MiB --nvme-path DIR --nvme-capacity 256MiB

Prints ``kvstore serving on HOST:PORT ucx HOST:PORT`` when ready; SIGTERM or SIGINT stops it
(exit 0). The last line it prints before exiting is ``ucx counters {...}`` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

import grpc

from kvstore.config import load_config
from kvstore.server.app import build_store
from kvstore.server.servicer import KVStoreServicer, add_to_server
from kvstore.transport.ucx_server import add_ucx_to_server

READY_LINE = "kvstore serving on "


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT."""
    config = load_config(
        overrides={
            "server.listen": args.listen,
            "dram.capacity": args.dram_capacity,
            "nvme.path": args.nvme_path,
            "nvme.capacity": args.nvme_capacity,
        }
    )
    store = build_store(config)
    limit = 2 * config.server.max_block_bytes + 8 * 1024**2
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ]
    )
    servicer = KVStoreServicer(store)
    add_to_server(servicer, server)
    ucx = await add_ucx_to_server(server, store, args.ucx_listen)
    servicer.ucx_address = ucx.address
    port = server.add_insecure_port(config.server.listen)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    host = config.server.listen.rpartition(":")[0]
    print(f"{READY_LINE}{host}:{port} ucx {ucx.address}", flush=True)
    await stop.wait()
    await server.stop(1.0)
    await ucx.close()
    await store.close()
    print("ucx counters " + json.dumps(dict(ucx.counters)), flush=True)


def main() -> int:
    """Parse flags and serve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--ucx-listen", default="127.0.0.1:0")
    parser.add_argument("--dram-capacity", default="256MiB")
    parser.add_argument("--nvme-path", default="")
    parser.add_argument("--nvme-capacity", default="256MiB")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
