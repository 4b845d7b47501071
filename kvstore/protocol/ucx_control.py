"""Control messages over a UCX endpoint: a transfer's ``UcxGet`` / ``UcxPut`` request and its
answer as two small tagged messages on the endpoint the payloads use, instead of a gRPC call.

Authentication comes from a handshake, never from a message: the client binds its endpoints with
one authenticated gRPC call (``UcxTransfer.UcxBind``: the bearer token, client certificate and
tenant checks of every gRPC call), and the server answers a fresh random key for them. From then
on each control message carries a keyed BLAKE2b MAC (16 bytes) over its header and body under
that key, and the server serves it as the tenant that bound the endpoint it *arrived on*: the
client id, lanes and tenant a message names are checked against that binding, never believed.
A message that fails (a bad MAC, an unknown kind or version, a sequence number already seen,
an endpoint not bound) is answered with an error status and nothing else is done; the endpoint
stays up. The answers are MAC'd the same way, so a client never acts on a forged one.

A frame (little-endian)::

    magic "KVUC" | version u8 | kind u8 | reserved u16 | seq u64 | transfer_id u64 |
    timeout_ms u32 | answer_bytes u32 | body_len u32 | mac[16] | body

``seq`` rises strictly per endpoint (requests): a replayed message is refused; an answer echoes
its request's ``seq`` and ``transfer_id``. ``timeout_ms`` is the caller's deadline (the server
caps it by ``ucx.transfer_timeout_s``, as a gRPC deadline); ``answer_bytes`` the room the caller
posted for the answer (an answer that would not fit is an error answer instead). The body of a
request is the serialized ``UcxGetRequest`` / ``UcxPutRequest``, of an answer the
``UcxGetResponse`` / ``PutResponse``, of an error a u32 status code and its UTF-8 details.
Requests travel on :data:`CONTROL_TAG`, an answer on :func:`answer_tag` of its transfer.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any

from kvstore.formats import UCX_CONTROL

__all__ = [
    "ANSWER_ERROR",
    "ANSWER_GET",
    "ANSWER_PUT",
    "CONTROL_TAG",
    "HEADER_BYTES",
    "KEY_BYTES",
    "MAX_CONTROL_BYTES",
    "REQUEST_GET",
    "REQUEST_PUT",
    "ControlError",
    "Frame",
    "answer_tag",
    "decode",
    "encode",
    "encode_error",
    "error_of",
    "peek",
]

#: Tag of a request (transfer 0, index 2: below every payload tag, beside ``HELLO_TAG``).
CONTROL_TAG = 2
#: Largest control message either side receives (the server posts receives of this size).
MAX_CONTROL_BYTES = 1024**2
#: Length of the key ``UcxBind`` answers.
KEY_BYTES = 32
MAC_BYTES = 16
_MAGIC = b"KVUC"
_HEAD = struct.Struct("<4sBBHQQIII")
#: Header and MAC, before the body.
HEADER_BYTES = _HEAD.size + MAC_BYTES
#: Bit 60 of a tag: answers (payload tags use 60 bits, and tags stay below 2**61 - 1).
_ANSWER_BIT = 1 << 60
_TRANSFER_MASK = (1 << 36) - 1
#: Most characters of an error's details.
_MAX_DETAILS = 1024

REQUEST_GET, REQUEST_PUT = 1, 2
ANSWER_GET, ANSWER_PUT, ANSWER_ERROR = 0x81, 0x82, 0xFF
_REQUESTS = {REQUEST_GET, REQUEST_PUT}
_ANSWERS = {ANSWER_GET, ANSWER_PUT, ANSWER_ERROR}


class ControlError(Exception):
    """A control message that is not well-formed or not authentic (the message says why)."""


@dataclass(frozen=True)
class Frame:
    """One decoded, authenticated control message."""

    kind: int
    seq: int
    transfer_id: int
    timeout_ms: int
    answer_bytes: int
    body: bytes


def answer_tag(transfer_id: int) -> int:
    """The tag of the answer to transfer ``transfer_id``'s request (unique per endpoint)."""
    return _ANSWER_BIT | (transfer_id & _TRANSFER_MASK)


def _mac(key: bytes, head: bytes, body: Any) -> bytes:
    digest = hashlib.blake2b(head, key=key, digest_size=MAC_BYTES)
    digest.update(body)
    return digest.digest()


def encode(
    key: bytes,
    kind: int,
    seq: int,
    transfer_id: int,
    body: bytes,
    *,
    timeout_ms: int = 0,
    answer_bytes: int = 0,
) -> bytes:
    """A frame of ``body``, MAC'd under ``key``."""
    head = _HEAD.pack(
        _MAGIC,
        UCX_CONTROL.latest,
        kind,
        0,
        seq,
        transfer_id & ((1 << 64) - 1),
        min(max(timeout_ms, 0), 0xFFFFFFFF),
        min(answer_bytes, 0xFFFFFFFF),
        len(body),
    )
    return head + _mac(key, head, body) + body


def peek(buffer: Any) -> tuple[int, int]:
    """``(seq, transfer_id)`` a frame's header names (unauthenticated: only to address a refusal);
    :class:`ControlError` if there is no header."""
    view = memoryview(buffer).cast("B")
    if len(view) < HEADER_BYTES or bytes(view[:4]) != _MAGIC:
        raise ControlError("not a kvstore UCX control message")
    _, _, _, _, seq, transfer_id, _, _, _ = _HEAD.unpack_from(view)
    return seq, transfer_id


def decode(key: bytes, buffer: Any, kinds: set[int] | None = None) -> Frame:
    """The frame at the start of ``buffer`` (which may be longer), checked: magic, a version this
    release reads, a kind of ``kinds`` (requests by default), the length and the MAC."""
    view = memoryview(buffer).cast("B")
    if len(view) < HEADER_BYTES or bytes(view[:4]) != _MAGIC:
        raise ControlError("not a kvstore UCX control message")
    _, version, kind, _, seq, transfer_id, timeout_ms, answer_bytes, length = _HEAD.unpack_from(
        view
    )
    if version not in UCX_CONTROL.reads:
        raise ControlError(
            f"UCX control message version {version}; this release reads "
            f"{', '.join(map(str, UCX_CONTROL.reads))}"
        )
    if kind not in (_REQUESTS if kinds is None else kinds):
        raise ControlError(f"UCX control message of kind {kind:#x} not accepted here")
    if HEADER_BYTES + length > len(view):
        raise ControlError(f"UCX control message body of {length} bytes is cut short")
    body = bytes(view[HEADER_BYTES : HEADER_BYTES + length])
    mac = bytes(view[_HEAD.size : HEADER_BYTES])
    if not hmac.compare_digest(mac, _mac(key, bytes(view[: _HEAD.size]), body)):
        raise ControlError("UCX control message MAC does not verify under this endpoint's key")
    return Frame(kind, seq, transfer_id, timeout_ms, answer_bytes, body)


def encode_error(key: bytes, seq: int, transfer_id: int, code: int, details: str) -> bytes:
    """An error answer: status ``code`` (a ``grpc.StatusCode`` value's number) and ``details``."""
    body = struct.pack("<I", code) + details[:_MAX_DETAILS].encode()
    return encode(key, ANSWER_ERROR, seq, transfer_id, body)


def error_of(frame: Frame) -> tuple[int, str]:
    """``(code, details)`` of an error answer."""
    if len(frame.body) < 4:
        raise ControlError("UCX control error answer without a status")
    (code,) = struct.unpack_from("<I", frame.body)
    return code, frame.body[4:].decode(errors="replace")
