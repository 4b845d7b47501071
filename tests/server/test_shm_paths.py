"""Where shared-memory sockets go (:mod:`kvstore.server.shm_paths`): the automatic directory of a
server without tenants, and each tenant's unlistable directory and random socket name."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from kvstore.server import shm_paths
from kvstore.server.shm_paths import remove_private_dir, shm_socket_path, tenant_socket_path

NOBODY = 65534


@pytest.mark.parametrize(("mode", "dir_mode"), [(0o660, 0o710), (0o600, 0o700), (0o666, 0o711)])
def test_auto_socket_directory_admits_whom_the_socket_admits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, dir_mode: int
) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(shm_paths.tempfile, "tempdir", str(tmp_path))
    path = Path(shm_socket_path("auto", mode))
    assert path.parent.parent == tmp_path and path.name == "shm.sock"
    assert stat.S_IMODE(path.parent.stat().st_mode) == dir_mode
    assert shm_socket_path("auto", mode) != str(path)  # a fresh directory each time
    remove_private_dir(str(path))
    assert not path.parent.exists()
    # A configured path's directory is never removed.
    remove_private_dir(str(tmp_path / "mine.sock"))
    assert tmp_path.exists()


@pytest.mark.parametrize("setting", ["explicit", "auto"])
def test_a_tenant_socket_cannot_be_derived_from_another_tenants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(shm_paths.tempfile, "tempdir", str(tmp_path))
    configured = str(tmp_path / "kvstore.sock") if setting == "explicit" else "auto"
    a = Path(tenant_socket_path(configured, "a", 0o666))
    b = Path(tenant_socket_path(configured, "b", 0o666))
    assert a.parent.parent == b.parent.parent == tmp_path
    assert a.parent != b.parent
    # 128 random bits name each socket: b's path says nothing of a's.
    assert len(a.stem) >= 22 and a.stem != b.stem
    assert str(a) != str(b).replace(".b.", ".a.").replace("-b-", "-a-")
    # Search but no list for the others the socket's mode admits: b's user can reach b's socket
    # but cannot read a's directory to learn its name.
    for path in (a, b):
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o711
    os.chmod(tmp_path, 0o711)
    listing = subprocess.run(
        ["ls", str(a.parent)], user=NOBODY, capture_output=True, text=True, timeout=20, cwd="/"
    )
    assert listing.returncode != 0 and "Permission denied" in listing.stderr
    remove_private_dir(str(a))
    remove_private_dir(str(b))
    assert sorted(tmp_path.iterdir()) == []


def test_a_tenant_socket_setting_that_is_off_stays_off() -> None:
    assert tenant_socket_path("", "a") == ""
