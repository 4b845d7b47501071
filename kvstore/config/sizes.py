"""Byte sizes as people write them (``512MiB``, ``4GiB``, ``1.5GB``) and as logs print them.

``KiB``, ``MiB``, ``GiB``, ``TiB`` are binary (powers of 1024); ``KB``, ``MB``, ``GB``, ``TB`` and
their one-letter forms ``K``, ``M``, ``G``, ``T`` are decimal (powers of 1000), as the SI and
disk vendors have them: ``4G`` is 4,000,000,000 bytes, ``4GiB`` 4,294,967,296.

A leaf module: the config loader, the tenant tables and the CLI all read sizes the same way.
"""

from __future__ import annotations

import re

from kvstore.errors import ConfigError

__all__ = ["SIZE_HINT", "format_size", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
#: What a size looks like, for messages and help.
SIZE_HINT = (
    "a size is bytes or a number with one of KiB, MiB, GiB, TiB, KB, MB, GB, TB, e.g. 4GiB "
    "(KiB... are powers of 1024; KB or K... powers of 1000: 4G is 4000000000 bytes)"
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Parse ``"512MiB"``, ``"4GiB"``, ``"1.5GB"`` or ``1048576`` into a number of bytes."""
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"a size must be >= 0, got {value}")
        return value
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"cannot parse size {value!r}: {SIZE_HINT}")
    number = match.group(1)
    # Whole numbers stay integers: a float would round sizes above 2**53.
    if "." not in number:
        return int(number) * _UNITS[unit]
    return int(float(number) * _UNITS[unit])


def format_size(num_bytes: float) -> str:
    """Render a byte count with a binary unit, e.g. ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"
