"""The server's end of UCX control messages (:mod:`kvstore.protocol.ucx_control`): ``UcxBind``,
and the requests that arrive over a bound endpoint instead of ``UcxGet`` / ``UcxPut`` calls.

``UcxBind`` is a gRPC call, authenticated like every other (the interceptor's token or
certificate, then the tenant rule): it binds the endpoints it names to the calling tenant (as a
first ``UcxGet`` would) and gives them a fresh key. Each bound endpoint then has one receive of
:data:`~kvstore.protocol.ucx_control.MAX_CONTROL_BYTES` posted on the control tag; a request that
arrives is served as the tenant that bound *that endpoint* (the scope captured at bind), once its
MAC verifies under that endpoint's key and its sequence number is new; the client id it names
must be that endpoint's, and the lanes it names are checked against the binding as for a gRPC
call. Whatever fails is answered with an error status (a refused message: UNAUTHENTICATED,
"UCX control message refused: ..."), and the endpoint keeps serving. A message longer than the
posted receive fails that receive: the endpoint is dropped (the client reconnects, or uses gRPC).
Everything runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore.errors import InvalidRequestError, KVStoreError, PermissionDeniedError, status_of
from kvstore.formats import UCX_CONTROL
from kvstore.protocol import ucx_control as ctl
from kvstore.protocol.ucx import UcxTransportError
from kvstore.server.durations import timed
from kvstore.server.ucx_endpoints import ClientEndpoint
from kvstore.server.ucx_put import UcxPuts, UcxScope

__all__ = ["ControlBinding", "UcxControl"]

logger = logging.getLogger(__name__)

#: The prefix of the details of a refused control message (the client then uses gRPC).
REFUSED = "UCX control message refused"
#: Control messages one endpoint may have served at once; the next is received once one ends
#: (as a gRPC connection's concurrent streams are bounded).
MAX_CONTROL_INFLIGHT = 64


@dataclass
class ControlBinding:
    """What ``UcxBind`` gave an endpoint: its key, the tenant's scope, the last ``seq`` seen."""

    key: bytes
    scope: UcxScope
    seq: int = 0


class UcxControl(UcxPuts):
    """``UcxBind`` and the control messages over bound endpoints (gets: :meth:`serve_get`)."""

    async def serve_get(
        self, scope: UcxScope, request: ucx_pb.UcxGetRequest, deadline: float
    ) -> ucx_pb.UcxGetResponse:
        """Serve a get (:class:`~kvstore.server.ucx.UcxDataServer` does)."""
        raise NotImplementedError

    def bind(self, request: ucx_pb.UcxBindRequest) -> ucx_pb.UcxBindResponse:
        """The ``UcxBind`` call, as the calling tenant (see the module)."""
        scope = self._scope()  # PermissionDeniedError for credentials in no tenant
        ids = list(request.client_ids)
        if not ids:
            raise InvalidRequestError("UcxBind names no endpoint")
        clients = self._lanes(ids[0], ids[1:], scope.owner)  # bounds, duplicates, owner
        version = max(set(request.versions) & set(UCX_CONTROL.reads), default=0)
        if not version:
            return ucx_pb.UcxBindResponse(version=0)
        key = os.urandom(ctl.KEY_BYTES)
        for client in clients:
            listening = client.control is not None
            # A new key: whatever was signed with the old one is refused from now on.
            client.control = ControlBinding(key, scope)
            if not listening:
                self._spawn(self._control_loop(client))
        self.counters["control_binds"] += 1
        return ucx_pb.UcxBindResponse(
            key=key, version=version, max_message_bytes=ctl.MAX_CONTROL_BYTES
        )

    async def _control_loop(self, client: ClientEndpoint) -> None:
        """Receive control messages on ``client``'s endpoint until it goes."""
        room = asyncio.Semaphore(MAX_CONTROL_INFLIGHT)
        while self._clients.get(client.client_id) is client and not client.endpoint.closed:
            await room.acquire()
            buffer = np.empty(ctl.MAX_CONTROL_BYTES, dtype=np.uint8)  # no zeroing
            try:
                await client.endpoint.recv(buffer, tag=ctl.CONTROL_TAG)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # closed, or a message longer than the receive
                if self._clients.get(client.client_id) is client:
                    self._drop(client, f"control receive failed: {type(exc).__name__}: {exc}")
                return
            self._spawn(self._control_one(client, buffer, room))

    async def _control_one(
        self, client: ClientEndpoint, buffer: Any, room: asyncio.Semaphore
    ) -> None:
        """Check one control message, serve it, answer it (then make room for the next)."""
        try:
            await self._control_checked(client, buffer)
        finally:
            room.release()

    async def _control_checked(self, client: ClientEndpoint, buffer: Any) -> None:
        binding = client.control
        assert binding is not None
        try:
            seq, transfer_id = ctl.peek(buffer)
        except ctl.ControlError as exc:  # not even a header to address an answer to
            self._refused(client, exc)
            return
        try:
            frame = ctl.decode(binding.key, buffer)
            if frame.seq <= binding.seq:
                raise ctl.ControlError(f"sequence number {frame.seq} already used (a replay)")
            binding.seq = frame.seq
        except ctl.ControlError as exc:
            self._refused(client, exc)
            await self._answer(
                client,
                transfer_id,
                ctl.encode_error(
                    binding.key,
                    seq,
                    transfer_id,
                    _code(grpc.StatusCode.UNAUTHENTICATED),
                    f"{REFUSED}: {exc}",
                ),
            )
            return
        await self._answer(client, transfer_id, await self._serve(client, binding, frame))

    async def _serve(
        self, client: ClientEndpoint, binding: ControlBinding, frame: ctl.Frame
    ) -> bytes:
        """The answer frame to an authentic request."""
        deadline = time.monotonic() + min(frame.timeout_ms / 1000, self.transfer_timeout_s)
        scope = binding.scope
        try:
            if frame.kind == ctl.REQUEST_GET:
                get = _parse(ucx_pb.UcxGetRequest, frame, client)
                with timed("get", "ucx", lambda: scope.owner):
                    response: Any = await self.serve_get(scope, get, deadline)
                kind = ctl.ANSWER_GET
            else:
                put = _parse(ucx_pb.UcxPutRequest, frame, client)
                with timed("put", "ucx", lambda: scope.owner):
                    response = await self.serve_put(scope, put, deadline, drop_refused=False)
                kind = ctl.ANSWER_PUT
            body = response.SerializeToString()
            if ctl.HEADER_BYTES + len(body) > frame.answer_bytes:
                # Sends of a get may be under way: they end with the endpoint.
                self._drop(client, "control answer larger than the client's room for it")
                raise UcxTransportError("the answer is larger than the room the client gave it")
            return ctl.encode(binding.key, kind, frame.seq, frame.transfer_id, body)
        except KVStoreError as exc:
            code, details = status_of(exc), str(exc)
        except DecodeError as exc:
            code, details = grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {exc}"
        except UcxTransportError as exc:
            code, details = grpc.StatusCode.ABORTED, str(exc)
        except Exception as exc:
            logger.exception("unexpected failure serving a UCX control message")
            code, details = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
        return ctl.encode_error(binding.key, frame.seq, frame.transfer_id, _code(code), details)

    async def _answer(self, client: ClientEndpoint, transfer_id: int, frame: bytes) -> None:
        """Send an answer on its transfer's answer tag; a failure drops the endpoint. Not
        waited for: a small message leaves at once, and the client waits for it anyway."""
        try:
            sending = asyncio.ensure_future(
                client.endpoint.send(
                    np.frombuffer(frame, dtype=np.uint8), tag=ctl.answer_tag(transfer_id)
                )
            )
        except Exception as exc:  # the endpoint closed already
            self._drop(client, f"control answer failed: {type(exc).__name__}: {exc}")
            return
        self.counters["control_messages"] += 1

        def sent(future: asyncio.Future[Any]) -> None:
            error = None if future.cancelled() else future.exception()
            if error is not None and self._clients.get(client.client_id) is client:
                self._drop(client, f"control answer failed: {type(error).__name__}: {error}")

        sending.add_done_callback(sent)

    def _refused(self, client: ClientEndpoint, exc: Exception) -> None:
        self.counters["control_refused"] += 1
        logger.warning("refused a UCX control message on %s: %s", client.client_id.hex(), exc)


def _parse(message: Any, frame: ctl.Frame, client: ClientEndpoint) -> Any:
    """The request of ``frame``, naming the endpoint it arrived on and the frame's transfer."""
    request = message.FromString(frame.body)
    if request.client_id != client.client_id:
        raise PermissionDeniedError(
            "a UCX control message must name the endpoint it arrives on as its client_id"
        )
    if request.transfer_id != frame.transfer_id:
        raise InvalidRequestError("the control message's transfer id differs from its request's")
    return request


def _code(code: grpc.StatusCode) -> int:
    return int(code.value[0])
