"""A rogue holder: a gRPC server that answers ``KVStore.Get`` with forged blocks and records
every call it gets (its metadata and request), as a process with write access to the index
Redis would run after naming itself a holder there. It knows no secret of the cluster, so it
cannot prove itself; it sends junk headers and no proof."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.cluster_nodes import blocks_for, grpc_client
from kvstore.node.peers import holder_rank

if TYPE_CHECKING:
    from harness.serve import ServerProcess

import threading
from concurrent import futures
from typing import Any

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb


class RoguePeer:
    """Listens on a free loopback port (:attr:`target`) until :meth:`close`."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, str], pb.GetRequest]] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.unary_stream_rpc_method_handler(
            self._get,
            request_deserializer=pb.GetRequest.FromString,
            response_serializer=pb.GetResponse.SerializeToString,
        )
        generic = grpc.method_handlers_generic_handler("kvstore.v1.KVStore", {"Get": handler})
        self._server.add_generic_rpc_handlers((generic,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{port}"
        self._server.start()

    def _get(self, request: pb.GetRequest, context: Any) -> Any:
        metadata = {key: str(value) for key, value in context.invocation_metadata()}
        with self._lock:
            self.calls.append((metadata, request))
        forged = [
            pb.GetResult(index=i, found=True, value=b"forged" * 100, tier="dram", header=b"\0" * 64)
            for i in range(len(request.keys))
        ]
        yield pb.GetResponse(results=forged)

    def close(self) -> None:
        self._server.stop(None)

    def __enter__(self) -> RoguePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rogue_first(count: int) -> tuple[list[bytes], list[bytes]]:
    """Keys for which the rogue comes before node ``one`` in every reader's holder order."""
    keys, values = blocks_for(30_000, 4 * count)
    first = [i for i, key in enumerate(keys) if holder_rank(key, "rogue") < holder_rank(key, "one")]
    chosen = first[:count]
    assert len(chosen) == count
    return [keys[i] for i in chosen], [values[i] for i in chosen]


def put(node: ServerProcess, keys: list[bytes], values: list[bytes]) -> None:
    with grpc_client(node) as writer:
        assert writer.put(keys, values).stored == len(keys)
