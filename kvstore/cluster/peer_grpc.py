"""Peer reads over gRPC: a node reading sealed blocks from another node's ``KVStore.Get``.

:class:`GrpcPeerLink` is the gRPC half of :class:`~kvstore.cluster.peers.PeerSource`: one per
peer (its gRPC target), a ``grpc.aio`` channel presenting ``cluster.peer_token``. It asks for
each block sealed (``GetRequest.sealed``) and returns the payloads with their sealed headers,
unverified: the peer source verifies them (:mod:`kvstore.cluster.peer_blocks`), as it does
what UCX brings (:mod:`kvstore.cluster.peer_ucx`).

**Bounds.** A peer's answer is not trusted to size itself: the channel refuses a message larger
than one block plus a message's worth of smaller ones (what the holder sends at most), and an
answer that names a key out of range or twice, or a block over ``server.max_block_bytes``, fails
the read (:class:`~kvstore.cluster.peer_blocks.PeerAnswerError`).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.client.channel import ChannelSecurity, aio_channel
from kvstore.client.core import client_settings
from kvstore.cluster.peer_blocks import PeerAnswerError, SealedBlock
from kvstore.protocol import messages as _wire

__all__ = ["GrpcPeerLink"]

#: Room in one message beyond its blocks' payloads (per-result fields and headers).
_MESSAGE_SLACK_BYTES = 1024**2


class GrpcPeerLink:
    """Reads sealed blocks from one peer over gRPC (``target``: its gRPC address), presenting
    ``token``; blocks over ``max_block_bytes`` fail the read."""

    def __init__(self, target: str, token: str, max_block_bytes: int) -> None:
        self.target = target
        self.max_block_bytes = max_block_bytes
        security = ChannelSecurity.for_client(
            client_settings(None, "grpc"), token or None, None, None, None
        )
        largest = max_block_bytes + _wire.MESSAGE_TARGET_BYTES + _MESSAGE_SLACK_BYTES
        options = [
            ("grpc.max_receive_message_length", largest),
            ("grpc.max_send_message_length", -1),
        ]
        self._channel = aio_channel(target, security, options)
        self._stub = pb_grpc.KVStoreStub(self._channel)

    async def get(
        self, keys: Sequence[bytes], namespace: bytes, timeout: float
    ) -> list[SealedBlock | None]:
        """Each key's sealed block (``None`` where the peer does not hold it), within
        ``timeout``; raises :class:`~kvstore.errors.KVStoreError` (a deadline:
        :class:`~kvstore.errors.DeadlineExceededError`) or :class:`PeerAnswerError`."""
        request = pb.GetRequest(namespace=namespace, keys=list(keys), sealed=True)
        blocks: list[SealedBlock | None] = [None] * len(keys)
        answered = bytearray(len(keys))
        call = self._stub.Get(request, timeout=timeout)
        try:
            async for response in call:
                for result in response.results:
                    index = result.index
                    if index >= len(keys) or answered[index]:
                        raise PeerAnswerError(f"answer names result {index} twice or out of range")
                    answered[index] = 1
                    if not result.found:
                        continue
                    value = result.value  # each read of a bytes field is a copy of it
                    if len(value) > self.max_block_bytes:
                        raise PeerAnswerError(
                            f"a block of {len(value)} bytes; the limit is "
                            f"{self.max_block_bytes} (server.max_block_bytes)"
                        )
                    blocks[index] = SealedBlock(result.header, value)
        except grpc.aio.AioRpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        finally:
            call.cancel()  # a refused answer ends the stream here (a no-op once it is over)
        return blocks

    async def aclose(self) -> None:
        """Close the channel."""
        await self._channel.close(None)
