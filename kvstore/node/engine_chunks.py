"""Which kvstore chunks a vLLM engine holds in its own prefix cache, from its blocks' events.

vLLM names the blocks of its prefix cache (``block_size`` tokens, 16 by default) by hashes of its
own and reports them in KV events (:mod:`.engine_events`); kvstore names chunks of
``chunk_size`` tokens by chained keys (:mod:`kvstore.keys`). :class:`EngineChunks` follows the
engine's chains: for each block it remembers its parent and the chain state at its end (the key
of the last whole chunk and the tokens since it), so a stored block names the chunks that end
inside it exactly as the connector names them (its base namespace with the request's cache salt,
its secret and algorithm). A chunk is claimed only when *whole*: every block from the prompt's
first token to the chunk's last one is held, since vLLM's prefix lookup stops at the first
missing block.

Never claim what may be gone:

* a block whose parent is unknown (learnt before this node listened, or forgotten) cannot be
  named and is not followed, nor are its descendants;
* a removed block drops its chunks *and* those of every block after it in its chains;
* :meth:`EngineChunks.clear` (the engine's ``AllBlocksCleared``, a lost event, an undecodable
  batch, the engine gone) drops everything;
* blocks of LoRA requests (the connector names them by adapter name and path; events carry only
  the name), of multimodal prompts and of prompt embeddings are never named (the connector does
  not store those either).

**KV cache groups** (vLLM's hybrid KV cache manager: sliding-window layers beside full attention,
recurrent state): the chunks are named from the blocks of *one* full-attention group, the first
one whose events say ``kv_cache_spec_kind`` is full attention (the group whose chunk keys the
connector stores as the plain chunk keys: :func:`kvstore.integrations.paged.groups.anchor_group`);
an engine whose events name no kind is followed in its group 0 (or none), as before groups.
Other groups' events are counted per kind (:attr:`EngineChunks.other_groups`) and change no
claim: a prefix whose full-attention blocks the engine holds but whose sliding window it evicted
stays claimed, a partial hit rather than a miss (the engine's connector loads the window's
chunks from the node's store).

Memory is bounded: at most ``max_blocks`` blocks are remembered; past that the least recently
stored one is forgotten, and with it (as for a removal) its chunks and its descendants'.

:class:`LocalPublisher` is a store's publisher that also publishes these chunks, as tier
:data:`LOCAL` for this node (the fastest of all; while the engine holds a chunk it wins over the
node's own tiers, and once the engine drops it the node's own tier shows again).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.cluster.layout import LOCAL, Client, Layout
from kvstore.keys import ChunkHasher, HashAlgorithm, Namespace
from kvstore.node.membership import Membership
from kvstore.node.publisher import Publisher
from kvstore.store import TieredStore

__all__ = ["FULL_KINDS", "LOCAL", "EngineChunks", "LocalPublisher", "StoredBlocks"]

logger = logging.getLogger(__name__)

#: A vLLM block hash as its events carry it: bytes, or an int with
#: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.
BlockHash = bytes | int


_NO_TOKENS: tuple[bytes, ...] = ()

#: ``kv_cache_spec_kind`` values of groups whose blocks hold every token of a prompt.
FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


class UnnameableError(ValueError):
    """Blocks whose chunks the connector would not name this way (never claimed)."""


@dataclass(frozen=True)
class StoredBlocks:
    """One ``BlockStored`` event: consecutive blocks of one chain, after ``parent``."""

    hashes: Sequence[BlockHash]
    parent: BlockHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    #: Per block, the untagged extra keys vLLM hashed (cache salt, multimodal, embeddings).
    extra_keys: Sequence[Sequence[object] | None] | None = None
    group: int | None = None
    #: vLLM's ``kv_cache_spec_kind`` of the group (``full_attention``, ``sliding_window``, ...),
    #: ``None`` from an engine whose events do not say.
    kind: str | None = None


@dataclass(slots=True)
class _Block:
    parent: BlockHash | None
    hasher: ChunkHasher
    #: The chain key at the last chunk boundary at or before this block's end.
    key: bytes
    #: The tokens (little-endian uint32 bytes) after that boundary, shared with ancestors.
    tail: tuple[bytes, ...]
    #: The chunk keys ending inside this block.
    keys: list[bytes]
    #: Blocks stored after this one in a chain (``None`` while none: most blocks are leaves).
    children: set[BlockHash] | None = None


class EngineChunks:
    """One engine's blocks and the whole kvstore chunks they make.

    ``hold(key)`` is called when the engine starts holding a chunk, ``release(key)`` when it may
    no longer (each key once per change, whatever the number of blocks naming it).
    """

    def __init__(
        self,
        base: Namespace,
        chunk_size: int,
        secret: bytes,
        hold: Callable[[bytes], None],
        release: Callable[[bytes], None],
        *,
        algorithm: HashAlgorithm = "xxh3_128",
        max_blocks: int = 200_000,
    ) -> None:
        self.base = base
        self.chunk_size = chunk_size
        self.max_blocks = max_blocks
        self._secret = secret
        self._algorithm: HashAlgorithm = algorithm
        self._hold = hold
        self._release = release
        self._hashers: dict[str, ChunkHasher] = {}
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()
        #: Chunk key -> how many remembered blocks name it.
        self._held: dict[bytes, int] = {}
        #: Blocks not followed (unknown parent, unnameable), for tests and logs.
        self.skipped = 0
        #: The group whose blocks name chunks (``None`` until an event names a full one).
        self.group: int | None = None
        #: Blocks stored in groups not followed, by ``kv_cache_spec_kind``.
        self.other_groups: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def held(self) -> frozenset[bytes]:
        """The chunk keys the engine holds whole, as far as its events tell."""
        return frozenset(self._held)

    def _hasher(self, cache_salt: str) -> ChunkHasher:
        hasher = self._hashers.get(cache_salt)
        if hasher is None:
            namespace = self.base.for_request("", cache_salt)
            hasher = ChunkHasher(
                self.chunk_size, namespace, secret=self._secret, algorithm=self._algorithm
            )
            self._hashers[cache_salt] = hasher
        return hasher

    def stored(self, event: StoredBlocks) -> None:
        """The engine cached ``event``'s blocks (or reports cached ones it reused)."""
        if not self._follows(event.group, event.kind):
            kind = event.kind or "unknown"
            self.other_groups[kind] = self.other_groups.get(kind, 0) + len(event.hashes)
            return
        if event.lora_name:
            self.skipped += len(event.hashes)
            return
        size = event.block_size
        extras = event.extra_keys or [None] * len(event.hashes)
        if (
            size < 1
            or len(event.token_ids) != size * len(event.hashes)
            or len(extras) != len(event.hashes)
        ):
            # Tokens that do not split evenly into the blocks (vLLM skips masked blocks of
            # sliding-window groups): which tokens are whose is unknown, so nothing is named.
            self.skipped += len(event.hashes)
            return
        previous = event.parent
        for index, block_hash in enumerate(event.hashes):
            known = self._blocks.get(block_hash)
            if known is not None:  # a reused block: it stays, and is now the most recent
                self._blocks.move_to_end(block_hash)
                previous = block_hash
                continue
            tokens = event.token_ids[index * size : (index + 1) * size]
            try:
                block = self._follow(previous, tokens, extras[index])
            except UnnameableError:
                self.skipped += len(event.hashes) - index
                return
            self._add(block_hash, block)
            previous = block_hash

    def _follow(
        self, parent: BlockHash | None, tokens: Sequence[int], extra: Sequence[object] | None
    ) -> _Block:
        """The block after ``parent`` holding ``tokens``, its chain state and whole chunks."""
        salts = [value for value in extra or () if isinstance(value, str)]
        if len(salts) != len(extra or ()):
            raise UnnameableError("multimodal or prompt-embedding block")
        if parent is None:
            if len(salts) > 1:
                raise UnnameableError("several cache salts")
            hasher = self._hasher(salts[0] if salts else "")
            key, tail = hasher.root, _NO_TOKENS
        else:
            before = self._blocks.get(parent)
            if before is None or salts:  # a salt only ever comes with a prompt's first block
                raise UnnameableError("unknown parent")
            hasher, key, tail = before.hasher, before.key, before.tail
        data = np.asarray(tokens, dtype=np.int64)
        if data.size and (int(data.min()) < 0 or int(data.max()) > 0xFFFFFFFF):
            raise ValueError("BlockStored token ids out of range")
        tail = (*tail, data.astype("<u4").tobytes())
        whole = self.chunk_size * 4
        keys: list[bytes] = []
        if sum(len(part) for part in tail) >= whole:
            joined = b"".join(tail)
            start = 0
            while len(joined) - start >= whole:
                chunk = np.frombuffer(joined, dtype="<u4", count=self.chunk_size, offset=start)
                key = bytes(hasher.next_key(key, chunk))
                keys.append(key)
                start += whole
            tail = (joined[start:],) if start < len(joined) else _NO_TOKENS
        return _Block(parent, hasher, key, tail, keys)

    def _add(self, block_hash: BlockHash, block: _Block) -> None:
        self._blocks[block_hash] = block
        if block.parent is not None:
            parent = self._blocks[block.parent]
            if parent.children is None:
                parent.children = set()
            parent.children.add(block_hash)
        for key in block.keys:
            count = self._held.get(key, 0)
            self._held[key] = count + 1
            if not count:
                self._hold(key)
        while len(self._blocks) > self.max_blocks:
            self._drop(next(iter(self._blocks)))

    def _follows(self, group: int | None, kind: str | None) -> bool:
        """Whether blocks of ``group`` (of ``kind``) name chunks (see the module docstring)."""
        if kind is None:
            return group in (None, 0) and self.group in (None, 0)
        if kind not in FULL_KINDS:
            return False
        if self.group is None:
            self.group = group
        return group == self.group

    def removed(self, hashes: Sequence[BlockHash], group: int | None = None) -> None:
        """The engine evicted these blocks: they and their descendants stop counting (only
        those of the group followed: another group's evictions leave a partial hit)."""
        if group != self.group and not (self.group is None and group in (None, 0)):
            return
        for block_hash in hashes:
            if block_hash in self._blocks:
                self._drop(block_hash)

    def _drop(self, block_hash: BlockHash) -> None:
        first = self._blocks.pop(block_hash)
        if first.parent is not None:
            parent = self._blocks.get(first.parent)
            if parent is not None and parent.children is not None:
                parent.children.discard(block_hash)
        stack = [first]
        while stack:
            block = stack.pop()
            for key in block.keys:
                self._unhold(key)
            if block.children is not None:
                stack.extend(self._blocks.pop(child) for child in block.children)

    def _unhold(self, key: bytes) -> None:
        count = self._held[key] - 1
        if count:
            self._held[key] = count
        else:
            del self._held[key]
            self._release(key)

    def clear(self) -> None:
        """Forget everything learnt from the engine (its cache was cleared, or may have been)."""
        self._blocks.clear()
        held, self._held = self._held, {}
        for key in held:
            self._release(key)


class LocalPublisher(Publisher):
    """A store's :class:`Publisher` that also publishes the chunks its engine holds, as tier
    :data:`LOCAL` (:meth:`hold`, :meth:`release` are :class:`EngineChunks`' callbacks)."""

    def __init__(
        self,
        client: Client,
        layout: Layout,
        store: TieredStore | None,
        membership: Membership,
        interval_s: float,
    ) -> None:
        super().__init__(client, layout, store, membership, interval_s)
        #: The chunk keys the engine holds.
        self.local: set[bytes] = set()

    def on_change(self, key: bytes, tier: str | None) -> None:
        """The store's listener: while the engine holds ``key``, it stays published as local."""
        if key not in self.local:
            super().on_change(key, tier)

    def hold(self, key: bytes) -> None:
        """The engine holds ``key``."""
        self.local.add(key)
        super().on_change(key, LOCAL)

    def release(self, key: bytes) -> None:
        """The engine may no longer hold ``key``: the node's own tier (or nothing) shows again."""
        self.local.discard(key)
        super().on_change(key, self.store.tier_of(key) if self.store is not None else None)

    def holdings(self) -> Iterator[tuple[bytes, str]]:
        """The store's holdings with the engine's chunks as local (a full resync)."""
        local = self.local
        for key, tier in super().holdings():
            yield key, LOCAL if key in local else tier
        store = self.store
        for key in list(local):
            if store is None or store.tier_of(key) is None:
                yield key, LOCAL
