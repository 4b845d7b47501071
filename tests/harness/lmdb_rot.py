"""Simulated disk rot in an LMDB data file, shared by the nvme tier and store tests."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["rot_in_file"]


def rot_in_file(data_file: Path, pattern: bytes) -> int:
    """Flip a bit of every copy of ``pattern`` in ``data_file``, as a disk would; returns copies.

    Freed LMDB pages keep old copies of a value until they are reused: flipping every copy makes
    sure the live value is among them.
    """
    contents = data_file.read_bytes()
    spots = []
    where = contents.find(pattern)
    while where >= 0:
        spots.append(where)
        where = contents.find(pattern, where + 1)
    fd = os.open(data_file, os.O_WRONLY)
    try:
        for spot in spots:
            os.pwrite(fd, bytes([contents[spot] ^ 0x80]), spot)
    finally:
        os.close(fd)
    return len(spots)
