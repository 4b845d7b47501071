"""The store: what moves blocks between tiers, below the server and above the tiers.

:class:`TieredStore` is the facade the server calls (its parts, one job each, are listed in
:mod:`kvstore.store.tiered`); :class:`Prefetcher` moves blocks up ahead of need. Nothing here is
imported by a client process.
"""

from kvstore.store.prefetch import Prefetcher
from kvstore.store.tiered import Acquired, GetResult, Promotion, TieredStore
from kvstore.types import LookupResult, PutResult

__all__ = [
    "Acquired",
    "GetResult",
    "LookupResult",
    "Prefetcher",
    "Promotion",
    "PutResult",
    "TieredStore",
]
