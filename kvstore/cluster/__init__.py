"""The cluster index: which ``kvstore serve`` node holds which blocks, in which tier, in Redis.

Every node registers itself (:mod:`.membership`: node id, boot epoch, addresses, capacity, a
lease it renews) and publishes, batched, which blocks it holds in which tier (:mod:`.publisher`);
a router asks :class:`~.index.ClusterIndex` which nodes hold how many leading chunks of a
request. :mod:`.layout` names the Redis keys; :mod:`.node` starts and stops it all for a server.
With ``cluster.engine_events`` a node also publishes, as tier ``local``, the chunks the vLLM
engine beside it holds in its own prefix cache, learnt from the engine's KV events
(:mod:`.engine_events`, :mod:`.engine_chunks`; their staleness is described there). With
``cluster.shared_data = peers | both`` a node reads blocks it lacks from the nodes the index names
(:mod:`.peers`, over :mod:`.peer_grpc` or :mod:`.peer_ucx`), and an entry proves nothing: every
block a peer sends is verified against its keyed MAC before it is used (:mod:`.peer_blocks`).

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

**Two sides.** The index contract and its reader (:mod:`.layout`, :mod:`.index`) are all a router
needs, and all that importing this package loads. The node agent (:mod:`.node`,
:mod:`.membership`, :mod:`.publisher`, :mod:`.engine_events`, :mod:`.engine_chunks`, :mod:`.peers`
and the ``peer_*`` modules) runs inside ``kvstore serve`` beside the store; its names below are
loaded on first use (:func:`__getattr__`), so ``import kvstore.router`` loads neither the agent nor
the store, the tiers or LMDB (``tests/test_layering.py`` checks it in a fresh interpreter).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstore.cluster.index import ClusterIndex, Holding
from kvstore.cluster.layout import LOCAL, Layout, connect

#: The node agent's names this package still offers, and the module each one is loaded from on
#: first use (the agent imports the store: only a server should pay for it).
_AGENT = {
    "EngineChunks": "kvstore.cluster.engine_chunks",
    "LocalPublisher": "kvstore.cluster.engine_chunks",
    "Membership": "kvstore.cluster.membership",
    "NodeInfo": "kvstore.cluster.membership",
    "ClusterNode": "kvstore.cluster.node",
    "start_cluster": "kvstore.cluster.node",
    "Publisher": "kvstore.cluster.publisher",
}

__all__ = [
    "LOCAL",
    "ClusterIndex",
    "ClusterNode",
    "EngineChunks",
    "Holding",
    "Layout",
    "LocalPublisher",
    "Membership",
    "NodeInfo",
    "Publisher",
    "connect",
    "start_cluster",
]


def __getattr__(name: str) -> Any:
    """A node agent name of :data:`_AGENT`, imported now (PEP 562)."""
    module = _AGENT.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without this call
    return value
