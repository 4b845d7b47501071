"""What the soak (:mod:`soak`) samples of a process from outside: RSS and its parts, open
descriptors and what each points to, an LMDB directory's size, a node's memory gauges."""

from __future__ import annotations

import os
import urllib.request
from collections import Counter
from collections.abc import Collection
from pathlib import Path

__all__ = ["GAUGES", "fd_kinds", "lmdb_figures", "metrics_figures", "proc_figures"]


def proc_figures(pid: int) -> dict[str, int]:
    """RSS and its parts (KiB) and open descriptors of process ``pid`` (empty once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {}
    out = {"fds": fds}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[name.lower() + "_kib"] = int(value.split()[0])
    return out


def lmdb_figures(path: Path) -> dict[str, int]:
    """Apparent and allocated bytes of the files in an LMDB directory."""
    size = allocated = 0
    for entry in path.glob("**/*"):
        if entry.is_file():
            info = entry.stat()
            size += info.st_size
            allocated += info.st_blocks * 512
    return {"lmdb_bytes": size, "lmdb_allocated_bytes": allocated}


#: Gauges of a node's /metrics sampled with its RSS: the buffers that may hold memory.
GAUGES = (
    "kvstore_shared_write_backlog_bytes",
    "kvstore_shared_write_queue_blocks",
    "kvstore_shared_write_queue_bytes",
)


def metrics_figures(url: str) -> dict[str, float]:
    """The :data:`GAUGES` of a node (summed over tenants); empty if it does not answer."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in GAUGES:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _sockets(pid: int) -> dict[str, tuple[int, int, bool]]:
    """Socket inode -> (local port, remote port, listening) of the TCP sockets in ``pid``'s
    network namespace; unix sockets are left out (they are told apart by their link)."""
    table: dict[str, tuple[int, int, bool]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote = (int(f.rsplit(":", 1)[1], 16) for f in fields[1:3])
            table[fields[9]] = (local, remote, fields[3] == "0A")
    return table


def fd_kinds(
    pid: int, redis_ports: Collection[int], listen_ports: Collection[int]
) -> dict[str, int]:
    """``pid``'s open descriptors by what they point to (``fds.*``): ``redis`` (connections to
    one of ``redis_ports``), ``clients`` (accepted on one of ``listen_ports``), ``listening``,
    ``tcp_other``, ``unix`` sockets, ``memfd`` (arenas), ``shm`` (``/dev/shm`` files), ``files``
    (LMDB, logs) and ``other``
    (pipes, eventfds, epoll). Where a count moves, this says which kind moved."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    sockets = _sockets(pid)
    kinds: Counter[str] = Counter()
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            entry = sockets.get(link[len("socket:[") : -1])
            if entry is None:
                kinds["unix"] += 1
            elif entry[2]:
                kinds["listening"] += 1
            elif entry[1] in redis_ports:
                kinds["redis"] += 1
            elif entry[0] in listen_ports:
                kinds["clients"] += 1
            else:
                kinds["tcp_other"] += 1
        elif link.startswith("/memfd:"):
            kinds["memfd"] += 1
        elif link.startswith("/dev/shm/"):
            kinds["shm"] += 1
        elif link.startswith("/") and not link.startswith("/dev/"):
            kinds["files"] += 1
        else:
            kinds["other"] += 1
    return {f"fds.{kind}": count for kind, count in sorted(kinds.items())}
