"""Peer reads over gRPC: a node reading sealed blocks from another node's ``KVStore.Get``.

:class:`GrpcPeerLink` is the gRPC half of :class:`~kvstore.node.peers.PeerSource`: one per
peer (its gRPC target), a ``grpc.aio`` channel that presents no credential: each call carries
an authenticator for exactly that request and that holder (:mod:`kvstore.node.peer_auth`),
and nothing of the answer is read before the holder proved, in its initial metadata, that it
belongs to the cluster too. It asks for each block sealed (``GetRequest.sealed``) and returns the
payloads with their sealed headers, unverified: the peer source verifies them
(:mod:`kvstore.node.peer_blocks`), as it does what UCX brings (:mod:`kvstore.node.peer_ucx`).

**Bounds.** A peer's answer is not trusted to size itself: the channel refuses a message larger
than one block plus a message's worth of smaller ones (what the holder sends at most), and an
answer that names a key out of range or twice, or a block over ``server.max_block_bytes``, fails
the read (:class:`~kvstore.node.peer_blocks.PeerAnswerError`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.client.base import client_settings
from kvstore.client.channel import ChannelSecurity, aio_channel
from kvstore.node.peer_auth import (
    CALL_METADATA,
    PeerAuthError,
    PeerCall,
    PeerSigner,
    request_digest,
)
from kvstore.node.peer_blocks import PeerAnswerError, SealedBlock
from kvstore.protocol import messages as _wire

__all__ = ["GrpcPeerLink"]

#: How long an answer without a proof may take to show it was a refusal (its status).
_STATUS_GRACE_S = 0.1
#: Room in one message beyond its blocks' payloads (per-result fields and headers).
_MESSAGE_SLACK_BYTES = 1024**2


class GrpcPeerLink:
    """Reads sealed blocks from one peer over gRPC (``target``: its gRPC address), each call
    signed by ``signer`` (``None``: unauthenticated, for a server that asks nothing); blocks over
    ``max_block_bytes`` fail the read."""

    def __init__(self, target: str, signer: PeerSigner | None, max_block_bytes: int) -> None:
        self.target = target
        self.signer = signer
        self.max_block_bytes = max_block_bytes
        # Token "" (not None, which would take $KVSTORE_TOKEN): nothing secret goes to a peer.
        security = ChannelSecurity.for_client(client_settings(None, "grpc"), "", None, None, None)
        largest = max_block_bytes + _wire.MESSAGE_TARGET_BYTES + _MESSAGE_SLACK_BYTES
        options = [
            ("grpc.max_receive_message_length", largest),
            ("grpc.max_send_message_length", -1),
        ]
        self._channel = aio_channel(target, security, options)
        self._stub = pb_grpc.KVStoreStub(self._channel)

    async def get(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        timeout: float,
        holder: tuple[str, int] = ("", 0),
    ) -> list[SealedBlock | None]:
        """Each key's sealed block (``None`` where the peer does not hold it), within
        ``timeout``, from ``holder`` (its node id and boot epoch, as its signed description in
        the index says); raises :class:`~kvstore.errors.KVStoreError` (a deadline:
        :class:`~kvstore.errors.DeadlineExceededError`), :class:`PeerAnswerError` or
        :class:`~kvstore.node.peer_auth.PeerAuthError` (no proof from the holder)."""
        request = pb.GetRequest(namespace=namespace, keys=list(keys), sealed=True)
        blocks: list[SealedBlock | None] = [None] * len(keys)
        answered = bytearray(len(keys))
        signed = None
        if self.signer is not None:
            signed = self.signer.sign("Get", *holder, request_digest(namespace, keys))
        metadata = None if signed is None else ((CALL_METADATA, signed.metadata()),)
        call = self._stub.Get(request, timeout=timeout, metadata=metadata)
        try:
            if signed is not None:
                await self._proven(call, signed)
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

    async def _proven(self, call: Any, signed: PeerCall) -> None:
        """Return once the holder proved itself in the answer's initial metadata; raise the
        call's own error where it ended without one (it refused the request: the holder's
        message says why), else :class:`PeerAuthError`."""
        assert self.signer is not None
        try:
            self.signer.check(signed, await call.initial_metadata())
            return
        except PeerAuthError as exc:
            unproven = exc
        # A refusal comes as trailers only, whose status may land a moment after the (empty)
        # initial metadata: give it that moment, so a node refusing us is not taken for a rogue.
        with contextlib.suppress(TimeoutError):
            if await asyncio.wait_for(call.code(), _STATUS_GRACE_S) != grpc.StatusCode.OK:
                async for _ in call:  # raises the call's error, mapped by the caller
                    break
        raise unproven

    async def aclose(self) -> None:
        """Close the channel."""
        await self._channel.close(None)
