"""Reading blocks into device (GPU) memory: straight over UCX where it can, else through pinned
host staging.

:meth:`kvstore.KVStoreClient.get_into_device` fills torch tensors on any device. Which path the
bytes take depends on where the client is and on what UCX can do in this process:

``host``
    The destinations are host memory: a plain ``get_into`` (shared memory, UCX or gRPC).
``shm-dma``
    The store is on this host, the destinations are CUDA tensors, and the pages of the leased
    blocks in this client's mapping of the arena are page-locked
    (:mod:`kvstore.client.arena_registration`, started by the first such call): one DMA per
    block straight out of the arena, no host copy. Until the registration covers them, the
    blocks take ``shm-pinned``.
``ucx-device``
    The store is on another host (no shared memory), its UCX listener is reachable, and UCX has a
    transport that reaches device memory in this process (``cuda_copy``, ``cuda_ipc``,
    ``gdr_copy``): the receive targets the device tensors themselves, no host copy at all.
``shm-pinned``, ``ucx-pinned``, ``grpc-pinned``
    Anything else: the blocks land in page-locked host staging buffers over that data plane
    (the caller's, or ones made for the call), then one host-to-device copy per block on a side
    stream, waited for before the call returns.

The result says which path was taken (:class:`DeviceFill`), so engines and benchmarks can report
it; a UCX receive into device memory that fails falls back to the pinned path within the same
deadline. torch is imported only when a call asks for device memory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.client.cuda_runtime import HOST_TO_DEVICE, cuda_runtime
from kvstore.client.shm import ShmLease
from kvstore.errors import InvalidRequestError

__all__ = [
    "DEVICE_TRANSPORTS",
    "DeviceFill",
    "checked_staging",
    "copy_from_lease",
    "copy_to_devices",
    "device_byte_views",
    "device_transports_in",
    "is_device_tensor",
    "queued_streams",
    "settle_queued_writes",
    "staging_for",
]

#: UCX transports that read or write GPU memory (UCX names them so in its context description).
DEVICE_TRANSPORTS = ("cuda_copy", "cuda_ipc", "gdr_copy", "rocm_copy", "rocm_ipc")
_TRANSPORT_WORD = re.compile(r"\b(" + "|".join(DEVICE_TRANSPORTS) + r")\b")


@dataclass(frozen=True, slots=True)
class DeviceFill:
    """What :meth:`~kvstore.KVStoreClient.get_into_device` did.

    Attributes:
        found: Per key, whether its tensor was filled (False: missing, or its size differs).
        path: ``"host"``, ``"ucx-device"`` or ``"<plane>-pinned"`` (see the module docstring).
    """

    found: list[bool]
    path: str


def is_device_tensor(value: Any) -> bool:
    """True for a torch tensor in accelerator memory (the host cannot address it)."""
    device = getattr(value, "device", None)
    return device is not None and getattr(device, "type", "cpu") != "cpu"


def device_transports_in(context_info: str) -> tuple[str, ...]:
    """The device-memory transports named in UCX's description of a context, in a fixed order.

    A UCX built with CUDA support lists ``cuda_copy`` only where a CUDA driver and device are
    present, so this is what the running process can use, not what the library was built with.
    """
    found = set(_TRANSPORT_WORD.findall(context_info))
    return tuple(name for name in DEVICE_TRANSPORTS if name in found)


def device_byte_views(tensors: Sequence[Any]) -> list[Any]:
    """Each tensor as a flat ``uint8`` tensor over the same memory (what UCX receives into:
    ``__cuda_array_interface__`` has no bfloat16); non-contiguous tensors are refused."""
    import torch

    views = []
    for number, tensor in enumerate(tensors):
        if not tensor.is_contiguous():
            raise InvalidRequestError(
                f"tensors[{number}] must be contiguous; call .contiguous() first"
            )
        views.append(tensor.detach().reshape(-1).view(torch.uint8))
    return views


def checked_staging(staging: Sequence[Any], tensors: Sequence[Any]) -> list[Any]:
    """The caller's staging buffers, each checked to be host memory of its tensor's size."""
    if len(staging) != len(tensors):
        raise InvalidRequestError(
            f"got {len(staging)} staging buffers for {len(tensors)} tensors; give one per tensor"
        )
    for number, (host, tensor) in enumerate(zip(staging, tensors, strict=True)):
        if is_device_tensor(host):
            raise InvalidRequestError(f"staging[{number}] is on {host.device}; it must be host")
        if int(host.nbytes) != int(tensor.nbytes):
            raise InvalidRequestError(
                f"staging[{number}] holds {host.nbytes} bytes, its tensor {tensor.nbytes}"
            )
    return list(staging)


def staging_for(tensors: Sequence[Any]) -> list[Any]:
    """Host buffers shaped like ``tensors``, page-locked where CUDA is present."""
    import torch

    pin = bool(torch.cuda.is_available())
    return [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]


def queued_streams(tensors: Sequence[Any]) -> dict[Any, Any]:
    """The calling thread's current stream on each CUDA device among ``tensors``: where its
    work on them is queued. Read it on the caller's thread: the asyncio client runs blocking
    steps on a worker thread, whose current streams are others."""
    devices = {t.device for t in tensors if is_device_tensor(t) and t.device.type == "cuda"}
    if not devices:
        return {}
    import torch

    return {device: torch.cuda.current_stream(device) for device in devices}


def settle_queued_writes(queued: Mapping[Any, Any]) -> None:
    """Wait until the work on the :func:`queued_streams` is done: a receive straight into
    device memory (UCX) is ordered by no stream, so a queued kernel writing the same tensors
    would land on top of the received bytes."""
    for stream in queued.values():
        stream.synchronize()


def copy_to_devices(
    staging: Sequence[Any],
    targets: Sequence[Any],
    found: Sequence[bool],
    queued: Mapping[Any, Any] | None = None,
) -> None:
    """Copy each found block from its host staging buffer into its target, a
    :func:`device_byte_views` view of the device tensor; returns when the copies are complete
    (they run on a side stream, so other work on the device's current stream is not serialized
    behind them). They start after the work on the caller's ``queued`` streams
    (:func:`queued_streams`)."""
    import torch

    # Byte views on both sides: a caller's staging buffer need only match its tensor's size.
    pairs = [
        (source.reshape(-1).view(torch.uint8), target)
        for source, target, ok in zip(staging, targets, found, strict=True)
        if ok
    ]
    if not pairs:
        return
    device = pairs[0][1].device
    if device.type != "cuda":
        for source, target in pairs:
            target.copy_(source)
        return
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    # After the caller's work already queued on the device (a kernel still writing the targets
    # would otherwise land on top of the copies).
    if queued and device in queued:
        stream.wait_stream(queued[device])
    with torch.cuda.stream(stream):
        for source, target in pairs:
            target.copy_(source, non_blocking=True)
    stream.synchronize()


def copy_from_lease(
    lease: ShmLease, targets: Sequence[Any], queued: Mapping[Any, Any]
) -> list[bool] | None:
    """DMA each leased block straight from the arena into its target (a
    :func:`device_byte_views` view of a CUDA tensor); returns once the copies are complete,
    with which blocks were copied whole and intact. ``None`` where the lease's pages are not
    all page-locked yet (they are asked for, so a later call finds them): use the staging path.
    """
    registration = lease.registration
    if registration is None:
        return None
    sizes = [int(target.nbytes) for target in targets]
    sources = registration.enter_blocks(lease.views, sizes)
    if sources is None:
        return None
    try:
        import torch

        runtime = cuda_runtime()
        device = targets[0].device
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            if device in queued:  # after the caller's work already queued on the targets
                stream.wait_stream(queued[device])
            for source, target, size in zip(sources, targets, sizes, strict=True):
                if source is None:
                    continue
                at = int(target.data_ptr())
                # Each part inside one registered piece: the driver DMAs it from pinned pages.
                for address, nbytes, _ in registration.cut(source, size):
                    runtime.copy_async(at, address, nbytes, HOST_TO_DEVICE, stream.cuda_stream)
                    at += nbytes
            stream.synchronize()
    finally:
        registration.leave()
    intact = lease.intact()
    return [source is not None and ok for source, ok in zip(sources, intact, strict=True)]
