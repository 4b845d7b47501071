"""The scheduler half's view of the engine's KV cache groups: keys, hits, load and save plans.

One code path serves one group and many (:mod:`kvstore.integrations.paged.groups` has the rules):
a request's lookup asks the store about every group's keys of its loadable chunks in one batch,
the hit is the longest prefix at which every group has what its layers read, and the plans name,
per group, only the chunks and blocks that rule needs. vLLM's null block (the placeholder it puts
in a block table where a sliding window or a state slot skipped blocks) is never loaded into
nor saved from: it is ``-1`` in a plan, like a block the engine already holds.

An engine with a group kvstore does not support (recurrent state, several page sizes in one
group, ...) still runs with its hybrid manager on: the connector looks up, loads and saves
nothing, says so once at start and counts each request it answered 0 tokens for
(``vllm:kvstore_unsupported_group_total{kind}``).

Nothing here imports vLLM: block tables are read duck-typed (``get_block_ids()``, and
``block_pool.null_block`` where the manager has one).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from kvstore.integrations.paged.groups import (
    GroupSpec,
    anchor_group,
    group_keys,
    longest_hit,
    needed_chunks,
)
from kvstore.integrations.paged.plan import LoadSpec, SaveSpec, load_targets
from kvstore.integrations.vllm.common import check_whole_blocks
from kvstore.retention import Retention
from kvstore.types import LookupResult

__all__ = ["GroupLayout", "null_block_id"]

logger = logging.getLogger(__name__)


def null_block_id(manager: Any) -> int | None:
    """The id of vLLM's null block, read from a cache manager (``None``: not exposed)."""
    pool = getattr(manager, "block_pool", None)
    null = getattr(pool, "null_block", None)
    block_id = getattr(null, "block_id", None)
    return int(block_id) if isinstance(block_id, int) else None


class GroupLayout:
    """The engine's groups, as the scheduler half plans with them."""

    def __init__(self, groups: Sequence[GroupSpec], chunk_size: int) -> None:
        self.groups = list(groups)
        self.chunk_size = chunk_size
        self.anchor = anchor_group(self.groups)
        #: Kinds kvstore does not store, present in this engine (empty: every group is stored).
        self.unsupported = sorted({g.kind for g in self.groups if not g.supported})
        self.active = bool(self.groups) and not self.unsupported
        self.hybrid = len(self.groups) > 1
        self._bpc = {}
        # An engine kvstore stores nothing for may have any block size (a recurrent group's page
        # sets it): it must start all the same.
        for group in self.groups if self.active else ():
            check_whole_blocks(chunk_size, group.block_size)
            self._bpc[group.index] = chunk_size // group.block_size
        if self.unsupported:
            logger.warning(
                "kvstore: this model has KV cache groups of kind %s (%s), which kvstore does "
                "not store; the engine runs with its hybrid KV cache manager and kvstore "
                "loads and saves nothing for it (counted in "
                "vllm:kvstore_unsupported_group_total)",
                ", ".join(self.unsupported),
                ", ".join(g.label for g in self.groups),
            )

    def blocks_per_chunk(self, group: int) -> int:
        """Engine blocks of group ``group`` in one chunk."""
        return self._bpc[group]

    def keys(self, chunk_keys: Sequence[bytes]) -> list[list[bytes]]:
        """Each group's keys of ``chunk_keys`` (in group order)."""
        return [group_keys(chunk_keys, g, self.anchor) for g in self.groups]

    def lookup_keys(self, per_group: Sequence[Sequence[bytes]], count: int) -> list[bytes]:
        """The keys one lookup asks about: the first ``count`` chunks of every group, group by
        group (the anchor's first, so the answer's leading hits are the anchor's)."""
        return [key for g in self._order() for key in per_group[g][:count]]

    def _order(self) -> list[int]:
        return [self.anchor] + [g.index for g in self.groups if g.index != self.anchor]

    def hit(self, answer: LookupResult, count: int) -> tuple[int, list[str]]:
        """From the answer to :meth:`lookup_keys` (``count`` chunks): the hit in chunks, and the
        tier of each of the anchor group's leading chunks (for the load plan's cost model).

        A key is present when its tier is named, or when it is among the answer's leading hits
        (an answer without tiers).
        """
        order = self._order()
        tiers = answer.tiers
        present: dict[int, list[bool]] = {}
        for at, index in enumerate(order):
            present[index] = [
                i < answer.hits or (i < len(tiers) and bool(tiers[i]))
                for i in range(at * count, (at + 1) * count)
            ]
        hits = longest_hit(
            self.groups, [present[g.index] for g in self.groups], self.chunk_size, count
        )
        return hits, list(tiers[:hits])

    def load_specs(
        self,
        req_id: str,
        per_group_keys: Sequence[Sequence[bytes]],
        block_ids: Sequence[Sequence[int]],
        start: int,
        end: int,
        null_id: int | None,
    ) -> list[LoadSpec]:
        """Loads of tokens ``[start, end)`` (``end`` a chunk boundary) into the request's blocks,
        one spec per group, each with only the chunks its rule needs; null blocks are ``-1``."""
        boundary = end // self.chunk_size
        specs = []
        for group in self.groups:
            need = needed_chunks(group, boundary, self.chunk_size)
            first_token = max(start, need.start * self.chunk_size)
            if first_token >= end:
                continue
            ids = [-1 if b == null_id else b for b in block_ids[group.index]]
            chunks, targets = load_targets(
                ids,
                first_token,
                end,
                self.chunk_size,
                group.block_size,
                self._bpc[group.index],
            )
            if all(b < 0 for b in targets):
                continue
            keys = list(per_group_keys[group.index][chunks.start : chunks.stop])
            # The anchor's load counts the request's tokens, whatever its window wrote.
            tokens = end - start if group.index == self.anchor else 0
            specs.append(LoadSpec(req_id, keys, targets, group.index, tokens))
        return specs

    def save_specs(
        self,
        req_id: str,
        per_group_keys: Sequence[Sequence[bytes]],
        block_ids: Sequence[Sequence[int]],
        chunks: Sequence[int],
        retention: Retention,
        null_id: int | None,
    ) -> list[SaveSpec]:
        """Saves of ``chunks`` of each group from the request's current block table: a chunk
        of a group whose blocks are not all the request's own real blocks now (a sliding
        window dropped them: freed, maybe given to another request) is not saved for it."""
        specs = []
        for group in self.groups:
            bpc = self._bpc[group.index]
            ids = block_ids[group.index]
            keys: list[bytes] = []
            blocks: list[int] = []
            for chunk in chunks:
                chunk_ids = list(ids[chunk * bpc : (chunk + 1) * bpc])
                if len(chunk_ids) < bpc or any(b == null_id or b < 0 for b in chunk_ids):
                    continue
                keys.append(per_group_keys[group.index][chunk])
                blocks.extend(chunk_ids)
            if keys:
                specs.append(SaveSpec(req_id, keys, blocks, retention, group.index))
        return specs


def scheme_block_size(groups: Sequence[GroupSpec]) -> int:
    """The block size a chunk size must be a whole multiple of: every stored group's (1 where
    nothing is stored, so that an engine kvstore cannot serve still starts)."""
    sizes = [g.block_size for g in groups if g.supported]
    if not sizes or any(not g.supported for g in groups):
        return 1
    return math.lcm(*sizes)
