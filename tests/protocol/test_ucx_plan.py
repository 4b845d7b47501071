"""The UCX message plan (kvstore.protocol.ucx_plan): cuts, checks, lanes and layouts, on real
numpy memory (no UCX needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.protocol.ucx import MAX_BATCH
from kvstore.protocol.ucx_plan import (
    MAX_MESSAGE_BYTES,
    StreamLayout,
    assign_lanes,
    check_plan,
    host_piece,
    lane_loads,
    plan_messages,
)


def test_plan_cuts_at_every_break_and_at_the_message_cap() -> None:
    assert plan_messages(100, [], max_message=100) == [100]
    assert plan_messages(100, [30, 30, 70], max_message=100) == [30, 40, 30]
    assert plan_messages(100, [], max_message=40) == [40, 40, 20]
    assert plan_messages(100, [50], max_message=40) == [40, 10, 40, 10]
    assert plan_messages(0, []) == []


def test_check_plan_refuses_what_would_land_in_the_wrong_place() -> None:
    check_plan([30, 70], 100, [30])
    with pytest.raises(ValueError, match="moves 90 bytes"):
        check_plan([30, 60], 100, [])
    with pytest.raises(ValueError, match="break at stream offset 50"):
        check_plan([100], 100, [50])
    with pytest.raises(ValueError, match="empty"):
        check_plan([0, 100], 100, [])
    with pytest.raises(ValueError, match="limit"):
        check_plan([1] * (MAX_BATCH + 1), MAX_BATCH + 1, [])
    big = MAX_MESSAGE_BYTES + 1
    with pytest.raises(ValueError, match="the most is"):
        check_plan([big], big, [])
    check_plan([big], big, [], longest=big)  # one block that large may travel whole


def test_lanes_balance_bytes_the_same_way_on_both_sides() -> None:
    messages = [4, 4, 1, 1, 1, 1, 8]
    lanes = assign_lanes(messages, 3)
    assert lanes == assign_lanes(messages, 3)  # deterministic: nothing about it travels
    assert lanes[:3] == [0, 1, 2]
    assert sum(lane_loads(messages, lanes, 3)) == sum(messages)
    # Greedy: no lane carries more than its share plus one message.
    assert max(lane_loads(messages, lanes, 3)) <= sum(messages) / 3 + max(messages)
    assert assign_lanes(messages, 1) == [0] * len(messages)


def test_adjacent_slices_of_one_buffer_are_one_message_and_others_break() -> None:
    stream = np.arange(64, dtype=np.uint8)
    other = np.zeros(16, dtype=np.uint8)
    # Blocks 0 and 1 are next to each other in memory; block 2 is elsewhere; block 3 follows 1
    # in the stream but not in memory.
    layout = StreamLayout([[stream[0:16]], [stream[16:32]], [other], [stream[40:48]]])
    assert layout.block_starts == [0, 16, 32, 48]
    assert layout.breaks == [32, 48]
    messages = plan_messages(layout.total, layout.breaks)
    assert messages == [32, 16, 8]
    views = layout.views(messages)
    assert np.array_equal(views[0], stream[0:32])  # one view over two blocks, no copy
    views[0][:] = 7
    assert (stream[0:32] == 7).all()
    assert list(layout.blocks_of(16, 20)) == [1, 2]
    assert layout.crosses_break(20, 20) and not layout.crosses_break(0, 32)


def test_a_message_over_a_break_is_scattered_into_the_pieces() -> None:
    a, b = np.zeros(10, np.uint8), np.zeros(6, np.uint8)
    layout = StreamLayout([[a, b]])  # one block in two runs
    assert layout.breaks == [10]
    data = np.arange(16, dtype=np.uint8)
    layout.scatter(0, data)
    assert np.array_equal(a, data[:10]) and np.array_equal(b, data[10:])
    with pytest.raises(ValueError):
        check_plan([16], 16, layout.breaks)


def test_host_piece_takes_bytes_like_without_copying() -> None:
    buffer = bytearray(b"abc")
    piece = host_piece(memoryview(buffer))
    piece[0] = ord("z")
    assert buffer == bytearray(b"zbc")
    array = np.zeros(4, np.uint8)
    assert host_piece(array) is array
