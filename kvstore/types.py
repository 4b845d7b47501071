"""Result and progress types that both sides use: the client returns them, the store produces them.

This module imports nothing of kvstore beyond the standard library, so a client process that only
needs these names loads neither the store nor its tiers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["LookupResult", "PrefetchProgress", "PrefetchState", "PutResult"]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``hits`` leading keys are present; ``tiers[i]`` is where key ``i`` is ("" if absent)."""

    hits: int
    tiers: list[str]


@dataclass(frozen=True, slots=True)
class PutResult:
    """How a put went: newly stored, already present (skipped), or dropped for lack of room."""

    stored: int = 0
    already_present: int = 0
    dropped: int = 0


class PrefetchState(enum.Enum):
    """Where a prefetch is in its life; DONE and CANCELLED are final."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """True for the final states."""
        return self in (PrefetchState.DONE, PrefetchState.CANCELLED)


@dataclass(frozen=True, slots=True)
class PrefetchProgress:
    """A snapshot of one prefetch: its state and how its keys have fared so far.

    ``ready`` keys are resident in dram (already there, or moved), ``missing`` ones are in no tier
    under the namespace, ``failed`` ones were found but could not be moved. Keys of batches not
    yet run (or never run, after a cancel) are in none of the three.
    """

    state: PrefetchState
    total: int
    ready: int = 0
    missing: int = 0
    failed: int = 0

    @property
    def finished(self) -> bool:
        """True once the prefetch is DONE or CANCELLED."""
        return self.state.finished
