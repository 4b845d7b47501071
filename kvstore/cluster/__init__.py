"""The cluster index: which ``kvstore serve`` node holds which blocks, in which tier, in Redis.

Every node registers itself (:mod:`kvstore.node.membership`: node id, boot epoch, addresses,
capacity, a lease it renews, a signed description: :mod:`.records`) and publishes, batched, which
blocks it holds in which tier (:mod:`kvstore.node.publisher`); a router asks
:class:`~.index.ClusterIndex` which nodes hold how many leading chunks of a request.
:mod:`.layout` names the Redis keys. With ``cluster.engine_events`` a node also publishes, as tier
``local``, the chunks the vLLM engine beside it holds in its own prefix cache (their staleness is
described in :mod:`kvstore.node.engine_chunks`). With ``cluster.shared_data = peers | both`` a
node reads blocks it lacks from the nodes the index names (:mod:`kvstore.node.peers`), and an
entry proves nothing: every block a peer sends is verified against its keyed MAC before it is
used.

**What counts.** An entry counts only while its node's lease is alive *and* carries the entry's
boot epoch: a node that crashed stops counting when its lease expires, a restarted node's entries
from an earlier boot never count (its new lease carries its new epoch), and a node stopping
cleanly deletes its lease first (its entries stop counting at once) and then its entries.

**Staleness bound.** A block a node gained or lost shows in the index within
``cluster.publish_interval_s`` plus one Redis round trip (a batch of ``BATCH_EVENTS`` changes is
sent at once). A node that dies without stopping keeps counting for at most
``cluster.lease_ttl_s``. While Redis is unreachable nothing is published; once it answers again,
the node republishes everything it holds (a full resync) and its view is again current within one
publish interval. The index claims only exact chunk keys a node holds: a key that was evicted
after the router's query is a miss there, as with any cache.

**Two sides.** This package is the index contract and its reader (:mod:`.layout`, :mod:`.records`,
:mod:`.index`): all a router needs. The node agent that writes the index (membership, publisher,
engine events, peers) runs inside ``kvstore serve`` beside the store, in :mod:`kvstore.node`; so
``import kvstore.router`` loads neither the agent nor the store, the tiers or LMDB
(``tests/test_layering.py`` checks it in a fresh interpreter).
"""

from __future__ import annotations

from kvstore.cluster.index import ClusterIndex, Holding
from kvstore.cluster.layout import LOCAL, Layout, connect
from kvstore.cluster.records import NodeInfo, RecordError

__all__ = ["LOCAL", "ClusterIndex", "Holding", "Layout", "NodeInfo", "RecordError", "connect"]
