"""A peer read's refresh of node addresses when another read replaced the index's epochs.

The index reader (:class:`~kvstore.cluster.index.ClusterIndex`) keeps the epochs of its latest
``holders`` answer; with several reads in flight one read's holders can name a node whose lease
lapsed in another, later answer. That once surfaced as a server-side ``INTERNAL: KeyError`` under
load when a node was killed. A stand-in index (no Redis needed: only the epoch bookkeeping is
under test) plays the interleaving.
"""

from __future__ import annotations

import asyncio
import time

from kvstore.cluster.records import NodeInfo
from kvstore.node.peers import PeerSource
from kvstore.store.counters import StoreCounters

_LATER_MS = int((time.time() + 3600) * 1000)  # signed descriptions still valid


class _InterleavedIndex:
    """An index whose latest ``holders`` answer (``epochs``) no longer has node ``one``."""

    def __init__(self) -> None:
        self.epochs: dict[str, int] = {"two": 5}
        self.refused: dict[str, int] = {}  # no unsigned descriptions met
        self.newer: dict[str, int] = {}  # nor descriptions of a later release
        self.refused_count = 0
        self.asked_nodes = 0

    async def nodes(self) -> dict[str, NodeInfo]:
        self.asked_nodes += 1
        return {"two": NodeInfo("two", 5, "10.0.0.2:1", expires_ms=_LATER_MS)}


def test_a_holder_whose_lease_lapsed_in_a_later_answer_is_refreshed_not_a_key_error() -> None:
    index = _InterleavedIndex()
    source = PeerSource(index, "three", StoreCounters(), transport="grpc")  # type: ignore[arg-type]
    source._nodes["one"] = NodeInfo("one", 1, "10.0.0.1:1", expires_ms=_LATER_MS)
    asyncio.run(source._refresh({"one": object(), "two": object()}))
    assert index.asked_nodes == 1  # node one counts as moved: addresses read again
    assert source._nodes["two"].grpc == "10.0.0.2:1"
