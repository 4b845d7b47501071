"""A real ``kvstore serve`` process on a free loopback port, for the vLLM tests and benchmarks."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from harness.ports import free_port


class StoreProcess:
    """A ``kvstore serve`` subprocess (dram + nvme tiers) on a free loopback port, or on
    ``target`` (a restart: the same address and ``workdir``, a log of its own, ``name``)."""

    def __init__(
        self, workdir: Path, *flags: str, target: str | None = None, name: str = "store"
    ) -> None:
        """``flags``: more ``kvstore serve`` flags (later ones win: ``--dram-capacity 8MiB``)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.target = target or f"127.0.0.1:{free_port()}"
        self.log = workdir / f"{name}.log"
        command = [
            sys.executable,
            "-c",
            "import sys; from kvstore.cli import main; sys.exit(main())",
            "serve",
            "--metrics-listen",
            "127.0.0.1:0",
            "--listen",
            self.target,
            "--nvme-path",
            str(workdir / "nvme"),
            "--dram-capacity",
            "1GiB",
            *flags,
        ]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        from kvstore import KVStoreClient, KVStoreError

        deadline = time.monotonic() + 30
        with KVStoreClient(self.target, timeout=1.0) as client:
            while True:
                try:
                    client.stats()
                    return
                except KVStoreError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        pytest.fail(f"kvstore serve did not start:\n{self.log.read_text()}")
                    time.sleep(0.05)  # a restart test times from here

    def stats(self) -> dict[str, Any]:
        """The server's stats."""
        from kvstore import KVStoreClient

        with KVStoreClient(self.target, timeout=5.0) as client:
            return client.stats()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 15 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
