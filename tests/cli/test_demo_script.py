"""``scripts/demo.sh`` runs against the server it started, and reinstalls only when needed.

The script's environment is a stand-in venv (``KVSTORE_VENV``): its ``python`` and ``kvstore``
are the shared test environment's (loading this checkout's code through ``PYTHONPATH``), its
``pip`` only records how it was called. So the install decision is the real one, and the test
sees exactly when the script installs, without downloading anything.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _wrapper(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A venv directory whose python/kvstore are real and whose pip only logs its arguments."""
    root = tmp_path / "venv"
    (root / "bin").mkdir(parents=True)
    _wrapper(root / "bin" / "python", f'exec "{sys.executable}" "$@"')
    _wrapper(root / "bin" / "kvstore", f'exec "{BIN / "kvstore"}" "$@"')
    _wrapper(root / "bin" / "pip", f'echo "pip $*" >> "{root / "pip.log"}"')
    return root


@pytest.fixture
def port_50051_taken() -> Iterator[list[bytes]]:
    """A dummy listener on 127.0.0.1:50051 (what another program could hold); what it received."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", 50051))
    except OSError:
        # Something else already holds 50051: the situation under test exists already.
        listener.close()
        yield []
        return
    listener.listen(8)
    listener.settimeout(0.2)
    received: list[bytes] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    received.append(conn.recv(1024))
                except OSError:
                    received.append(b"")

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield received
    stop.set()
    thread.join()
    listener.close()


def _demo(venv: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "KVSTORE_VENV": str(venv),
        # Where the default data directory would be: the demo must not use it.
        "HOME": str(tmp_path / "home"),
        "XDG_DATA_HOME": str(tmp_path / "home" / "data"),
        "KVSTORE_DRAM_CAPACITY": "64MiB",
        "TMPDIR": str(tmp_path),
    }
    env.pop("XDG_RUNTIME_DIR", None)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )


def test_demo_uses_its_own_server_and_installs_once(
    venv: Path, tmp_path: Path, port_50051_taken: list[bytes]
) -> None:
    first = _demo(venv, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "demo.sh: demo OK against its own server" in first.stdout
    assert "127.0.0.1:50051" not in first.stdout
    assert "has no install record: installing" in first.stdout
    assert "pip install" in (venv / "pip.log").read_text()
    # Nobody talked to the other program on 50051.
    assert port_50051_taken == []

    (venv / "pip.log").unlink()
    second = _demo(venv, tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "is up to date with pyproject.toml (no reinstall)" in second.stdout
    assert "installing" not in second.stdout
    assert not (venv / "pip.log").exists()
    assert "demo.sh: demo OK against its own server" in second.stdout
    # The demo's log file, data directory and the server's socket directory are gone, and the
    # default data directory (a server of the user's could be using it) was never touched.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["venv"]


def test_changed_pyproject_reinstalls(venv: Path, tmp_path: Path) -> None:
    (venv / ".kvstore-pyproject.sha256").write_text("an older pyproject.toml\n")
    done = _demo(venv, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pyproject.toml changed since" in done.stdout
    assert "pip install" in (venv / "pip.log").read_text()


def test_demo_fails_loudly_when_the_server_cannot_start(venv: Path, tmp_path: Path) -> None:
    _wrapper(venv / "bin" / "kvstore", 'echo "kvstore: cannot start" >&2; exit 2')
    (venv / ".kvstore-pyproject.sha256").write_text(
        subprocess.run(
            ["sha256sum", str(ROOT / "pyproject.toml")], capture_output=True, text=True, check=True
        ).stdout.split()[0]
        + "\n"
    )
    done = _demo(venv, tmp_path)
    assert done.returncode != 0
    assert "demo OK" not in done.stdout
    assert "demo.sh: FAILED: kvstore serve" in done.stderr
    assert "kvstore: cannot start" in done.stderr
