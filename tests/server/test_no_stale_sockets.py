"""A server leaves no shared-memory socket or socket directory behind in the temp directory."""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from harness.serve import ServerProcess, clean_env

from kvstore import KVStoreClient, Namespace

NS = Namespace(model="stale-sockets", num_layers=1, num_kv_heads=1, head_size=8)


def _leftovers(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("kvstore-"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_server_removes_its_socket_directory(tmp_path: Path, sig: int) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    server = ServerProcess(
        tmp_path / "serve", settings={"dram.capacity": "16MiB"}, tmpdir=tmpdir
    ).start()
    try:
        # While it runs, the socket is where the automatic setting puts it: in the temp dir.
        (directory,) = _leftovers(tmpdir)
        assert stat.S_ISSOCK((tmpdir / directory / "shm.sock").stat().st_mode)
        with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
            assert client.put([b"k" * 16], [b"v" * 64]).stored == 1
            assert client.data_plane == "shm"
    finally:
        code = server.stop(sig)
    assert code == 0, server.output()
    assert _leftovers(tmpdir) == []
    assert list(tmpdir.iterdir()) == []


def test_server_that_cannot_listen_leaves_nothing(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = clean_env({"TMPDIR": str(tmpdir)})  # no XDG_RUNTIME_DIR: the socket goes in TMPDIR
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        sizes = ["--nvme-path", str(tmp_path / "nvme"), "--dram-capacity", "16MiB"]
        sizes += ["--metrics-listen", "127.0.0.1:0"]
        done = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "serve", "--listen", listen, *sizes],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    assert done.returncode != 0, done.stdout
    assert list(tmpdir.iterdir()) == []
