"""The router's one-script index query answers exactly as :class:`ClusterIndex` does, on a real
redis-server: live and expired leases, entries of an earlier boot epoch, gaps, tiers."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from kvstore.cluster import ClusterIndex, Holding, Layout, connect
from kvstore.router.lookup import ScriptIndex

sys.path.insert(0, str(Path(__file__).parent / "tiers"))
from redis_server import RedisServer

KEYS = [bytes([i]) * 16 for i in range(6)]


def test_script_index_equals_cluster_index(tmp_path: Path) -> None:
    layout = Layout("kvstore:cluster:v1:", "team")
    with RedisServer(tmp_path / "redis") as server:
        raw = server.client()
        raw.set(layout.lease("a"), 2)
        raw.set(layout.lease("b"), 1)
        # c has no lease (expired); a's entries of epoch 1 are from an earlier boot.
        for index, key in enumerate(KEYS):
            entry = layout.entry(key)
            raw.hset(entry, "a", "2:dram" if index != 3 else "1:dram")
            if index < 2:
                raw.hset(entry, "b", "1:nvme")
            raw.hset(entry, "c", "1:dram")
        raw.hset(layout.entry(KEYS[4]), "b", "1:redis")
        # The same keys without the tenant belong to another view and never count here.
        raw.hset(Layout("kvstore:cluster:v1:").entry(KEYS[0]), "a", "2:hbm")

        async def both() -> tuple[dict[str, Holding], dict[str, Holding], dict[str, Holding]]:
            client = connect(server.url, 2.0)
            try:
                script = ScriptIndex(client, layout)
                return (
                    await ClusterIndex(client, layout).holders(KEYS),
                    await script.holders(KEYS),
                    await script.holders([b"\x99" * 16]),
                )
            finally:
                await client.aclose()

        expected, got, none = asyncio.run(both())
    assert got == expected
    assert got == {
        "a": Holding(3, ["dram", "dram", "dram", "", "dram", "dram"]),
        "b": Holding(2, ["nvme", "nvme", "", "", "redis", ""]),
    }
    assert none == {}
