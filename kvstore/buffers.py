"""Viewing caller buffers as flat bytes without copying them.

Values reach kvstore as bytes, bytearrays, memoryviews, numpy arrays or CPU torch tensors. Every
path (gRPC, shared memory) wants a flat, contiguous, byte-addressed view of them; this module makes
one and refuses, with a clear message, what cannot be viewed without a hidden copy (GPU tensors,
non-contiguous arrays).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.errors import InvalidRequestError

__all__ = ["byte_view", "writable_byte_view"]


def _from_tensor(value: Any) -> memoryview:
    if value.device.type != "cpu":
        raise InvalidRequestError(
            f"tensor on {value.device} cannot be read by the host; copy it to CPU (pinned) first"
        )
    if not value.is_contiguous():
        raise InvalidRequestError("tensor must be contiguous; call .contiguous() first")
    # A uint8 view keeps dtypes numpy lacks (bfloat16) byte-exact.
    flat = value.detach().reshape(-1).view(dtype=_torch_uint8())
    return memoryview(flat.numpy())


def _torch_uint8() -> Any:
    import torch

    return torch.uint8


def byte_view(value: Any) -> memoryview:
    """A read-only-or-better, flat ``"B"`` memoryview over ``value``'s bytes, without a copy."""
    if hasattr(value, "device") and hasattr(value, "is_contiguous"):
        return _from_tensor(value)
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            raise InvalidRequestError("numpy array must be C-contiguous")
        return value.reshape(-1).view(np.uint8).data
    try:
        view = memoryview(value)
    except TypeError as exc:
        raise InvalidRequestError(
            f"value of type {type(value).__name__} is not a bytes-like buffer"
        ) from exc
    if not view.c_contiguous:
        raise InvalidRequestError("buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def writable_byte_view(value: Any) -> memoryview:
    """Like :func:`byte_view`, for a destination buffer; rejects read-only buffers."""
    view = byte_view(value)
    if view.readonly:
        raise InvalidRequestError(f"destination of type {type(value).__name__} is read-only")
    return view
