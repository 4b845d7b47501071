"""The ``kvstore`` command against real ``kvstore serve`` processes: one data directory per
server (a lock), ``stats`` into a closed pipe, ``stats --watch``, the stats table, and the
progress lines of a start-up that rebuilds its index.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.ports import free_port
from harness.serve import ServerProcess, without_settings

from kvstore import KVStoreClient, Namespace

NS = Namespace(model="cli-test", num_layers=1, num_kv_heads=1, head_size=8)
TIMEOUT_S = 30


def _env() -> dict[str, str]:
    return without_settings()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path / "server", ["--dram-capacity", "16MiB", "--nvme-capacity", "16MiB"]
    )
    try:
        yield process.start()
    finally:
        process.close()


def _put(target: str, count: int) -> None:
    with KVStoreClient(target, namespace=NS) as client:
        keys = [bytes([i]) * 16 for i in range(count)]
        client.put(keys, [os.urandom(4096) for _ in keys])
        client.get(keys)


def test_second_server_on_the_same_nvme_directory_is_refused(
    server: ServerProcess, tmp_path: Path
) -> None:
    nvme = server.nvme_path
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "serve", "--nvme-path", str(nvme),
         "--listen", f"127.0.0.1:{free_port()}", "--dram-capacity", "16MiB",
         "--nvme-capacity", "16MiB", "--metrics-listen", "127.0.0.1:0"],
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvstore serve:")]
    assert len(errors) == 1, result.stderr
    assert "nvme.path" in errors[0] and str(nvme) in errors[0]
    assert f"pid {server.proc.pid if server.proc else '?'}" in errors[0]
    assert "another kvstore server" in errors[0]
    # The first one keeps serving, its data untouched.
    assert server.running
    _put(server.target, 2)


def test_a_stopped_servers_directory_can_be_used_again(server: ServerProcess) -> None:
    server.restart()  # the lock went with the first process
    _put(server.target, 1)


def test_stats_into_a_closed_pipe_ends_quietly(server: ServerProcess) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written, as after `| head -1`
    try:
        result = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "stats", "--target", server.target],
            env=_env(), stdout=write, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
    finally:
        os.close(write)
    assert result.stderr == ""
    assert result.returncode == 141


def test_stats_detail_line_shows_each_number_once(server: ServerProcess) -> None:
    _put(server.target, 3)
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "stats", "--target", server.target],
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table, details = result.stdout.split("\nblocks ", 1)
    assert "evictions" in table
    detail_lines = details.splitlines()[1:]
    assert [line.split(":")[0] for line in detail_lines] == ["dram", "nvme"]
    for line in detail_lines:
        assert "evictions=" not in line and "hits=" not in line, line


def test_stats_watch_prints_frames_until_ctrl_c(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "watch.out"
    with out.open("w") as handle:
        watch = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "stats", "--target", server.target,
             "--watch", "0.2"],
            env={**_env(), "PYTHONUNBUFFERED": "1"}, stdout=handle, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while out.read_text().count("kvstore stats ") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        _put(server.target, 4)  # counters move between frames: the next one shows rates
        while out.read_text().count("kvstore stats ") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        watch.send_signal(signal.SIGINT)
        _, stderr = watch.communicate(timeout=TIMEOUT_S)
    finally:
        watch.kill()
    text = out.read_text()
    assert watch.returncode == 0, stderr
    assert "Traceback" not in stderr
    frames = [frame for frame in text.split("kvstore stats ")[1:] if frame.strip()]
    assert len(frames) >= 3, text
    assert all("\ndram " in frame and "\nnvme " in frame for frame in frames)
    assert "/s)" in text  # a counter rate appeared after the puts
    assert f"{server.target} at " in text and "every 0.2s" in text


def test_serve_logs_progress_around_rebuilding_its_index(server: ServerProcess) -> None:
    _put(server.target, 5)
    server.restart()
    log = server.stderr()
    before = log.index("reading the block index of")
    after = log.index("read the index of 5 block(s) in ")
    assert before < after


def test_stats_watch_waits_for_a_server_that_is_not_there_yet(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "watch.out"
    with out.open("w") as handle:
        watch = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "stats", "--target", f"127.0.0.1:{port}",
             "--watch", "0.2", "--timeout", "1"],
            env={**_env(), "PYTHONUNBUFFERED": "1"}, stdout=handle, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
    serve = ServerProcess(
        tmp_path / "serve",
        listen=f"127.0.0.1:{port}",
        settings={"dram.capacity": "16MiB", "nvme.capacity": "16MiB"},
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while "nothing answers" not in out.read_text() and time.monotonic() < deadline:
            assert watch.poll() is None, watch.communicate()[1]
            time.sleep(0.05)
        serve.start()
        while "\ndram " not in out.read_text() and time.monotonic() < deadline:
            assert watch.poll() is None, watch.communicate()[1]
            time.sleep(0.05)
        watch.send_signal(signal.SIGINT)
        _, stderr = watch.communicate(timeout=TIMEOUT_S)
    finally:
        watch.kill()
        serve.close()
    text = out.read_text()
    assert watch.returncode == 0, stderr
    assert "Traceback" not in stderr
    waiting = text.index(f"nothing answers at 127.0.0.1:{port} — is `kvstore serve` running?")
    assert waiting < text.index("\ndram "), text  # it waited, then showed the server's stats
