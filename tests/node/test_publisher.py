"""The cluster publisher in-process, on real ``TieredStore`` objects and a real redis-server.

Tenants' entries never mix (a reader for one tenant sees none of another's), a listener that
raises never fails a store operation, and a delete withdraws the key from the index.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.redis_server import RedisServer
from harness.store_blocks import key, make_store, payload

from kvstore.cluster import ClusterIndex, Layout, NodeInfo, connect
from kvstore.node import Membership, Publisher

NS = bytes(16)
PREFIX = "test:cluster:"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


async def test_tenants_see_only_their_own_entries_and_deletes_withdraw(
    redis_server: RedisServer,
) -> None:
    client = connect(redis_server.url, 2.0)
    layout = Layout(PREFIX)
    membership = Membership(
        client, layout, lambda epoch: NodeInfo("n1", epoch, "h:1"), 5.0, lambda: None
    )
    stores = {"x": make_store(None), "y": make_store(None)}
    publishers = {
        name: Publisher(client, layout.for_tenant(name), store, membership, 0.05)
        for name, store in stores.items()
    }
    for publisher in publishers.values():
        publisher.start()
    await membership.start()
    try:
        await stores["x"].put([key(1), key(2)], [payload(1), payload(2)], NS)
        await stores["y"].put([key(3)], [payload(3)], NS)
        for publisher in publishers.values():
            assert await publisher.flush()
        as_x = ClusterIndex(client, layout.for_tenant("x"))
        as_y = ClusterIndex(client, layout.for_tenant("y"))
        everything = [key(1), key(2), key(3)]
        found_x = await as_x.holders(everything)
        assert found_x["n1"].tiers == ["dram", "dram", ""]
        assert found_x["n1"].leading == 2
        assert (await as_y.holders(everything))["n1"].tiers == ["", "", "dram"]
        assert await ClusterIndex(client, layout).holders(everything) == {}
        assert (await as_x.nodes())["n1"].grpc == "h:1"

        await stores["x"].delete([key(1)], NS)
        assert await publishers["x"].flush()
        assert (await as_x.holders(everything))["n1"].tiers == ["", "dram", ""]
    finally:
        for publisher in publishers.values():
            await publisher.stop()
        await membership.stop()
        for publisher in publishers.values():
            await publisher.withdraw()
        assert await as_x.holders(everything) == {}
        await client.aclose()
        for store in stores.values():
            await store.close()


async def test_a_failing_listener_never_fails_the_store() -> None:
    store = make_store(None)
    seen: list[tuple[bytes, str | None]] = []

    def broken(changed: bytes, tier: str | None) -> None:
        raise RuntimeError("listener bug")

    store.add_listener(broken)
    store.add_listener(lambda changed, tier: seen.append((changed, tier)))
    assert (await store.put([key(1)], [payload(1)], NS)).stored == 1
    assert await store.delete([key(1)], NS) == 1
    assert seen == [(key(1), "dram"), (key(1), None)]
    assert dict(store.holdings()) == {}
    await store.close()
