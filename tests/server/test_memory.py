"""What a server's memory is made of (``kvstore.server.memory``): glibc's account of its heap,
the event loop's tasks, and the periodic trim that hands freed heap memory back.

The trim test builds the case the soak found (issue 41): payload-sized buffers allocated in a
burst and most of them freed, the survivors pinning the heap so that it cannot shrink from its
top. Without a trim the freed memory stays resident; after one it no longer is.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from kvstore.server import memory

glibc = pytest.mark.skipif(memory._LIBC is None, reason="needs glibc's mallinfo2/malloc_trim")


def rss_anon_kib() -> int:
    found = re.search(r"^RssAnon:\s+(\d+)", Path("/proc/self/status").read_text(), re.M)
    assert found is not None
    return int(found.group(1))


@glibc
async def test_counters_name_the_heap_and_the_tasks() -> None:
    figures = memory.memory_counters()
    assert figures["malloc_in_use_bytes"] > 0
    assert figures["malloc_free_bytes"] >= 0 and figures["malloc_mmapped_bytes"] >= 0
    assert figures["asyncio_tasks"] >= 1  # this test's own


def test_without_a_loop_there_is_no_task_count() -> None:
    assert "asyncio_tasks" not in memory.memory_counters()


@glibc
def test_a_trim_hands_a_burst_of_freed_buffers_back() -> None:
    # 64 KiB: below glibc's mmap threshold, so from the heap (like most block payloads).
    burst = [bytearray(64 * 1024) for _ in range(2000)]  # ~128 MiB, touched (zeroed)
    # Every eighth survives (as what a queue or cache still holds would), pinning the heap.
    kept, burst = burst[::8], []
    free = memory.memory_counters()["malloc_free_bytes"]
    assert free > 64 * 2**20, free  # the allocator kept what was freed
    before = rss_anon_kib()
    memory.trim_heap()
    after = rss_anon_kib()
    assert before - after > 48 * 1024, (before, after)  # KiB: most of it went back
    assert len(kept) > 200


@glibc
async def test_the_periodic_trim_runs_until_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(memory, "trim_heap", lambda: calls.append(1))
    task = asyncio.create_task(memory.trim_heap_periodically(every_s=0.01))
    deadline = asyncio.get_running_loop().time() + 10
    while len(calls) < 3:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
