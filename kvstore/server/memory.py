"""What a running server's memory is made of, for ``Stats``, ``/metrics`` and the soak.

A node's RSS mixes memory it holds for a reason (the arena and LMDB are mapped files; queues and
caches are bounded by settings) with memory the C allocator keeps after Python freed it: blocks of
32-192 KiB are ``malloc``-ed and freed by the thousand, and glibc keeps freed heap memory for
reuse instead of handing it back. :func:`memory_counters` tells these apart with glibc's own
account (``mallinfo2``): ``malloc_in_use_bytes`` is what live objects hold, ``malloc_free_bytes``
what the heap keeps free (a high-water mark of transient buffers, not a leak), next to the
event loop's task count (a task per call or copy that never ends would show there).

:func:`trim_heap_periodically` hands the heap's free memory back every few seconds
(``malloc_trim``), so a node's RSS follows what it holds rather than its highest burst.

Debugging aid, off unless asked for: with ``KVSTORE_DEBUG_TRACEMALLOC`` set to a directory,
:func:`install_tracemalloc_dump` starts :mod:`tracemalloc` and writes a snapshot there on every
``SIGUSR1`` (``tracemalloc-<pid>-<n>.snap``; compare two with ``Snapshot.load`` and
``compare_to``). Tracing slows every allocation: never in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import tracemalloc
from pathlib import Path

__all__ = [
    "TRACEMALLOC_ENV",
    "install_tracemalloc_dump",
    "memory_counters",
    "trim_heap",
    "trim_heap_periodically",
]

logger = logging.getLogger(__name__)

#: The environment variable naming the directory of tracemalloc snapshots (debugging only).
TRACEMALLOC_ENV = "KVSTORE_DEBUG_TRACEMALLOC"
#: Seconds between two hand-backs of free heap memory (``malloc_trim`` takes about a
#: millisecond per hundred MiB of heap; once every few seconds costs nothing measurable).
TRIM_EVERY_S = 5.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "mallinfo2") or not hasattr(libc, "malloc_trim"):
        return None  # not glibc >= 2.33 (musl, macOS): no figures, no trimming
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


_LIBC = _libc()


def memory_counters() -> dict[str, int]:
    """The process's allocator figures (glibc only; absent elsewhere) and event-loop tasks.

    ``malloc_in_use_bytes``: held by live allocations (heap and ``mmap``-ed chunks);
    ``malloc_free_bytes``: free in the heap, kept by the allocator (RSS, unless trimmed);
    ``malloc_mmapped_bytes``: the large chunks served by ``mmap`` (returned when freed);
    ``malloc_trims``: :func:`trim_heap` calls so far;
    ``python_allocated_blocks``: memory blocks held through Python's allocators (mostly small
    objects, each a few dozen bytes); ``asyncio_tasks``: tasks of the running event loop, where
    there is one.
    """
    out: dict[str, int] = {}
    if _LIBC is not None:
        info = _LIBC.mallinfo2()
        out["malloc_in_use_bytes"] = int(info.uordblks + info.hblkhd)
        out["malloc_free_bytes"] = int(info.fordblks)
        out["malloc_mmapped_bytes"] = int(info.hblkhd)
        out["malloc_trims"] = _trims
    # Memory blocks Python's allocators hold now (small objects: index entries, cache keys).
    out["python_allocated_blocks"] = sys.getallocatedblocks()
    with contextlib.suppress(RuntimeError):  # no running loop: no task count
        out["asyncio_tasks"] = len(asyncio.all_tasks())
    return out


_trims = 0


def trim_heap() -> None:
    """Hand the heap's free memory back to the system (``malloc_trim(0)``; glibc only)."""
    global _trims
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
        _trims += 1


async def trim_heap_periodically(every_s: float = TRIM_EVERY_S) -> None:
    """:func:`trim_heap` every ``every_s`` seconds until cancelled (the server runs one).

    Off the event loop: trimming walks the heap, and a request should not wait for it.
    """
    if _LIBC is None:
        return
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(trim_heap)


def install_tracemalloc_dump(loop: asyncio.AbstractEventLoop) -> bool:
    """Where :data:`TRACEMALLOC_ENV` names a directory: trace allocations and dump a snapshot
    there on each ``SIGUSR1``. Returns whether it did (a debugging aid, see the module)."""
    folder = os.environ.get(TRACEMALLOC_ENV)
    if not folder:
        return False
    directory = Path(folder)
    directory.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(int(os.environ.get(f"{TRACEMALLOC_ENV}_FRAMES", "1")))
    count = 0

    def dump() -> None:
        nonlocal count
        count += 1
        path = directory / f"tracemalloc-{os.getpid()}-{count}.snap"
        tracemalloc.take_snapshot().dump(str(path))
        logger.warning("tracemalloc snapshot written to %s (%s)", path, TRACEMALLOC_ENV)

    loop.add_signal_handler(signal.SIGUSR1, dump)
    logger.warning("tracing allocations (%s=%s): slow, for debugging only", TRACEMALLOC_ENV, folder)
    return True
