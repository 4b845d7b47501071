"""A rogue holder: a gRPC server that answers ``KVStore.Get`` with forged blocks and records
every call it gets (its metadata and request), as a process with write access to the index
Redis would run after naming itself a holder there. It knows no secret of the cluster, so it
cannot prove itself; it sends junk headers and no proof."""

from __future__ import annotations

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
