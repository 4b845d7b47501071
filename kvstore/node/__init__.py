"""The node agent: what a ``kvstore serve`` node runs beside its store to take part in a cluster.

It registers the node in the cluster index and keeps its lease (:mod:`.membership`), publishes
which blocks the store holds in which tier (:mod:`.publisher`), optionally the chunks the vLLM
engine beside it holds in its own prefix cache (:mod:`.engine_events`, :mod:`.engine_chunks`),
and reads blocks it lacks from other nodes (:mod:`.peers` over :mod:`.peer_grpc` or
:mod:`.peer_ucx`; every block verified by :mod:`.peer_blocks`, every call authenticated by
:mod:`.peer_auth`). :mod:`.agent` starts and stops it all for a server.

The index's contract and its reader, all that a router needs, are :mod:`kvstore.cluster`; this
package sits on the server's side (it imports the store) and no client or router imports it.
"""

from __future__ import annotations

from kvstore.node.agent import ClusterNode, start_cluster
from kvstore.node.engine_chunks import EngineChunks, LocalPublisher
from kvstore.node.membership import Membership
from kvstore.node.publisher import Publisher

__all__ = [
    "ClusterNode",
    "EngineChunks",
    "LocalPublisher",
    "Membership",
    "Publisher",
    "start_cluster",
]
