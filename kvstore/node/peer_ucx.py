"""Peer reads over UCX: a node reading blocks from another node's UCX listener.

:class:`UcxPeerLink` is the UCX half of :class:`~kvstore.node.peers.PeerSource`: one per peer
(its gRPC target and advertised UCX address). It speaks the same protocol as the client's UCX data
path (:mod:`kvstore.client.ucx`): a ``UcxTransfer.UcxGet`` control call over gRPC, then the
payloads over the link's UCX endpoints (``lanes`` of them, ``ucx.lanes``), as the messages the
holder's answer plans (:mod:`kvstore.protocol.ucx_plan`): without a landing the reader takes the
stream in one buffer (``receive_any``), so the holder's blocks in consecutive pages move as one
message; into a landing's pages, one message per block (or per run of the holder's pages). The
control call presents no credential: it carries an authenticator of exactly that request, naming
the endpoints, transfer and layout the payloads go to (:mod:`kvstore.node.peer_auth`), and no
receive is posted before the
holder's answer proved that it belongs to the cluster too. The call asks for the blocks sealed
(``UcxGetRequest.sealed``): the answer carries each payload's sealed header, returned with the
payload for the peer source to verify (:mod:`kvstore.node.peer_blocks`); the xxh3 checksums of
the answer only tell a damaged transfer from a whole one. Given the reader's keyring, the link
verifies the MACs itself, in the one thread hop after the receive, and reads the checksums only of
a block whose MAC fails (a block whose MAC holds arrived whole): a mismatch there is a damaged
transfer (:class:`~kvstore.protocol.ucx.UcxTransportError`), a match a block sealed wrongly.

**Which loop.** Unlike the blocking client, which runs ucxx on a thread of its own, a link runs on
the server's event loop, where the peer source runs: ucxx completes its futures on the loop that
first used it, and in a server that is the loop of its own UCX listener. The server's loop is never
blocked: every step is awaited.

**Failures.** Any failure (no ucxx, no connection, a late or failed transfer on any lane, a peer
that forgot
this endpoint twice, an answer not well-formed: a header missing, a block over
``server.max_block_bytes``, which is never allocated) raises
:class:`~kvstore.protocol.ucx.UcxTransportError` after dropping the endpoint (which cancels
receives still posted, so nothing lands late); the peer source then reads the same keys over gRPC
in what is left of the deadline. Request errors of the peer (a refused
authenticator, a bad namespace) raise the :class:`~kvstore.errors.KVStoreError` gRPC would.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any, cast

import grpc

from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore._proto.kvstore.v1 import ucx_pb2_grpc as ucx_pb_grpc
from kvstore.block import Keyring
from kvstore.client.base import client_settings
from kvstore.client.channel import ChannelSecurity, aio_channel
from kvstore.client.ucx import CONNECT_SHARE
from kvstore.node.peer_auth import (
    CALL_METADATA,
    PeerAuthError,
    PeerCall,
    PeerSigner,
    request_digest,
)
from kvstore.node.peer_blocks import SealedBlock, verify_blocks
from kvstore.protocol import messages as _wire
from kvstore.protocol.ucx import (
    CLIENT_ID_BYTES,
    UcxTransportError,
    parse_address,
    signed_destination,
    verify_payloads,
)
from kvstore.protocol.ucx_plan import StreamLayout, assign_lanes, check_plan, host_piece
from kvstore.protocol.ucx_wire import abort_endpoint, move_messages, open_endpoint
from kvstore.store.remote import Landing

__all__ = ["UcxPeerLink"]

logger = logging.getLogger(__name__)

#: gRPC codes of the control call that mean "the UCX path failed", not "the request was bad".
_TRANSPORT_CODES = {
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
}


class UcxPeerLink:
    """Reads sealed blocks from one peer over UCX (``target``: its gRPC address, for the control
    calls; ``ucx_address``: the ``HOST:PORT`` its listener advertises), each control call signed
    by ``signer`` (``None``: unauthenticated, for a server that asks nothing); a block over
    ``max_block_bytes`` fails the read; ``lanes``: the endpoints it opens to the peer."""

    def __init__(
        self,
        target: str,
        ucx_address: str,
        signer: PeerSigner | None,
        max_block_bytes: int = 64 * 1024**2,
        lanes: int = 1,
    ) -> None:
        self.target = target
        self.signer = signer
        self.max_block_bytes = max_block_bytes
        self.address = ucx_address
        self._host, self._port = parse_address(ucx_address)
        # Token "" (not None, which would take $KVSTORE_TOKEN): nothing secret goes to a peer.
        security = ChannelSecurity.for_client(client_settings(None, "grpc"), "", None, None, None)
        self._channel = aio_channel(target, security)
        self._stub = ucx_pb_grpc.UcxTransferStub(self._channel)
        self.lanes = lanes
        self._endpoints: list[Any] = []
        self._connecting = asyncio.Lock()
        self._client_ids: list[bytes] = []
        self._transfer_ids = itertools.count(1)  # 0 is never used: HELLO_TAG is tag (0, 1)
        #: ``time.monotonic()`` before which UCX is not tried again after a failure.
        self.retry_at = 0.0

    def usable(self) -> bool:
        """False for a while after a failure (the peer source reads over gRPC meanwhile)."""
        return time.monotonic() >= self.retry_at

    async def get(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        timeout: float,
        landing: Landing | None = None,
        holder: tuple[str, int] = ("", 0),
        keyring: Keyring | None = None,
    ) -> list[SealedBlock | None]:
        """Each key's sealed block (``None`` where the peer does not hold it), within
        ``timeout``, from ``holder`` (its node id and boot epoch, as its signed description in
        the index says); received into ``landing``'s buffers where it offers them (those buffers
        are then the payloads; on failure they are abandoned to it). With ``keyring``, each block
        comes verified against it (:attr:`SealedBlock.verified`), else unverified. A holder that
        does not prove itself raises :class:`~kvstore.node.peer_auth.PeerAuthError`."""
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):
            endpoints, client_ids = await self._connect(deadline)
            transfer_id = next(self._transfer_ids)
            request = ucx_pb.UcxGetRequest(
                namespace=_wire.namespace_bytes(namespace),
                keys=list(keys),
                client_id=client_ids[0],
                lanes=client_ids[1:],
                transfer_id=transfer_id,
                sealed=True,
                receive_any=landing is None,
            )
            response = await self._ask(request, holder, deadline, retry=attempt == 1)
            if response is None:
                continue  # the peer forgot the endpoint: a new one, once
            if not _well_formed(response, len(keys), self.max_block_bytes):
                await self.drop()  # the peer's sends, if any, end with the endpoint
                raise UcxTransportError("malformed UcxGet answer")
            try:
                # Bounded too: reserving pages may wait for the store's lock and evict.
                blocks = await asyncio.wait_for(
                    _buffers(keys, response, landing), _remaining(deadline)
                )
            except TimeoutError as exc:
                await self.drop()  # the peer's sends, already under way, end with the endpoint
                raise UcxTransportError("no buffers to receive into before the deadline") from exc
            buffers: dict[int, Any] = {index: memoryview(b) for index, b in blocks.items()}
            if buffers:
                try:
                    await self._receive(endpoints, transfer_id, blocks, response, deadline)
                    # Before anything is installed or served: what arrived is what was sent.
                    verdicts = await asyncio.to_thread(
                        self._check, keys, namespace, response, buffers, keyring
                    )
                except BaseException:
                    # Failed, late, damaged or cancelled: no receive still posted may outlive
                    # this call, and pages of the host tier it wrote into are not reused for a
                    # while (nor installed).
                    if landing is not None:
                        landing.abandon([keys[index] for index in blocks])
                    await self.drop()
                    raise
            sealed: list[SealedBlock | None] = [None] * len(keys)
            for index, block in blocks.items():
                # bytes-like, and the store only measures, views and copies a served payload.
                verdict = None if not buffers else verdicts[index]
                sealed[index] = SealedBlock(response.headers[index], cast(bytes, block), verdict)
            return sealed
        raise UcxTransportError("the peer forgot this UCX endpoint twice")  # pragma: no cover

    async def _ask(
        self,
        request: ucx_pb.UcxGetRequest,
        holder: tuple[str, int],
        deadline: float,
        *,
        retry: bool,
    ) -> ucx_pb.UcxGetResponse | None:
        """The signed ``UcxGet`` control call and its answer, the holder's proof checked;
        ``None`` if the peer forgot this endpoint and ``retry`` allows a new one."""
        signed = self._sign(request, holder)
        metadata = None if signed is None else ((CALL_METADATA, signed.metadata()),)
        call = self._stub.UcxGet(request, timeout=_remaining(deadline), metadata=metadata)
        try:
            response = await call
            if signed is not None and self.signer is not None:
                self.signer.check(signed, await call.initial_metadata())
        except PeerAuthError:
            await self.drop()  # whatever it sends ends with the endpoint, never received
            raise
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if exc.code() == grpc.StatusCode.ABORTED and "unknown UCX client" in details:
                # The peer restarted (or dropped us): a new endpoint, once.
                await self.drop()
                if retry:
                    return None
            if exc.code() in _TRANSPORT_CODES:
                await self.drop()
                raise UcxTransportError(
                    f"UCX control call failed: {exc.code().name}: {details}"
                ) from exc
            raise _wire.map_rpc_error(exc) from exc
        return response  # type: ignore[no-any-return]

    def _check(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        response: ucx_pb.UcxGetResponse,
        buffers: dict[int, Any],
        keyring: Keyring | None,
    ) -> list[bool | None]:
        """Per key, the MAC verdict of what arrived (``None`` without ``keyring``); raises
        :class:`UcxTransportError` for a damaged transfer: every payload's checksum without a
        keyring, only those of payloads whose MAC fails with one."""
        if keyring is None:
            verify_payloads(buffers, response.checksums)
            return [None] * len(keys)
        blocks = [
            SealedBlock(response.headers[i], buffers[i]) if i in buffers else None
            for i in range(len(keys))
        ]
        verdicts = verify_blocks(keys, namespace, blocks, keyring, self.max_block_bytes)
        failed = {i: buffers[i] for i in buffers if not verdicts[i]}
        verify_payloads(failed, response.checksums)  # whole, so sealed wrongly: refused
        return list(verdicts)

    def _sign(self, request: ucx_pb.UcxGetRequest, holder: tuple[str, int]) -> PeerCall | None:
        """The request's authenticator (``None`` without a signer): over its namespace, keys,
        and the endpoint and transfer its payloads go to."""
        if self.signer is None:
            return None
        digest = request_digest(request.namespace, request.keys, signed_destination(request))
        return self.signer.sign("UcxGet", *holder, digest)

    async def _receive(
        self,
        endpoints: list[Any],
        transfer_id: int,
        blocks: dict[int, Any],
        response: ucx_pb.UcxGetResponse,
        deadline: float,
    ) -> None:
        """Receive the answer's plan into ``blocks`` over the lanes; UcxTransportError if the
        plan does not fit them or a lane fails (every posted receive has ended by then)."""
        layout = StreamLayout([[host_piece(blocks[index])] for index in sorted(blocks)])
        messages = list(response.messages)
        try:
            check_plan(messages, layout.total, layout.breaks)
        except ValueError as exc:
            raise UcxTransportError(f"UcxGet answer with a bad plan: {exc}") from exc
        lane_of = assign_lanes(messages, len(endpoints))
        failed = await move_messages(
            "recv", endpoints, transfer_id, layout.views(messages), lane_of, _remaining(deadline)
        )
        if failed:
            lane, error = next(iter(failed.items()))
            raise UcxTransportError(f"UCX lane {lane} to {self.address} failed: {error}")

    async def _connect(self, deadline: float) -> tuple[list[Any], list[bytes]]:
        """The open endpoints, or new ones made in at most a share of the time left (a vanished
        listener stalls the handshake, and the gRPC fallback needs the rest)."""
        async with self._connecting:  # concurrent reads share the new endpoints
            if self._endpoints and not any(e.closed for e in self._endpoints):
                return self._endpoints, self._client_ids
            await self.drop()
            client_ids = [os.urandom(CLIENT_ID_BYTES) for _ in range(self.lanes)]
            timeout = _remaining(deadline) * CONNECT_SHARE
            opened = await asyncio.gather(
                *(open_endpoint(self._host, self._port, c, timeout) for c in client_ids),
                return_exceptions=True,
            )
            endpoints = [e for e in opened if not isinstance(e, BaseException)]
            errors = [e for e in opened if isinstance(e, BaseException)]
            if errors:
                for endpoint in endpoints:
                    await abort_endpoint(endpoint)
                error = errors[0]
                if isinstance(error, UcxTransportError):
                    raise error
                raise UcxTransportError(f"cannot open a UCX lane to {self.address}: {error}")
            self._endpoints, self._client_ids = endpoints, client_ids
            logger.debug("peer fetch: %d UCX lanes to %s open", len(endpoints), self.address)
            return endpoints, client_ids

    async def drop(self) -> None:
        """Abort the endpoints (the next read reconnects)."""
        endpoints, self._endpoints = self._endpoints, []
        for endpoint in endpoints:
            try:
                await abort_endpoint(endpoint)
            except Exception:  # already closed by the peer's failure
                logger.debug("aborting a peer UCX endpoint failed", exc_info=True)

    async def aclose(self) -> None:
        """Drop the endpoint and close the control channel."""
        await self.drop()
        await self._channel.close(None)


async def _buffers(
    keys: Sequence[bytes], response: ucx_pb.UcxGetResponse, landing: Landing | None
) -> dict[int, Any]:
    """A buffer for each block the peer sends: the landing's pages where it offers them, else
    a bytearray (its zeroed pages come lazily from the kernel, and it needs no copy after);
    without a landing, slices of one bytearray for the whole stream (``receive_any``)."""
    sent = [index for index, flag in enumerate(response.sent) if flag]
    if landing is None:
        stream = memoryview(bytearray(sum(response.lengths[index] for index in sent)))
        out: dict[int, Any] = {}
        offset = 0
        for index in sent:
            out[index] = stream[offset : offset + response.lengths[index]]
            offset += response.lengths[index]
        return out
    offered: list[Any | None] = [None] * len(sent)
    if sent:
        offered = await landing.buffers(
            [keys[index] for index in sent], [response.lengths[index] for index in sent]
        )
    return {
        index: bytearray(response.lengths[index]) if buffer is None else buffer
        for index, buffer in zip(sent, offered, strict=True)
    }


def _well_formed(response: ucx_pb.UcxGetResponse, count: int, max_block_bytes: int) -> bool:
    """An answer of ``count`` keys, each block sent with its header and within the size limit
    (checked before a receive buffer of the stated length is made)."""
    fields = (response.lengths, response.sent, response.headers)
    if any(len(field) != count for field in fields):
        return False
    return all(
        0 < length <= max_block_bytes
        for length, sent in zip(response.lengths, response.sent, strict=True)
        if sent
    )


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise UcxTransportError("deadline passed before the UCX transfer finished")
    return remaining
