"""A *remote source*: where a store reads blocks it does not index once its local tiers miss.

The cluster's peer fetch (:mod:`kvstore.node.peers`) is one: it asks the cluster index which
live node holds a key and reads it from that node. The store knows only this interface; with no
source set (the default) a get costs nothing more.

A request's deadline reaches the source through :data:`REQUEST_DEADLINE` (set by the gRPC
servicer for the call it serves), so a remote read never outlives the request that needs it:
it gets :func:`remaining_s`, which keeps :data:`ANSWER_SHARE` of the time left for the request to
answer afterwards (a peer that stays silent is then a miss in the answer, not a deadline error
that loses the keys this node did serve).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any, Protocol

__all__ = ["ANSWER_SHARE", "REQUEST_DEADLINE", "Landing", "RemoteSource", "remaining_s"]

#: The ``time.monotonic()`` by which the request being served must be answered (``None``: the
#: caller set none; the source applies its own bound).
REQUEST_DEADLINE: ContextVar[float | None] = ContextVar("kvstore_request_deadline", default=None)


#: The share of a request's time left that a remote read leaves to the request's answer.
ANSWER_SHARE = 0.1


def remaining_s() -> float | None:
    """Seconds a remote read may take for the current request: what is left before its deadline
    less :data:`ANSWER_SHARE` of it (``None`` without a deadline)."""
    deadline = REQUEST_DEADLINE.get()
    return None if deadline is None else (deadline - time.monotonic()) * (1 - ANSWER_SHARE)


class Landing(Protocol):
    """Pages of this node's host tier that a source may receive blocks into (no copy to place
    them afterwards); see :class:`kvstore.store.landing.ArenaLanding`."""

    async def buffers(self, keys: Sequence[bytes], lengths: Sequence[int]) -> list[Any | None]:
        """A writable buffer of exactly ``lengths[i]`` bytes per key, or ``None`` (receive that
        one into memory of your own). A buffer received into whole is the key's payload."""
        ...

    def abandon(self, keys: Sequence[bytes]) -> None:
        """Buffers of ``keys`` that a failed transfer may still write into: never served, and
        given back later."""
        ...


class RemoteSource(Protocol):
    """Blocks held elsewhere, read by key."""

    #: The tier name hits from this source are counted under (``peer``).
    name: str

    async def read(
        self, keys: Sequence[bytes], namespace: bytes, landing: Landing | None = None
    ) -> tuple[list[bytes | None], dict[int, str]]:
        """Each key's payload (``None`` where not found), and why, by position, a key that some
        source was asked for was not served (a miss reason such as ``peer_timeout``). With a
        ``landing``, a payload may be one of its buffers, received in place."""
        ...
