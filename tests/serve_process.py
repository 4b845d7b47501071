"""A ``kvstore serve`` subprocess whose temp directory is the test's own (tests at the top level).

Its ``TMPDIR`` is a directory the test owns and ``XDG_RUNTIME_DIR`` is unset, so the automatic
shared-memory socket directory lands there, where the test can look for leftovers, and never in
the machine's ``/tmp``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

READY_LINE = "kvstore serving on "
START_TIMEOUT_S = 60.0


class Serve:
    """``python -m kvstore.cli serve ARGS`` with its own temp directory; the ready address."""

    def __init__(
        self, args: Sequence[str], tmpdir: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.out = tmpdir.parent / f"{tmpdir.name}.serve.out"
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmpdir), **(env or {})}
        environ.pop("XDG_RUNTIME_DIR", None)
        with self.out.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvstore.cli",
                    "serve",
                    "--metrics-listen",
                    "127.0.0.1:0",
                    *args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environ,
            )
        self.target = self._wait_ready()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            for line in self.out.read_text(errors="replace").splitlines():
                if line.startswith(READY_LINE):
                    return line[len(READY_LINE) :].strip()
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise AssertionError(f"kvstore serve did not start:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        """Everything the server printed."""
        return self.out.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)
