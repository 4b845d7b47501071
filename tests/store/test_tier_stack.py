"""The store finds its shared tier by capability (:class:`~kvstore.tiers.base.SharedTier`), not by
backend class, and refuses a tier that claims to be shared without the calls that takes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvstore.block import BlockHeader
from kvstore.store.layout import TierStack
from kvstore.tiers.base import Buffer, SharedTier, StoredBlock
from kvstore.tiers.dram import DramTier


class _NotRedis(SharedTier):
    """A shared backend that is not Redis (an object store, say): only the calls are stood in."""

    name = "objects"
    capacity = 2**40
    used = 0

    def footprint(self, length: int) -> int:
        return length

    async def write(self, header: BlockHeader, payload: Buffer) -> bool:
        return True

    async def read(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        return [None] * len(keys)

    async def remove(self, keys: Sequence[bytes]) -> bool:
        return True

    def stats(self) -> dict[str, int]:
        return {}

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)

    async def extend(self, keys: Sequence[bytes], ttl_s: float) -> int:
        return 0

    async def write_outcomes(
        self, items: Sequence[tuple[BlockHeader, Buffer]], ttl_s: float | None = None
    ) -> list[bool | None]:
        return [True] * len(items)


def test_any_shared_tier_backend_is_the_stacks_shared_tier() -> None:
    shared = _NotRedis()
    stack = TierStack([DramTier(1 << 20), shared])
    assert stack.shared is shared
    assert stack.shared_level == 1 and stack.local == stack.tiers[:1]
    assert TierStack([DramTier(1 << 20)]).shared is None


def test_a_tier_that_claims_shared_without_the_calls_is_refused() -> None:
    claims = DramTier(1 << 20)
    claims.shared = True  # a local tier marked shared: write-through would silently not happen
    with pytest.raises(ValueError, match=r"a shared tier must be a SharedTier"):
        TierStack([DramTier(1 << 20), claims])
