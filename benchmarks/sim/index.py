"""The cluster index as the simulator keeps it: which node holds each key in which tier.

It mirrors :mod:`kvstore.cluster`'s Redis layout (one hash per chunk key, field node id, value
``EPOCH:TIER``; :class:`kvstore.cluster.Layout` names the keys) and counts what that costs:

* **entries**: (key, node) fields, and hashes (keys with at least one field), now and at peak;
* **bytes**: Redis memory for them: :data:`HASH_OVERHEAD` per hash and :data:`FIELD_OVERHEAD` per
  field beyond the key, field and value strings (measured: ``INFO memory`` ``used_memory`` of a
  redis-server 7.0 before and after 20,000 such hashes; ``validate.py`` measures it again on the
  index its real nodes wrote);
* **operations**: one ``HSET``/``HDEL`` per change a node publishes (the publisher coalesces
  changes within ``cluster.publish_interval_s``; this counts every change, an upper bound), one
  ``HGETALL`` per key a router or a peer-fetching node asks about, and the lease ``GET`` s that
  :meth:`kvstore.cluster.ClusterIndex.holders` pipelines for every node it knows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvstore.cluster import Holding, Layout

from .node import TIERS

__all__ = ["FIELD_OVERHEAD", "HASH_OVERHEAD", "SimIndex"]

#: Redis bytes per hash beyond its key name and first field (dict entry, objects, listpack
#: header): 149 bytes measured for a 37-byte key and a 15-byte field and value.
HASH_OVERHEAD = 97
#: Redis bytes per field beyond the field and value strings: 14 bytes measured for 15 (a small
#: hash is one listpack, whose entry headers cost less than the allocator's rounding saves).
FIELD_OVERHEAD = -1
_ENTRY_KEY_BYTES = len(Layout("kvstore:cluster:v1:").entry(bytes(16)))
_VALUE_BYTES = len("1:dram")  # EPOCH:TIER for small epochs
_BUCKET_S = 1.0


class SimIndex:
    """Key -> node -> fastest tier level, with entry, byte and operation counts over time."""

    def __init__(self, node_id_bytes: int) -> None:
        self.holders: dict[bytes, dict[str, int]] = {}
        self.fields = 0
        self.peak_fields = 0
        self.peak_hashes = 0
        self.ops: Counter[str] = Counter()
        self.ops_by_second: Counter[int] = Counter()
        #: The same without lease GETs (what a router caching leases would send).
        self.ops_by_second_no_leases: Counter[int] = Counter()
        self.now = 0.0
        self._field_bytes = node_id_bytes + _VALUE_BYTES + FIELD_OVERHEAD
        #: Per reader (the router, each node's peer source): the nodes its ClusterIndex has
        #: seen, for each of which it pipelines a lease GET per query.
        self._known: dict[str, set[str]] = {}
        #: Lease GETs if a query read only the leases of the nodes its answer names.
        self.named_lease_gets = 0
        #: Per reader: nodes seen in the query under way (peer lookups, one key at a time).
        self._seen: dict[str, set[str]] = {}

    def _count(self, kind: str, count: int = 1) -> None:
        self.ops[kind] += count
        second = int(self.now / _BUCKET_S)
        self.ops_by_second[second] += count
        if kind != "lease_get":
            self.ops_by_second_no_leases[second] += count

    def changed(self, node: str, key: bytes, level: int | None) -> None:
        """A node's publisher reports ``key`` now at ``level`` (``None``: gone)."""
        held = self.holders.get(key)
        if level is None:
            if held is not None and held.pop(node, None) is not None:
                self.fields -= 1
                if not held:
                    del self.holders[key]
            self._count("hdel")
            return
        if held is None:
            held = self.holders[key] = {}
        if node not in held:
            self.fields += 1
            if self.fields > self.peak_fields:
                self.peak_fields = self.fields
            if len(self.holders) > self.peak_hashes:
                self.peak_hashes = len(self.holders)
        held[node] = level
        self._count("hset")

    def bytes_for(self, hashes: int, fields: int) -> int:
        """Redis memory of ``hashes`` entry hashes holding ``fields`` fields in all."""
        return hashes * (HASH_OVERHEAD + _ENTRY_KEY_BYTES) + fields * self._field_bytes

    def query(self, keys: Sequence[bytes], reader: str = "router") -> dict[str, Holding]:
        """What :meth:`kvstore.cluster.ClusterIndex.holders` answers a router for ``keys``."""
        found: dict[str, Holding] = {}
        count = len(keys)
        for position, key in enumerate(keys):
            for node, level in self.holders.get(key, {}).items():
                holding = found.get(node)
                if holding is None:
                    holding = found[node] = Holding(0, [""] * count)
                holding.tiers[position] = TIERS[level]
        for holding in found.values():
            holding.leading = next((i for i, t in enumerate(holding.tiers) if not t), count)
        self._count("hgetall", count)
        self._seen.setdefault(reader, set()).update(found)
        self.count_leases(reader)
        return found

    def count_leases(self, reader: str) -> None:
        """The lease ``GET`` s of one ``holders`` query by ``reader``: one per node it knew, one
        per node new to it in the answer (a second round trip); then it knows them all."""
        known = self._known.setdefault(reader, set())
        seen = self._seen.pop(reader, set())
        self._count("lease_get", len(known) + len(seen - known))
        self.named_lease_gets += len(seen)
        known |= seen

    def peer_for(self, key: bytes, asking: str) -> str | None:
        """The node a peer fetch of ``key`` reads from (dram holders first, as PeerSource
        chooses), ``None`` if no other node holds it; counts the index read."""
        self._count("hgetall")
        held = self.holders.get(key)
        if not held:
            return None
        self._seen.setdefault(asking, set()).update(held)
        best = None
        for node, level in held.items():
            if node != asking and (best is None or level < held[best]):
                best = node
        return best
