"""Tests of :func:`stop_process.stop_process`, the harnesses' way to stop a server they started."""

from __future__ import annotations

import signal
import subprocess
import sys

from harness.stop_process import stop_process

#: A child that says it is ready once its SIGTERM disposition is set (ignored or default).
_CHILD = """
import signal, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""


def _child(mode: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", _CHILD, mode], stdout=subprocess.PIPE)
    assert process.stdout is not None
    assert process.stdout.readline() == b"ready\n"
    return process


def test_a_process_that_exits_on_sigterm_ends_by_sigterm() -> None:
    with _child("default") as process:
        stop_process(process, grace_s=60)
    assert process.returncode == -signal.SIGTERM


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    with _child("ignore") as process:
        stop_process(process, grace_s=0.2)
    assert process.returncode == -signal.SIGKILL
