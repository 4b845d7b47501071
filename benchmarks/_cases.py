"""Timed cases several benchmarks measure alike, for :func:`_common.run_interleaved`.

* :func:`memcpy_case`: ``numpy.copyto`` of a batch into preallocated buffers, the ceiling a
  ``get_into`` into the same buffers is compared with.
* :func:`get_into_case`: one client's ``get_into`` of a batch, checked to have filled every
  buffer (a miss would make its timing mean nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from _common import check, timed

from kvstore import KVStoreClient

__all__ = ["get_into_case", "memcpy_case"]


def memcpy_case(buffers: Sequence[np.ndarray], blocks: Sequence[np.ndarray]) -> Callable[[], float]:
    """A case copying ``blocks`` into ``buffers``; it returns the seconds the copies took."""

    def case() -> float:
        start = time.perf_counter()
        for buffer, block in zip(buffers, blocks, strict=True):
            np.copyto(buffer, block)
        return time.perf_counter() - start

    return case


def get_into_case(
    client: KVStoreClient, label: str, keys: Sequence[bytes], buffers: Sequence[np.ndarray]
) -> Callable[[], float]:
    """A case reading ``keys`` into ``buffers`` through ``client`` (``label`` names it when a
    key is missed); it returns the seconds the call took."""

    def case() -> float:
        seconds, filled = timed(lambda: client.get_into(keys, buffers))
        check(filled == [True] * len(keys), f"{label}: filled {filled}")
        return seconds

    return case
