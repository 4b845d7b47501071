"""The tenant leaks of issue 28, each refused by a real ``kvstore serve`` with ``[tenants]``.

- Sockets: with an explicit ``shm.socket`` tenant sockets were ``PATH.NAME``; bob, told
  ``PATH.b``, guessed ``PATH.a`` and mapped tenant a's arena. Now a process of b's user finds
  nothing of a's, even in a directory it may list.
- Modes: the tenants' nvme root and ``nvme/tenants`` were 0755 (tenant names listable).
- Namespaces: inside one tenant a co-located client of another namespace mapped, read and
  overwrote the arena; a tenant's arena is now mapped only where the tenant says its engines
  trust each other (``tenants.NAME.shm``).

The metrics leak is refused in ``test_metrics.py``. Processes of another local user are real
subprocesses run as ``nobody`` (the suite runs as root), speaking the socket's protocol by hand.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from harness.tenant_config import (
    NOBODY,
    NOGROUP,
    NS,
    TOKENS,
    blocks,
    client,
    data_plane_of,
    write_config,
)

from kvstore import KVStoreClient, Namespace
from kvstore.errors import KVStoreError, NamespaceMismatchError
from kvstore.protocol.messages import namespace_bytes
from kvstore.protocol.shm_frames import Op, frame

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

OTHER_NS = Namespace(model="tenant-leaks-other", num_layers=2, num_kv_heads=2, head_size=64)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A directory anyone may list and pass through, as a node's ``/run/kvstore`` often is (the
    suite's own temporary directories are root's alone)."""
    directory = Path(tempfile.mkdtemp(prefix="kvt-leaks-"))
    os.chmod(directory, 0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# Run as b's user, told only b's socket: try every path it can derive or find for another
# socket, say HELLO on each, and print how many answered with descriptors (an arena mapped).
_GUESS = """
import array, os, socket, sys
own, configured, hello = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
parent, mine = os.path.dirname(configured), os.path.basename(own)
candidates = {own.replace(".b", ".a"), configured + ".a", os.path.join(parent, "shm.sock")}
listed = os.listdir(parent)
for name in listed:
    entry = os.path.join(parent, name)
    candidates |= {entry, os.path.join(entry, "shm.sock"), os.path.join(entry, mine)}
    try:
        candidates |= {os.path.join(entry, inner) for inner in os.listdir(entry)}
    except OSError:
        pass
mapped = 0
for path in sorted(candidates - {own}):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(path)
        sock.sendall(hello)
        _, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
        mapped += bool(ancillary)
    except OSError:
        pass
    finally:
        sock.close()
print(len(listed), mapped)
"""


def test_a_tenant_socket_cannot_be_guessed_from_another(
    server_factory: ServerFactory, tmp_path: Path, socket_dir: Path
) -> None:
    configured = socket_dir / "kvstore.sock"
    # a lists no uids (the case of the issue): only the secret path keeps b's user out.
    config = write_config(tmp_path, f'socket = "{configured}"', b_uids=f"[{NOBODY}]", a_uids="[]")
    server = server_factory("--config", str(config))
    a_path, b_path = (data_plane_of(server, who).shm_socket for who in ("alice", "bob"))
    assert a_path and b_path
    hello = frame(Op.HELLO, namespace_bytes(NS)).hex()
    done = subprocess.run(
        ["/usr/bin/python3", "-c", _GUESS, b_path, str(configured), hello],
        user=NOBODY,
        group=NOGROUP,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
    listed, mapped = map(int, done.stdout.split())
    assert listed == 2  # it saw both tenants' directories, and could open neither
    assert mapped == 0, "a process of tenant b's user mapped another tenant's arena"
    assert not os.path.exists(f"{configured}.a")
    # Both sockets still serve their own tenant.
    keys, values = blocks(11)
    with client(server, "alice", data_plane="shm") as a:
        assert a.put(keys, values).stored == 4
        assert a.get(keys) == values and a.data_plane == "shm"
    # The tenant without uids/gids is said loudly at start.
    assert "tenant a lists no uids or gids" in server.stderr()
    assert "tenant b lists no uids or gids" not in server.stderr()


def test_every_directory_and_file_the_server_makes_is_private(
    server_factory: ServerFactory, tmp_path: Path, socket_dir: Path
) -> None:
    nvme = tmp_path / "data" / "nvme"  # neither exists yet: the server makes both
    config = write_config(tmp_path, f'socket = "{socket_dir / "kvstore.sock"}"')
    # Secrets from the environment, as in k8s: no integrity.key makes the nvme root first.
    env = {"KVSTORE_INTEGRITY_SECRETS": "a-secret-of-this-test-only"}
    server = server_factory("--config", str(config), nvme_path=nvme, env=env)
    with client(server, "alice") as a:
        assert a.put(*blocks(12)).stored == 4
    made = [nvme.parent, nvme, *nvme.rglob("*")]
    assert {p.name for p in made} >= {"data", "nvme", "tenants", "a", "b", "data.mdb"}
    for path in made:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path} has mode {oct(mode)}"
    sockets = [Path(data_plane_of(server, who).shm_socket) for who in ("alice", "bob")]
    for path in sockets:
        # Search only (no read) for the others the socket's mode 0666 admits: they can reach
        # the socket they were told of, and list nothing.
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o711
    server.stop()
    assert not any(path.parent.exists() for path in sockets)


def test_a_tenants_namespaces_map_its_arena_only_where_it_trusts_them(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """A process that maps an arena can read and overwrite every block in it, whatever
    namespace it says it works in: without ``tenants.NAME.shm`` nobody maps the tenant's arena,
    and a client of another namespace of the same tenant cannot touch a block it did not put."""
    server = server_factory("--config", str(write_config(tmp_path, shm="false")))
    assert data_plane_of(server, "alice").shm_socket == ""
    assert "tenants.a.shm is false" in server.stderr()
    keys, values = blocks(13)
    _, others = blocks(14)
    with (
        client(server, "alice") as victim,
        KVStoreClient(server.target, namespace=OTHER_NS, token=TOKENS["alice"]) as neighbour,
    ):
        assert victim.put(keys, values).stored == 4
        assert victim.data_plane == "grpc"
        with (
            KVStoreClient(
                server.target, namespace=OTHER_NS, token=TOKENS["alice"], data_plane="shm"
            ) as mapper,
            pytest.raises(KVStoreError, match="shared-memory data plane unavailable"),
        ):
            mapper.get(keys)
        # The neighbour's reach is its own namespace: a get misses, an overwrite is refused.
        assert neighbour.get(keys) == [None] * 4
        with pytest.raises(NamespaceMismatchError):
            neighbour.put(keys, others)
        assert victim.get(keys) == values
