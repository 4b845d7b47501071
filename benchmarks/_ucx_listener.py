"""Where a benchmark's ``kvstore serve --ucx-listen`` takes UCX connections.

A :class:`~kvstore.client.ucx.UcxDataClient` needs the gRPC channel its control calls may use and
the server's UCX listener address; the server says the address in its ``DataPlane`` answer.
"""

from __future__ import annotations

from typing import Any

from _common import check

from kvstore import KVStoreClient
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

__all__ = ["ucx_listener"]


def ucx_listener(client: KVStoreClient) -> tuple[Any, str]:
    """``client``'s gRPC channel and its server's UCX listener address (checked: not empty)."""
    channel = client._transport.channel  # type: ignore[attr-defined]
    answer = pb_grpc.KVStoreStub(channel).DataPlane(pb.DataPlaneRequest(), timeout=10)
    address = str(answer.ucx_address)
    check(bool(address), "the server has no UCX listener (start it with --ucx-listen)")
    return channel, address
