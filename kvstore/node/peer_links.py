"""The links a peer source keeps open to other nodes (:mod:`kvstore.node.peers`).

One gRPC link per peer address and one UCX link per (gRPC, UCX) address pair, keyed by address
because a restarted node may listen elsewhere; at most :data:`MAX_CLIENTS` of each, the least
recently used closed (in the background) when one more is opened.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

from kvstore.cluster.records import NodeInfo
from kvstore.node.peer_auth import PeerSigner
from kvstore.node.peer_grpc import GrpcPeerLink
from kvstore.node.peer_ucx import UcxPeerLink

__all__ = ["MAX_CLIENTS", "PeerLinks"]

#: Links kept open per transport (one per peer; the least recently used is closed).
MAX_CLIENTS = 64


class _Closable(Protocol):
    async def aclose(self) -> None: ...


_Key = TypeVar("_Key", bound=Hashable)
_Connection = TypeVar("_Connection", bound=_Closable)


def _cached(
    cache: OrderedDict[_Key, _Connection], key: _Key, make: Callable[[], _Connection]
) -> _Connection:
    """``cache[key]``, made by ``make`` if missing, as the most recently used; past
    :data:`MAX_CLIENTS` entries the least recently used one is closed (in the background)."""
    connection = cache.get(key)
    if connection is None:
        connection = cache[key] = make()
        if len(cache) > MAX_CLIENTS:
            _, old = cache.popitem(last=False)
            asyncio.get_running_loop().create_task(old.aclose())
    cache.move_to_end(key)
    return connection


class PeerLinks:
    """The open gRPC and UCX links to peers, each request on them signed by ``signer``."""

    def __init__(self, signer: PeerSigner, max_block_bytes: int, ucx_lanes: int = 1) -> None:
        self.signer = signer
        self.max_block_bytes = max_block_bytes
        #: UCX endpoints each link opens to its peer (``ucx.lanes``).
        self.ucx_lanes = ucx_lanes
        self._grpc: OrderedDict[str, GrpcPeerLink] = OrderedDict()
        self._ucx: OrderedDict[tuple[str, str], UcxPeerLink] = OrderedDict()

    def grpc(self, info: NodeInfo) -> GrpcPeerLink:
        """The gRPC link to the node ``info`` describes."""
        target = info.grpc
        return _cached(
            self._grpc, target, lambda: GrpcPeerLink(target, self.signer, self.max_block_bytes)
        )

    def ucx(self, info: NodeInfo) -> UcxPeerLink:
        """The UCX link to the node ``info`` describes (it advertises a UCX listener)."""
        return _cached(
            self._ucx,
            (info.grpc, info.ucx),
            lambda: UcxPeerLink(
                info.grpc, info.ucx, self.signer, self.max_block_bytes, self.ucx_lanes
            ),
        )

    async def aclose(self) -> None:
        """Close every gRPC and UCX link."""
        clients, self._grpc = list(self._grpc.values()), OrderedDict()
        for client in clients:
            await client.aclose()
        links, self._ucx = list(self._ucx.values()), OrderedDict()
        for link in links:
            await link.aclose()
