"""Retention a request asks for: keep its blocks for N seconds, keep them in fast tiers only, or
do not store them at all (prompt caching as hosted APIs offer it).

A :class:`Retention` rides with a put (Python API, the ``Put`` RPC, the shared-memory ``COMMIT``)
and with a vLLM request's ``kv_transfer_params``. What the store does with it:

* ``seconds`` > 0: each block the put stores (or finds already stored) is *retained* until
  ``seconds`` from now; a read of a retained block starts its window again. Eviction passes over
  retained blocks in every local tier (no flood of one-off prompts pushes them out); only a put
  that itself asks for retention, and finds a tier holding nothing but retained and pinned
  blocks, may evict the retained block whose time runs out first (*evicted early*: the tenant's
  quota, its tier sizes, is full of retained blocks). In Redis a retained block is written with a
  TTL of at least ``seconds``, and one found stored has its Redis TTL lengthened to that. The
  deadlines survive a restart where the store has an nvme tier
  (:mod:`kvstore.store.retention_journal`). At most the tenant's ``max_retention_s`` (else the
  server's ``policy.max_retention_s``).
* ``tiers = "fast"``: store only in memory tiers (dram, hbm): never written to nvme or Redis,
  dropped instead of demoted out of memory, not copied down at shutdown.
* ``tiers = "none"``: store nothing anywhere; the put is counted (``put_not_stored``) and answered
  with nothing stored.

This module is a leaf: the client and the server both import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.errors import InvalidRequestError

__all__ = ["DEFAULT_MAX_RETENTION_S", "KEEP", "RETENTION_TIERS", "Retention"]

#: Accepted values of :attr:`Retention.tiers`: every tier (as without retention), memory tiers
#: only, no tier at all.
RETENTION_TIERS = ("all", "fast", "none")

#: ``policy.max_retention_s`` unless configured: one hour, the longest hosted caches offer.
DEFAULT_MAX_RETENTION_S = 3600.0


@dataclass(frozen=True, slots=True)
class Retention:
    """What one put asks of the store (see the module docstring); the default asks nothing."""

    #: Keep the blocks at least this long (0: plain eviction order).
    seconds: float = 0.0
    #: ``"all"``, ``"fast"`` (memory tiers only) or ``"none"`` (store nothing).
    tiers: str = "all"

    def __post_init__(self) -> None:
        if not (isinstance(self.seconds, int | float) and math.isfinite(self.seconds)):
            raise InvalidRequestError(
                f"retention seconds must be a finite number >= 0, got {self.seconds!r}"
            )
        if self.seconds < 0:
            raise InvalidRequestError(f"retention seconds must be >= 0, got {self.seconds!r}")
        if self.tiers not in RETENTION_TIERS:
            raise InvalidRequestError(
                f"retention tiers must be one of {list(RETENTION_TIERS)}, got {self.tiers!r}"
            )

    @property
    def is_default(self) -> bool:
        """Whether this asks nothing beyond a plain put."""
        return self.seconds == 0 and self.tiers == "all"

    @property
    def stores(self) -> bool:
        """Whether blocks are stored at all."""
        return self.tiers != "none"

    @property
    def fast_only(self) -> bool:
        """Whether blocks stay out of persistent and shared tiers."""
        return self.tiers == "fast"

    def check(self, max_seconds: float, setting: str = "policy.max_retention_s") -> None:
        """Refuse (:class:`InvalidRequestError`) more seconds than ``max_seconds`` allows."""
        if self.seconds > max_seconds:
            raise InvalidRequestError(
                f"retention of {self.seconds:g} s is over this store's maximum of "
                f"{max_seconds:g} s ({setting}); ask for 0 to {max_seconds:g}"
            )


#: The retention of a plain put.
KEEP = Retention()
