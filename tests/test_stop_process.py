"""Tests of :func:`stop_process.stop_process` and :func:`stop_process.stop_group`, the harnesses'
ways to stop a server (or an engine's process group) they started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from harness.polling import poll
from harness.stop_process import stop_group, stop_process

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


#: A group leader that spawns a worker which ignores SIGTERM, prints the worker's pid, and then
#: exits at once (``exit``) or waits for its signal (``stay``).
_LEADER = """
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", sys.argv[2], "ignore"], stdout=subprocess.PIPE)
assert worker.stdout.readline() == b"ready\\n"
print(worker.pid, flush=True)
if sys.argv[1] == "stay":
    worker.wait()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed worker whose parent is gone is reaped by init; until then it is a zombie.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def _group(mode: str) -> tuple[subprocess.Popen[bytes], int]:
    process = subprocess.Popen(
        [sys.executable, "-c", _LEADER, mode, _CHILD],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def test_stop_group_takes_the_whole_group_down() -> None:
    process, worker = _group("stay")
    with process:
        stop_group(process, grace_s=0.5)
    assert process.returncode == -signal.SIGTERM
    poll(lambda: not _alive(worker), 10.0, "the worker that ignored SIGTERM killed with its group")


def test_stop_group_kills_what_a_leader_that_exited_left_behind() -> None:
    process, worker = _group("exit")
    with process:
        process.wait(timeout=30)
        assert _alive(worker)
        stop_group(process)
    poll(lambda: not _alive(worker), 10.0, "the lingering worker killed")
