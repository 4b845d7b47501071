"""The router's index query on a single Redis: one server-side script instead of a pipeline.

:meth:`kvstore.cluster.ClusterIndex.holders` sends one ``HGETALL`` per chunk plus the known
leases, and redis-py's cost of building and parsing those commands (~30 µs each) is most of a
routing decision. On a single Redis (not Redis Cluster, whose keys of one request lie in many
slots) :class:`ScriptIndex` asks the same question in one ``EVALSHA``: the script reads the
entries and the leases of the nodes in them and applies the same rule (an entry counts only if
its node's lease is alive and carries the entry's epoch), answering one short string per node.
``tests/router/test_router_lookup.py`` checks that both give the same answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.cluster.index import Holding
from kvstore.cluster.layout import Client, Layout

__all__ = ["ScriptIndex"]

#: KEYS: the entries; ARGV[1]: the lease key of a node is ARGV[1] .. node id.
#: Returns node, "tier,tier,,..." (one field per key, empty where the node does not count).
_SCRIPT = """
local n = #KEYS
local found, order, leases = {}, {}, {}
for i = 1, n do
  local flat = redis.call('HGETALL', KEYS[i])
  for j = 1, #flat, 2 do
    local node = flat[j]
    local lease = leases[node]
    if lease == nil then
      lease = redis.call('GET', ARGV[1] .. node)
      leases[node] = lease
    end
    if lease then
      local prefix = lease .. ':'
      local value = flat[j + 1]
      if string.sub(value, 1, #prefix) == prefix then
        local tiers = found[node]
        if tiers == nil then
          tiers = {}
          found[node] = tiers
          order[#order + 1] = node
        end
        tiers[i] = string.sub(value, #prefix + 1)
      end
    end
  end
end
local out = {}
for _, node in ipairs(order) do
  local tiers, parts = found[node], {}
  for i = 1, n do parts[i] = tiers[i] or '' end
  out[#out + 1] = node
  out[#out + 1] = table.concat(parts, ',')
end
return out
"""


class ScriptIndex:
    """:meth:`holders` as :class:`~kvstore.cluster.ClusterIndex`'s, in one script call."""

    def __init__(self, client: Client, layout: Layout) -> None:
        self.layout = layout
        self._script: Any = client.register_script(_SCRIPT)
        self._lease_prefix = layout.lease("")

    async def holders(self, keys: Sequence[bytes]) -> dict[str, Holding]:
        """Per live node holding any of ``keys``: its leading run and tier per key."""
        if not keys:
            return {}
        entry = self.layout.entry
        flat = await self._script(keys=[entry(key) for key in keys], args=[self._lease_prefix])
        found: dict[str, Holding] = {}
        for index in range(0, len(flat), 2):
            tiers = flat[index + 1].decode().split(",")
            leading = next((i for i, tier in enumerate(tiers) if not tier), len(tiers))
            found[flat[index].decode()] = Holding(leading, tiers)
        return found
