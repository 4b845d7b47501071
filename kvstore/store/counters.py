"""``StoreCounters``: what the store counts, and the ``Stats`` report built from it."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

from kvstore.protocol.rates import LATENCY_KEY, RATE_KEY, RateMeter
from kvstore.store.index import BlockIndex
from kvstore.store.layout import TierStack

__all__ = ["MISS_REASONS", "StoreCounters"]

#: Why a key asked for was not served (``misses`` in ``Stats``, ``kvstore_misses_total``):
#: ``absent`` never stored here (as far as this node knows), ``evicted`` it left the store to make
#: room, ``corrupt`` its copy failed verification (in a tier, or as a peer sent it: see
#: ``peer_corrupt_blocks``), ``tier_down`` the shared tier that may hold it is down, ``namespace``
#: it is stored under another namespace; the server adds ``deadline`` (the
#: call ran out of time) and ``denied`` (the caller's credentials were refused); peer fetch adds
#: ``peer_timeout`` (the peer holding it did not answer in time) and ``peer_down`` (it refused or
#: failed, or is suspect since it last did) and ``newer_format`` (the peer sealed it in a header
#: version newer than this release reads: :mod:`kvstore.formats`).
MISS_REASONS = (
    "absent",
    "evicted",
    "corrupt",
    "tier_down",
    "deadline",
    "denied",
    "namespace",
    "peer_timeout",
    "peer_down",
    "newer_format",
)

# Keys remembered as evicted from the store, to tell an ``evicted`` miss from an ``absent`` one
# (16 bytes a key plus the dict's overhead: about 10 MiB at most).
_GONE_KEYS = 65536


class StoreCounters:
    """Store-wide counters (``puts``, ``hits``...), per tier its hits, bytes and moves, and misses
    by reason."""

    def __init__(self) -> None:
        self.values: Counter[str] = Counter()
        #: Blocks served, by the name of the tier that served them.
        self.tier_hits: Counter[str] = Counter()
        #: Blocks evicted, by the name of the tier they left.
        self.evictions: Counter[str] = Counter()
        #: Payload bytes served / written, by tier name.
        self.read_bytes: Counter[str] = Counter()
        self.written_bytes: Counter[str] = Counter()
        #: Blocks moved down out of / up into a tier, by tier name.
        self.demotions: Counter[str] = Counter()
        self.promotions: Counter[str] = Counter()
        #: Retained blocks evicted before their time (the tier was full of retained blocks and
        #: another retained one needed room), by tier name.
        self.evicted_early: Counter[str] = Counter()
        #: Keys not served, by reason (:data:`MISS_REASONS`).
        self.misses: Counter[str] = Counter()
        #: How fast each tier (and a remote source, ``peer``) serves batched reads, measured.
        self.read_rates: dict[str, RateMeter] = {}
        self._gone: OrderedDict[bytes, None] = OrderedDict()

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name`` (creating it, even at 0)."""
        self.values[name] += amount

    def time_read(self, name: str, size: int, seconds: float) -> None:
        """Record one batched read of ``size`` payload bytes from ``name`` that took ``seconds``."""
        meter = self.read_rates.get(name)
        if meter is None:
            meter = self.read_rates[name] = RateMeter()
        meter.add(size, seconds)

    def rate_values(self, name: str) -> dict[str, int]:
        """``name``'s measured read rate as ``Stats`` values (0 and 0 until measured)."""
        meter = self.read_rates.get(name)
        rate = meter.rate() if meter is not None else None
        if rate is None or not rate.known:
            return {RATE_KEY: 0, LATENCY_KEY: 0}
        return {RATE_KEY: int(rate.per_s), LATENCY_KEY: round(rate.latency_s * 1e6)}

    @property
    def evicted_keys_remembered(self) -> int:
        """Keys remembered as evicted now (at most :data:`_GONE_KEYS`)."""
        return len(self._gone)

    def left_store(self, key: bytes) -> None:
        """Remember that ``key`` was evicted from the store (a later miss of it is ``evicted``)."""
        gone = self._gone
        gone[key] = None
        gone.move_to_end(key)
        if len(gone) > _GONE_KEYS:
            gone.popitem(last=False)

    def count_misses(
        self,
        keys: Sequence[bytes],
        missed: Iterable[int],
        reasons: Mapping[int, str],
        indexed: Container[bytes],
    ) -> None:
        """Count the keys at positions ``missed`` by reason: ``reasons`` where a read said why,
        else ``namespace`` for a key ``indexed`` (under another namespace), ``evicted`` for one
        that left the store, ``absent`` for the rest."""
        for position in missed:
            reason = reasons.get(position)
            if reason is None:
                key = keys[position]
                if key in indexed:
                    reason = "namespace"
                elif key in self._gone:
                    reason = "evicted"
                else:
                    reason = "absent"
            self.misses[reason] += 1

    def report(self, stack: TierStack, index: BlockIndex) -> dict[str, Any]:
        """Per-tier usage and counters, plus store-wide counters (the ``Stats`` answer)."""
        tiers = {}
        now = time.monotonic()
        for level, tier in enumerate(stack.tiers):
            entry = tier.stats()
            name = tier.name
            entry["hits"] = self.tier_hits[name]
            entry["evictions"] = self.evictions[name]
            entry["indexed_blocks"] = len(index.levels[level])
            entry["read_bytes"] = self.read_bytes[name]
            entry["written_bytes"] = self.written_bytes[name]
            entry["demotions"] = self.demotions[name]
            entry["promotions"] = self.promotions[name]
            entry.update(_retained(index, level, now))
            entry["retained_evicted_early"] = self.evicted_early[name]
            entry.update(self.rate_values(name))
            tiers[name] = entry
        counters = dict(self.values)
        # A remote source (``peer``) is no tier of the stack: its rate rides in the counters.
        for name in self.read_rates.keys() - tiers.keys():
            counters.update({f"{name}_{k}": v for k, v in self.rate_values(name).items()})
        # Misses by reason ride in the counters map as ``miss_<reason>`` (the wire format has no
        # other place for them); every reason is present, even at 0.
        counters.update({f"miss_{reason}": self.misses[reason] for reason in MISS_REASONS})
        return {"tiers": tiers, "counters": counters, "blocks": len(index)}


def _retained(index: BlockIndex, level: int, now: float) -> dict[str, int]:
    """How many blocks tier ``level`` holds whose retention has not run out, and the bytes they
    occupy there (the shared tier is not indexed: it reports what it wrote with a retention
    TTL itself)."""
    members = index.levels[level].members
    blocks = size = 0
    for key, (until, _) in index.retained.items():
        if until > now and key in members:
            blocks += 1
            size += members[key]
    return {"retained_blocks": blocks, "retained_bytes": size}
