"""The message plan of a UCX transfer: which bytes travel as one message, over which lane.

The payloads of one transfer, concatenated in key order, form a byte *stream* (for a get: the
blocks sent). Each side holds the stream in its own memory, as a list of *pieces* (a caller's
buffer, a run of arena pages, a receive buffer); where one piece does not start at the byte after
the previous one ends, that side has a *break*. A message is a run of the stream with no break of
either side inside, so it lies in one piece of memory on both sides and UCX moves it with no
copy: blocks that sit next to each other in both sides' memory (consecutive arena pages, slices of
one staging tensor) move as one message, and a block split over several runs of arena pages moves
as one message per run instead of through a contiguous copy. Messages are also cut at
``max_message`` bytes, so a large block can be spread over several lanes.

Who plans: the side that knows both layouts. For a get that is the sender (the server), told the
caller's breaks by ``UcxGetRequest.joined`` (or none: ``receive_any``) before its answer, which
carries the plan; for a put it is the client, which sends at once and names its plan in
``UcxPutRequest.messages``: a receiver whose memory breaks inside a message receives that message
into a buffer of its own and copies it out (:meth:`StreamLayout.scatter`). Each side checks the
plan it is given against its own breaks (:func:`check_plan`) before posting anything.

Lanes: message ``m`` travels over lane :func:`assign_lanes` names, the same rule on both sides
(each message to the lane with the fewest bytes so far, the lowest index on ties), so no lane
numbers travel in the control messages.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.protocol.ucx import MAX_BATCH

__all__ = [
    "MAX_MESSAGE_BYTES",
    "StreamLayout",
    "assign_lanes",
    "check_plan",
    "host_piece",
    "lane_loads",
    "plan_messages",
]

#: The longest message a planner makes. Messages of 1-4 MiB kept UCX's TCP transport at its best
#: here (one 32 MiB message moved 0.7x what eight 4 MiB ones did, measured with ucxx alone), and
#: a cap lets one large block use several lanes.
MAX_MESSAGE_BYTES = 4 * 1024**2


def host_piece(buffer: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``buffer`` (bytes-like or a uint8 array, host memory) as a flat uint8 array, no copy."""
    if isinstance(buffer, np.ndarray) and buffer.dtype == np.uint8 and buffer.ndim == 1:
        return buffer
    return np.frombuffer(buffer, dtype=np.uint8)


def _address(piece: Any) -> int | None:
    """Where a host piece starts in this process's memory; ``None`` for memory that is not
    addressable here (a device tensor), which never shares a message with another piece."""
    if isinstance(piece, np.ndarray):
        return int(piece.__array_interface__["data"][0])
    return None


class StreamLayout:
    """One side's memory for a transfer's stream: ``blocks[i]`` lists block ``i``'s pieces in
    order (flat uint8 host arrays from :func:`host_piece`, or opaque device buffers)."""

    def __init__(self, blocks: Sequence[Sequence[Any]]) -> None:
        self._pieces: list[tuple[int, Any]] = []  # (stream offset, piece)
        #: Stream offset of each block's first byte, and the stream's length.
        self.block_starts: list[int] = []
        offset = 0
        for pieces in blocks:
            self.block_starts.append(offset)
            for piece in pieces:
                size = int(piece.nbytes)
                if size:
                    self._pieces.append((offset, piece))
                    offset += size
        self.total = offset
        #: Stream offsets where this side's memory is not contiguous (sorted, in ``(0, total)``).
        self.breaks: list[int] = []
        for (_, before), (start, after) in zip(self._pieces, self._pieces[1:], strict=False):
            end, begin = _address(before), _address(after)
            if end is None or begin is None or end + int(before.nbytes) != begin:
                self.breaks.append(start)

    def views(self, messages: Sequence[int]) -> list[Any]:
        """One contiguous buffer per message of a plan without a break of this side inside."""
        out = []
        offset = 0
        for length in messages:
            out.append(self.view(offset, length))
            offset += length
        return out

    def view(self, offset: int, length: int) -> Any:
        """The stream's bytes ``[offset, offset + length)``, which must not cross a break."""
        first = self._piece_at(offset)
        start, piece = self._pieces[first]
        inside = offset - start
        if inside + length <= piece.nbytes:
            return piece[inside : inside + length]
        # Over several pieces that follow each other in memory (host only: checked by breaks).
        address = _address(piece)
        if address is None:
            raise ValueError("a message spans pieces that are not contiguous")
        raw = (ctypes.c_ubyte * length).from_address(address + inside)
        return np.ctypeslib.as_array(raw)

    def crosses_break(self, offset: int, length: int) -> bool:
        """Whether ``[offset, offset + length)`` has a break of this side strictly inside."""
        return any(offset < b < offset + length for b in self.breaks)

    def scatter(self, offset: int, data: Any) -> None:
        """Copy ``data`` (a received message) into the pieces covering ``[offset, ...)``."""
        source = host_piece(data)
        done = 0
        for start, piece in self._pieces[self._piece_at(offset) :]:
            if done >= len(source):
                break
            inside = offset + done - start
            take = min(int(piece.nbytes) - inside, len(source) - done)
            piece[inside : inside + take] = source[done : done + take]
            done += take

    def blocks_of(self, offset: int, length: int) -> Iterator[int]:
        """Indices of the blocks with bytes in ``[offset, offset + length)``."""
        ends = [*self.block_starts[1:], self.total]
        for index, (start, end) in enumerate(zip(self.block_starts, ends, strict=True)):
            if start < offset + length and offset < end:
                yield index

    def _piece_at(self, offset: int) -> int:
        lo, hi = 0, len(self._pieces) - 1
        while lo < hi:  # the last piece starting at or before ``offset``
            mid = (lo + hi + 1) // 2
            if self._pieces[mid][0] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo


def plan_messages(
    total: int, breaks: Sequence[int], max_message: int = MAX_MESSAGE_BYTES
) -> list[int]:
    """The message lengths of a ``total``-byte stream cut at every offset of ``breaks`` (both
    sides' breaks) and every ``max_message`` bytes in between."""
    messages: list[int] = []
    start = 0
    for cut in [*sorted(set(breaks)), total]:
        if not start < cut <= total:
            continue
        while cut - start > max_message:
            messages.append(max_message)
            start += max_message
        messages.append(cut - start)
        start = cut
    return messages


def check_plan(
    messages: Sequence[int], total: int, breaks: Sequence[int], longest: int = 0
) -> None:
    """Raise ``ValueError`` unless ``messages`` cut a ``total``-byte stream into at most
    :data:`~kvstore.protocol.ucx.MAX_BATCH` non-empty messages with a boundary at each of
    ``breaks`` (this side's: a message must lie in one piece of its memory), none longer than
    :data:`MAX_MESSAGE_BYTES` or ``longest`` (a block's length), whichever is more: what a side
    may have to stage one message in."""
    if len(messages) > MAX_BATCH:
        raise ValueError(f"{len(messages)} messages in one transfer; the limit is {MAX_BATCH}")
    cap = max(MAX_MESSAGE_BYTES, longest)
    boundaries = set()
    offset = 0
    for length in messages:
        if length <= 0:
            raise ValueError("a message of the plan is empty")
        if length > cap:
            raise ValueError(f"a message of {length} bytes; the most is {cap}")
        offset += length
        boundaries.add(offset)
    if offset != total:
        raise ValueError(f"the plan moves {offset} bytes, the payloads are {total}")
    missing = [b for b in breaks if b not in boundaries]
    if missing:
        raise ValueError(f"the plan crosses this side's memory break at stream offset {missing[0]}")


def assign_lanes(messages: Sequence[int], lanes: int) -> list[int]:
    """The lane of each message: the one with the fewest bytes so far (lowest index on ties)."""
    if lanes <= 1:
        return [0] * len(messages)
    load = [0] * lanes
    out = []
    for length in messages:
        lane = min(range(lanes), key=load.__getitem__)
        load[lane] += length
        out.append(lane)
    return out


def lane_loads(messages: Sequence[int], lane_of: Sequence[int], lanes: int) -> list[int]:
    """Bytes each of ``lanes`` lanes carries under the assignment ``lane_of``."""
    loads = [0] * lanes
    for length, lane in zip(messages, lane_of, strict=True):
        loads[lane] += length
    return loads
