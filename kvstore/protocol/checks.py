"""The rules a request must meet, written once for every door into the store.

The store, the gRPC servicer, the shared-memory server and the UCX server all refuse a bad request
with the same words (clients see them in the error's details), so each rule lives here once:

* :func:`check_pairs`: every key has its value (length, buffer...): ``"3 keys but 2 values"``;
* :func:`check_keys`: at least one key, at most the request limit, each :data:`KEY_BYTES` long,
  and a :func:`check_namespace`-valid namespace;
* :func:`check_streamed_keys`: the limit while a streamed request is still arriving;
* :func:`check_streamed_block`: each block of a streamed request and the running total, as they
  arrive (before the request is collected whole);
* :func:`check_sizes`: every value non-empty, within the block limit, and the batch within what
  the tiers can hold (the same footprint arithmetic the store places blocks with).

Every check raises :class:`InvalidRequestError` (or :class:`CapacityError` for sizes) and changes
nothing, so callers run them before touching any state.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Protocol

from kvstore.errors import CapacityError, InvalidRequestError
from kvstore.keys import KEY_BYTES, NAMESPACE_BYTES

#: The longest namespace JSON a ``KeyScheme`` request may carry (a real one is a few hundred
#: characters: model id, revision, shape, cache layout, tenant).
MAX_SCHEME_REQUEST_CHARS = 4096
#: Characters of a secret fingerprint (:func:`kvstore.key_scheme.secret_fingerprint`).
_SECRET_CHECK_CHARS = 16

__all__ = [
    "MAX_SCHEME_REQUEST_CHARS",
    "BlockHolder",
    "check_key_scheme_request",
    "check_keys",
    "check_namespace",
    "check_pairs",
    "check_sizes",
    "check_streamed_block",
    "check_streamed_keys",
]


class BlockHolder(Protocol):
    """What :func:`check_sizes` needs of a tier (any :class:`kvstore.tiers.base.Tier` has it)."""

    name: str
    capacity: int

    def footprint(self, length: int) -> int:
        """Bytes a block of ``length`` payload bytes occupies here."""
        ...


def check_pairs(keys: Sized, items: Sized, what: str) -> None:
    """Refuse ``keys`` and ``items`` (``"values"``, ``"lengths"``, ...) of different counts."""
    if len(items) != len(keys):
        raise InvalidRequestError(f"{len(keys)} keys but {len(items)} {what}")


def check_namespace(namespace: bytes) -> None:
    """Refuse a namespace fingerprint that is not :data:`NAMESPACE_BYTES` long."""
    if len(namespace) != NAMESPACE_BYTES:
        raise InvalidRequestError(
            f"namespace fingerprint is {len(namespace)} bytes; it must be {NAMESPACE_BYTES}"
        )


def check_keys(keys: Sequence[bytes], namespace: bytes | None, max_keys: int) -> None:
    """Refuse no keys, more than ``max_keys``, a key of the wrong size or a bad namespace.

    ``namespace`` ``None`` (an operator's delete across namespaces) is not checked.
    """
    if not keys:
        raise InvalidRequestError("the request names no keys")
    if len(keys) > max_keys:
        raise InvalidRequestError(f"{len(keys)} keys in one request; the limit is {max_keys}")
    if set(map(len, keys)) != {KEY_BYTES}:  # C speed; lookups of 1000s of keys are hot
        index, key = next((i, k) for i, k in enumerate(keys) if len(k) != KEY_BYTES)
        raise InvalidRequestError(f"key {index} is {len(key)} bytes; keys are {KEY_BYTES} bytes")
    if namespace is not None:
        check_namespace(namespace)


def check_key_scheme_request(namespace_json: str, secret_check: str) -> None:
    """Refuse a ``KeyScheme`` request whose namespace JSON is empty or over
    :data:`MAX_SCHEME_REQUEST_CHARS`, or whose secret check is neither empty nor 16 hex digits."""
    if not namespace_json:
        raise InvalidRequestError("the KeyScheme request names no namespace")
    if len(namespace_json) > MAX_SCHEME_REQUEST_CHARS:
        raise InvalidRequestError(
            f"the KeyScheme request's namespace is {len(namespace_json)} characters; "
            f"the limit is {MAX_SCHEME_REQUEST_CHARS}"
        )
    if secret_check and (
        len(secret_check) != _SECRET_CHECK_CHARS
        or not all(c in "0123456789abcdef" for c in secret_check)
    ):
        raise InvalidRequestError(
            f"the KeyScheme request's secret_check must be empty or {_SECRET_CHECK_CHARS} "
            "lowercase hex digits"
        )


def check_streamed_keys(count: int, max_keys: int) -> None:
    """Refuse a streamed request as soon as it has passed ``max_keys`` keys (before it ends)."""
    if count > max_keys:
        raise InvalidRequestError(f"more than {max_keys} keys in one request")


def check_streamed_block(
    index: int, length: int, total: int, max_block_bytes: int, capacity: int, max_request_bytes: int
) -> None:
    """Refuse block ``index`` of a streamed request if it is empty or over ``max_block_bytes``,
    or if the request's running ``total`` (this block included) passed the ``capacity`` of all
    tiers together (the words of :func:`check_sizes`) or ``max_request_bytes``
    (``server.inflight_bytes``: no request may hold more than the whole budget)."""
    if length <= 0:
        raise InvalidRequestError(f"value {index} is empty")
    if length > max_block_bytes:
        raise CapacityError(
            f"value {index} is {length} bytes; the block limit is {max_block_bytes} bytes"
        )
    if total > capacity:
        raise CapacityError(
            f"the request holds at least {total} bytes; all tiers together hold {capacity} bytes"
        )
    if total > max_request_bytes:
        raise CapacityError(
            f"the request passed {max_request_bytes} bytes (server.inflight_bytes) at value "
            f"{index}; split it into smaller requests"
        )


def check_sizes(lengths: Sequence[int], tiers: Sequence[BlockHolder], max_block_bytes: int) -> None:
    """Refuse an empty value, one over ``max_block_bytes``, or a batch ``tiers`` cannot hold.

    Sizes are counted as footprints in the largest of ``tiers`` (pages, headers), both for each
    value and for the batch against all of ``tiers`` together: a batch refused here could never
    be stored, and one accepted may still evict older blocks.
    """
    largest = max(tiers, key=lambda tier: tier.capacity)
    total = 0
    for index, length in enumerate(lengths):
        if length <= 0:
            raise InvalidRequestError(f"value {index} is empty")
        if length > max_block_bytes:
            raise CapacityError(
                f"value {index} is {length} bytes; the block limit is {max_block_bytes} bytes"
            )
        if largest.footprint(length) > largest.capacity:
            raise CapacityError(
                f"value {index} is {length} bytes; no tier can hold it (largest tier "
                f"{largest.name} holds {largest.capacity} bytes)"
            )
        total += largest.footprint(length)
    capacity = sum(tier.capacity for tier in tiers)
    if total > capacity:
        raise CapacityError(
            f"the request holds {total} bytes; all tiers together hold {capacity} bytes"
        )
