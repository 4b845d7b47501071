"""The defaults that depend on the machine: the dram arena's size from its memory, where the
embedded nvme data lives; worked out here and nowhere else (:func:`machine_defaults`), read by
:func:`kvstore.config.load_config`.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "available_memory",
    "default_data_dir",
    "default_dram_capacity",
    "default_inflight_bytes",
    "machine_defaults",
]

_DEFAULT_AVAILABLE = 4 * 1024**3


def available_memory(meminfo: str | None = None) -> int:
    """``MemAvailable`` in bytes from the text of ``/proc/meminfo`` (read when ``None``); 4 GiB
    when it cannot be read or says nothing about it."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            return _DEFAULT_AVAILABLE
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return _DEFAULT_AVAILABLE


def default_dram_capacity(available: int) -> int:
    """A quarter of ``available`` bytes, capped at 16 GiB and rounded down to a MiB."""
    return min(available // 4, 16 * 1024**3) // 1024**2 * 1024**2


def default_inflight_bytes(dram_capacity: int) -> int:
    """A quarter of the dram arena, at least 64 MiB: the bytes requests may hold at once."""
    return max(dram_capacity // 4, 64 * 1024**2)


def default_data_dir(env: Mapping[str, str]) -> str:
    """``$XDG_DATA_HOME/kvstore`` (``~/.local/share/kvstore``): where embedded nvme data lives.

    The home directory is ``$HOME`` of ``env``, else the user's entry in the password database
    (what :meth:`Path.home` falls back to), so that nothing here reads the process environment.
    """
    base = env.get("XDG_DATA_HOME") or str(_home(env) / ".local" / "share")
    return str(Path(base) / "kvstore")


def _home(env: Mapping[str, str]) -> Path:
    if env.get("HOME"):
        return Path(env["HOME"])
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:  # a uid without an entry: what expanduser("~") gives then
        return Path("~")


def machine_defaults(env: Mapping[str, str], meminfo: str | None = None) -> dict[str, Any]:
    """The defaults that depend on the machine, by dotted setting name; the one place they are
    worked out (the configuration's dataclasses hold plain data).

    ``dram.capacity`` is :func:`default_dram_capacity` of the memory ``meminfo`` (the text of
    ``/proc/meminfo``, read when ``None``) says is available; ``nvme.path`` is ``nvme`` under
    :func:`default_data_dir` of ``env``.
    """
    return {
        "dram.capacity": default_dram_capacity(available_memory(meminfo)),
        "nvme.path": str(Path(default_data_dir(env)) / "nvme"),
    }
