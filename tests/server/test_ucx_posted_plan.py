"""What the UCX server sends for a plan the caller posted its receives for
(``kvstore.server.ucx._posted_views``): each message whole or empty, on real numpy memory."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import InvalidRequestError
from kvstore.server.ucx import _posted_views


def test_a_miss_empties_its_message_and_voids_the_blocks_sharing_it() -> None:
    pages = np.arange(40, dtype=np.uint8)
    pieces = {0: [pages[0:10]], 1: [pages[10:20]], 3: [pages[30:40]]}
    sizes = [10, 10, 10, 10]
    sent = [True, True, False, True]
    # Blocks 0-1 in one message, 2-3 in another (the caller's buffers follow each other).
    views, voided = _posted_views(sizes, sent, pieces, [20, 20])
    assert np.array_equal(views[0], pages[0:20]) and views[1].nbytes == 0
    assert voided == {3}


def test_a_block_over_several_messages_is_voided_in_all_of_them() -> None:
    pages = np.arange(30, dtype=np.uint8)
    pieces = {0: [pages[0:20]], 1: [pages[20:30]]}
    # Block 0 is split over messages 0 and 1; message 1 also holds block 1, which is missing.
    views, voided = _posted_views([20, 10], [True, False], pieces, [15, 15])
    assert [view.nbytes for view in views] == [0, 0] and voided == {0}


def test_pages_not_next_to_each_other_are_copied_into_one_message() -> None:
    first, second = np.arange(8, dtype=np.uint8), np.arange(8, 16, dtype=np.uint8)
    views, voided = _posted_views([8, 8], [True, True], {0: [first], 1: [second]}, [16])
    assert voided == set() and np.array_equal(views[0], np.arange(16, dtype=np.uint8))


def test_a_plan_that_does_not_fit_the_sizes_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="UcxGet plan"):
        _posted_views([8], [True], {0: [np.zeros(8, np.uint8)]}, [4])
    with pytest.raises(InvalidRequestError, match="size"):
        _posted_views([], [], {}, [4])
