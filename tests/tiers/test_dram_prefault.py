"""``dram.prefault``: the arena's pages are resident from the start (no page fault on a block's
first write), read from the kernel's own account of the mapping (``/proc/self/smaps``)."""

from __future__ import annotations

import pytest

from kvstore.config import load_config
from kvstore.tiers import build_tiers
from kvstore.tiers.dram import DramTier

MIB = 1024**2


def resident_bytes(tier: DramTier) -> int:
    """Bytes of the process's mapping of ``tier``'s memfd that are resident in memory."""
    start = tier.range_view(0, 1).ctypes.data
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                low, high = (int(part, 16) for part in fields[0].split("-"))
                inside = low <= start < high
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    raise AssertionError("the arena's mapping is not in /proc/self/smaps")


@pytest.mark.parametrize("prefault", [False, True])
async def test_a_prefaulted_arena_is_resident_from_the_start(prefault: bool) -> None:
    tier = DramTier(32 * MIB, prefault=prefault)
    try:
        resident = resident_bytes(tier)
        assert resident == 32 * MIB if prefault else resident < MIB
    finally:
        await tier.close()


async def test_the_setting_reaches_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_DRAM_PREFAULT", "1")
    monkeypatch.setenv("KVSTORE_DRAM_CAPACITY", "8MiB")
    monkeypatch.setenv("KVSTORE_NVME_PATH", "")
    config = load_config()
    assert config.dram.prefault
    tiers = build_tiers(config)
    try:
        dram = next(t for t in tiers if isinstance(t, DramTier))
        assert resident_bytes(dram) == 8 * MIB
    finally:
        for tier in tiers:
            await tier.close()
