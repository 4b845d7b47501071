"""Where blocks go and which ones stay: the store's placement and admission rules, in one place.

:class:`~kvstore.store.TieredStore` does the moving; it asks a :class:`Policy` three questions:

* **When does a new block reach the shared tier?** ``write-through`` (default): at once, in the
  background, so every other node can load it within milliseconds. ``write-back``: only when the
  block leaves this node's local tiers (evicted from the last one), which writes far less to Redis
  but lets other nodes see a block only after this node stops caching it.
* **Which blocks evicted from dram are worth the disk write?** ``all`` (default) demotes every
  victim into nvme. ``hit`` demotes only blocks that were read at least once since they were
  stored: a prefix nobody reused is dropped instead of costing an NVMe write (a miss later costs a
  recompute, the same as if it had never been stored).
* **In which order do a chain's blocks age?** Always suffix first. A chain is stored and read
  prefix first, so plain LRU would leave the prefix *older* than its suffix and evict it first,
  and a suffix without its prefix is worthless to an engine (a lookup counts leading hits only).
  :meth:`Policy.recency_order` gives the order in which to touch a request's keys so that the
  prefix ends up most recently used.
* **Which blocks leave a full tier first?** ``eviction``: ``lru`` (default), the least recently
  used; ``fifo``, the oldest stored; ``lfu-aging``, the least often used, with dynamic ageing so
  that blocks popular long ago age out (a chain's shared prefix, read by many requests, outlives
  one-off suffixes). Each is a priority function in :mod:`kvstore.store.eviction`.
* **When does a block earn a place in a device tier (hbm)?** Only once it was read at least
  ``promote_after_reads`` times since it was stored (default 2). Device pools are small: promoting
  on every first read would churn the pool with blocks read once and never again, each costing a
  host-to-device copy and evicting a block that was really hot. Reads are counted in the block's
  index entry, so the counters cost nothing beyond the index and go with the block. Host tiers
  (dram) still take a block read from below on its first read.
* **How long may a request ask to keep its blocks?** ``max_retention_s`` (default one hour; a
  tenant's own ``max_retention_s`` replaces it for that tenant's store): see
  :mod:`kvstore.retention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.retention import DEFAULT_MAX_RETENTION_S

__all__ = ["EVICTIONS", "NVME_ADMISSIONS", "SHARED_WRITES", "Policy"]

#: Accepted values of ``policy.shared_write``.
SHARED_WRITES = ("through", "back")
#: Accepted values of ``policy.nvme_admission``.
NVME_ADMISSIONS = ("all", "hit")
#: Accepted values of ``policy.eviction`` (the policies of :mod:`kvstore.store.eviction`).
EVICTIONS = ("lru", "fifo", "lfu-aging")


@dataclass(frozen=True)
class Policy:
    """The store's write, admission and eviction rules (see the module docstring)."""

    shared_write: str = "through"
    nvme_admission: str = "all"
    eviction: str = "lru"
    promote_after_reads: int = 2
    max_retention_s: float = DEFAULT_MAX_RETENTION_S
    #: The setting ``max_retention_s`` came from, named in a refusal.
    max_retention_setting: str = "policy.max_retention_s"

    def __post_init__(self) -> None:
        if not self.max_retention_s >= 0:
            raise ValueError(f"max_retention_s must be >= 0: {self.max_retention_s!r}")
        if self.promote_after_reads < 1:
            raise ValueError(f"promote_after_reads must be >= 1: {self.promote_after_reads!r}")
        if self.shared_write not in SHARED_WRITES:
            raise ValueError(f"shared_write must be one of {SHARED_WRITES}: {self.shared_write!r}")
        if self.nvme_admission not in NVME_ADMISSIONS:
            raise ValueError(
                f"nvme_admission must be one of {NVME_ADMISSIONS}: {self.nvme_admission!r}"
            )
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}: {self.eviction!r}")

    @property
    def write_through(self) -> bool:
        """Whether new blocks go to the shared tier when they are stored."""
        return self.shared_write == "through"

    @property
    def write_back(self) -> bool:
        """Whether blocks go to the shared tier when they leave this node."""
        return self.shared_write == "back"

    def admit_on_demotion(self, persistent_target: bool, hits: int) -> bool:
        """Whether a block evicted from a tier should be written into the next one down.

        ``persistent_target``: the next tier keeps blocks across restarts (nvme); ``hits``: how
        often the block was read since it was stored.
        """
        if persistent_target and self.nvme_admission == "hit":
            return hits > 0
        return True

    def promote_to_device(self, reads: int) -> bool:
        """Whether a block read ``reads`` times since it was stored may be promoted into a
        device tier (hbm); below that, promotions stop at the host tiers."""
        return reads >= self.promote_after_reads

    @staticmethod
    def recency_order(keys: Sequence[bytes]) -> list[bytes]:
        """The order to touch one request's keys in: suffix first, so the prefix is most recent."""
        return list(reversed(keys))
