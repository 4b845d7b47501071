"""The dram arena's memory: sealing its memfd, faulting its pages in, page-locking it for CUDA.

Helpers of :class:`kvstore.tiers.dram.DramTier`, kept apart from its block bookkeeping.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
from typing import Any

import numpy as np

__all__ = ["page_lock", "page_unlock", "prefault", "seal_arena"]

logger = logging.getLogger("kvstore.tiers.dram")


#: ``F_SEAL_FUTURE_WRITE`` (Linux 5.1): no new writable mapping, write or hole punch by anyone.
_SEAL_FUTURE_WRITE = 0x0010


def seal_arena(fd: int) -> bool:
    """Seal the arena's memfd (see :class:`DramTier`); False where the kernel cannot seal it
    against writes (before Linux 5.1), said once in the log: clients can then write it."""
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | _SEAL_FUTURE_WRITE)
        return True
    except OSError:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        logger.warning(
            "this kernel cannot seal the dram arena against writes (F_SEAL_FUTURE_WRITE, Linux "
            "5.1): clients of the shared-memory plane map it writable"
        )
        return False


def _cuda_present(force_check: bool) -> bool:
    """Whether an NVIDIA driver is there, checked without importing torch (slow) on CPU hosts."""
    return os.path.exists("/dev/nvidiactl") or force_check


def prefault(mapping: mmap.mmap) -> None:
    """Make every page of ``mapping`` resident now (a first write into a fresh memfd page
    faults, and zeroes it, in the middle of a transfer or a copy)."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except OSError:  # before Linux 5.14: touch one byte per page instead
        view = np.frombuffer(mapping, dtype=np.uint8)
        view[:: mmap.PAGESIZE] = 0


#: ``madvise`` advice that faults a range in writable (Linux 5.14; not in Python's mmap module).
_MADV_POPULATE_WRITE = 23


#: ``cudaHostRegisterPortable``: page-locked for every CUDA context, not only the current
#: device's, so an hbm tier on another device copies from the arena at DMA speed too.
_PORTABLE = 1


def page_lock(arena: np.ndarray[Any, Any], force_cuda_check: bool) -> bool:
    """Page-lock ``arena`` for CUDA DMA where a CUDA device exists; False where it cannot."""
    if arena.nbytes == 0 or not _cuda_present(force_cuda_check):
        return False
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        cuda: Any = torch.cuda  # cudart() is untyped
        cudart = cuda.cudart()
        outcome: list[int | BaseException] = []

        def register() -> None:
            try:
                outcome.append(
                    int(cudart.cudaHostRegister(arena.ctypes.data, arena.nbytes, _PORTABLE))
                )
            except Exception as exc:
                outcome.append(exc)

        # On a thread of its own: a failed call leaves CUDA's last error set on the calling
        # thread, where torch's next kernel launch would report it as its own failure.
        thread = threading.Thread(target=register, name="kvstore-page-lock")
        thread.start()
        thread.join()
        error = outcome[0]
        if isinstance(error, BaseException):
            raise error
    except Exception:  # no torch, or a driver problem: an unpinned arena still works
        logger.warning("could not page-lock the dram arena for CUDA", exc_info=True)
        return False
    if error != 0:
        logger.warning("cudaHostRegister of the dram arena failed with CUDA error %d", error)
        return False
    return True


def page_unlock(arena: np.ndarray[Any, Any]) -> None:
    import torch

    cuda: Any = torch.cuda
    cuda.cudart().cudaHostUnregister(arena.ctypes.data)
