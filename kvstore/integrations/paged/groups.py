"""KV cache groups of a hybrid model, and which stored chunks a hit needs from each.

An engine may split its layers into *groups*, each with its own block table and its own rule for
which past tokens a layer still reads (vLLM's hybrid KV cache manager: full attention beside
sliding-window attention, chunked local attention, recurrent state). A stored chunk is then one
value per (chunk key, group): ``chunk_size`` tokens of that group's layers only, under a key
derived from the chunk key and the group's fingerprint (:func:`group_keys`).

The hit rule (:func:`longest_hit`): a prefix of ``n`` chunks is a hit when every group holds what
its layers read to compute token ``n * chunk_size`` onward:

``full``     every chunk ``0 .. n-1``;
``sliding``  only the chunks covering the last ``window - 1`` tokens before the boundary (the
             next token attends to itself and the ``window - 1`` before it);
``local``    (chunked local attention) only the chunks from the start of the boundary's
             attention chunk;
``state``    (recurrent: Mamba, Mamba2, GDN, ...) the state at the boundary. kvstore does not
             store recurrent state yet, so a model with such a group gets no hits
             (:data:`SUPPORTED_KINDS`), and neither does ``mixed`` (one group whose layers have
             different page sizes) nor ``other`` (cross, encoder-only, draft-model groups).

Loads move only :func:`needed_chunks` of each group; nothing here knows an engine or torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

__all__ = [
    "GROUP_KINDS",
    "SUPPORTED_KINDS",
    "GroupSpec",
    "anchor_group",
    "group_keys",
    "groups_fingerprint",
    "longest_hit",
    "needed_chunks",
]

#: Every kind a group can be (see the module docstring).
GROUP_KINDS = ("full", "sliding", "local", "state", "mixed", "other")
#: The kinds kvstore stores and loads; an engine with any other group gets no hits.
SUPPORTED_KINDS = frozenset({"full", "sliding", "local"})

_GROUP_TAG = b"kvstore-group-key-v1\x00"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group as the connector sees it.

    Attributes:
        index: The group's position in the engine's list (its block table).
        kind: One of :data:`GROUP_KINDS`.
        block_size: Tokens per engine block of this group.
        window: ``sliding``: the attention window in tokens; ``local``: the attention chunk;
            0 otherwise.
        layers: The group's layer names, in the engine's order.
        page_bytes: Bytes of one block of one layer.
        detail: Everything else that decides the group's bytes (heads, head size, dtype,
            spec type), part of its fingerprint.
    """

    index: int
    kind: str
    block_size: int
    window: int
    layers: tuple[str, ...]
    page_bytes: int
    detail: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"group kind {self.kind!r}: one of {', '.join(GROUP_KINDS)}")

    @property
    def supported(self) -> bool:
        """Whether kvstore stores and loads this group."""
        return self.kind in SUPPORTED_KINDS

    @property
    def label(self) -> str:
        """``kind/index``, e.g. ``sliding/1``: how figures name the group."""
        return f"{self.kind}/{self.index}"

    def fingerprint(self) -> bytes:
        """16 bytes naming the group's spec: kind, window, block and page size, layers."""
        text = "\x1f".join(
            [
                self.kind,
                str(self.window),
                str(self.block_size),
                str(self.page_bytes),
                self.detail,
                *self.layers,
            ]
        )
        return hashlib.sha256(text.encode()).digest()[:16]


def groups_fingerprint(groups: Sequence[GroupSpec]) -> str:
    """A short hex name of the whole group layout, for the engine's namespace."""
    digest = hashlib.sha256()
    for group in groups:
        digest.update(group.index.to_bytes(4, "little") + group.fingerprint())
    return digest.hexdigest()[:16]


def anchor_group(groups: Sequence[GroupSpec]) -> int:
    """The group whose chunk keys are the plain chunk keys (the others' are derived).

    The first full-attention group (its chunks are every chunk, so the plain keys the router and
    the node's index name stay meaningful), else the first group.
    """
    return next((g.index for g in groups if g.kind == "full"), groups[0].index if groups else 0)


def group_keys(keys: Sequence[bytes], group: GroupSpec, anchor: int) -> list[bytes]:
    """The keys under which ``group`` stores chunks ``keys``: the chunk keys themselves for the
    anchor group, else each hashed with the group's fingerprint (16 bytes, like a chunk key)."""
    if group.index == anchor:
        return list(keys)
    salt = _GROUP_TAG + group.fingerprint()
    return [xxhash.xxh3_128_digest(salt + key) for key in keys]


def needed_chunks(group: GroupSpec, boundary: int, chunk_size: int) -> range:
    """The chunks of ``group`` a hit of ``boundary`` chunks needs (see the module docstring).

    Only meaningful for :data:`SUPPORTED_KINDS`; any other kind needs every chunk.
    """
    end_token = boundary * chunk_size
    if boundary <= 0:
        return range(0)
    if group.kind == "sliding" and group.window > 0:
        first_token = max(0, end_token - (group.window - 1))
        return range(first_token // chunk_size, boundary)
    if group.kind == "local" and group.window > 0:
        first_token = (end_token // group.window) * group.window
        return range(first_token // chunk_size, boundary)
    return range(0, boundary)


def longest_hit(
    groups: Sequence[GroupSpec],
    present: Sequence[Sequence[bool]],
    chunk_size: int,
    limit: int,
    held: int = 0,
) -> int:
    """The most leading chunks (at most ``limit``) at which every group has what it needs.

    ``present[i][c]``: whether group ``groups[i]`` has chunk ``c`` in the store. Chunks before
    ``held`` are the engine's own already (its prefix cache) and count as present. Any group of a
    kind kvstore does not support makes the answer 0.
    """
    if not groups or any(not g.supported for g in groups):
        return 0
    # misses[i][c]: chunks of group i before c that are absent (prefix sums: each boundary's
    # check is O(groups)).
    misses: list[list[int]] = []
    for flags in present:
        sums = [0]
        for c in range(limit):
            hit = c < held or (c < len(flags) and flags[c])
            sums.append(sums[-1] + (0 if hit else 1))
        misses.append(sums)
    for boundary in range(limit, 0, -1):
        for group, sums in zip(groups, misses, strict=True):
            need = needed_chunks(group, boundary, chunk_size)
            if sums[need.stop] - sums[need.start]:
                break
        else:
            return boundary
    return 0
