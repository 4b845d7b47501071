"""The UCX data path between hosts: what its server and client sides share.

The control messages (``kvstore.v1.UcxTransfer``: which keys, the namespace, the lengths, found or
missing) go over gRPC or, once bound, over the UCX endpoint itself
(:mod:`kvstore.protocol.ucx_control`), and UCX carries the payload bytes as the tagged messages of
the call's plan (blocks next to each other in both sides' memory as one message, over one or more
endpoints: :mod:`kvstore.protocol.ucx_plan`), so a whole batch costs one control round trip. UCX
picks its transports itself (RDMA where there is some, TCP otherwise). The pieces live in small
modules:

* this one: loading ``ucxx`` (optional: the ``ucx`` extra), the tag of each message, the address
  format, and :class:`UcxTransportError`, the one failure that means "use gRPC for this call";
* :mod:`kvstore.protocol.ucx_plan` (which bytes travel as one message, over which lane) and
  :mod:`kvstore.protocol.ucx_wire` (endpoints, moving a plan's messages, the client's loop);
* :mod:`kvstore.server.ucx`: :class:`~kvstore.server.ucx.UcxDataServer`, the
  listener and the gRPC servicer, on the server's event loop;
* :mod:`kvstore.client.ucx`: :class:`~kvstore.client.ucx.UcxDataClient`, used
  by the blocking ``KVStoreClient``, with its own event-loop thread.

Endpoints are created with UCX error handling on, so that a dead peer fails the transfers in
flight instead of hanging them (and never takes the process down). UCX then restricts itself to
transports that detect peer failure, which on a host without RDMA means TCP, also between two
processes of one host: co-located clients have the shared-memory path for that.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import xxhash

__all__ = [
    "CLIENT_ID_BYTES",
    "HELLO_TAG",
    "MAX_BATCH",
    "UCX_ENV_DEFAULTS",
    "UcxTransportError",
    "endpoint_error",
    "load_ucxx",
    "parse_address",
    "payload_checksum",
    "payload_checksums",
    "signed_destination",
    "transfer_tag",
    "ucx_unavailable_reason",
    "verify_payloads",
]

#: Length of the id a client announces over its endpoint and names in every control call.
CLIENT_ID_BYTES = 16

#: Tag of the hello a client sends after connecting, and of the server's one-byte answer (no
#: payload tag is this small: transfer ids start at 1).
HELLO_TAG = 1

#: Bits of a payload tag that hold the index of the message in its plan (the rest: transfer id).
_INDEX_BITS = 24
#: Most blocks, and most messages, in one transfer.
MAX_BATCH = 1 << _INDEX_BITS
# Tags stay below 2**61 - 1 so that ``hash(tag) == tag`` (ucxx hashes user tags with the
# endpoint's own tag); 36 bits of transfer id wrap after 68 billion transfers on one endpoint.
_TRANSFER_BITS = 36

#: UCX settings applied before the first import of ucxx; a value set in the environment wins.
#: ucxx's defaults assume a GPU (it stages rendezvous fragments in CUDA memory) and it warns about
#: UCX_MEMTYPE_CACHE, which it sets itself. Over TCP, UCX's automatic rendezvous scheme copies
#: large messages through 512 KiB staging fragments; ``put_zcopy`` writes straight from the
#: sender's buffer into the receiver's and measured 1.3-2.5x faster for 1-16 MiB blocks
#: (measured with ucx_perftest and benchmarks/bench_dataplane.py).
UCX_ENV_DEFAULTS = {
    "UCX_RNDV_FRAG_MEM_TYPE": "host",
    "UCX_RNDV_SCHEME": "put_zcopy",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # A restarted server must get its listener port back while the old connections are still
    # in TIME-WAIT; without this it comes up with the UCX path off.
    "UCX_TCP_CM_REUSEADDR": "y",
    # Without it ucxx awaits each request by yielding to the event loop until it completes, a
    # busy loop that also slows everything else on that loop (the server's gRPC and shared-memory
    # requests); with it a notifier thread completes futures. Measured 2x faster gets and puts
    # of 8 x 256 KiB over loopback (benchmarks/bench_dataplane.py).
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
}

_ucxx: ModuleType | None = None
_import_error: str | None = None


class UcxTransportError(Exception):
    """A UCX transfer could not be done (no ucxx, no connection, a failed or late transfer).

    Never reaches users of :class:`kvstore.KVStoreClient`: it means "move these bytes over gRPC
    instead". Request errors (bad keys, namespace mismatch, capacity) are
    :class:`kvstore.errors.KVStoreError`, as on the gRPC path.
    """


def load_ucxx() -> ModuleType:
    """Import ``ucxx`` (once, with host-memory defaults); :class:`UcxTransportError` if missing."""
    global _ucxx, _import_error
    if _ucxx is not None:
        return _ucxx
    if _import_error is not None:
        raise UcxTransportError(_import_error)
    for name, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        import ucxx
    except Exception as exc:  # ImportError, or a native library that fails to load
        _import_error = f"ucxx is not usable: {type(exc).__name__}: {exc}"
        raise UcxTransportError(_import_error) from exc
    module: ModuleType = ucxx
    _ucxx = module
    _stop_notifier_at_exit(module)
    return module


def _stop_notifier_at_exit(module: ModuleType) -> None:
    """Stop ucxx's notifier thread when the interpreter exits.

    The thread is not a daemon (when started from the main thread) and ucxx stops it only when
    asked, so a process would hang at exit. ``atexit`` runs too late (after non-daemon threads are
    joined); ``threading._register_atexit`` runs before, as concurrent.futures relies on.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython 3.9+: fall back to asking for a daemon-less exit
        atexit.register(module.stop_notifier_thread)
        return
    with contextlib.suppress(RuntimeError):  # registering while the interpreter shuts down
        register(module.stop_notifier_thread)


def ucx_unavailable_reason() -> str | None:
    """Why UCX cannot be used in this process, or ``None`` if ``ucxx`` imports."""
    try:
        load_ucxx()
    except UcxTransportError as exc:
        return str(exc)
    return None


def transfer_tag(transfer_id: int, index: int) -> int:
    """The UCX tag of message ``index`` of transfer ``transfer_id`` (unique per endpoint)."""
    if not 0 <= index < MAX_BATCH:
        raise ValueError(f"block index {index} out of range")
    return ((transfer_id % (1 << _TRANSFER_BITS)) << _INDEX_BITS) | index


def signed_destination(request: Any) -> bytes:
    """What a peer read's authenticator covers beside its keys: the endpoints (lanes) and the
    transfer its payloads go to, and how the reader lays them out (a ``UcxGetRequest``)."""
    lanes = b"".join(bytes(lane) for lane in request.lanes)
    layout = (
        b""
        if not (request.joined or request.receive_any)
        else (bytes([request.receive_any]) + bytes(bytearray(request.joined)))
    )
    transfer = int(request.transfer_id).to_bytes(8, "little")
    return bytes(request.client_id) + lanes + transfer + layout


def parse_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``HOST:PORT`` UCX address (``[v6]:port`` too)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"UCX address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def endpoint_error(exc: BaseException) -> UcxTransportError:
    """A :class:`UcxTransportError` describing ``exc`` (a ucxx or asyncio failure)."""
    if isinstance(exc, TimeoutError):
        return UcxTransportError("UCX transfer timed out")
    return UcxTransportError(f"UCX transfer failed: {type(exc).__name__}: {exc}")


def payload_checksum(payload: Any) -> int:
    """The xxh3-64 (seed 0, the same in every process) that a UCX get's answer gives for a
    payload it sends; the receiver checks the bytes that arrived against it."""
    return int(xxhash.xxh3_64_intdigest(payload))


def payload_checksums(payloads: Sequence[tuple[int, Any]], count: int) -> list[int]:
    """The ``checksums`` field of a get's answer: per key of ``count``, the checksum of its
    payload in ``payloads`` (``(index, bytes)``), 0 for keys that get none."""
    checksums = [0] * count
    for index, payload in payloads:
        checksums[index] = payload_checksum(payload)
    return checksums


def verify_payloads(received: Mapping[int, Any], checksums: Sequence[int]) -> None:
    """Raise :class:`UcxTransportError` unless every received payload (by index in the request)
    matches its announced checksum; an answer without checksums fails too (never trusted)."""
    for index, payload in received.items():
        if index >= len(checksums) or payload_checksum(payload) != checksums[index]:
            raise UcxTransportError(
                f"payload {index} does not match the checksum its sender announced "
                "(a short or damaged transfer)"
            )
