"""Chained prefix-chunk keys: the only way a KV block is ever named.

An engine cuts a prompt's token ids into chunks of ``chunk_size`` tokens and names chunk ``i`` by::

    key[-1] = H("kvstore-chain-v1" ‖ len(secret) ‖ secret ‖ namespace.fingerprint())
    key[i]  = H(key[i-1] ‖ tokens[i*C:(i+1)*C] as little-endian uint32)

so a key names the whole prefix up to the end of its chunk, not just the chunk's tokens, and two
namespaces (other model, dtype, layout, TP rank, LoRA, tenant, ...) can never share a key. ``H`` is
xxh3-128 by default or sha256 truncated to 128 bits, so every key is :data:`KEY_BYTES` long
whichever is chosen. Python's ``hash()`` is never used: it differs between processes.

A wrong key is silent corruption, the worst failure this system can have; the golden vectors in
``tests/test_keys_golden.py`` pin the scheme so that any change to it fails a test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, NewType

import numpy as np
import xxhash

from kvstore.errors import ConfigError, InvalidRequestError

__all__ = [
    "KEY_BYTES",
    "NAMESPACE_BYTES",
    "BlockKey",
    "ChunkHasher",
    "HashAlgorithm",
    "Namespace",
]

KEY_BYTES = 16
NAMESPACE_BYTES = 16

BlockKey = NewType("BlockKey", bytes)
"""A 16-byte chained chunk key."""

HashAlgorithm = Literal["xxh3_128", "sha256"]

_NAMESPACE_TAG = b"kvstore-namespace-v1\x00"
_CHAIN_TAG = b"kvstore-chain-v1\x00"
_MAX_TOKEN_ID = 2**32 - 1


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _sha256_128(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:KEY_BYTES]


_HASHES: dict[str, Callable[[bytes], bytes]] = {"xxh3_128": _xxh3_128, "sha256": _sha256_128}


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes two KV blocks of the same tokens incompatible.

    Only ``model`` is required; the defaults describe "unspecified", which is still a distinct,
    stable namespace. Engines should fill in every field they know.
    """

    model: str
    revision: str = "main"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    dtype: str = "auto"
    cache_layout: str = "default"
    tp_rank: int = 0
    tp_size: int = 1
    lora_id: str = ""
    tenant: str = ""
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("Namespace.model must be a non-empty model id")
        for name in ("num_layers", "num_kv_heads", "head_size", "tp_rank"):
            if getattr(self, name) < 0:
                raise ConfigError(f"Namespace.{name} must be >= 0, got {getattr(self, name)}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(
                f"Namespace needs 0 <= tp_rank < tp_size, got tp_rank={self.tp_rank} "
                f"tp_size={self.tp_size}"
            )

    def for_request(self, lora_id: str, cache_salt: str) -> Namespace:
        """This engine-wide namespace with one request's LoRA adapter and cache salt filled in:
        the namespace the connector names that request's chunks in (and the router too)."""
        return dataclasses.replace(self, lora_id=lora_id, cache_salt=cache_salt)

    def canonical(self) -> bytes:
        """The stable byte encoding the fingerprint is computed over (sorted-key JSON)."""
        fields: dict[str, Any] = asdict(self)
        return _NAMESPACE_TAG + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def fingerprint(self) -> bytes:
        """A 16-byte xxh3-128 digest of :meth:`canonical`; stored in every block header."""
        return xxhash.xxh3_128_digest(self.canonical())


class ChunkHasher:
    """Computes the chained keys of the full chunks of a token sequence.

    >>> hasher = ChunkHasher(chunk_size=4, namespace=Namespace(model="demo"))
    >>> len(hasher.keys(list(range(10))))  # two full chunks; the partial tail has no key
    2
    """

    def __init__(
        self,
        chunk_size: int = 256,
        namespace: Namespace | None = None,
        *,
        secret: bytes = b"",
        algorithm: HashAlgorithm = "xxh3_128",
    ) -> None:
        if chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1, got {chunk_size}")
        if namespace is None:
            raise ConfigError("ChunkHasher needs a namespace, e.g. Namespace(model='my-model')")
        if algorithm not in _HASHES:
            raise ConfigError(f"algorithm must be one of {sorted(_HASHES)}, got {algorithm!r}")
        self.chunk_size = chunk_size
        self.namespace = namespace
        self.algorithm: HashAlgorithm = algorithm
        self._hash = _HASHES[algorithm]
        self.namespace_fingerprint = namespace.fingerprint()
        self.root = self._hash(
            _CHAIN_TAG + struct.pack("<Q", len(secret)) + secret + self.namespace_fingerprint
        )

    def keys(self, token_ids: Sequence[int] | np.ndarray[Any, Any] | Any) -> list[BlockKey]:
        """Keys of every full chunk of ``token_ids`` (a list, numpy array or CPU tensor)."""
        tokens = self._as_uint32(token_ids)
        keys: list[BlockKey] = []
        parent = self.root
        size = self.chunk_size
        for start in range(0, len(tokens) - size + 1, size):
            parent = self._hash(parent + tokens[start : start + size].tobytes())
            keys.append(BlockKey(parent))
        return keys

    def next_key(self, parent: bytes, chunk: Sequence[int] | np.ndarray[Any, Any]) -> BlockKey:
        """The key of ``chunk`` following the key ``parent`` (use :attr:`root` for the first)."""
        tokens = self._as_uint32(chunk)
        if len(tokens) != self.chunk_size:
            raise InvalidRequestError(f"a chunk has {self.chunk_size} tokens, got {len(tokens)}")
        return BlockKey(self._hash(parent + tokens.tobytes()))

    @staticmethod
    def _as_uint32(token_ids: Any) -> np.ndarray[Any, np.dtype[np.uint32]]:
        if hasattr(token_ids, "detach"):  # a torch tensor; avoid importing torch here
            token_ids = token_ids.detach().cpu().numpy()
        array = np.asarray(token_ids)
        if array.ndim != 1:
            raise InvalidRequestError(f"token ids must be one-dimensional, got shape {array.shape}")
        if array.size == 0:
            return np.empty(0, dtype="<u4")
        if array.dtype.kind not in "iu":
            raise InvalidRequestError(f"token ids must be integers, got dtype {array.dtype}")
        if int(array.min()) < 0 or int(array.max()) > _MAX_TOKEN_ID:
            raise InvalidRequestError("token ids must lie in [0, 2**32)")
        return array.astype("<u4", copy=False)
