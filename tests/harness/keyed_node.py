"""A real gRPC server for one test, in this process, whose node has ``[keys]`` settings.

``kvstore serve`` builds its servicer's :class:`~kvstore.node.key_schemes.NodeKeySchemes` from the
node's ``[keys]`` settings; this serves the same servicer, over a real gRPC port on loopback, from
a :class:`NodeKeySchemes` the test gives (and a dram-only store), on an event loop of its own
thread, so blocking clients and the connector's halves can call it from the test's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import grpc

from kvstore.key_scheme import KeyScheme
from kvstore.node.key_schemes import NodeKeySchemes
from kvstore.server.servicer import KVStoreServicer, add_to_server
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier

__all__ = ["keyed_node"]

_START_S = 30.0


@contextlib.contextmanager
def keyed_node(scheme: KeyScheme, port: int = 0) -> Iterator[tuple[str, NodeKeySchemes]]:
    """Serve a node configured with ``scheme`` on ``127.0.0.1:port`` (0: a free one); yields its
    target and its key schemes (what engines declared to it)."""
    schemes = NodeKeySchemes(scheme)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="keyed-node", daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        store = TieredStore([DramTier(64 << 20)])
        server = grpc.aio.server()
        add_to_server(KVStoreServicer(store, key_schemes=schemes), server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, bound

    try:
        server, bound = asyncio.run_coroutine_threadsafe(start(), loop).result(_START_S)
        try:
            yield f"127.0.0.1:{bound}", schemes
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(_START_S)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_START_S)
        loop.close()
