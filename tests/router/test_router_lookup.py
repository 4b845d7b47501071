"""The router's one-script index query answers exactly as :class:`ClusterIndex` does, on a real
redis-server: live and expired leases, entries of an earlier boot epoch, gaps, tiers."""

from __future__ import annotations

import asyncio
from pathlib import Path

from harness.redis_server import RedisServer

from kvstore.cluster import ClusterIndex, Holding, Layout, connect
from kvstore.cluster.index import ONE_TRIP_NODES
from kvstore.router.lookup import ScriptIndex

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


def test_a_large_fleet_reads_only_the_leases_an_answer_names(tmp_path: Path) -> None:
    """Past ONE_TRIP_NODES known nodes the query stops reading every lease, and still answers
    the same: live nodes count, an expired lease and an earlier epoch do not."""
    layout = Layout("kvstore:cluster:v1:")
    nodes = [f"n{i}" for i in range(ONE_TRIP_NODES * 2)]
    with RedisServer(tmp_path / "redis") as server:
        raw = server.client()
        for node in nodes:
            raw.set(layout.lease(node), 1)
        for index, key in enumerate(KEYS):
            raw.hset(layout.entry(key), mapping={node: "1:dram" for node in nodes[index::6]})

        async def twice() -> tuple[dict[str, Holding], dict[str, Holding], int, int]:
            client = connect(server.url, 2.0)
            try:
                index = ClusterIndex(client, layout)
                first = await index.holders(KEYS)  # learns every node
                raw.delete(layout.lease("n0"))  # n0's lease expired
                raw.set(layout.lease("n1"), 2)  # n1 restarted: its entries are of epoch 1
                before = int(raw.info("stats")["total_commands_processed"])
                second = await index.holders(KEYS[:1])
                after = int(raw.info("stats")["total_commands_processed"])
                return first, second, after - before, len(index._known)
            finally:
                await client.aclose()

        first, second, commands, known = asyncio.run(twice())
    assert set(first) == set(nodes)
    assert first["n0"] == Holding(1, ["dram", "", "", "", "", ""])
    # KEYS[0] is held by n0, n6, n12, ...: n0 lost its lease; everyone else of them counts.
    assert set(second) == set(nodes[6::6]) and "n0" not in second
    assert known <= len(nodes[0::6])  # next time, the nodes this answer named
    # One HGETALL and one GET per holder named (plus the INFO call), not a GET per known node.
    assert commands <= 1 + len(nodes[0::6]) + 1 + 2, commands
