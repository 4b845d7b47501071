"""Several "hosts" on one machine: network namespaces joined by veth pairs to a bridge.

Processes started in a :class:`Host` see only that namespace's interfaces: their own loopback and
one veth with a private address. Nothing crosses between hosts over the network but TCP/UDP
through the bridge, so a loopback shortcut cannot hide a broken remote path. The file system is
shared, though: a unix socket bound to a path (``kvstore serve``'s shared-memory socket is one)
is reachable from every namespace, and a client on the automatic data plane does use shared
memory with a node on another host; clients that must cross the network ask for
``data_plane="grpc"`` (abstract unix sockets, unlike path ones, are per namespace).

The test process itself stays in the root namespace, where the bridge has the first address of
the subnet: it reaches every host, and every host reaches it (a Redis bound to
:attr:`Hosts.gateway` is "the Redis host").

Needs root (CAP_NET_ADMIN) and the ``ip`` command: without them :class:`Hosts` raises, it never
skips, since the multi-host tests are part of the suite. Namespaces carry the creating process's
id in their names, and a run removes what dead runs left behind.

    with Hosts(3) as hosts:
        proc = hosts[0].popen(["python", "-m", "kvstore.cli", "serve", "--listen",
                               f"{hosts[0].address}:7000"])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

__all__ = ["Host", "Hosts"]

_PREFIX = "kvh"  # namespace, veth and bridge names start with it (15-char interface limit)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _require_tools() -> None:
    if shutil.which("ip") is None:
        raise RuntimeError("the multi-host tests need the `ip` command (Debian: iproute2)")
    if os.geteuid() != 0:
        raise RuntimeError(
            "the multi-host tests create network namespaces and veth pairs: run them as root "
            "(or with CAP_NET_ADMIN and CAP_SYS_ADMIN)"
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> None:
    """Delete namespaces and bridges of earlier runs whose process is gone."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        parts = name.split("-")
        stale = parts[0] == _PREFIX and len(parts) == 3 and parts[1].isdigit()
        if stale and not _alive(int(parts[1])):
            _ip("netns", "delete", name, check=False)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        owner = name[len(_PREFIX) + 1 :]
        if name.startswith(_PREFIX + "b") and owner.isdigit() and not _alive(int(owner)):
            _ip("link", "delete", name, check=False)


class Host:
    """One network namespace with one address on the shared bridge."""

    def __init__(self, namespace: str, address: str) -> None:
        self.namespace = namespace
        self.address = address

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` in this host (``kwargs`` go to :class:`subprocess.Popen`)."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in this host to completion (``kwargs`` go to :func:`subprocess.run`)."""
        return subprocess.run(self.command(argv), **kwargs)

    def __repr__(self) -> str:
        return f"Host({self.namespace!r}, {self.address!r})"


class Hosts:
    """``count`` hosts on a private /24 behind a bridge in the root namespace; removed on exit."""

    def __init__(self, count: int) -> None:
        if not 1 <= count <= 200:
            raise ValueError(f"Hosts(count={count}): 1 to 200 hosts")
        self.count = count
        pid = os.getpid()
        self._tag = f"{pid}"
        self.bridge = f"{_PREFIX}b{pid}"[:15]
        # A subnet per creating process, so two test runs side by side do not collide.
        self._subnet = f"10.{100 + pid % 100}.{pid // 100 % 250}"
        self.gateway = f"{self._subnet}.1"
        self.hosts: list[Host] = []
        self._serial = 0
        self._outside: list[str] = []  # the bridge ends of the veth pairs

    def __enter__(self) -> Hosts:
        _require_tools()
        remove_leftovers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index in range(self.count):
            namespace = f"{_PREFIX}-{self._tag}-{index}"
            outside, inside = f"{_PREFIX}o{self._tag}x{index}"[:15], "eth0"
            address = f"{self._subnet}.{index + 2}"
            _ip("netns", "add", namespace)
            self.hosts.append(Host(namespace, address))
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", namespace)
            self._outside.append(outside)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inside)
            _ip("-n", namespace, "link", "set", inside, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "route", "add", "default", "via", self.gateway)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def cut(self, host: Host) -> None:
        """Take ``host``'s link down: its packets go nowhere (a partition, not a crash)."""
        _ip("-n", host.namespace, "link", "set", "eth0", "down")

    def mend(self, host: Host) -> None:
        """Bring ``host``'s link back up after :meth:`cut`."""
        _ip("-n", host.namespace, "link", "set", "eth0", "up")
        _ip("-n", host.namespace, "route", "replace", "default", "via", self.gateway)

    def close(self) -> None:
        """Remove every namespace (their veths go with them) and the bridge."""
        for host in self.hosts:
            # Processes still inside keep a namespace alive only as long as they run; the
            # tests stop theirs first, and the name goes now regardless.
            _ip("netns", "delete", host.namespace, check=False)
        self.hosts.clear()
        # A namespace with a process still inside outlives its name, and its veth pair with it:
        # deleting our end removes both, so the next Hosts of this process can use the names.
        for outside in self._outside:
            _ip("link", "delete", outside, check=False)
        self._outside.clear()
        with contextlib.suppress(subprocess.SubprocessError):
            _ip("link", "delete", self.bridge, check=False)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
