"""What a peer answers a read with, and the check every block of it passes before it is used.

A node's entry in the cluster index proves nothing: anyone able to write to the index Redis can
register a node and claim keys. So a node reading another's blocks asks for them *sealed* (over
gRPC and over UCX alike): each payload comes with its packed wire header, whose keyed MAC covers
key, namespace, length and payload under the cluster's integrity secret bound to the tenant
(:mod:`kvstore.block`). :func:`verify_blocks` is the one check both transports' answers go
through, against the reader's own keyring, before a byte is installed or served: a block that
fails it (no header, a header for another key or namespace, a MAC under another secret, a length
out of bounds) is never used, and its holder is suspect (:mod:`kvstore.node.peers`). A block
sealed in a header version newer than this release reads (:func:`sealed_newer`, a peer running a
later release: :mod:`kvstore.formats`) is not used either, but its holder is not suspect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvstore.block import CorruptBlockError, Keyring, WireHeader, verify_sealed
from kvstore.formats import NewerFormatError

__all__ = ["PeerAnswerError", "SealedBlock", "sealed_newer", "verify_blocks"]


class SealedBlock(NamedTuple):
    """One block a peer sent: its packed wire header and its payload (bytes, or a buffer a
    transport received it into); ``verified``: the verdict of :func:`verify_blocks` where the
    transport already ran it (UCX, in the thread that checks what arrived), else ``None``."""

    header: bytes
    payload: Any
    verified: bool | None = None


class PeerAnswerError(Exception):
    """A peer's answer is not one a well-behaved peer gives (an index out of range or repeated,
    a block over the size limit): the whole read fails and the peer is suspect."""


def verify_blocks(
    keys: Sequence[bytes],
    namespace: bytes,
    blocks: Sequence[SealedBlock | None],
    keyring: Keyring,
    max_block_bytes: int,
) -> list[bool]:
    """Per block, whether it is exactly what a node holding ``keyring``'s secret stored under
    its key in ``namespace`` (``True`` for a missing block: nothing to refuse; a block's
    :attr:`~SealedBlock.verified` where set). Costs a MAC over every payload: call it off the
    event loop."""
    verdicts: list[bool] = []
    for key, block in zip(keys, blocks, strict=True):
        if block is None:
            verdicts.append(True)
            continue
        if block.verified is not None:
            verdicts.append(block.verified)
            continue
        if not 0 < len(block.payload) <= max_block_bytes:
            verdicts.append(False)
            continue
        try:
            verify_sealed(key, namespace, block.header, block.payload, keyring)
        except (CorruptBlockError, NewerFormatError):
            verdicts.append(False)
        else:
            verdicts.append(True)
    return verdicts


def sealed_newer(header: bytes) -> bool:
    """Whether a refused block's ``header`` is one of a later release (a newer header version
    this release cannot verify), rather than forged or damaged."""
    try:
        WireHeader.unpack(header)
    except NewerFormatError:
        return True
    except CorruptBlockError:
        return False
    return False
