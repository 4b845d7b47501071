"""Chunk keys as the engines' vLLM connector names them, computed by the router.

The connector's scheduler names a request's chunks with a :class:`~kvstore.keys.ChunkHasher` over
its rank-0 *base namespace* (model, shape, cache layout, tenant), with the request's LoRA adapter
and cache salt filled in, and the secret ``$KVSTORE_HASH_SECRET``
(:func:`kvstore.integrations.vllm.common.make_hasher`). Those rank-0 keys are what a node stores
for rank 0 and publishes to the cluster index, so they are what the router asks about.

The router cannot read the engine's configuration: it reads the key scheme the nodes publish in
the cluster index (:mod:`.fleet_keys`, which makes a :class:`RouterKeys` of it), or, deprecated,
``router.namespace`` (a JSON object of :class:`~kvstore.keys.Namespace` fields, which the
connector logs at start) with ``router.chunk_size`` and ``router.hash_algorithm``. A namespace
that differs from the engines' in any field only makes every lookup miss (routing falls back to
load); it never sends a wrong answer anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.key_scheme import namespace_from_json
from kvstore.keys import ChunkHasher, HashAlgorithm, Namespace

__all__ = ["RouterKeys", "parse_namespace"]


def parse_namespace(text: str) -> Namespace:
    """The ``router.namespace`` setting (a JSON object of Namespace fields) as rank 0's base."""
    return namespace_from_json(text, "router.namespace")


class RouterKeys:
    """Rank-0 chunk keys of a token sequence, per (LoRA adapter, cache salt), as the connector."""

    def __init__(
        self,
        base: Namespace,
        chunk_size: int,
        secret: str,
        algorithm: HashAlgorithm = "xxh3_128",
    ) -> None:
        self.base = base
        self.chunk_size = chunk_size
        self._secret = secret.encode()
        self._algorithm: HashAlgorithm = algorithm
        self._hashers: dict[tuple[str, str], ChunkHasher] = {}

    def hasher(self, lora_id: str = "", cache_salt: str = "") -> ChunkHasher:
        """The hasher the connector uses for this adapter and salt (made once, then kept)."""
        hasher = self._hashers.get((lora_id, cache_salt))
        if hasher is None:
            hasher = ChunkHasher(
                self.chunk_size,
                self.base.for_request(lora_id, cache_salt),
                secret=self._secret,
                algorithm=self._algorithm,
            )
            self._hashers[(lora_id, cache_salt)] = hasher
        return hasher

    def keys(
        self, token_ids: Sequence[int] | Any, lora_id: str = "", cache_salt: str = ""
    ) -> list[bytes]:
        """The keys of every full chunk of ``token_ids``."""
        return [bytes(key) for key in self.hasher(lora_id, cache_salt).keys(token_ids)]
