"""Peer fetch (``cluster.shared_data``) with real ``kvstore serve`` nodes and a real redis-server.

With ``peers``, a block put on one node is read on another straight from the node holding it
(over gRPC, each request authenticated under the shared integrity secret) and Redis holds only
the index, no payload. A node SIGKILLed makes reads of its blocks misses within the caller's
deadline; it is marked suspect and not asked again until it comes back under a new lease. With
``both``, Redis serves what no peer can.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from harness.cluster_nodes import (
    blocks_for,
    counters,
    grpc_client,
    holders,
    payload_keys,
    peer_env,
)
from harness.polling import poll

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

from harness.redis_server import RedisServer


def test_peers_serve_blocks_and_a_dead_peer_is_a_bounded_miss(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    one, two, three = (
        server_factory(env=peer_env(url, name, "peers")) for name in ("one", "two", "three")
    )
    keys, values = blocks_for(0, 4)
    with grpc_client(one) as writer:
        assert writer.put(keys, values).stored == 4
    poll(lambda: holders(url, keys).get("one") is not None, 5.0, "node one in the index")

    with grpc_client(three) as reader:
        assert reader.get(keys) == values  # bit-identical, from node one
        assert counters(three)["peer_hits"] == 4
        # Placed on node three like a promotion: read again, it is local.
        poll(lambda: reader.lookup(keys) == 4, 5.0, "the fetched blocks placed on node three")
        asked = counters(three)["peer_requests"]
        assert reader.get(keys) == values
        assert counters(three)["peer_requests"] == asked
    assert payload_keys(redis_server) == []  # Redis holds the index only

    # Node one dies with blocks only it holds; its lease still names it for a while.
    lost, lost_values = blocks_for(10_000, 3)
    with grpc_client(one) as writer:
        assert writer.put(lost, lost_values).stored == 3
    poll(lambda: holders(url, lost).get("one") is not None, 5.0, "the new blocks in the index")
    one.stop(signal.SIGKILL)
    with grpc_client(three) as reader:
        # Misses, returned within the client's deadline (a hang would raise DeadlineExceeded).
        assert reader.get(lost) == [None] * 3
        asked = counters(three)["peer_requests"]
        assert counters(three)["peer_suspected"] == 1
        assert reader.get(lost) == [None] * 3  # node one is suspect: not asked again
        after = counters(three)
        assert after["peer_requests"] == asked
        assert after["miss_peer_down"] == 6
    # Node two never held them and was never asked.
    assert counters(two).get("miss_peer_down", 0) == 0

    # Back under a new epoch (and port): asked again.
    one.start()
    fresh, fresh_values = blocks_for(20_000, 2)
    with grpc_client(one) as writer:
        assert writer.put(fresh, fresh_values).stored == 2
    poll(lambda: holders(url, fresh).get("one") is not None, 5.0, "node one back in the index")
    with grpc_client(three) as reader:
        assert reader.get(fresh) == fresh_values
        assert counters(three)["peer_requests"] == asked + 1
    assert payload_keys(redis_server) == []


def test_both_falls_back_to_redis_when_the_peer_is_gone(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    one, three = (server_factory(env=peer_env(url, name, "both")) for name in ("one", "three"))
    keys, values = blocks_for(0, 3)
    with grpc_client(one) as writer:
        assert writer.put(keys, values).stored == 3
    poll(lambda: holders(url, keys).get("one") is not None, 5.0, "node one in the index")
    poll(lambda: len(payload_keys(redis_server)) == 3, 5.0, "the payloads written through")
    with grpc_client(three) as reader:
        assert reader.get(keys[:1]) == values[:1]
        assert counters(three)["peer_hits"] == 1  # peers first
        one.stop(signal.SIGKILL)
        assert reader.get(keys[1:]) == values[1:]  # node one is gone: Redis serves them
        after = counters(three)
        assert after["peer_hits"] == 1
        assert after["peer_requests"] == 2
