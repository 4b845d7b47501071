"""What one try of a UCX get brought back (:class:`GetOutcome`), for
:mod:`kvstore.client.ucx`: where each sent block lands, and which blocks a lost message spoiled
(never returned: asked for again, or the call falls back to gRPC)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore.client.device_fill import is_device_tensor
from kvstore.protocol.ucx import verify_payloads
from kvstore.protocol.ucx_plan import StreamLayout

__all__ = ["GetOutcome", "landing", "settle"]


@dataclass
class GetOutcome:
    """What one try of a get brought: per key whether it was sent, the buffers it landed in."""

    sent: list[bool]
    buffers: dict[int, Any]
    #: Indices whose messages a dead lane carried: not in ``buffers``, to be asked again.
    failed: set[int] = field(default_factory=set)


def landing(views: list[Any] | None, lengths: Sequence[int], indices: list[int]) -> dict[int, Any]:
    """Where each sent block lands: the caller's buffer, or (no buffers: ``receive_any``) its
    slice of one buffer for the whole stream, in which every message lands in place."""
    if views is not None:
        return {index: views[index] for index in indices}
    stream = np.empty(sum(lengths[i] for i in indices), dtype=np.uint8)
    buffers, offset = {}, 0
    for index in indices:
        buffers[index] = stream[offset : offset + lengths[index]]
        offset += lengths[index]
    return buffers


def settle(
    outcome: GetOutcome,
    layout: StreamLayout,
    placed: Sequence[int],
    lost: list[tuple[int, int]],
    response: ucx_pb.UcxGetResponse,
) -> None:
    """Mark failed the sent blocks a lost message covered (block ``placed[p]`` is block ``p``
    of ``layout``), check the others' checksums, and take the failed ones out."""
    sent, lengths = outcome.sent, response.lengths
    for position, index in enumerate(placed):
        start = layout.block_starts[position]
        if sent[index] and any(s < start + lengths[index] and start < e for s, e in lost):
            outcome.failed.add(index)
    # Device memory cannot be hashed here; what the host received is checked.
    host = {
        i: b
        for i, b in outcome.buffers.items()
        if not is_device_tensor(b) and i not in outcome.failed
    }
    verify_payloads(host, response.checksums)
    for index in outcome.failed:
        outcome.buffers.pop(index, None)
